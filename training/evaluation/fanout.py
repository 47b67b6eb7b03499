"""Evaluation methods of the autoregressive fan-out route, decoded by the bundle's ONNX models.

- `folm-warmstart`: the warm-start policy, one sample (the zero-shot analogue);
- `folm`: the GRPO policy, one sample;
- `best-of-5`: five warm-start samples, the best by composite reward.
`folm` and `folm-warmstart` are the served AR route (`service.scheduling.assembly.ar_route`) over
either
policy: same prompt, decoding, sub-query resolution and dense fill as an HTTP answer. Samples are
drawn at the temperature recorded in the exported `folm.json` (decoded freely, a policy this
small greedily repeats one line) with fixed seeds, all three under the served policy's decoding
(`served_decoding`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial

import numpy as np

from service.artifacts.bundle import Bundle
from service.artifacts.stages import AR_STAGE, AR_WARMSTART
from service.fanout.decoding import FOLM_CONFIG
from service.fanout.format import parse_fanout
from service.fanout.grounding import PromptNeighbourhood
from service.routes.autoregressive import AutoregressiveRoute
from service.runtime.encoder import Encoder
from service.scheduling.assembly import ar_route
from service.settings import Settings
from training.evaluation.baselines import (
    CandidateLookup,
    Method,
    MethodOutput,
    fanout_output,
    route_method,
)
from training.stage1_fanout.grpo import embed_subqueries
from training.stage1_fanout.reward import score_probes

BEST_OF = 5
SEED = 0


def served_decoding(bundle: Bundle, decoding: str | None) -> str | None:
    """`decoding`, else the served policy's (folm/folm.json) so that every AR method decodes
    alike, else None (each decoder's own)."""
    if decoding is not None:
        return decoding
    served = bundle.path / AR_STAGE / FOLM_CONFIG
    config = json.loads(served.read_text()) if served.is_file() else {}
    return config.get("decoding")


def policy_route(bundle: Bundle, folder: str, threads: int, temperature: float | None,
                seed: int, decoding: str | None) -> AutoregressiveRoute:
    """The served AR route over the policy in `folder`, sampling at its recorded temperature
    (1.0 when it records none) with `seed`."""
    if temperature is None:
        config = json.loads((bundle.path / folder / FOLM_CONFIG).read_text())
        temperature = float(config.get("temperature", 1.0))
    settings = Settings(bundle=bundle.path, ar_backend="onnx", threads=threads, seed=seed,
                        fanout_cache_size=0, ar_temperature=temperature,
                        ar_decoding=served_decoding(bundle, decoding))
    return ar_route(settings, bundle, Encoder(bundle.encoder_config), folder=folder)


def prompt_candidates(bundle: Bundle, path: AutoregressiveRoute) -> CandidateLookup | None:
    """The items the AR route's prompt names (what `context` decoding chooses among), from the
    route's own candidate generator."""
    if path.prompt_builder.n == 0:
        return None
    lookup = PromptNeighbourhood(path.prompt_builder.candidates, bundle.items.texts,
                                 bundle.items.embeddings, path.prompt_builder.n)
    return lambda texts, queries: list(lookup.rows(texts, queries))


def one_sample(
    bundle: Bundle, folder: str, k: int = 10, threads: int = 0,
    temperature: float | None = None, seed: int = SEED, decoding: str | None = None,
) -> Method:
    """One sample of the policy in `folder` through the served AR route."""
    path = policy_route(bundle, folder, threads, temperature, seed, decoding)
    return route_method(bundle, path, k, prompt_candidates(bundle, path))


folm_warmstart = partial(one_sample, folder=AR_WARMSTART)
folm = partial(one_sample, folder=AR_STAGE)


def best_of_5(
    bundle: Bundle, k: int = 10, threads: int = 0, n: int = BEST_OF,
    temperature: float | None = None, seed: int = SEED, decoding: str | None = None,
) -> Method:
    """n warm-start samples per query (the served route's prompts and decoding); keep the one
    with the highest composite reward."""
    path = policy_route(bundle, AR_WARMSTART, threads, temperature, seed, decoding)
    candidates = prompt_candidates(bundle, path)

    def run(texts: list[str], queries: np.ndarray) -> MethodOutput:
        prompts = path.prompt_builder.prompts(texts, queries)
        parsed = [parse_fanout(g.text, k) for g in path.backend.generate(prompts, n=n)]  # (Q·n,)
        q_rep = np.repeat(queries, n, axis=0)  # (Q·n, d)
        probes = embed_subqueries(path.encoder, path.grounding, parsed, q_rep,
                                  fallback=True)  # (Q·n, k, d)
        valid = np.stack([p.scored for p in parsed])  # (Q·n, k)
        terms = score_probes(bundle.index, bundle.items.embeddings, q_rep, probes, valid)
        best = terms.total.reshape(len(texts), n).argmax(axis=1) + n * np.arange(len(texts))
        out = fanout_output(bundle, probes[best])  # (Q, k, d) probes of the chosen samples
        out.valid = valid[best]
        out.candidates = None if candidates is None else candidates(texts, queries)
        return out

    return run


FANOUT_METHODS: dict[str, Callable[..., Method]] = {
    AR_WARMSTART: folm_warmstart,
    AR_STAGE: folm,
    "best-of-5": best_of_5,
}
