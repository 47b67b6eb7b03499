"""Route assembly: every path a bundle and the settings allow, each over the backend and
runtimes they choose, built once at load so the retriever only serves what it is handed.
The AR route's backend is the bundle's ONNX policy (folm/), its GGUF policy (llm/) or an
OpenAI-compatible endpoint (service/backends/); evaluation and the benchmarks build their
paths here too, so they measure what the service answers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.artifacts.bundle import Bundle
from service.artifacts.stages import AR_STAGE
from service.backends.llama import LLM_DIR, LLM_MODEL, LlamaCppFanoutBackend, read_llm_config
from service.backends.onnx import OnnxFanoutBackend
from service.backends.openai import OpenAICompletionBackend, OpenAIConfig
from service.backends.protocol import FanoutBackend
from service.errors import BundleError
from service.fanout.candidates import UNRECORDED_SOURCE
from service.fanout.format import MAX_NEW_TOKENS, item_names
from service.ranker.ranker import ScoredCandidates
from service.routes.autoregressive import AutoregressiveRoute
from service.routes.diffusion import DiffusionRoute, Sampler
from service.routes.hybrid import HybridRoute
from service.routes.ranked import RankedRoute
from service.routes.route import Route
from service.routes.single import SingleRoute
from service.runtime.encoder import Encoder
from service.runtime.faults import FaultySampler
from service.settings import Settings

SAMPLER_FILE = "diffusion/sampler.onnx"

ComponentFactory = Callable[[Path, list[str] | None, int], Any]
# An AR backend, its k, and the number and source of the catalog names its prompts carry.
BackendChoice = tuple[FanoutBackend, int, int, str]


def default_sampler(directory: Path, providers: list[str] | None, threads: int) -> Sampler:
    """The stage-3 ONNX sampler (imported here: only a bundle with diffusion/ needs it)."""
    from service.runtime.sampler import DiffusionSampler  # owned by the stage-3 runtime

    return DiffusionSampler(directory, providers=providers, threads=threads)


def default_decoder(directory: Path, providers: list[str] | None, threads: int) -> Any:
    """The stage-1 ONNX decoder (imported here: only a bundle with folm/ needs it)."""
    from service.fanout.decoding import FanoutDecoder  # owned by the stage-1 runtime

    return FanoutDecoder(directory, providers=providers, threads=threads)


@dataclass(frozen=True)
class Loaders:
    """How the model runtimes are built (tests may pass their own real loaders)."""

    sampler: ComponentFactory = default_sampler
    decoder: ComponentFactory = default_decoder


def _ar_backend(settings: Settings, bundle: Bundle, loaders: Loaders,
                folder: str = AR_STAGE) -> BackendChoice:
    """R4T_AR_BACKEND's backend, or with "auto" the first the bundle or settings offer."""
    choice = settings.ar_backend
    if choice == "onnx" or (choice == "auto" and bundle.has(f"{folder}/model.onnx")):
        return _onnx_backend(settings, bundle, loaders, folder)
    if choice == "llama" or (choice == "auto" and bundle.has(LLM_MODEL)):
        return _llama_backend(settings, bundle)
    if settings.openai_base_url:
        return _openai_backend(settings, settings.openai_base_url)
    raise BundleError(f"bundle has no {folder}/model.onnx, no {LLM_MODEL} and "
                      "R4T_OPENAI_BASE_URL is not set")


def _onnx_backend(settings: Settings, bundle: Bundle, loaders: Loaders,
                  folder: str) -> BackendChoice:
    """The fan-out model in `folder`, decoded as its folm.json records unless R4T_AR_* say
    otherwise; context decoding without catalog names in the prompt is refused."""
    decoder = loaders.decoder(bundle.path / folder, settings.provider_list, settings.threads)
    decoding = settings.ar_decoding or str(decoder.config.get("decoding", "lines"))
    names = item_names(bundle.items.texts) if decoding == "catalog" else []
    backend = OnnxFanoutBackend(
        decoder, settings.ar_temperature, settings.ar_max_new_tokens or MAX_NEW_TOKENS,
        settings.seed,
        decoding=decoding, catalog_names=names,
    )
    context = settings.ar_context
    if context is None:
        context = int(decoder.config.get("context", 0))
    if backend.decoding == "context" and context == 0:
        raise BundleError("R4T_AR_DECODING=context needs catalog names in the prompt "
                          "(R4T_AR_CONTEXT > 0)")
    source = settings.ar_candidates or str(decoder.config.get("candidates", UNRECORDED_SOURCE))
    return backend, int(decoder.config.get("k", settings.fanout_k)), context, source


