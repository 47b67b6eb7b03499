"""`route=auto` in the evaluation harness: method `auto` is what the service does with a
route=auto request whose A/B arm is diffusion. The fan-out trigger
(service.scheduling.trigger.FanoutTrigger, at the served threshold unless one is given) sends a
narrow query to the `single` path and a broad one to the diffusion path, both the service's own
path objects.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.artifacts.bundle import Bundle
from service.paths.answer import PathAnswer, PathQuery
from service.paths.diffusion import DiffusionPath
from service.paths.single import SinglePath
from service.runtime.encoder import Encoder
from service.scheduling.trigger import FanoutTrigger
from service.settings import Settings
from training.evaluation.baselines import Method, ServedPath, path_method
from training.evaluation.diffusion import open_sampler


def routed(trigger: FanoutTrigger, single: ServedPath, fanout: ServedPath) -> ServedPath:
    """A path answering each query as route=auto does: `single` or the fan-out path."""

    def answer(batch: Sequence[PathQuery]) -> list[PathAnswer]:
        wide = [trigger.decide(q.text).fanout for q in batch]
        out: list[PathAnswer | None] = [None] * len(batch)
        for path, chosen in ((fanout, True), (single, False)):
            picked = [i for i, w in enumerate(wide) if w == chosen]
            if picked:
                for i, a in zip(picked, path([batch[i] for i in picked]), strict=True):
                    out[i] = a
        return [a for a in out if a is not None]

    return answer


def auto(bundle: Bundle, k: int = 10, seed: int = 0, threads: int = 0,
         threshold: float | None = None) -> Method:
    """Eval factory: the trigger over `single` and the served diffusion route (noise `seed`)."""
    encoder = Encoder(bundle.encoder_config)
    trigger = FanoutTrigger(bundle.lexical, Settings().fanout_threshold if threshold is None
                            else threshold)
    diffusion = DiffusionPath(bundle, encoder, open_sampler(bundle, threads=threads), seed)
    return path_method(bundle, routed(trigger, SinglePath(bundle, encoder), diffusion), k)
