"""`diffusion-scores`, what the solver adds: the standalone student's own item scores over its
served context, then the ranker's greedy spread, no solver."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from service.artifacts.bundle import load_bundle
from service.command import main
from service.errors import BundleError
from service.routes.diffusion import DiffusionContext
from service.runtime.encoder import Encoder
from service.runtime.sampler import read_config
from tests.service.bundles import export_tiny_diffusion
from training.evaluation.harness import evaluate
from training.evaluation.student_scores import diffusion_scores
from training.stage3_diffusion.trainer import load_ema


@pytest.fixture(scope="module")
def student(small_bundle_dir, tmp_path_factory):
    """The small bundle with a tiny standalone student; its stage-3 checkpoint beside it."""
    root = tmp_path_factory.mktemp("student-scores")
    shutil.copytree(small_bundle_dir, root / "b")
    export_tiny_diffusion(root / "b", root / "run")
    (root / "b" / "runs" / "diffusion").mkdir(parents=True)  # where `r4t train` leaves it
    shutil.copy(root / "run" / "checkpoint.pt", root / "b" / "runs" / "diffusion")
    return root / "b", root / "run" / "checkpoint.pt"


def test_the_student_s_best_scored_context_item_leads_k_distinct_picks(student):
    bundle_dir, checkpoint = student
    bundle = load_bundle(bundle_dir)
    texts = ["animal", "tool", "musical instrument"]
    queries = Encoder(bundle.encoder_config).encode(texts)
    out = diffusion_scores(bundle, k=4, checkpoint=checkpoint)(texts, queries)
    context = DiffusionContext(bundle, read_config(bundle_dir / "diffusion"))
    rows = context.rows(texts, queries)  # (Q, C)
    model, _ = load_ema(checkpoint)
    with torch.no_grad():
        scores = model.item_scores(torch.from_numpy(context.features(
            context.embeddings(rows), rows, queries, texts))).numpy()  # (Q, C)
    for items, row, score in zip(out.items, rows, scores, strict=True):
        assert len(set(items.tolist())) == 4 and set(items.tolist()) <= set(row.tolist())
        assert items[0] == row[np.argmax(score)]  # the spread starts at the best score
    report = evaluate(bundle, "diffusion-scores", "val", checkpoint=checkpoint)
    assert 0.0 <= report["metrics"]["coverage@10"] <= 1.0


def test_a_bundle_without_a_checkpoint_is_refused_with_the_command(student, tmp_path):
    bundle_dir, _ = student
    with pytest.raises(BundleError, match="r4t train diffusion"):
        diffusion_scores(load_bundle(bundle_dir), checkpoint=tmp_path / "none.pt")


def test_r4t_eval_runs_it_by_name_from_the_bundle_s_checkpoint(student):
    bundle_dir, _ = student
    assert main(["--bundle", str(bundle_dir), "eval", "--split", "val", "--method",
                 "diffusion-scores", "--threads", "1"]) == 0
    assert (bundle_dir / "eval" / "diffusion-scores-val.json").is_file()
