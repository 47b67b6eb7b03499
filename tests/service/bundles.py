"""The serving test bundles' parts: a real tiny diffusion export shaped as the `standalone`
student's (see conftest.py), and the toy sampler graphs built to misbehave on purpose."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto, helper

from service.artifacts.bundle import config_hash, read_manifest, stage

ROWS = 10  # rows = k, as the default bundle's sampler
DIM = 128
CONTEXT = 16  # the served sampler attends to 16 items: its query's nearest mentions, then nearest
CONTEXT_SOURCE = "mentioned"
DRAWS = 1
SOLVER, STEPS = "euler", 1
TRAIN_STEPS = 4
NOISE_SCALE = 0.05  # the toy graph's
LLM_K, LLM_CONTEXT = 10, 16  # the tiny GGUF policy's fan-out and prompt names


def sampler_graph(broken: bool = False, fail_above: int | None = None) -> onnx.ModelProto:
    """query (B, d), noise (B, L, d) → rows (B, L, d) = normalize(noise·s + query): a toy that
    follows contract 4, kept only to build samplers that fail on purpose, which a real export
    cannot be made to do.

    broken=True reshapes the noise to an impossible shape: loads fine, fails on every run.
    fail_above=n reads entry B-1 of a length-n vector: fails only on batches larger than n.
    """
    query = helper.make_tensor_value_info("query", TensorProto.FLOAT, ["B", DIM])
    noise = helper.make_tensor_value_info("noise", TensorProto.FLOAT, ["B", ROWS, DIM])
    rows = helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["B", ROWS, DIM])
    consts = [
        helper.make_tensor("axis1", TensorProto.INT64, [1], [1]),
        helper.make_tensor("scale", TensorProto.FLOAT, [], [NOISE_SCALE]),
        helper.make_tensor("eps", TensorProto.FLOAT, [], [1e-12]),
    ]
    source = "noise"
    nodes = []
    if fail_above is not None:  # gather entry B-1 of a length-n vector of zeros
        consts += [helper.make_tensor("zeros", TensorProto.FLOAT, [fail_above],
                                      [0.0] * fail_above),
                   helper.make_tensor("one", TensorProto.INT64, [1], [1])]
        nodes += [
            helper.make_node("Shape", ["noise"], ["batch"], end=1),  # (1,): B
            helper.make_node("Sub", ["batch", "one"], ["last"]),  # (1,): B - 1
            helper.make_node("Gather", ["zeros", "last"], ["zero"], axis=0),  # (1,) or error
            helper.make_node("Add", ["noise", "zero"], ["noise_checked"]),  # (B, L, d)
        ]
        source = "noise_checked"
    if broken:
        consts.append(helper.make_tensor("tail", TensorProto.INT64, [2], [7, -1]))
        nodes += [  # a shape known only at run time, so the model loads and then fails
            helper.make_node("Shape", ["noise"], ["full"], end=1),  # (1,): B
            helper.make_node("Concat", ["full", "tail"], ["bad_shape"], axis=0),  # [B, 7, -1]
            helper.make_node("Reshape", ["noise", "bad_shape"], ["noise_bad"]),
        ]
        source = "noise_bad"
    nodes += [
        helper.make_node("Unsqueeze", ["query", "axis1"], ["q3"]),  # (B, 1, d)
        helper.make_node("Mul", [source, "scale"], ["scaled"]),  # (B, L, d)
        helper.make_node("Add", ["scaled", "q3"], ["shifted"]),  # (B, L, d)
        helper.make_node("ReduceL2", ["shifted"], ["norm"], axes=[-1], keepdims=1),  # (B, L, 1)
        helper.make_node("Max", ["norm", "eps"], ["safe"]),
        helper.make_node("Div", ["shifted", "safe"], ["rows"]),
    ]
    graph = helper.make_graph(nodes, "toy_sampler", [query, noise], [rows], initializer=consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def add_diffusion_stage(
    bundle_dir: Path, broken: bool = False, fail_above: int | None = None
) -> None:
    """Commit a toy diffusion/sampler.onnx + diffusion/diffusion.json into the bundle."""
    manifest = read_manifest(bundle_dir)
    manifest["name"] = bundle_dir.name
    config = {
        "rows": ROWS, "k": ROWS, "dim": DIM, "solver": "none (test stand-in)", "steps": 0,
        "cfg_weight": 0.0, "cfg_formula": "none", "sigma_min": 0.0, "sigma_max": NOISE_SCALE,
        "params": 0, "flops_per_query": 4 * ROWS * DIM, "preset": "test-broken" if broken
        else "test",
    }
    record = {"config": config, "config_hash": config_hash(config), "wall_s": 0.0}
    with stage(bundle_dir, manifest, "diffusion", record) as staged:
        (staged / "diffusion").mkdir()
        onnx.save(sampler_graph(broken, fail_above), staged / "diffusion" / "sampler.onnx")
        (staged / "diffusion" / "diffusion.json").write_text(json.dumps(config))


def export_tiny_diffusion(bundle_dir: Path, run_dir: Path) -> dict[str, Any]:
    """Train the tiny denoiser a few steps with the default bundle's context, export its
    sampler as the default bundle's is, and commit it into the bundle; its diffusion.json."""
    import torch

    from tests.training.stage3_diffusion.proxy_dataset import tiny_checkpoint
    from training.stage3_diffusion.export import ExportConfig, export_diffusion

    torch.set_num_threads(1)
    # one block and a few training steps keep the session's setup short (the dynamo export
    # of one step graph dominates it); ordered rows and a "mentioned" context with its items'
    # mention features, as the `standalone` preset
    checkpoint = tiny_checkpoint(run_dir, rows=ROWS, steps=TRAIN_STEPS, context=CONTEXT,
                                 context_source=CONTEXT_SOURCE, ordered=True, layers=1,
                                 mentions=True)
    return export_diffusion(bundle_dir, checkpoint,
                            ExportConfig(solver=SOLVER, steps=STEPS, draws=DRAWS))
