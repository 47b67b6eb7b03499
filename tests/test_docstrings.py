"""Docstrings in service/ say why in a few lines; numbers belong in reports, not in code."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOST_LINES = 6


def long_docstrings(source: str) -> list[str]:
    """The names of the module, classes and functions in `source` whose docstring runs longer."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            doc = ast.get_docstring(node, clean=False)
            if doc and len(doc.splitlines()) > MOST_LINES:
                found.append(getattr(node, "name", "<module>"))
    return found


def test_the_check_finds_a_long_docstring():
    assert long_docstrings('def f():\n    """1\n2\n3\n4\n5\n6\n7"""\n') == ["f"]
    assert long_docstrings('"""1\n2\n3\n4\n5\n6"""\n') == []


def test_no_docstring_in_the_service_runs_past_six_lines():
    paths = sorted((ROOT / "service").rglob("*.py"))
    offending = {str(path.relative_to(ROOT)): found for path in paths
                 if (found := long_docstrings(path.read_text()))}
    assert offending == {}
