"""Figure 5 with a GGUF policy: the LLM route, `single` and the student timed in one run, the
LLM measured up to its batch limit and projected past it, never mixed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loadtest.llm_bench import markdown, run
from service.backends.llama import LlamaConfig
from tests.gguf_model import write_tiny_gguf
from training.stage1_fanout.gguf import commit_llm


@pytest.fixture(scope="module")
def llm_bundle(small_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("llm-bench")
    target = root / "llm"
    shutil.copytree(small_bundle_dir, target)
    commit_llm(target, write_tiny_gguf(root / "tiny.gguf"), LlamaConfig(context=16))
    return target


def test_measured_then_projected_beside_single(llm_bundle, tmp_path):
    report = run(llm_bundle, (1, 2, 4), threads=1, llm_max_batch=2, out_dir=tmp_path)
    rows = report["rows"]
    assert [r.get("llm_measured") for r in rows] == [True, True, False]
    per_query = rows[1]["llm_s"] / 2
    assert rows[2]["llm_s"] == pytest.approx(4 * per_query)  # the largest measured batch's rate
    assert all(r["single_s"] > 0 and r["llm_vs_single"] > 0 for r in rows)
    assert report["sampler"] is None and all("speedup" not in r for r in rows)  # no student
    table = markdown(report)
    assert "(proj.)" in table.splitlines()[-1] and "(proj.)" not in table.splitlines()[-2]
    assert (tmp_path / "bench-llm.json").is_file() and (tmp_path / "bench-llm.png").is_file()
