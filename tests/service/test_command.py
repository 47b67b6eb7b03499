"""The `r4t` command table (service/command.py): outside training/, and `r4t serve` builds and
runs without importing it, as in the runtime image, which holds no training/."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from service.command import COMMANDS, build_parser, chosen

ROOT = Path(__file__).resolve().parents[2]


def test_the_entry_point_is_not_under_training() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["r4t"] == "service.command:main"


def test_the_runtime_image_copies_no_training() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    runtime = dockerfile[dockerfile.index("FROM runtime-"):]
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
