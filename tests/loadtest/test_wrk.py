"""`make wrk`'s driver against a live service: wrk.lua's summary is read back whole (every
answer counted by status, latency percentiles), with the server's batches and CPU beside it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from loadtest.wrk import drive, layers
from tests.service.conftest import live_server, make_settings

pytestmark = pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed")


def test_a_short_wrk_run_is_counted_whole(small_bundle_dir: Path, tmp_path: Path) -> None:
    settings = make_settings(small_bundle_dir, None, index="bundle")
    with live_server(settings) as server:
        port = int(server.url.rsplit(":", 1)[1])
        row = drive([port], [os.getpid()], "single", connections=4, seconds=1, out_dir=tmp_path,
                    profile=False)
    assert row["requests"] > 0 and row["socket_errors"] == 0
    assert row["statuses"] == {"200": row["requests"]}
    assert 0 < row["latency_ms"]["50"] <= row["latency_ms"]["99"]
    assert row["mean_batch"]["single"] >= 1.0
    assert row["server_cpu_ms_per_request"] > 0


def test_profile_layers_are_shares_of_the_leaf_frames(tmp_path: Path) -> None:
    stacks = tmp_path / "profile.txt"
    stacks.write_text(
        "run (uvicorn/server.py:1);search (faiss/__init__.py:9) 6\n"
        "run (uvicorn/server.py:1);answer (service/paths/single.py:3) 3\n"
        "run (uvicorn/server.py:1) 1\n")
    assert layers(stacks) == {"FAISS": 0.6, "r4t service code": 0.3,
                              "uvicorn + httptools": 0.1}
