"""What a test needs from the machine beyond the serving install: programs on PATH (Debian's
prometheus, chromium, wrk) and Python modules of an extra (torch). `make install` and .ci/run
provide them all. On a machine without one, a test marked `needs(...)` is skipped, naming what
is missing and what provides it; under CI (CI=true, as .ci/run exports) it fails instead, since
there a missing program means the install is broken and a skip would hide a test that never ran.

The mark is enforced by this module's hooks, which tests/conftest.py installs.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Sequence

import pytest


def under_ci() -> bool:
    """True when the environment says this is a CI run (CI=true, as most CI systems set)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def needs(*programs: str, package: str, modules: Sequence[str] = ()) -> pytest.MarkDecorator:
    """A mark for a test (or `pytestmark`) that needs `programs` on PATH and `modules`
    importable, all provided by `package` (say how to install it): skipped when one is missing,
    failed instead under CI=true."""
    absent = [f"program {name!r}" for name in programs if shutil.which(name) is None]
    absent += [f"Python module {name!r}" for name in modules
               if importlib.util.find_spec(name) is None]
    reason = f"{' and '.join(absent)} not found; it comes with {package}" if absent else ""
    return pytest.mark.needs(reason=reason)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "needs(reason): a program or module the test needs is missing (reason "
        "empty: all present); skip, or fail under CI=true (tests/prerequisites.py)")


@pytest.hookimpl(tryfirst=True)  # before any fixture is set up
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        reason = mark.kwargs.get("reason", "")
        if not reason:
            continue
        if under_ci():
            pytest.fail(f"{reason} (CI=true: a test's missing prerequisite fails the run "
                        "instead of skipping it)", pytrace=False)
        pytest.skip(reason)
