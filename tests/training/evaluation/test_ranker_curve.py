"""The ranker's learning curve and the oracles beside it."""

from __future__ import annotations

import json

from service.artifacts.bundle import load_bundle
from service.ranker.ranker import RANKER_CONFIG, RANKER_DIR, RANKER_MODEL
from service.routes.ranked import RankedRoute
from service.runtime.encoder import Encoder
from training.data.splits import load_split
from training.evaluation.ranker_curve import run_ranker_curve
from training.ranker.lambdarank import coverage


def test_the_full_share_is_the_ranker_stage_and_the_oracles_stand_beside_it(small_bundle_dir):
    path = run_ranker_curve(small_bundle_dir, "test", shares=(0.5, 1.0), draws=2)
    report = json.loads(path.read_text())
    curve = report["curve"]
    assert [(r["share"], r["draw"]) for r in curve] == [(0.5, 0), (0.5, 1), (1.0, 0)]
    assert curve[0]["train_queries"] < curve[-1]["train_queries"]
    # trained on every labeled train query, it is the stage's own model, tuned the same way
    stage = json.loads((small_bundle_dir / RANKER_DIR / RANKER_CONFIG).read_text())
    tried = [t["coverage@10"] for t in stage["trained"]["val_coverage@10"]
             if t["model"] == RANKER_MODEL]
    assert curve[-1]["val_coverage@10"] == max(tried)
    # the oracles stand beside the served ranker as the stage tuned it
    bundle = load_bundle(small_bundle_dir)
    served = RankedRoute(bundle, Encoder(bundle.encoder_config))
    labeled = [q for q in load_split(small_bundle_dir, "test") if q.groups]
    oracles = report["oracles"]
    assert oracles["ranked"] == coverage(served, labeled)
    assert all(0.0 <= value <= 1.0 for value in oracles.values())
    assert path.with_suffix(".md").is_file()
