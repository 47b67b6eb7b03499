"""`route=auto` in the evaluation harness: methods `auto` and `auto-ar` are what the service
does with a route=auto request whose A/B arm is diffusion, or AR; `diffusion-led` and `ar-led`
fan every query out as route=auto fans one out (its answer led by its own nearest items). The
fan-out trigger (service.scheduling.trigger.FanoutTrigger, at the served threshold unless one is
given) sends a narrow query to the `single` path and a broad one to the fan-out path, each the
service's own path object.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

from service.artifacts.bundle import Bundle
from service.artifacts.stages import AR_STAGE, AR_WARMSTART
from service.routes.answer import RouteAnswer, RouteQuery
from service.routes.diffusion import DiffusionRoute
from service.routes.single import SingleRoute
from service.runtime.encoder import Encoder
from service.scheduling.trigger import FanoutTrigger
from service.settings import Settings
from training.evaluation.baselines import Method, RouteCall, route_method
from training.evaluation.diffusion_method import open_sampler
from training.evaluation.fanout import policy_route


def routed(trigger: FanoutTrigger, single: RouteCall, fanout: RouteCall) -> RouteCall:
    """A path answering each query as route=auto does: `single` or the fan-out path."""

    def answer(batch: Sequence[RouteQuery]) -> list[RouteAnswer]:
        decisions = [trigger.decide(q.text) for q in batch]
        asked = [replace(q, lead=d.lead) for q, d in zip(batch, decisions, strict=True)]
        out: list[RouteAnswer | None] = [None] * len(batch)
        for path, chosen in ((fanout, True), (single, False)):
            picked = [i for i, d in enumerate(decisions) if d.fanout == chosen]
            if picked:
                for i, a in zip(picked, path([asked[i] for i in picked]), strict=True):
                    out[i] = a
        return [a for a in out if a is not None]

    return answer


def auto(bundle: Bundle, k: int = 10, seed: int = 0, threads: int = 0,
         threshold: float | None = None, lead: int | None = None,
         route: str = "diffusion") -> Method:
    """Eval factory: the trigger (the served threshold and lead, unless given) over `single`
    and the served `route` (diffusion with noise `seed`, or the AR route over the bundle's
    policy sampling with `seed`)."""
    encoder = Encoder(bundle.encoder_config)
    served = Settings()
    trigger = FanoutTrigger(bundle.lexical,
                            served.fanout_threshold if threshold is None else threshold,
                            served.fanout_lead if lead is None else lead)
    if route == "diffusion":
        fanout: RouteCall = DiffusionRoute(bundle, encoder, open_sampler(bundle, threads=threads),
                                           seed)
    else:  # stage 1's GRPO policy, or its warm start before GRPO has landed
        folder = AR_STAGE if bundle.has(f"{AR_STAGE}/model.onnx") else AR_WARMSTART
        fanout = policy_route(bundle, folder, threads, None, seed, None)
    return route_method(bundle, routed(trigger, SingleRoute(bundle, encoder), fanout), k)


auto_ar = partial(auto, route="ar")
# the fan-out routes as route=auto serves a query it fans out (led by its own nearest items):
# what the trigger curve weighs against `single`
diffusion_led = partial(auto, threshold=-math.inf)
ar_led = partial(auto, threshold=-math.inf, route="ar")
