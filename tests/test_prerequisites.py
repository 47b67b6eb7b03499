"""The `needs` mark (tests/prerequisites.py), run in a pytest of its own: a test whose program
or module is missing is skipped, naming it and what provides it, except under CI=true, where it
fails the run (an error at its setup, before any fixture); a test that has what it needs runs
either way."""

from __future__ import annotations

import sys

import pytest

pytest_plugins = ("pytester",)

CONFTEST = "from tests.prerequisites import pytest_configure, pytest_runtest_setup  # noqa\n"
TESTS = f"""
from tests.prerequisites import needs

@needs("r4t-no-such-program", package="the r4t-nothing package")
def test_a_missing_program():
    raise AssertionError("ran without its program")

@needs(modules=("r4t_no_such_module",), package="the nothing extra")
def test_a_missing_module():
    raise AssertionError("ran without its module")

@needs({sys.executable!r}, modules=("json",), package="Python")
def test_all_present():
    pass
"""


def run(pytester: pytest.Pytester) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_needs=TESTS)
    return pytester.runpytest("-p", "no:xdist", "-p", "no:cacheprovider", "-rsf")


@pytest.mark.parametrize("ci", [None, "", "false"])
def test_a_missing_prerequisite_skips_outside_ci(pytester, monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    result = run(pytester)
    result.assert_outcomes(passed=1, skipped=2)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines([
        "*program 'r4t-no-such-program' not found; it comes with the r4t-nothing package*",
        "*Python module 'r4t_no_such_module' not found; it comes with the nothing extra*"],
        consecutive=False)


def test_a_missing_prerequisite_fails_under_ci(pytester, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = run(pytester)
    result.assert_outcomes(passed=1, errors=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    output = result.stdout.str()
    assert "ran without" not in output  # failed at setup, not by running the test's body
    for line in ("program 'r4t-no-such-program' not found; it comes with the r4t-nothing "
                 "package (CI=true", "Python module 'r4t_no_such_module' not found; it comes "
                 "with the nothing extra (CI=true"):
        assert line in output, output
