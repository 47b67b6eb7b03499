"""The README's bring-your-own-catalog commands, run verbatim (the bundle line with `--preset
tiny`) on a small JSONL catalog: the catalog kept, the stages built on it, evaluated, served over
real HTTP; and the bad inputs around them: one line, exit 2, no bundle file changed."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.artifacts.bundle import read_manifest
from service.artifacts.stages import ROUTES_FILE
from service.command import main
from service.loopback import free_port, wait_ready
from tests.training.stage1_fanout.test_policy import write_tiny_sources
from training.evaluation.routes import RoutesConfig, choose

README = Path(__file__).resolve().parents[2] / "README.md"
BUNDLE = "models/mine"


def readme_commands() -> list[list[str]]:
    """The `r4t` lines of the README's code block that brings `my.jsonl`."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    block = next(b for b in blocks if "--source my.jsonl" in b)
    return [shlex.split(line, comments=True) for line in block.splitlines()
            if line.startswith("r4t ")]


def snapshot(bundle: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(bundle)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(bundle.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding my.jsonl, q.jsonl and, after the README's build commands, models/mine."""
    root = tmp_path_factory.mktemp("own")
    catalog, bench = write_tiny_sources(root)
    catalog.rename(root / "my.jsonl")
    bench.rename(root / "q.jsonl")
    return root


@pytest.fixture(scope="module")
def half(own: Path) -> str:
    """models/half in `own`: the catalog stages only (the README's first command)."""
    here = Path.cwd()
    os.chdir(own)
    try:
        assert main(["--bundle", "models/half", "catalog", "--source", "my.jsonl",
                     "--benchmark", "q.jsonl"]) == 0
    finally:
        os.chdir(here)
    return "models/half"


def run_r4t(argv: list[str], cwd: Path, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    here = Path.cwd()
    os.chdir(cwd)
    try:
        code = main(argv)
    finally:
        os.chdir(here)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_the_readme_commands_build_evaluate_and_serve_my_catalog(own, capsys) -> None:
    commands = readme_commands()
    assert [c[3] for c in commands] == ["catalog", "bundle", "eval", "serve"]
    catalog, bundle, evaluation, serve = (c[1:] for c in commands)
    assert run_r4t(catalog, own, capsys)[0] == 0
    code, out = run_r4t([*bundle, "--preset", "tiny"], own, capsys)
    assert code == 0
    assert "catalog: current" in out and "benchmark: current" in out  # my catalog, kept
    manifest = read_manifest(own / BUNDLE)
    assert manifest["config"]["source"] == "my.jsonl"
    assert "diffusion" in manifest["stages"] and "folm" not in manifest["stages"]  # no --ar
    assert "--ar builds it" in out
    code, out = run_r4t(evaluation, own, capsys)
    assert code == 0
    assert all((own / BUNDLE / "eval" / f"{m}-val.json").is_file()
               for m in ("single", "hybrid", "ranked", "diffusion"))
    measured = json.loads((own / BUNDLE / ROUTES_FILE).read_text())  # the free heuristic too
    assert {"single", "hybrid", "ranked", "diffusion"} <= set(measured["table"])
    best = choose(measured["table"], RoutesConfig())
    assert measured["weights"].split("=")[0] == best

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "service.command", *serve, "--port",
                                str(port)], cwd=own, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/readyz", 120.0, process)
        answer = httpx.post(f"{url}/v1/retrieve", json={"query": "camping", "k": 5,
                                                        "route": "diffusion"}, timeout=30)
        assert answer.status_code == 200
        body = answer.json()
        assert body["route"] == "diffusion" and not body["fallback"]["used"]
        routing = httpx.get(f"{url}/v1/info", timeout=30).json()["served"]["routing"]
        assert max(routing["weights"], key=routing["weights"].get) == best
        ids = {json.loads(line)["id"] for line in (own / "my.jsonl").read_text().splitlines()}
        assert len(body["items"]) == 5 and {item["id"] for item in body["items"]} <= ids
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_another_source_on_a_built_bundle_is_refused_and_changes_nothing(own, capsys) -> None:
    bundle = own / BUNDLE
    if not (bundle / "manifest.json").is_file():
        assert run_r4t(readme_commands()[0][1:], own, capsys)[0] == 0
    before = snapshot(bundle)
    for argv in (["--bundle", BUNDLE, "bundle", "--preset", "tiny"],
                 ["--bundle", BUNDLE, "catalog"]):
        code, out = run_r4t([*argv, "--source", "wordnet"], own, capsys)
        assert code == 2
        assert out.count("\n") == 1 and "--force" in out and "new bundle" in out, out
    code, out = run_r4t(["--bundle", BUNDLE, "catalog", "--source", "q.jsonl"], own, capsys)
    assert code == 2 and "was built from --source my.jsonl" in out
    assert snapshot(bundle) == before


@pytest.mark.parametrize("argv", [
    ["eval", "--method", "all"],
    ["eval", "--method", "diffusion", "--split", "val"],
    ["eval", "--method", "folm"],
    ["eval", "--steps-curve"],
    ["llm", "missing.gguf"],
], ids=lambda argv: " ".join(argv[:3]))
def test_a_command_on_a_bundle_without_its_stage_names_it_in_one_line(own, half, capsys,
                                                                       argv) -> None:
    before = snapshot(own / half)
    code, out = run_r4t(["--bundle", half, *argv], own, capsys)
    assert code == 2
    assert out.count("\n") == 1 and out.startswith("r4t: error: "), out
    assert f"r4t --bundle {half} bundle" in out or "llm" in argv, out
    assert snapshot(own / half) == before


@pytest.mark.parametrize("command", [
    ["-m", "loadtest.bench", "--bundle", "{own}/models/half"],
    ["-m", "service.command", "--bundle", "{own}/models/none", "serve"],
], ids=["bench", "serve"])
def test_bench_and_serve_without_their_stages_exit_2_with_one_line(own, half, command) -> None:
    done = subprocess.run([sys.executable, *(c.format(own=own) for c in command)],
                          cwd=README.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "build it with `r4t --bundle" in done.stderr, \
        done.stderr
    assert not (own / "models" / "none").exists()
