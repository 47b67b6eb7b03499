"""The HTTP answer to a retrieval: what the retriever served, as the response schema says."""

from __future__ import annotations

from dataclasses import asdict

from service.api.schemas import Fallback, FanoutDecision, Item, RetrieveResponse
from service.artifacts.bundle import Bundle
from service.scheduling.retriever import Served


def retrieve_response(served: Served, bundle: Bundle) -> RetrieveResponse:
    items, answer = bundle.items, served.answer
    selection = answer.selection
    return RetrieveResponse(
        items=[
            Item(id=items.ids[row], text=items.texts[row], score=round(score, 6), slot=slot)
            for row, score, slot in zip(selection.rows, selection.scores, selection.slots,
                                        strict=True)
        ],
        route=served.route,  # type: ignore[arg-type]
        arm=served.arm,
        fallback=Fallback(used=served.fallback is not None, reason=served.fallback),
        fanout=None if served.decision is None else FanoutDecision(**asdict(served.decision)),
        bundle=bundle.name,
        groundedness=round(answer.groundedness, 6),
        notes=answer.notes,
        subqueries=answer.subqueries,
        timings_ms={stage: round(s * 1000.0, 3) for stage, s in served.timings_s.items()},
    )
