"""Stage 2: synthesise the diffusion model's training set from the frozen fan-out policy.

Each training query is sampled `SynthesisConfig.samples_per_query` times at its `temperature`
(the paper's values); each sample's k sub-queries are resolved to catalog items — a name by
lookup, other text by its top-1 neighbour (service/fanout/grounding.py) — whose embeddings form
the target block. The targets are the policy's whole output distribution: no reward filter by
default (paper Fig. 1, §2.4). `--keep-top-frac F` keeps only each query's best F of samples by
reward — the "filter successful trajectories" reading, for comparison. The local and torch
backends sample as the service decodes (`--decoding`, default `context`: each of the k lines one
of the prompt's catalog names, service/fanout/trie.py); a sample with fewer than k non-empty
lines (the http backend's, unconstrained) cannot give k targets and is dropped (counted in the
ledger); duplicate lines are kept and resolve to the same item, as the policy wrote them.
`--extra-queries N` adds N catalog names that are no val/test query (the warm start's pick) as
queries, `--extra-samples` samples each: the student sees more distinct conditions than the
train split's queries alone.

Backends: `local` (in this process, the default: the policy exported to ONNX and decoded
by `service.fanout.decoding.FanoutDecoder` — what the service runs, and faster than HF
`generate` on CPU), `torch` (HF `generate` in this process, on the GPU if
any), `http` (an OpenAI-compatible `/v1/completions` endpoint) and `vllm` (a vLLM server started
on the policy for the run, the accelerator recipe's: docs/gpu.md; "lines" decoding as vLLM's
regex). `local`, `http` and `vllm` are the service's own fan-out backends asked for n samples
per prompt; `torch` is in backends.py. Each distinct sub-query text is embedded and searched
once per run (resolution.py's `ResolutionCache`); the ledger's retrieval calls count those
searches.
The run directory (`models/<bundle>/runs/synthesis/`) holds config.json,
shards/shard-NNNNN.npz + .jsonl (resumable: finished shards are skipped) and ledger.json
(samples, tokens, retrieval calls, wall time).
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from service.artifacts.bundle import (
    Bundle,
    config_hash,
    git_commit,
    load_bundle,
    read_manifest,
    stage,
)
from service.artifacts.stages import AR_STAGE
from service.backends.onnx import OnnxFanoutBackend
from service.backends.openai import OpenAICompletionBackend, OpenAIConfig
from service.backends.protocol import FanoutBackend
from service.errors import BundleError, InputError
from service.fanout.candidates import UNRECORDED_SOURCE, Candidates
from service.fanout.decoding import FanoutDecoder, lines_regex
from service.fanout.format import PROMPT_RECIPE, PromptBuilder, item_names
from service.fanout.trie import DECODINGS, NAME_SCOPES
from service.loopback import free_port
from service.ranker.words import ItemWords
from service.runtime.encoder import Encoder
from training.stage2_synthesis.backends import TorchFanoutBackend, chosen_backend
from training.stage2_synthesis.dataset import SHARDS, save_shard
from training.stage2_synthesis.resolution import ResolutionCache, resolve_samples
from training.stage2_synthesis.server import served, vllm_command

SYNTHESIS_RUN = "synthesis"
POLICY_ONNX = "policy-onnx"  # the policy exported for the local backend, in the run folder
BACKENDS = ("local", "torch", "http", "vllm", "auto")
ENDPOINT_TIMEOUT_S = 120.0  # 128 samples of one prompt on a busy teacher server
EXTRA_CHOICES = ("uniform", "breadth")
TEACHERS = (AR_STAGE, "ranker", "oracle")  # `--teacher`: the policy, or stage2_synthesis/teachers


@dataclass(frozen=True)
class SynthesisConfig:
    # half the paper's 128, and half the extra queries' samples: stage 2 was the default
    # build's longest stage
    samples_per_query: int = 64
    # Catalog names (no val/test query) as extra queries, `extra_samples` each: many more
    # distinct conditions for the student at a small sampling cost.
    # As many as the warm start's WarmStartConfig.extra_queries, not imported: it imports torch.
    extra_queries: int = 4000
    extra_samples: int = 8
    # how they are drawn: "uniform", or "breadth", ∝ log(1 + texts holding the name): the
    # category-like names that broad queries are come more often (training_queries)
    extra_choice: str = "uniform"
    temperature: float = 0.9
    max_new_tokens: int | None = None  # None: the policy's own budget
    shard_queries: int = 16
    # "local" (ONNX Runtime), "torch" (HF generate, on the GPU if any), "http" (an OpenAI-
    # compatible server at `endpoint`), "vllm" (a vLLM server started on the policy for the
    # run) or "auto" (vllm where a GPU runs it and `decoding` is one regex, else torch)
    backend: str = "local"
    endpoint: str | None = None  # base URL of an OpenAI-compatible server (http backend)
    model: str = AR_STAGE  # model name sent to the http backend
    keep_top_frac: float | None = None  # None: no reward filter (the paper's choice)
    decoding: str = "context"  # as GRPO sampled and the service decodes (service/fanout/trie.py)
    k: int = PROMPT_RECIPE.k
    seed: int = 0
    threads: int = 1  # ONNX Runtime / torch intra-op threads
    # who writes the blocks: "folm", the policy sampled as above; "ranker", the bundle's ranker
    # sampled at `temperature` among the student's context (stage2_synthesis/teachers.py)
    teacher: str = AR_STAGE

    def __post_init__(self) -> None:
        counts = {"samples per query": self.samples_per_query, "k": self.k,
                  "extra samples": self.extra_samples, "queries per shard": self.shard_queries}
        bad = [f"{name} must be ≥ 1 (got {value})" for name, value in counts.items() if value < 1]
        if self.extra_queries < 0:
            bad.append(f"extra queries must be ≥ 0 (got {self.extra_queries})")
        if self.extra_choice not in EXTRA_CHOICES:
            bad.append(f"extra choice must be one of {', '.join(EXTRA_CHOICES)} "
                       f"(got {self.extra_choice})")
        if self.decoding not in DECODINGS:
            bad.append(f"decoding must be one of {', '.join(DECODINGS)} (got {self.decoding})")
        if self.temperature < 0:
            bad.append(f"temperature must be ≥ 0 (got {self.temperature})")
        if self.teacher not in TEACHERS:
            bad.append(f"teacher must be one of {', '.join(TEACHERS)} (got {self.teacher})")
        if self.backend not in BACKENDS:
            bad.append(f"backend must be one of {', '.join(BACKENDS)} (got {self.backend})")
        if bad:
            raise InputError("synthesis: " + "; ".join(bad))


SYNTHESIS_PRESETS: dict[str, SynthesisConfig] = {
    # the ranker, the teacher that measured best on val, at T = 0 (its served answer): its
    # student learned better from sharper blocks than from the paper's 0.9 or from 0.5. A
    # query's blocks are then copies: their counts only weight the train split's queries (64)
    # over the extra names (8).
    # extra names drawn by breadth: its student scored higher on val, over five seeds
    "cpu": SynthesisConfig(teacher="ranker", temperature=0.0, extra_choice="breadth"),
    "tiny": SynthesisConfig(samples_per_query=6, extra_queries=0, max_new_tokens=48,
                            shard_queries=3, teacher="ranker"),
    # the paper's 128 samples per query and its temperature, decoded as GRPO sampled the LLM
    # (docs/gpu.md)
    "gpu": SynthesisConfig(samples_per_query=128, extra_samples=16, backend="auto",
                           decoding="lines", shard_queries=64, threads=8),
    # names from the prompt: even an untrained checkpoint ends its lines (docs/gpu.md)
    "gpu-smoke": SynthesisConfig(samples_per_query=4, extra_queries=0, shard_queries=4,
                                 backend="auto"),
}


def synthesis_queries(bundle: Bundle, bundle_dir: Path, config: SynthesisConfig) -> list[str]:
    """The train split's texts, then the extra catalog names drawn as `extra_choice` says."""
    from training.data.splits import training_queries

    breadth = ItemWords.of(bundle).fanin if config.extra_choice == "breadth" else None
    return training_queries(bundle_dir, item_names(bundle.items.texts), config.extra_queries,
                            config.seed, breadth)