def _llama_backend(settings: Settings, bundle: Bundle,
                   mode: str | None = None) -> BackendChoice:
    """The bundle's GGUF policy (llm/) in llama.cpp, prompted as its llm.json records (in
    `mode`, when given); R4T_AR_TEMPERATURE, R4T_AR_MAX_NEW_TOKENS and R4T_SEED override it."""
    config = read_llm_config(bundle.path / LLM_DIR, mode=mode,
                             temperature=settings.ar_temperature,
                             max_new_tokens=settings.ar_max_new_tokens, seed=settings.seed)
    context = config.context if config.mode == "names" else 0
    backend = LlamaCppFanoutBackend(bundle.path / LLM_MODEL, config, settings.threads)
    return backend, config.lines, context, config.candidates


def _openai_backend(settings: Settings, base_url: str) -> BackendChoice:
    """The endpoint at `base_url` (R4T_OPENAI_BASE_URL), prompted with R4T_AR_CONTEXT
    catalog names."""
    key = settings.openai_api_key.get_secret_value() if settings.openai_api_key else None
    config = OpenAIConfig(
        base_url=base_url, model=settings.openai_model, api_key=key,
        timeout_s=settings.openai_timeout_s, retries=settings.openai_retries,
        backoff_s=settings.openai_backoff_s, max_connections=settings.openai_max_connections,
        temperature=settings.ar_temperature or 0.0,
        max_tokens=settings.ar_max_new_tokens or MAX_NEW_TOKENS,
    )
    return (OpenAICompletionBackend(config), settings.fanout_k, settings.ar_context or 0,
            settings.ar_candidates or UNRECORDED_SOURCE)


def ar_route(
    settings: Settings, bundle: Bundle, encoder: Encoder, loaders: Loaders | None = None,
    folder: str = AR_STAGE,
) -> AutoregressiveRoute:
    """The AR route as `settings` configure it, over the fan-out model in `folder`."""
    backend, fanout_k, context, source = _ar_backend(settings, bundle, loaders or Loaders(),
                                                     folder)
    return AutoregressiveRoute(bundle, encoder, backend, fanout_k, context, source,
                              settings.fanout_cache_size)


def llm_route(settings: Settings, bundle: Bundle, encoder: Encoder,
             mode: str | None = None) -> AutoregressiveRoute:
    """The AR route over the bundle's GGUF policy (llm/), prompted in `mode` (default: its
    llm.json's)."""
    backend, fanout_k, context, source = _llama_backend(settings, bundle, mode)
    return AutoregressiveRoute(bundle, encoder, backend, fanout_k, context, source,
                              settings.fanout_cache_size)


def load_routes(
    settings: Settings, bundle: Bundle, encoder: Encoder, loaders: Loaders
) -> tuple[dict[str, Route], dict[str, str]]:
    """Build every path the bundle and settings allow; say why the others are missing. A route
    whose stage the bundle lacks (BundleError) or whose runtime is not installed (ImportError)
    is left out; one whose model is there but does not load (an ONNX Runtime or opset mismatch,
    a corrupt graph) refuses the whole bundle, so a reload never swaps it in quietly."""
    paths: dict[str, Route] = {"single": SingleRoute(bundle, encoder)}
    problems: dict[str, str] = {}
    # the ranker and its mention features, loaded once and handed to every route reading them
    ranker = functools.cache(functools.partial(ScoredCandidates, bundle))

    def ranker_if_present() -> ScoredCandidates | None:
        try:  # a student's context reads it where the bundle has one
            return ranker()
        except (BundleError, ImportError):
            return None

    def diffusion() -> Route:
        if not bundle.has(SAMPLER_FILE):
            raise BundleError(f"bundle has no {SAMPLER_FILE}")
        sampler = loaders.sampler(bundle.path / "diffusion", settings.provider_list,
                                  settings.threads)
        if settings.fault_diffusion_rate > 0:
            sampler = FaultySampler(sampler, settings.fault_diffusion_rate, settings.seed)
        return DiffusionRoute(bundle, encoder, sampler, settings.seed, ranker_if_present())

    builders: dict[str, Callable[[], Route]] = {
        "diffusion": diffusion, "ranked": lambda: RankedRoute(bundle, encoder, scored=ranker()),
        "hybrid": lambda: HybridRoute(bundle, encoder),
        "ar": lambda: ar_route(settings, bundle, encoder, loaders)}
    for route, build in builders.items():
        try:
            paths[route] = build()
        except (BundleError, ImportError) as exc:
            problems[route] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            raise BundleError(f"bundle {bundle.path}: the {route} route's model does not load: "
                              f"{type(exc).__name__}: {exc}") from exc
    return paths, problems
