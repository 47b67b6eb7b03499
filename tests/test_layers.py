"""The tree's layers: a module imports only from its own layer or a lower one (lazy imports
included), and every module of service/, training/ and loadtest/ has a layer. docs/design.md's
code map lists the same folders; a new one must be placed here first."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "training", "loadtest")
# lowest first; a module's layer is its longest matching prefix
LAYERS: tuple[tuple[str, ...], ...] = (
    ("service.errors", "service.deadline", "service.limits", "service.loopback",
     "service.arguments", "service.redaction", "service.extras"),
    ("service.runtime",),
    ("service.artifacts",),
    ("service.fanout",),
    ("service.ranker",),
    ("service.backends",),
    ("service.routes",),
    ("service.settings", "service.metrics"),
    ("service.scheduling",),
    ("service.api",),
    ("service.command", "service"),
    ("training.device", "training.commands", "training.shipped", "training.progress",
     "training.library_noise"),
    ("training.data",),
    ("training.ranker",),
    ("training.stage1_fanout",),
    ("training.stage2_synthesis",),
    ("training.stage3_diffusion",),
    ("training.evaluation",),
    ("training.recipe", "training.launcher", "training.builders"),
    ("training.pipeline",),
    ("training.cli", "training"),
    ("loadtest",),
)


def layer_of(module: str) -> int | None:
    """The layer of the longest prefix in LAYERS that names `module` or a package above it."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for number, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                best = max(best or (-1, -1), (len(prefix), number))
    return None if best is None else best[1]


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts).removesuffix(".__init__")] = path
    return found


def imports(path: Path) -> set[str]:
    """Every project module `path` imports, at any depth of its code."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {name for name in names if name.split(".")[0] in PACKAGES}


def upward_imports(root: Path) -> list[str]:
    """'a (layer i) imports b (layer j > i)' for each import that climbs."""
    found = []
    for module, path in sorted(modules(root).items()):
        own = layer_of(module)
        for target in sorted(imports(path)):
            theirs = layer_of(target)
            if own is not None and theirs is not None and theirs > own:
                found.append(f"{module} (layer {own}) imports {target} (layer {theirs})")
    return found


def test_no_module_imports_from_a_higher_layer() -> None:
    assert upward_imports(ROOT) == []


def test_every_module_has_a_layer() -> None:
    assert [m for m in modules(ROOT) if layer_of(m) is None] == []


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    """The check itself: a runtime module that imports the API, lazily, is reported."""
    (tmp_path / "service" / "runtime").mkdir(parents=True)
    (tmp_path / "service" / "runtime" / "index.py").write_text(
        "def f():\n    from service.api.app import create_app\n    return create_app\n")
    assert upward_imports(tmp_path) == [
        "service.runtime.index (layer 1) imports service.api.app (layer 9)",
        "service.runtime.index (layer 1) imports service.api.app.create_app (layer 9)"]


@pytest.mark.parametrize("module, layer", [("service.routes.diffusion", 6), ("service", 10),
                                           ("training.data.metrics", 12)])
def test_a_module_takes_its_longest_prefixs_layer(module: str, layer: int) -> None:
    assert layer_of(module) == layer