def top_fraction(reward: np.ndarray, frac: float | None) -> np.ndarray:
    """Indices of the best `frac` of samples by reward (all of them when frac is None)."""
    if frac is None:
        return np.arange(len(reward))
    n = max(1, int(np.ceil(frac * len(reward))))
    return np.sort(np.argsort(-reward, kind="stable")[:n])


def synthesize_shard(
    ctx: dict[str, Any], config: SynthesisConfig, shard: int, queries: list[int], path: Path
) -> dict[str, float]:
    """Sample, resolve and write one shard; returns its ledger entries."""
    arrays: dict[str, list] = {k: [] for k in ("query_index", "rows", "target", "reward",
                                               "ground", "diversity", "alignment")}
    lines, tokens, samples, dropped = [], 0, 0, 0
    searches_before = ctx["cache"].searches
    for qi in queries:
        generations = ctx["sampler"].generate([ctx["prompts"][qi]], n=ctx["samples"][qi],
                                              seed=config.seed * 1_000_003 + qi)
        texts = [g.text for g in generations]
        n_tok = sum(g.n_tokens for g in generations)
        tokens, samples = tokens + n_tok, samples + len(texts)
        got = resolve_samples(ctx["cache"], ctx["query_emb"][qi], texts, config.k)
        if got is None:
            dropped += len(texts)
            continue
        terms = got["terms"]
        pick = top_fraction(terms.total, config.keep_top_frac)
        dropped += len(texts) - len(pick)
        arrays["query_index"].append(np.full(len(pick), qi, dtype=np.int64))
        arrays["rows"].append(got["rows"][pick])
        arrays["target"].append(got["target"][pick])
        for name, values in (("reward", terms.total), ("ground", terms.ground),
                             ("diversity", terms.diversity), ("alignment", terms.alignment)):
            arrays[name].append(values[pick].astype(np.float32))
        lines += [json.dumps({"query_index": qi, "subqueries": got["subs"][j]}) for j in pick]
    save_shard(path, arrays, lines, config.k, ctx["dim"])
    kept = sum(len(a) for a in arrays["query_index"])
    return {"samples": samples, "kept": kept, "dropped": dropped, "tokens": tokens,
            "retrieval_calls": ctx["cache"].searches - searches_before}


