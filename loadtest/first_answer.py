"""Time to a first `diffusion` answer on a fresh machine: the README's `make serve` in a clean
clone (its install, with an empty package cache, then `r4t serve --build`), one client asking
every second with the route forced to `diffusion`, until one is answered by it with no fallback.

Records each line `make serve` prints with its time since the command, the steps between
(install, catalog stages, shipped stages adopted, the reload that serves them) and their
shares; every answer, its route and fallback. Writes first_answer.json and first_answer.md.
Run alone: it times the whole start-up.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.report import publish

QUERY = {"query": "musical instrument", "k": 10, "route": "diffusion"}
# (step, the first output line that ends it); a step lasts from the previous step's end
STEPS = (
    ("install (venv, pip: the serve extra only)", "serve --build"),
    ("catalog stages (embed, index, lexical, benchmark)", "== folm-warmstart"),
    ("stages 1-3 adopted from models/shipped/default", ": done"),
)


def probe(client: httpx.Client) -> dict[str, Any]:
    try:
        response = client.post("/v1/retrieve", json=QUERY)
    except httpx.TransportError:
        return {"status": 0}  # not listening yet
    if response.status_code != 200:
        return {"status": response.status_code}
    body = response.json()
    return {"status": 200, "route": body.get("route"),
            "fallback": bool(body.get("fallback", {}).get("used"))}


def follow(stream: Any, started: float, lines: list[dict[str, Any]]) -> None:
    """Keep each output line with its time since the command (progress bars' \\r kept)."""
    for raw in iter(stream.readline, ""):
        lines.append({"t_s": round(time.monotonic() - started, 2), "line": raw.rstrip()})


def watch(url: str, started: float, limit_s: float, period_s: float) -> list[dict[str, Any]]:
    """One forced-diffusion request per period until diffusion answers without fallback."""
    log: list[dict[str, Any]] = []
    with httpx.Client(base_url=url, timeout=30.0) as client:
        while time.monotonic() - started < limit_s:
            entry = {"t_s": round(time.monotonic() - started, 2), **probe(client)}
            log.append(entry)
            if entry.get("route") == "diffusion" and not entry.get("fallback"):
                break
            time.sleep(period_s)
    return log


def steps(lines: list[dict[str, Any]], answered_s: float | None) -> list[dict[str, Any]]:
    """Each step's end and duration from the output's marker lines; the last step runs to the
    first diffusion answer."""
    out, previous = [], 0.0
    for name, marker in STEPS:
        end = next((e["t_s"] for e in lines if marker in e["line"]), None)
        if end is None:
            continue
        out.append({"step": name, "end_s": end, "seconds": round(end - previous, 2)})
        previous = end
    if answered_s is not None:
        out.append({"step": "load, verify, warm up and hot-reload the routes",
                    "end_s": answered_s, "seconds": round(answered_s - previous, 2)})
    for step in out:
        step["share"] = round(step["seconds"] / answered_s, 3) if answered_s else None
    return out


def run(clone: Path, port: int, limit_s: float, period_s: float) -> dict[str, Any]:
    """`make serve` in `clone` with a fresh pip cache, watched until diffusion answers."""
    cache = tempfile.mkdtemp(prefix="pip-cache-")
    env = {**os.environ, "PIP_CACHE_DIR": cache, "R4T_PORT": str(port)}
    env.pop("VIRTUAL_ENV", None)
    started = time.monotonic()
    make = subprocess.Popen(["make", "serve"], cwd=clone, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    lines: list[dict[str, Any]] = []
    reader = threading.Thread(target=follow, args=(make.stdout, started, lines), daemon=True)
    reader.start()
    try:
        log = watch(f"http://127.0.0.1:{port}", started, limit_s, period_s)
    finally:
        os.killpg(make.pid, 15)
        make.wait(timeout=60)
        reader.join(timeout=10)
    first = next((e["t_s"] for e in log if e.get("route") == "diffusion"
                  and not e.get("fallback")), None)
    answered = [e for e in log if e["status"] == 200]
    return {"command": "make serve", "clone": str(clone), "pip_cache": "empty (fresh folder)",
            "first_diffusion_answer_s": first,
            "first_answer_s": answered[0]["t_s"] if answered else None,
            "steps": steps(lines, first), "requests": len(log), "log": log, "output": lines}


def markdown(report: dict[str, Any]) -> str:
    rows = [f"| {s['step']} | {s['seconds']:.1f} | {s['end_s']:.1f} | {s['share']:.0%} |"
            for s in report["steps"] if s["share"] is not None]
    return "\n".join([
        "# First `diffusion` answer on a fresh clone (`make serve`)", "",
        f"From the command to the first answer with `route: diffusion` forced and "
        f"`fallback.used` false: **{report['first_diffusion_answer_s']} s** (first answer of "
        f"any route: {report['first_answer_s']} s; the package cache empty).", "",
        "| step | s | ends at s | share |", "|---|---:|---:|---:|", *rows, "",
        "Written by `python -m loadtest.first_answer --clone <clean clone>`.",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clone", type=Path, required=True,
                        help="a clean clone of the repository (no .venv, no models/default)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--limit-min", type=float, default=30.0,
                        help="give up after this many minutes")
    parser.add_argument("--period-s", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args()
    report = run(args.clone.resolve(), args.port, 60 * args.limit_min, args.period_s)
    publish(args.out, "first_answer", report, markdown(report))


if __name__ == "__main__":
    main()
