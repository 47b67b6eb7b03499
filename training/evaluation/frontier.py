"""Coverage against price: every served route of a bundle (and the diffusion route of other
bundles, e.g. a student variant) on val and test, beside the process CPU it spends per answer
relative to `single`'s, measured in one run through the harness on the served index (R4T_INDEX's
default). Quality is the protocol's (exact index, sampled methods over SEEDS seeds). Writes
frontier.json and frontier.md, and frontier.png with the train extra's matplotlib.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.artifacts.bundle import load_bundle, read_manifest
from service.artifacts.stages import AR_STAGE
from service.runtime.index import IndexChoice
from service.settings import Settings
from training.evaluation.harness import evaluate

SEEDS = 4
SPLITS = ("val", "test")
ROUTES = (("single", ()), ("hybrid", ("lexical",)), ("ranked", ("ranker",)),
          ("diffusion", ("diffusion",)), (AR_STAGE, (AR_STAGE,)))
SEEDED = ("diffusion", AR_STAGE)
NO_SOLVER = "diffusion, no solver (its item scores, greedy spread; torch)"


@dataclass(frozen=True)
class Point:
    """One method of one bundle: what it is called in the table, and how it is run."""

    label: str
    bundle: Path
    method: str


def points(bundle_dir: Path, others: list[tuple[str, Path]]) -> list[Point]:
    """The bundle's routes that it has the stages for, what the solver adds where its student
    scores items (`diffusion-scores`, from its stage-3 checkpoint), then each other bundle's
    diffusion."""
    stages = read_manifest(bundle_dir).get("stages", {})
    found = [Point(name, bundle_dir, name) for name, needs in ROUTES
             if all(stage in stages for stage in needs)]
    if "mention_words" in stages.get("diffusion", {}).get("sampler", {}) \
            and (bundle_dir / "runs" / "diffusion" / "checkpoint.pt").is_file():
        found.append(Point(NO_SOLVER, bundle_dir, "diffusion-scores"))
    return found + [Point(label, path, "diffusion") for label, path in others]


def measure(point: Point, served_index: str) -> dict[str, Any]:
    """Coverage@10 per split on the exact index, and CPU ms per answer on the served one."""
    exact, served = load_bundle(point.bundle), load_bundle(point.bundle,
                                                           IndexChoice.parse(served_index))
    seeds = SEEDS if point.method in SEEDED else 1
    row: dict[str, Any] = {"label": point.label, "bundle": str(point.bundle),
                           "method": point.method, "seeds": seeds}
    cpu = []
    for split in SPLITS:
        quality = evaluate(exact, point.method, split, seeds=seeds)
        row[f"{split}_coverage@10"] = quality["metrics"]["coverage@10"]
        row[f"{split}_per_query"] = quality["diagnostics"]["per_query"]["coverage@10"]
        cpu.append(evaluate(served, point.method, split)["diagnostics"]["cpu_ms_per_query"])
    row["cpu_ms_per_answer"] = float(np.mean(cpu))
    return row


def paired(row: dict[str, Any], reference: dict[str, Any], split: str) -> tuple[float, float]:
    """Mean and standard error of row − reference over the split's queries."""
    diff = np.array(row[f"{split}_per_query"]) - np.array(reference[f"{split}_per_query"])
    return float(diff.mean()), float(diff.std(ddof=1) / np.sqrt(len(diff)))


def table(rows: list[dict[str, Any]], reference: str = "ranked") -> str:
    """The markdown table, cheapest first, each method paired against `reference`."""
    single = next(r for r in rows if r["label"] == "single")["cpu_ms_per_answer"]
    ref = next((r for r in rows if r["label"] == reference), None)
    lines = ["| method | coverage@10 val | coverage@10 test | − "
             f"{reference}, val | − {reference}, test | CPU per answer vs single |",
             "|---|---:|---:|---|---|---:|"]
    for row in sorted(rows, key=lambda r: r["cpu_ms_per_answer"]):
        diffs = ["–", "–"] if ref is None or row is ref else [
            "{:+.3f} ± {:.3f}".format(*paired(row, ref, split)) for split in SPLITS]
        lines.append(f"| {row['label']} | {row['val_coverage@10']:.3f} | "
                     f"{row['test_coverage@10']:.3f} | {diffs[0]} | {diffs[1]} | "
                     f"{row['cpu_ms_per_answer'] / single:.1f}× |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Coverage@10 (val, test) against CPU per answer relative to single, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    single = next(r for r in rows if r["label"] == "single")["cpu_ms_per_answer"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for split, marker in zip(SPLITS, ("o", "s"), strict=True):
        x = [r["cpu_ms_per_answer"] / single for r in rows]
        ax.scatter(x, [r[f"{split}_coverage@10"] for r in rows], marker=marker, label=split)
    for row in rows:
        ax.annotate(row["label"], (row["cpu_ms_per_answer"] / single, row["val_coverage@10"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("process CPU per answer / single's (served index)")
    ax.set_ylabel("coverage@10")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_frontier(bundle_dir: Path, others: list[tuple[str, Path]], out: Path) -> dict[str, Any]:
    served_index = Settings(bundle=bundle_dir).index
    rows = [measure(point, served_index) for point in points(bundle_dir, others)]
    report = {"bundle": str(bundle_dir), "served_index": served_index, "seeds": SEEDS,
              "rows": rows}
    text = (f"# Coverage against price: `{bundle_dir}`\n\nCoverage@10 on the exact index "
            f"(sampled methods over {SEEDS} seeds), paired over queries; process CPU per "
            f"answer through the harness on the served index ({served_index}), one run, "
            "relative to single's.\n\n" + table(rows) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "frontier.md").write_text(text)
    print(text)
    try:
        plot(rows, out / "frontier.png")
    except ImportError:  # matplotlib is the train extra's: the table stands without it
        print("no matplotlib: frontier.png not drawn")
    return report


def named_bundle(value: str) -> tuple[str, Path]:
    """LABEL=BUNDLE."""
    label, sep, path = value.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=BUNDLE, got {value!r}")
    return label, Path(path)


def register(sub: argparse._SubParsersAction) -> None:
    """`r4t frontier [--also LABEL=BUNDLE ...] [--out DIR]`."""
    parser = sub.add_parser("frontier", help="every route's coverage@10 against its CPU per "
                                             "answer relative to single's, one run")
    parser.add_argument("--also", type=named_bundle, action="append", default=[],
                        metavar="LABEL=BUNDLE", help="another bundle's diffusion route")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.set_defaults(func=lambda args: run_frontier(args.bundle, args.also, args.out))