@contextmanager
def open_teacher_sampler(
    config: SynthesisConfig, checkpoint: Path, run_dir: Path, max_new_tokens: int,
    names: list[str] | None = None,
) -> Iterator[FanoutBackend]:
    """The sampling backend for one run; `names` (every catalog name) serve the "catalog"
    decoding. `vllm` holds a vLLM server on the checkpoint until the block ends."""
    backend = chosen_backend(config.backend, config.decoding)
    if backend == "local":
        folder = run_dir / POLICY_ONNX
        if not (folder / "folm.json").is_file():
            from training.stage1_fanout.export import export_folder

            export_folder(checkpoint, folder)
        yield OnnxFanoutBackend(FanoutDecoder(folder, threads=config.threads),
                                config.temperature, max_new_tokens, config.seed,
                                config.decoding, names or ())
    elif backend == "torch":
        from training.device import device_of

        yield TorchFanoutBackend(checkpoint, config.k, config.temperature, max_new_tokens,
                                 config.decoding, names, device_of().torch)
    elif backend == "http":
        if not config.endpoint:
            raise InputError("the http backend needs --endpoint (e.g. http://127.0.0.1:8000)")
        yield _endpoint(config, config.endpoint, max_new_tokens)
    else:
        if importlib.util.find_spec("vllm") is None:
            raise InputError("the vllm backend needs vllm installed (docs/gpu.md); use "
                             "--backend torch or auto")
        if config.decoding in NAME_SCOPES:
            raise InputError(f"the vllm backend takes one regular expression for every prompt, "
                             f"not --decoding {config.decoding}; use lines or free")
        port = free_port()
        command = vllm_command(checkpoint, port, config.model, config.seed)
        regex = lines_regex(config.k) if config.decoding == "lines" else None
        with served(command, f"http://127.0.0.1:{port}", run_dir / "vllm.log") as url:
            yield _endpoint(config, url, max_new_tokens, regex)


