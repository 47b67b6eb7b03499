"""Evaluation methods of the autoregressive fan-out path, decoded by the served ONNX model.

- `folm-warmstart`: the warm-start policy, one sample (the zero-shot analogue);
- `folm`: the GRPO policy, one sample;
- `best-of-5`: five warm-start samples, the best by composite reward.
Samples are drawn at the temperature recorded in the exported `folm.json` (the one GRPO
sampled at, 1.0): a policy this small decodes greedily into one line repeated, whatever its
training, so greedy decoding would measure the decoder, not the policy. Seeds are fixed.
Each sub-query is embedded and resolved like every other method (k distinct nearest items,
500 candidates per sub-query for Recall@5K). An invalid slot (missing, empty, duplicate)
falls back to the query embedding as its probe so k items are still returned, and is marked
invalid so the reward scores it 0; a completion of more than k lines scores 0 in every slot,
as in GRPO.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from service.bundle import Bundle
from service.decoding import FanoutDecoder
from service.encoder import Encoder
from service.fanout import ParsedFanout, PromptBuilder, parse_fanout
from service.reward import score_probes
from training.grpo import embed_subqueries
from training.methods import Method, MethodOutput, fanout_output

BEST_OF = 5
SEED = 0


def _decoder(bundle: Bundle, folder: str, threads: int) -> FanoutDecoder:
    return FanoutDecoder(bundle.path / folder, threads=threads)


def _prompts(bundle: Bundle, decoder: FanoutDecoder) -> PromptBuilder:
    """The prompts the service would build for this decoder (same catalog context)."""
    return PromptBuilder(bundle.index, bundle.items.texts, int(decoder.config.get("context", 0)))


def _output(
    bundle: Bundle, encoder: Encoder, parsed: list[ParsedFanout], queries: np.ndarray
) -> MethodOutput:
    probes = embed_subqueries(encoder, parsed, fallback=queries)  # (Q, k, d)
    out = fanout_output(bundle, probes)
    out.valid = np.stack([p.scored for p in parsed])  # (Q, k); > k lines scores 0
    return out


def sampling_temperature(decoder: FanoutDecoder, temperature: float | None) -> float:
    return float(decoder.config.get("temperature", 1.0)) if temperature is None else temperature


def one_sample_method(
    bundle: Bundle, folder: str, k: int, threads: int, temperature: float | None, seed: int
) -> Method:
    decoder = _decoder(bundle, folder, threads)
    encoder = Encoder(bundle.encoder_config)
    temp = sampling_temperature(decoder, temperature)
    prompts = _prompts(bundle, decoder)

    def run(texts: list[str], queries: np.ndarray) -> MethodOutput:
        gens = decoder.generate(prompts.prompts(texts, queries), temperature=temp, seed=seed)
        parsed = [parse_fanout(g.text, k) for g in gens]
        return _output(bundle, encoder, parsed, queries)

    return run


def folm_warmstart(
    bundle: Bundle, k: int = 10, threads: int = 0, temperature: float | None = None,
    seed: int = SEED,
) -> Method:
    return one_sample_method(bundle, "folm-warmstart", k, threads, temperature, seed)


def folm(
    bundle: Bundle, k: int = 10, threads: int = 0, temperature: float | None = None,
    seed: int = SEED,
) -> Method:
    return one_sample_method(bundle, "folm", k, threads, temperature, seed)


def best_of_5(
    bundle: Bundle, k: int = 10, threads: int = 0, n: int = BEST_OF,
    temperature: float | None = None, seed: int = SEED,
) -> Method:
    """n warm-start samples per query; keep the one with the highest composite reward."""
    decoder = _decoder(bundle, "folm-warmstart", threads)
    encoder = Encoder(bundle.encoder_config)
    temp = sampling_temperature(decoder, temperature)
    prompts = _prompts(bundle, decoder)

    def run(texts: list[str], queries: np.ndarray) -> MethodOutput:
        repeated = [p for p in prompts.prompts(texts, queries) for _ in range(n)]  # (Q·n,)
        gens = decoder.generate(repeated, temperature=temp, seed=seed)
        parsed = [parse_fanout(g.text, k) for g in gens]
        q_rep = np.repeat(queries, n, axis=0)  # (Q·n, d)
        probes = embed_subqueries(encoder, parsed, fallback=q_rep)  # (Q·n, k, d)
        valid = np.stack([p.scored for p in parsed])  # (Q·n, k)
        terms = score_probes(bundle.index, bundle.items.embeddings, q_rep, probes, valid)
        best = terms.total.reshape(len(texts), n).argmax(axis=1)  # (Q,)
        chosen = [parsed[i * n + int(b)] for i, b in enumerate(best)]
        return _output(bundle, encoder, chosen, queries)

    return run


FANOUT_METHODS: dict[str, Callable[..., Method]] = {
    "folm-warmstart": folm_warmstart,
    "folm": folm,
    "best-of-5": best_of_5,
}
