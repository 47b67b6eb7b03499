"""Export a FOLM to ONNX with a key/value cache, plus its tokenizer, into a bundle folder.

One graph serves the prompt pass (past length 0) and every single-token step:
inputs `input_ids` (B,T), `attention_mask` (B,P+T), `position_ids` (B,T) int64 and per layer
`past_key.{i}`, `past_value.{i}` (B,H_kv,P,Dh) float32; outputs `logits` (B,T,V) and
`present_key.{i}`, `present_value.{i}` (B,H_kv,P+T,Dh). The service decodes it with ONNX
Runtime alone (`service.fanout.decoding.FanoutDecoder`). Bundle folders: `folm/` (the GRPO policy)
and
`folm-warmstart/` (the warm start), each with model.onnx, tokenizer.json and folm.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from service.artifacts.bundle import config_hash, git_commit, read_manifest, stage
from service.artifacts.stages import AR_STAGE, AR_WARMSTART, ONNX_POLICIES
from service.errors import InputError
from service.fanout.candidates import UNRECORDED_SOURCE
from service.fanout.decoding import FOLM_CONFIG, MODEL_FILE, TOKENIZER_FILE
from training.commands import subcommand_group

OPSET = 18
PROTOBUF_LIMIT = 1_800_000_000  # bytes of fp32 weights one model.onnx holds (2 GB, less slack)


def cached_decoder(model: Any) -> Any:
    """Flat-tensor interface around a HF causal LM that rebuilds a DynamicCache inside.

    Defined lazily so that building the CLI does not import torch.
    """
    import torch
    from transformers import DynamicCache

    class CachedDecoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.n_layers = model.config.num_hidden_layers

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor, past: tuple) -> tuple[torch.Tensor, ...]:
            return decoder_forward(self.model, DynamicCache, input_ids, attention_mask,
                                   position_ids, past)

    return CachedDecoder()


def decoder_forward(
    model: Any, cache_cls: Any, input_ids: Any, attention_mask: Any, position_ids: Any,
    past: tuple,
) -> tuple:
    cache = cache_cls(config=model.config)
    for i, (key, value) in enumerate(past):
        cache.update(key, value, i)  # (B, H_kv, P, Dh) each
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=cache, use_cache=True,
    )
    presents: list[Any] = []
    for layer in out.past_key_values.layers:
        presents += [layer.keys, layer.values]  # (B, H_kv, P+T, Dh) each
    return (out.logits, *presents)


def cache_shape(config: Any) -> tuple[int, int]:
    """(H_kv, Dh) of the model's cache."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads, head_dim


def export_onnx(model: Any, path: Path) -> None:
    """torch.onnx dynamo export with dynamic batch, new-token and past lengths; the weights
    of a model past protobuf's 2 GB go to `model.onnx.data` beside it."""
    import torch

    from training.stage1_fanout.policy import n_params

    model.eval()
    wrapper = cached_decoder(model).eval()
    n_kv, head_dim = cache_shape(model.config)
    b, t, p = 2, 3, 2  # example sizes >= 2 on every dynamic axis
    ids = torch.ones((b, t), dtype=torch.long)  # (B, T)
    mask = torch.ones((b, p + t), dtype=torch.long)  # (B, P+T)
    pos = torch.arange(p, p + t).expand(b, t).contiguous()  # (B, T)
    past = tuple(
        (torch.zeros(b, n_kv, p, head_dim), torch.zeros(b, n_kv, p, head_dim))
        for _ in range(wrapper.n_layers)
    )
    batch, new, past_len = (torch.export.Dim(n) for n in ("batch", "new", "past"))
    total = torch.export.Dim("total")
    kv_dims = {0: batch, 2: past_len}
    dynamic_shapes = {
        "input_ids": {0: batch, 1: new},
        "attention_mask": {0: batch, 1: total},
        "position_ids": {0: batch, 1: new},
        "past": tuple((kv_dims, kv_dims) for _ in range(wrapper.n_layers)),
    }
    names = [f"{kind}.{i}" for i in range(wrapper.n_layers) for kind in ("past_key", "past_value")]
    outs = [f"{kind}.{i}" for i in range(wrapper.n_layers)
            for kind in ("present_key", "present_value")]
    with torch.no_grad():
        program = torch.onnx.export(
            wrapper, (ids, mask, pos, past), dynamo=True, dynamic_shapes=dynamic_shapes,
            input_names=["input_ids", "attention_mask", "position_ids", *names],
            output_names=["logits", *outs], opset_version=OPSET, external_data=False,
        )
    program.save(str(path), external_data=n_params(model) * 4 > PROTOBUF_LIMIT)


def trained_decoding(meta: dict[str, Any]) -> str:
    """How a checkpoint's policy sampled: its GRPO config's `decoding`; the `grammar` flag of
    runs older than the name decodings; else "context" when its prompts carry catalog names."""
    config = meta.get("config", {})
    if "decoding" in config:
        return str(config["decoding"])
    if "grammar" in config:
        return "lines" if config["grammar"] else "free"
    return "context" if int(meta.get("policy", {}).get("context", 0)) > 0 else "lines"