def _endpoint(config: SynthesisConfig, url: str, max_new_tokens: int,
              regex: str | None = None) -> OpenAICompletionBackend:
    """The service's OpenAI-compatible backend on a `/v1/completions` server at `url`."""
    return OpenAICompletionBackend(OpenAIConfig(
        base_url=f"{url.rstrip('/')}/v1", model=config.model, timeout_s=ENDPOINT_TIMEOUT_S,
        temperature=config.temperature, max_tokens=max_new_tokens, regex=regex))


def synthesize(
    bundle_dir: Path, config: SynthesisConfig, checkpoint: Path, run_dir: Path | None = None,
    queries: list[str] | None = None,
) -> Path:
    """Run (or resume) stage 2 into `run_dir`; returns it."""
    from training.data.splits import query_texts
    from training.stage1_fanout.grpo import check_decoding
    from training.stage1_fanout.policy import policy_meta

    started = time.perf_counter()
    if config.backend in ("local", "torch"):
        import torch

        torch.set_num_threads(config.threads)
    run_dir = run_dir or bundle_dir / "runs" / SYNTHESIS_RUN
    (run_dir / SHARDS).mkdir(parents=True, exist_ok=True)
    bundle = load_bundle(bundle_dir)
    if queries is None:
        queries = synthesis_queries(bundle, bundle_dir, config)
    n_train = len(query_texts(bundle_dir, "train"))
    samples = [config.samples_per_query if i < n_train else config.extra_samples
               for i in range(len(queries))]  # extra queries come after the train split's
    policy = policy_meta(checkpoint).get("policy", {})
    context = int(policy.get("context", 0))  # catalog names in each prompt, as trained
    source = str(policy.get("candidates", UNRECORDED_SOURCE))  # and where they come from
    check_decoding(config.decoding, context)
    record = {"stage": "synthesis", "config": asdict(config), "checkpoint": str(checkpoint),
              "n_queries": len(queries), "context": context, "candidates": source,
              "seed": config.seed,
              "git_commit": git_commit()}
    _check_resume(run_dir, record)
    encoder = Encoder(bundle.encoder_config)
    query_emb = encoder.encode(queries)  # (Q, d)
    np.save(run_dir / "query_emb.npy", query_emb)
    (run_dir / "queries.json").write_text(json.dumps(queries) + "\n")
    budget = config.max_new_tokens or int(policy.get("max_new_tokens", 48))
    prompts = PromptBuilder(Candidates.of(bundle, source), bundle.items.texts,
                            context).prompts(queries, query_emb)
    catalog = item_names(bundle.items.texts) if config.decoding == "catalog" else None
    ctx = {"cache": ResolutionCache(bundle, encoder), "queries": queries, "prompts": prompts,
           "query_emb": query_emb, "dim": encoder.dim,
           "samples": samples}
    shards = [list(range(s, min(s + config.shard_queries, len(queries))))
              for s in range(0, len(queries), config.shard_queries)]
    if not all(_shard_path(run_dir, n).is_file() for n in range(len(shards))):
        with open_teacher_sampler(config, checkpoint, run_dir, budget, catalog) as sampler:
            _sample_shards(run_dir, config, {**ctx, "sampler": sampler}, shards)
    wall = time.perf_counter() - started
    ledger = _load_ledger(run_dir)
    print(f"synthesis: {ledger.get('kept', 0):,} samples kept of {ledger.get('samples', 0):,}, "
          f"{ledger.get('tokens', 0):,} tokens, wall {wall:.0f} s this run "
          f"({ledger.get('wall_s', 0):.0f} s in shards overall) -> {run_dir}")
    return run_dir


