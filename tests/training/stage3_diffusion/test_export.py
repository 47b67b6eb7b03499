import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from service.artifacts.bundle import new_manifest, verify_bundle, write_manifest
from service.runtime.encoder import EncoderConfig
from tests.training.stage3_diffusion.proxy_dataset import tiny_checkpoint
from training.stage3_diffusion.export import ExportConfig, export_diffusion, export_step
from training.stage3_diffusion.sampler_graph import compose_sampler
from training.stage3_diffusion.solvers import sample
from training.stage3_diffusion.trainer import load_ema


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    torch.set_num_threads(1)
    model, _ = load_ema(tiny_checkpoint(tmp_path_factory.mktemp("run")))
    with torch.no_grad():  # a few steps barely move the zero-initialised head: randomise
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def step_graphs(tiny_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("step")
    return {w: export_step(tiny_model, w, directory / f"step-{w}.onnx") for w in (0.0, 0.5)}


@pytest.mark.parametrize("form", ["unrolled", "loop"])
@pytest.mark.parametrize(("solver", "steps", "cfg"), [("euler", 6, 0.0), ("heun", 4, 0.5),
                                                      ("heun", 1, 0.0)])
def test_whole_sampler_graph_matches_pytorch(tiny_model, step_graphs, form, solver, steps, cfg):
    config = tiny_model.config
    graph = compose_sampler(step_graphs[cfg], config.rows, config.dim, solver, steps,
                            config.sigma_min, config.sigma_max, form)
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for batch in (1, 5):
        query = rng.standard_normal((batch, config.dim)).astype(np.float32)
        noise = rng.standard_normal((batch, config.rows, config.dim)).astype(np.float32)
        rows = session.run(["rows"], {"query": query, "noise": noise})[0]
        expected = sample(tiny_model, torch.from_numpy(query), solver, steps, cfg,
                          noise=torch.from_numpy(noise)).numpy()
        assert rows.shape == (batch, config.rows, config.dim)
        assert np.abs(rows - expected).max() < 1e-3


def test_step_graph_matches_pytorch(tiny_model, step_graphs):
    session = ort.InferenceSession(step_graphs[0.5].SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    x, sigma, query = torch.randn(3, 10, 128), torch.tensor([0.01, 0.1, 0.9]), torch.randn(3, 128)
    out = session.run(None, {"x": x.numpy(), "sigma": sigma.numpy(), "query": query.numpy()})[0]
    expected = tiny_model.guided(x, sigma, query, 0.5).detach().numpy()
    assert np.abs(out - expected).max() < 1e-4


def test_export_commits_a_verified_diffusion_stage(tmp_path):
    bundle_dir = tmp_path / "bundle"
    bundle_dir.mkdir()
    manifest = new_manifest("t", EncoderConfig(), seed=0)
    write_manifest(bundle_dir, manifest)
    checkpoint = tiny_checkpoint(tmp_path / "run")
    meta = export_diffusion(bundle_dir, checkpoint, ExportConfig(solver="heun", steps=3))
    manifest = verify_bundle(bundle_dir)
    record = manifest["stages"]["diffusion"]
    assert {"diffusion/sampler.onnx", "diffusion/step.onnx", "diffusion/diffusion.json",
            "diffusion/training.json", "diffusion/loss_curve.png"} <= set(manifest["files"])
    assert record["ledger"]["steps"] == 20 and record["config_hash"]
    written = json.loads((bundle_dir / "diffusion" / "diffusion.json").read_text())
    assert written["evaluations"] == 5 and written["parity_max_abs_diff"] < 1e-3
    assert written["flops_per_query"] == meta["flops_per_query"] > 0
    assert not [p for p in bundle_dir.iterdir() if p.name.startswith(".stage")]


@pytest.mark.parametrize(("form", "solver"), [("unrolled", "euler"), ("loop", "heun")])
def test_a_model_with_context_exports_with_parity(tmp_path, form, solver):
    from training.stage3_diffusion.export import write_sampler

    torch.set_num_threads(1)
    model, _ = load_ema(tiny_checkpoint(tmp_path / "run", context=4))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    meta = write_sampler(model, ExportConfig(solver=solver, steps=4, cfg_weight=0.5, form=form),
                         tmp_path / "diffusion")
    assert meta["context"] == 4 and meta["parity_max_abs_diff"] < 1e-3
    session = ort.InferenceSession(str(tmp_path / "diffusion" / "sampler.onnx"),
                                   providers=["CPUExecutionProvider"])
    inputs = {i.name: i.shape for i in session.get_inputs()}
    assert inputs["context"][1:] == [4, 128] and set(inputs) == {"query", "context", "noise"}


def test_a_model_reading_item_parts_exports_with_parity(tmp_path):
    from training.stage3_diffusion.export import write_sampler

    torch.set_num_threads(1)
    model, _ = load_ema(tiny_checkpoint(tmp_path / "run", context=4, parts=("name", "head")))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    meta = write_sampler(model, ExportConfig(solver="euler", steps=1), tmp_path / "diffusion")
    assert meta["parts"] == ["name", "head"] and meta["parity_max_abs_diff"] < 1e-3
    session = ort.InferenceSession(str(tmp_path / "diffusion" / "sampler.onnx"),
                                   providers=["CPUExecutionProvider"])
    inputs = {i.name: i.shape for i in session.get_inputs()}
    assert inputs["context"][1:] == [4, 130]


def test_a_student_sampled_in_one_evaluation_exports_projected_with_parity(tmp_path):
    from training.stage3_diffusion.export import served_width, write_sampler

    torch.set_num_threads(1)
    model, _ = load_ema(tiny_checkpoint(tmp_path / "run", context=4, mentions=True,
                                        context_source="mentioned", ordered=True))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    catalog = np.random.default_rng(0).standard_normal((50, 128)).astype(np.float32)
    meta = write_sampler(model, ExportConfig(solver="euler", steps=1), tmp_path / "one",
                         embeddings=catalog)
    mc = model.config
    assert meta["items_file"] == "items.npy" and meta["parity_max_abs_diff"] < 1e-3
    assert meta["context_width"] == served_width(mc) < mc.context_width
    items = np.load(tmp_path / "one" / "items.npy")
    assert items.shape == (50, mc.hidden) and items.dtype == np.float32
    session = ort.InferenceSession(str(tmp_path / "one" / "sampler.onnx"),
                                   providers=["CPUExecutionProvider"])
    inputs = {i.name: i.shape for i in session.get_inputs()}
    assert inputs["context"][1:] == [4, served_width(mc)]
    with pytest.raises(ValueError, match="one evaluation"):  # its mixture needs embeddings
        compose_sampler(onnx.load(str(tmp_path / "one" / "step.onnx")), mc.rows, mc.dim,
                        "euler", 4, mc.sigma_min, mc.sigma_max)
    # more evaluations: the full context, the rows mixed in the graph's steps
    meta = write_sampler(model, ExportConfig(solver="euler", steps=2), tmp_path / "two",
                         embeddings=catalog)
    assert "items_file" not in meta and meta["context_width"] == mc.context_width
    assert meta["parity_max_abs_diff"] < 1e-3 and not (tmp_path / "two" / "items.npy").exists()
