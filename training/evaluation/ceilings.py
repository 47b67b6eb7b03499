"""Label ceilings of candidate generation: for each source and size, the coverage@10 of the
best 10 picks among its candidates (`best_coverage`). A diagnostic that says, before any
training, how far a fan-out choosing from those candidates could go; never a training signal.
Beside them, how far each label-free stage-1 reward could take a choice among the default
prompt's names (training/evaluation/objectives.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from service.artifacts.bundle import REPORTS_DIR, Bundle, load_bundle
from service.fanout.candidates import Candidates, candidate_rows
from service.fanout.grounding import PromptNeighbourhood
from service.runtime.encoder import Encoder
from training.data.metrics import best_coverage
from training.data.splits import load_split
from training.evaluation.objectives import objective_rows

SOURCES = (("dense", 16), ("dense", 100), ("dense", 500), ("lexical", 50), ("lexical", 100),
           ("hybrid", 50), ("hybrid", 100))
# the fan-out prompt's names (the action space of teacher and student): the dense prompt of
# earlier bundles and hybrid prompts of the default's size and wider
PROMPTS = (("dense", 16), ("hybrid", 16), ("hybrid", 24), ("hybrid", 32))
CEILINGS_DIR = "ceilings"


def ceilings(bundle: Bundle, split: str = "val") -> dict[str, Any]:
    """Mean label ceiling and median candidate count per (source, n) over `split`."""
    queries = load_split(bundle.path, split)
    texts = [q.query for q in queries]
    embedded = Encoder(bundle.encoder_config).encode(texts)  # (Q, d)
    sources = {}
    for source, n in PROMPTS:
        if source != "dense" and bundle.lexical is None:
            continue
        prompt = PromptNeighbourhood(Candidates.of(bundle, source), bundle.items.texts,
                                     bundle.items.embeddings, n)
        sources[f"prompt names, {source} ({n})"] = list(prompt.rows(texts, embedded))  # (Q, n)
    for source, n in tqdm(SOURCES, desc=f"ceilings/{split}", unit="source"):
        if source != "dense" and bundle.lexical is None:
            continue
        sources[f"{source} ({n})"] = candidate_rows(bundle, texts, embedded, n, source)
    ids = bundle.items.ids
    rows = []
    for name, candidates in sources.items():
        values = [best_coverage({ids[r] for r in rows_i}, q.groups)
                  for rows_i, q in zip(candidates, queries, strict=True)]
        rows.append({"candidates": name, "ceiling@10": float(np.nanmean(values)),
                     "median_size": float(np.median([len(c) for c in candidates]))})
    objectives = objective_rows(bundle, queries) if bundle.lexical is not None else []
    return {"split": split, "n_queries": len(queries), "rows": rows, "objectives": objectives}


def write_ceilings(bundle_dir: Path, report: dict[str, Any]) -> Path:
    """eval/ceilings/<split>.json and the markdown table beside it."""
    directory = bundle_dir / REPORTS_DIR / CEILINGS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{report['split']}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# Label ceilings of candidate sources ({report['split']}, "
             f"{report['n_queries']} queries)", "",
             "| candidates | best 10 picks: coverage@10 | median candidates |", "|---|---:|---:|"]
    lines += [f"| {r['candidates']} | {r['ceiling@10']:.3f} | {r['median_size']:.0f} |"
              for r in report["rows"]]
    if report.get("objectives"):
        lines += ["", "## Label-free objectives, maximised greedily over the default prompt's "
                  f"names ({report['objectives'][0]['candidates']})", "",
                  "| objective (stage-1 reward) | coverage@10 of its best set | ± se |",
                  "|---|---:|---:|"]
        lines += [f"| {r['objective']} | {r['coverage@10']:.3f} | {r['se']:.3f} |"
                  for r in report["objectives"]]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return path


def run_ceilings(bundle_dir: Path, split: str) -> Path:
    """`r4t eval --ceilings`: compute, write and print; returns the JSON path."""
    path = write_ceilings(bundle_dir, ceilings(load_bundle(bundle_dir), split))
    print(path.with_suffix(".md").read_text())
    return path