def _shard_path(run_dir: Path, number: int) -> Path:
    return run_dir / SHARDS / f"shard-{number:05d}.npz"


def _sample_shards(run_dir: Path, config: SynthesisConfig, ctx: dict[str, Any],
                   shards: list[list[int]]) -> None:
    """Every shard not yet on disk, in order, each committed with the ledger."""
    samples = ctx["samples"]
    ledger = _load_ledger(run_dir)
    bar = tqdm(total=sum(samples), desc="synthesis", unit="sample")
    for number, shard in enumerate(shards):
        path = _shard_path(run_dir, number)
        if path.is_file():
            bar.update(sum(samples[q] for q in shard))
            continue
        began = time.perf_counter()
        entry = synthesize_shard(ctx, config, number, shard, path)
        entry["wall_s"] = time.perf_counter() - began
        for key, value in entry.items():
            ledger[key] = ledger.get(key, 0) + value
        _write_ledger(run_dir, ledger)
        bar.update(entry["samples"])
        bar.set_postfix(samples_per_s=f"{entry['samples'] / max(entry['wall_s'], 1e-9):.0f}")
    bar.close()


def block_context(config: SynthesisConfig, student: int) -> int | None:
    """How many items a picking teacher (the ranker, the labels) chooses among: the student's
    context, else the prompt's names; None for the policy, which writes sub-queries."""
    return None if config.teacher == AR_STAGE else (student or PROMPT_RECIPE.context)


def synthesis_stage_config(config: SynthesisConfig, context: int | None = None,
                           among: str = "ranked") -> dict[str, Any]:
    """The config the `synthesis` stage is current by, with a picking teacher's context and
    what it is (its blocks change with them)."""
    key: dict[str, Any] = {"synthesis": asdict(config)}
    if config.extra_choice == "uniform":  # earlier keys stay as they were
        del key["synthesis"]["extra_choice"]
    if context is not None:
        key["context"] = int(context)
        if among != "ranked":  # earlier keys stay as they were
            key["among"] = among
    return key


def commit_synthesis(bundle_dir: Path, config: SynthesisConfig, run_dir: Path,
                     context: int | None = None, among: str = "ranked") -> dict[str, Any]:
    """Record stage 2 in the manifest (its dataset stays in `run_dir`: no bundle files), so
    the stages that read it can tell when it changed; returns the manifest."""
    key = synthesis_stage_config(config, context, among)
    ledger = _load_ledger(run_dir)
    if not ledger.get("kept"):
        raise BundleError(f"{run_dir}: stage 2 kept no sample ({ledger}); nothing to train on")
    record = {"config": key, "config_hash": config_hash(key), "ledger": ledger,
              "run_dir": str(run_dir), "files": []}
    manifest = read_manifest(bundle_dir)
    with stage(bundle_dir, manifest, "synthesis", record):
        pass
    return manifest


def _check_resume(run_dir: Path, record: dict[str, Any]) -> None:
    """A run directory only resumes the same config; otherwise refuse rather than mix."""
    path = run_dir / "config.json"
    if path.is_file():
        old = json.loads(path.read_text())
        keys = ("config", "checkpoint", "n_queries", "context", "candidates")
        same = {k: old.get(k) for k in keys}
        if same != {k: record[k] for k in same}:
            raise BundleError(f"{run_dir} holds a synthesis run with another config; "
                              "choose another --run-dir or delete it")
        return
    path.write_text(json.dumps(record, indent=2) + "\n")


def _load_ledger(run_dir: Path) -> dict[str, float]:
    path = run_dir / "ledger.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_ledger(run_dir: Path, ledger: dict[str, float]) -> None:
    ledger = {k: round(v, 2) if isinstance(v, float) else v for k, v in ledger.items()}
    ledger["samples_per_s"] = round(ledger["samples"] / max(ledger["wall_s"], 1e-9), 1)
    (run_dir / "ledger.json").write_text(json.dumps(ledger, indent=2) + "\n")
