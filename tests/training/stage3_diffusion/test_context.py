"""Stage 3 reads each block's context at the width its denoiser was built for, whatever the
bundle's ranker offers beside it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from training.stage2_synthesis.dataset import load_dataset
from training.stage2_synthesis.synthesis import SynthesisConfig
from training.stage2_synthesis.teachers import synthesize_blocks
from training.stage3_diffusion.context import bundle_context
from training.stage3_diffusion.denoiser import PRESETS


@pytest.mark.parametrize(("preset", "among"), [("cpu", "ranked"), ("standalone", "mentioned")])
def test_a_context_is_as_wide_as_the_denoiser_reads_it(small_bundle_dir, tmp_path, preset,
                                                       among):
    model = replace(PRESETS[preset], context=12)
    config = SynthesisConfig(samples_per_query=1, extra_queries=0, k=4, temperature=0.0)
    run = synthesize_blocks(small_bundle_dir, "ranker", config, 12, tmp_path / "run", among)
    context = bundle_context(small_bundle_dir, load_dataset(run), model, run)
    assert context is not None
    assert context.of(np.arange(2)).shape == (2, 12, model.context_width)


def test_a_student_takes_the_width_of_its_bundle_s_encoder(small_sources, tmp_path):
    """A catalog embedded at another width (another encoder, or a Matryoshka cut) trains a
    denoiser of that width, whatever width its preset names."""
    from training.pipeline import CatalogConfig, build_catalog
    from training.stage3_diffusion.trainer import train_on_bundle, train_preset

    catalog, benchmark = small_sources
    bundle_dir = tmp_path / "narrow"
    build_catalog(bundle_dir, CatalogConfig(source=str(catalog), benchmark=str(benchmark),
                                            dim=64))
    config = SynthesisConfig(samples_per_query=1, extra_queries=0, k=4)
    run = synthesize_blocks(bundle_dir, "oracle", config, 12, tmp_path / "run")
    preset = train_preset("tiny")
    assert preset.model.dim != 64
    summary = train_on_bundle(bundle_dir, preset, run, tmp_path / "diffusion")
    assert summary["config"]["model"]["dim"] == 64
