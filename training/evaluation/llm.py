"""Evaluation methods of a pretrained LLM policy (the bundle's `llm/` GGUF, llama.cpp), each
the served AR route in one mode (service.fanout.instruction):

- `llm-names`: the LLM chooses k of its prompt's catalog names (zero-shot);
- `llm-free`: the LLM writes k kinds from what it knows, looked up by name, else embedded;
- `llm-multiquery`: LangChain MultiQueryRetriever's method, the peers' baseline: three
  alternative questions, their nearest items unioned (claimed round-robin) into k.
Greedy decoding: one pass, no seeds to average.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from service.artifacts.bundle import Bundle
from service.runtime.encoder import Encoder
from service.scheduling.assembly import llm_route
from service.settings import Settings
from training.evaluation.baselines import Method, route_method
from training.evaluation.fanout import prompt_candidates


def llm_method(bundle: Bundle, mode: str, k: int = 10, threads: int = 0) -> Method:
    """The served AR route over the bundle's GGUF policy, prompted in `mode`."""
    settings = Settings(bundle=bundle.path, ar_backend="llama", threads=threads,
                        fanout_cache_size=0)  # every query is decoded
    path = llm_route(settings, bundle, Encoder(bundle.encoder_config), mode)
    return route_method(bundle, path, k, prompt_candidates(bundle, path))



LLM_METHODS: dict[str, Callable[..., Method]] = {
    f"llm-{mode}": partial(llm_method, mode=mode) for mode in ("names", "free", "multiquery")
}
