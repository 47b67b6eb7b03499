"""Evaluation methods of the autoregressive fan-out path, decoded by the served ONNX model.

- `folm-warmstart`: the warm-start policy, one sample (the zero-shot analogue);
- `folm`: the GRPO policy, one sample;
- `best-of-5`: five warm-start samples, the best by composite reward.
Samples are drawn at the temperature recorded in the exported `folm.json` (the one GRPO
sampled at, 1.0): decoded freely, a policy this small greedily repeats one line, so greedy
decoding would measure the decoder, not the policy. Seeds are fixed. All three decode as the
served policy does (`served_decoding`). Each sub-query is resolved like every other method's
probes (a catalog name by lookup, other text embedded; k distinct nearest items, one pool of
5,000 distinct items shared by the sub-queries for Recall@5K). An invalid slot (missing,
empty, duplicate) falls back to the query embedding as its probe so k items are still
returned, and is marked invalid so the reward scores it 0; a completion of more than k lines
scores 0 in every slot, as in GRPO.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np

from service.bundle import Bundle
from service.decoding import FOLM_CONFIG, FanoutDecoder
from service.encoder import Encoder
from service.fanout import ParsedFanout, PromptBuilder, item_names, parse_fanout
from service.grounding import NameGrounding
from service.reward import score_probes
from service.trie import NAME_SCOPES, NameConstraint
from training.grpo import embed_subqueries
from training.methods import Method, MethodOutput, fanout_output

BEST_OF = 5
SEED = 0


def _decoder(bundle: Bundle, folder: str, threads: int) -> FanoutDecoder:
    return FanoutDecoder(bundle.path / folder, threads=threads)


def _prompts(bundle: Bundle, decoder: FanoutDecoder) -> PromptBuilder:
    """The prompts the service would build for this decoder (same catalog context)."""
    return PromptBuilder(bundle.index, bundle.items.texts, int(decoder.config.get("context", 0)))


def served_decoding(bundle: Bundle, decoder: FanoutDecoder, decoding: str | None) -> str:
    """`decoding`, else the served policy's (folm/folm.json) so that every AR method decodes
    alike, else this decoder's own, else "lines"."""
    if decoding is not None:
        return decoding
    served = bundle.path / "folm" / FOLM_CONFIG
    config = json.loads(served.read_text()) if served.is_file() else {}
    return str(config.get("decoding") or decoder.config.get("decoding", "lines"))


class Decode:
    """A decoder with the served decoding: `Decode(...)(prompts, T, seed)` → completions."""

    def __init__(self, bundle: Bundle, decoder: FanoutDecoder, decoding: str | None) -> None:
        self.decoder, self.decoding = decoder, served_decoding(bundle, decoder, decoding)
        names = item_names(bundle.items.texts) if self.decoding == "catalog" else ()
        self.names = NameConstraint(decoder.tokenizer, int(decoder.config["eos_id"]),
                                    self.decoding, names) if self.decoding in NAME_SCOPES else None

    def __call__(self, prompts: list[str], temperature: float, seed: int) -> list[str]:
        gens = self.decoder.generate(prompts, temperature=temperature, seed=seed,
                                     enforce_lines=self.decoding != "free", names=self.names)
        return [g.text for g in gens]


def _output(
    bundle: Bundle, encoder: Encoder, grounding: NameGrounding, parsed: list[ParsedFanout],
    queries: np.ndarray,
) -> MethodOutput:
    probes = embed_subqueries(encoder, grounding, parsed, queries, fallback=True)  # (Q, k, d)
    out = fanout_output(bundle, probes)
    out.valid = np.stack([p.scored for p in parsed])  # (Q, k); > k lines scores 0
    return out


def sampling_temperature(decoder: FanoutDecoder, temperature: float | None) -> float:
    return float(decoder.config.get("temperature", 1.0)) if temperature is None else temperature


def one_sample_method(
    bundle: Bundle, folder: str, k: int, threads: int, temperature: float | None, seed: int,
    decoding: str | None = None,
) -> Method:
    decoder = _decoder(bundle, folder, threads)
    encoder = Encoder(bundle.encoder_config)
    grounding = NameGrounding(bundle.items.texts, bundle.items.embeddings)
    temp = sampling_temperature(decoder, temperature)
    prompts, decode = _prompts(bundle, decoder), Decode(bundle, decoder, decoding)

    def run(texts: list[str], queries: np.ndarray) -> MethodOutput:
        completions = decode(prompts.prompts(texts, queries), temp, seed)
        parsed = [parse_fanout(c, k) for c in completions]
        return _output(bundle, encoder, grounding, parsed, queries)

    return run


def folm_warmstart(
    bundle: Bundle, k: int = 10, threads: int = 0, temperature: float | None = None,
    seed: int = SEED, decoding: str | None = None,
) -> Method:
    return one_sample_method(bundle, "folm-warmstart", k, threads, temperature, seed, decoding)


def folm(
    bundle: Bundle, k: int = 10, threads: int = 0, temperature: float | None = None,
    seed: int = SEED, decoding: str | None = None,
) -> Method:
    return one_sample_method(bundle, "folm", k, threads, temperature, seed, decoding)


def best_of_5(
    bundle: Bundle, k: int = 10, threads: int = 0, n: int = BEST_OF,
    temperature: float | None = None, seed: int = SEED, decoding: str | None = None,
) -> Method:
    """n warm-start samples per query; keep the one with the highest composite reward."""
    decoder = _decoder(bundle, "folm-warmstart", threads)
    encoder = Encoder(bundle.encoder_config)
    grounding = NameGrounding(bundle.items.texts, bundle.items.embeddings)
    temp = sampling_temperature(decoder, temperature)
    prompts, decode = _prompts(bundle, decoder), Decode(bundle, decoder, decoding)

    def run(texts: list[str], queries: np.ndarray) -> MethodOutput:
        repeated = [p for p in prompts.prompts(texts, queries) for _ in range(n)]  # (Q·n,)
        parsed = [parse_fanout(c, k) for c in decode(repeated, temp, seed)]
        q_rep = np.repeat(queries, n, axis=0)  # (Q·n, d)
        probes = embed_subqueries(encoder, grounding, parsed, q_rep, fallback=True)  # (Q·n, k, d)
        valid = np.stack([p.scored for p in parsed])  # (Q·n, k)
        terms = score_probes(bundle.index, bundle.items.embeddings, q_rep, probes, valid)
        best = terms.total.reshape(len(texts), n).argmax(axis=1)  # (Q,)
        chosen = [parsed[i * n + int(b)] for i, b in enumerate(best)]
        return _output(bundle, encoder, grounding, chosen, queries)

    return run


FANOUT_METHODS: dict[str, Callable[..., Method]] = {
    "folm-warmstart": folm_warmstart,
    "folm": folm,
    "best-of-5": best_of_5,
}
