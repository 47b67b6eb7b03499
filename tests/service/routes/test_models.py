"""The service over the project's real model runtimes: a tiny exported diffusion sampler
(service.runtime.sampler) and a tiny exported fan-out LM decoded with its KV cache
(service.fanout.decoding),
both committed into a bundle built in the session. Their weights are random, so the AR
output is usually malformed: the answer must still hold k distinct items and say so."""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

from service.artifacts.bundle import config_hash, read_manifest, stage
from service.artifacts.items import ItemStore
from tests.prerequisites import needs
from tests.service.live import live_server, make_settings
from tests.service.scrape import assert_k_unique

pytestmark = needs(modules=("torch",), package="torch, the train extra (make install)")


def commit_diffusion(bundle: Path, diffusion_dir: Path) -> None:
    record = {"config": {"source": "tiny test export"}, "wall_s": 0.0,
              "config_hash": config_hash({"source": "tiny test export"})}
    with stage(bundle, read_manifest(bundle), "diffusion", record) as staged:
        shutil.copytree(diffusion_dir, staged / "diffusion")


@pytest.fixture(scope="module")
def model_bundle(small_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from tests.training.stage3_diffusion.proxy_dataset import tiny_diffusion_dir
    from training.stage1_fanout.export import commit_policy
    from training.stage1_fanout.policy import (
        POLICY_PRESETS,
        build_model,
        hf_tokenizer,
        save_policy,
        tokenizer_corpus,
        train_tokenizer,
    )

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("models")
    bundle = root / "real"
    shutil.copytree(small_bundle_dir, bundle)
    commit_diffusion(bundle, tiny_diffusion_dir(root / "diffusion", solver="heun", steps=3))
    texts = ItemStore.load(bundle).texts[:300]
    tok = train_tokenizer(tokenizer_corpus(texts, ["tree", "boat"]), 384)
    config = POLICY_PRESETS["tiny"]
    model = build_model(config, tok, seed=3)
    save_policy(model, hf_tokenizer(tok, config.max_positions), root / "ckpt",
                {"policy": asdict(config)})
    commit_policy(bundle, root / "ckpt", "folm")
    return bundle


@pytest.fixture(scope="module")
def model_server(model_bundle: Path):
    settings = make_settings(model_bundle, None, ar_backend="onnx", ar_max_new_tokens=24,
                             groundedness_threshold=-1.0)
    with live_server(settings) as live:
        yield live


@pytest.mark.parametrize("route", ["diffusion", "ar"])
def test_real_runtimes_answer_k_distinct_items(model_server, route):
    with model_server.client() as client:
        for k in (10, 4):
            response = client.post("/v1/retrieve",
                                   json={"query": "boat", "k": k, "route": route})
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["route"] == route and not body["fallback"]["used"]
            assert_k_unique(body, k)


def test_info_reports_the_real_runtimes(model_server):
    with model_server.client() as client:
        served = client.get("/v1/info").json()["served"]
    assert served["paths"]["ar"]["backend"] == "onnx"
    # R4T_AR_DECODING unset: as the policy was trained, with catalog names in its prompts
    assert served["paths"]["ar"]["decoding"] == "context"
    assert "CPUExecutionProvider" in served["providers"]["ar"]
    assert "CPUExecutionProvider" in served["providers"]["diffusion"]
    assert served["paths"]["diffusion"]["config"]["solver"] == "heun"


def test_onnx_backend_decodes_under_the_decoding_setting(model_bundle: Path) -> None:
    from service.backends.onnx import OnnxFanoutBackend
    from service.fanout.format import build_prompt, prompt_context
    from tests.service.fanout.test_decoding import BreakHappyDecoder

    decoder = BreakHappyDecoder(model_bundle / "folm", threads=1)  # short fan-outs unless held
    prompts = ["query: boat\nfan-out:\n"] * 16
    held, free = ([g.text for g in OnnxFanoutBackend(decoder, 1.0, 120, 0, decoding=d)
                   .generate(prompts)] for d in ("lines", "free"))
    lines = [[len(t.split("\n")) for t in texts] for texts in (held, free)]
    assert min(lines[1]) < 10 <= min(lines[0])
    names = [f"boat {i}" for i in range(12)]
    context = [build_prompt("boat", names)] * 4
    named = [g.text for g in OnnxFanoutBackend(decoder, 1.0, 200, 0).generate(context)]  # context
    for text in named:
        assert len(set(text.split("\n"))) == 10 and set(text.split("\n")) <= set(names)
    assert prompt_context(context[0]) == names


def test_context_decoding_without_catalog_names_is_refused(model_bundle: Path) -> None:
    from service.artifacts.bundle import load_bundle
    from service.runtime.encoder import Encoder
    from service.scheduling.assembly import Loaders, load_routes

    bundle = load_bundle(model_bundle)
    encoder = Encoder(bundle.encoder_config)
    settings = make_settings(model_bundle, None, ar_backend="onnx", ar_context=0)
    paths, problems = load_routes(settings, bundle, encoder, Loaders())
    assert "ar" not in paths and "R4T_AR_CONTEXT > 0" in problems["ar"]
    lines = make_settings(model_bundle, None, ar_backend="onnx", ar_context=0,
                          ar_decoding="lines")
    assert "ar" in load_routes(lines, bundle, encoder, Loaders())[0]  # free text needs none
