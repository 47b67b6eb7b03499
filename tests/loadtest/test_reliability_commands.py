"""make overload, soak, chaos and wrk refuse bad input with a usage error before starting."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("arguments", [
    ["loadtest.overload", "--bundle", "no/such/bundle"],
    ["loadtest.soak", "--bundle", "no/such/bundle"],
    ["loadtest.chaos", "--bundle", "no/such/bundle"],
    ["loadtest.soak", "--minutes", "0"],
    ["loadtest.overload", "--factor", "-1"],
    ["loadtest.overload", "--stall-rate", "1.5"],
    ["loadtest.overload", "--stall-s", "0"],
    ["loadtest.chaos", "--cases", "reload,nope"],
    ["loadtest.wrk", "--bundle", "no/such/bundle"],
    ["loadtest.wrk", "--connections", "0"],
    ["loadtest.wrk", "--processes", "1,0"],
])
def test_bad_input_is_a_usage_error(arguments, tmp_path):
    done = subprocess.run([sys.executable, "-m", *arguments, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "error:" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()  # nothing was started or written