def folm_config(model: Any, tokenizer: Any, meta: dict[str, Any]) -> dict[str, Any]:
    from training.stage1_fanout.policy import n_params

    n_kv, head_dim = cache_shape(model.config)
    policy = meta.get("policy", {})
    return {
        "n_layers": model.config.num_hidden_layers,
        "n_kv_heads": n_kv,
        "head_dim": head_dim,
        "vocab_size": model.config.vocab_size,
        "bos_id": tokenizer.bos_token_id,
        "eos_id": tokenizer.eos_token_id,
        "pad_id": tokenizer.pad_token_id,
        "max_new_tokens": int(policy.get("max_new_tokens", 48)),
        "k": int(policy.get("k", 10)),
        "context": int(policy.get("context", 0)),  # catalog names in the prompt
        "candidates": str(policy.get("candidates", UNRECORDED_SOURCE)),  # and their source
        "preset": policy.get("preset", "custom"),
        # the temperature the policy was optimised at: serve and evaluate by sampling at it
        "temperature": float(meta.get("config", {}).get("temperature", 1.0)),
        # how its lines are decoded (service/fanout/trie.py): as GRPO sampled; a warm start with
        # catalog names in its prompt is decoded like the policy trained from it
        "decoding": trained_decoding(meta),
        "params": n_params(model),
    }


def export_folder(checkpoint: Path, out_dir: Path) -> dict[str, Any]:
    """Write model.onnx, tokenizer.json and folm.json of a checkpoint into `out_dir`."""
    from training.stage1_fanout.policy import load_policy, policy_meta

    model, tokenizer = load_policy(checkpoint)
    out_dir.mkdir(parents=True, exist_ok=True)
    export_onnx(model, out_dir / MODEL_FILE)
    tokenizer.backend_tokenizer.save(str(out_dir / TOKENIZER_FILE))
    config = folm_config(model, tokenizer, policy_meta(checkpoint))
    (out_dir / FOLM_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return config


def policy_stage_config(training: dict[str, Any],
                        policy: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config a FOLM stage is current by: its checkpoint's training config (`folm-warmstart`:
    the WarmStartConfig and the PolicyConfig it builds, `folm`: the GrpoConfig; the policy it
    inherits is the warm start's), as `training.pipeline` compares it."""
    return {"training": training} if policy is None else {"training": training, "policy": policy}


def commit_policy(bundle_dir: Path, checkpoint: Path, name: str,
                  key: dict[str, Any] | None = None) -> dict[str, Any]:
    """Export `checkpoint` and commit it as the bundle stage/folder `name`, current by `key`
    (default: the checkpoint's training config, `policy_stage_config`)."""
    from training.stage1_fanout.policy import policy_meta

    started = time.perf_counter()
    manifest = read_manifest(bundle_dir)
    meta = policy_meta(checkpoint)
    key = key or policy_stage_config(meta.get("config", {}),
                                     meta.get("policy") if name == AR_WARMSTART else None)
    record = {
        "config": key, "config_hash": config_hash(key), "checkpoint": str(checkpoint),
        "training_wall_s": meta.get("wall_s"), "training_ledger": meta.get("ledger"),
        "seed": meta.get("seed"), "source_git_commit": meta.get("git_commit", git_commit()),
    }
    with stage(bundle_dir, manifest, name, record) as staged:
        config = export_folder(checkpoint, staged / name)
        files = sorted(path.name for path in (staged / name).iterdir())  # + external data
        record.update(exported=config, wall_s=round(time.perf_counter() - started, 2),
                      files=[f"{name}/{f}" for f in files])
    print(f"exported {checkpoint} -> {bundle_dir / name} ({config['params']:,} params)")
    return config


def default_checkpoint(bundle_dir: Path, name: str) -> Path:
    from training.stage1_fanout.grpo import GRPO_PRESETS, run_dir_for

    if name == AR_WARMSTART:
        return bundle_dir / "runs" / AR_WARMSTART / "final"
    return run_dir_for(bundle_dir, GRPO_PRESETS["cpu"].reward) / "final"


def cmd_export(args: argparse.Namespace) -> None:
    unknown = set(args.which.split(",")) - set(ONNX_POLICIES)
    if unknown:
        raise InputError(f"--which takes {', '.join(ONNX_POLICIES)}, not {', '.join(unknown)}")
    import torch

    torch.set_num_threads(args.threads)
    # the warm start first: the policy's record keeps the hash of the warm start it read
    for name in sorted(args.which.split(","), key=lambda n: n != AR_WARMSTART):
        checkpoint = Path(args.checkpoint) if args.checkpoint else default_checkpoint(
            args.bundle, name)
        commit_policy(args.bundle, checkpoint, name)


def register(sub: argparse._SubParsersAction) -> None:
    """`r4t export folm [--which folm,folm-warmstart] [--checkpoint DIR]`."""
    what = subcommand_group(sub, "export", "export trained models into the bundle")
    folm = what.add_parser(AR_STAGE, help="the fan-out LM(s) to ONNX with a KV cache")
    folm.add_argument("--which", default=",".join(ONNX_POLICIES),
                      help=f"comma list of {', '.join(ONNX_POLICIES)}")
    folm.add_argument("--checkpoint", default=None, help="a HF checkpoint folder (one --which)")
    folm.add_argument("--threads", type=int, default=1)
    folm.set_defaults(func=cmd_export)
