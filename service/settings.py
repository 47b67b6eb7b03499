"""Service settings: environment variables with the `R4T_` prefix (or keyword arguments).

Every field is documented here and in `GET /v1/info`; `Settings()` reads the environment,
`Settings(bundle=...)` overrides it. Nothing is loaded at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.artifacts.stages import AR_STAGE
from service.limits import MAX_BATCH_QUERIES, MAX_K, MAX_QUERY_CHARS
from service.redaction import without_credentials
from service.routes import ROUTE_ORDER

FALLBACK_ROUTES = "diffusion=0.9,ar=0.1"  # a bundle that measured none (no `routes` stage)
DEFAULT_BUNDLE = Path("models/default")  # every command's --bundle default, and R4T_BUNDLE's


def parse_weights(text: str) -> dict[str, float]:
    """`"diffusion=0.9,ar=0.1"` → {"diffusion": 0.9, "ar": 0.1}; weights need not sum to 1."""
    weights: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in ROUTE_ORDER:
            raise ValueError(f"route weight {part.strip()!r}: expected <route>=<weight>, "
                             f"route one of {ROUTE_ORDER}")
        weight = float(value)
        if weight < 0:
            raise ValueError(f"route weight for {name} must be >= 0, got {weight}")
        weights[name] = weight
    if not weights or sum(weights.values()) <= 0:
        raise ValueError(f"route weights {text!r} must give some route a positive weight")
    return weights


class Settings(BaseSettings):
    """Everything `r4t serve` can be configured with (env `R4T_<FIELD>`, case-insensitive)."""

    model_config = SettingsConfigDict(env_prefix="R4T_", frozen=True, extra="ignore")

    # --- bundle and runtimes
    bundle: Path = Field(DEFAULT_BUNDLE, description="Bundle folder served at start-up.")
    models_root: Path | None = Field(
        None, description="Folder a reload's bundle must lie in (default: the start-up "
        "bundle's parent); POST /admin/reload names a bundle inside it.")
    providers: str = Field(
        "auto",
        description="ONNX Runtime providers, comma-separated; 'auto' = CUDA when available, "
        "else CPU.",
    )
    threads: int = Field(0, ge=0, description="ONNX Runtime intra-op threads and llama.cpp's "
                         "(0 = ONNX Runtime's default; llama.cpp: every core this process may "
                         "use).")
    faiss_threads: int = Field(1, ge=1, description="OpenMP threads FAISS may use per search.")
    compute_nice: int = Field(
        10, ge=0, le=19, description="Scheduling priority lowered this much for the compute "
        "threads (batchers, ONNX Runtime and FAISS pools), so the event loop that admits, "
        "refuses and answers runs first on busy cores; 0 = same priority.",
    )
    index: str = Field(
        "HNSW32/efSearch=64", description="The index the paths search: a FAISS index_factory "
        "string built at load over the bundle's embeddings, with search parameters after a "
        "slash, or 'bundle' (its own, exact). The default is the fastest choice that kept "
        "coverage@10 within 1% of exact (`r4t eval --index-curve`). 'milvus' searches the "
        "Milvus collection the bundle records (`r4t index`) and holds no index in the "
        "process; 'milvus://host:port' reaches that collection at another address.",
    )
    index_timeout_s: float = Field(
        2.0, gt=0, le=60, description="Bound on one call to an external index engine (Milvus): "
        "past it the request gets a 503 and /readyz turns 503, never a hang.",
    )
    seed: int | None = Field(None, description="Sampler/decoder seed (None = fresh randomness).")
    # --- HTTP server
    host: str = Field("127.0.0.1", description="Address uvicorn binds.")
    port: int = Field(8000, ge=0, le=65535, description="Port uvicorn binds.")
    admin_port: int | None = Field(
        None, ge=1, le=65535, description="A second port, on the same address, that alone "
        "serves /admin/* (keep it off the public Service); unset: the one port serves it.")
    log_level: str = Field("info", description="Log level of the JSON logs.")
    admin_token: SecretStr | None = Field(
        None, description="Bearer token of /admin/*; unset disables the admin API (403)."
    )
    # --- input limits
    max_body_bytes: int = Field(
        256 * 1024, ge=1024, description="Largest request body accepted (413 beyond)."
    )
    max_query_chars: int = Field(
        MAX_QUERY_CHARS, ge=1, le=MAX_QUERY_CHARS, description="Longest query accepted (422)."
    )
    max_k: int = Field(MAX_K, ge=1, le=MAX_K, description="Largest k accepted (422).")
    max_batch_queries: int = Field(
        MAX_BATCH_QUERIES, ge=1, le=MAX_BATCH_QUERIES,
        description="Most queries in one /v1/retrieve:batch call.",
    )
    # --- dynamic batching
    max_batch_size: int = Field(32, ge=1, description="Most requests in one batch.")
    max_wait_ms: float = Field(
        0.0, ge=0, description="How long a batch that is not full may wait for more requests "
        "after its first; 0: run what is queued as soon as the worker is free.",
    )
    queue_size: int = Field(256, ge=1, description="Bounded queue per route; full → 429.")
    request_timeout_ms: float = Field(
        5000.0, gt=0, description="Deadline of a request from arrival; past it → 504."
    )
    admit_wait_fraction: float = Field(
        0.1, gt=0, le=1, description="Admission by expected wait: a request whose path's "
        "expected queue wait (measured batch time × batches ahead) exceeds this fraction of its "
        "time left gets a 429 at once, with Retry-After from the estimate, instead of a slow "
        "504.",
    )
    retry_after_s: int = Field(
        1, ge=0, description="Least Retry-After sent with a 429 (the wait estimate may say "
        "more)."
    )
    max_in_flight: int = Field(
        512, ge=1, description="Retrieval requests admitted at once; beyond, an immediate 429 "
        "before the body is read (a batch call counts once).",
    )
    # --- connections and shutdown
    max_connections: int = Field(
        1024, ge=1, description="Open connections (and their requests) served at once; beyond, "
        "uvicorn answers 503 at once.",
    )
    receive_timeout_s: float = Field(
        10.0, gt=0, description="Time a client has to send a whole request, headers and body, "
        "from its connection or its request's first byte; then 408 and close (slow clients "
        "cannot hold connections).",
    )
    drain_s: float = Field(
        2.0, ge=0, description="On SIGTERM, /readyz answers 503 this long while requests are "
        "still served (a load balancer stops sending), then the listener closes.",
    )
    shutdown_grace_s: float = Field(
        10.0, gt=0, description="After the drain, how long in-flight requests may take before "
        "they are cancelled and the process exits.",
    )
    # --- fault injection (chaos tests)
    fault_diffusion_rate: float = Field(
        0.0, ge=0, le=1, description="Fraction of diffusion batches whose sampler run raises on "
        "purpose (chaos testing: their requests must fall back to AR); 0 in production.",
    )
    fault_stall_rate: float = Field(
        0.0, ge=0, le=1, description="Fraction of every route's batches that stall for "
        "`fault_stall_s` before computing (chaos testing: admission must see the stall and "
        "refuse with 429, not admit to a 504); 0 in production.",
    )
    fault_stall_s: float = Field(2.0, gt=0, le=60, description="How long a stalled batch "
                                 "stalls (with fault_stall_rate).")
    # --- routing and fallback
    routes: str | None = Field(
        None, description="A/B weights of the arms, sticky per user_id. Unset: the bundle's "
        f"own choice, measured on its val split (its `routes` stage), else {FALLBACK_ROUTES}.",
    )
    fanout_threshold: float = Field(
        3.9, description="route=auto fans a query out only when its breadth, ln(1 + catalog "
        "texts holding every query word the catalog uses: a typo is left out), reaches this; "
        "below, `single` answers it (narrow queries want the item they name). Chosen on the "
        "mixed val split with the default fan-out, `ranked`: `r4t eval --trigger-curve "
        "--method ranked` (service/scheduling/trigger.py).",
    )
    fanout_lead: int = Field(
        1, ge=0, le=MAX_K, description="A query route=auto fans out is answered leading with "
        "this many of its own nearest items (a narrow query judged broad still gets the item "
        "it names first); 0 = the fan-out alone.",
    )
    groundedness_threshold: float = Field(
        0.3, description="Diffusion answers whose mean cos(row, nearest item it may claim: "
        "its context's, or the catalog's under a filter) is below this fall back to the AR "
        "path (quality gate); -1 disables it.",
    )
    warmup_queries: int = Field(2, ge=1, description="Queries per warm-up batch of each path.")
    watch_s: float = Field(
        0.0, ge=0, description="Poll the served bundle's manifest this often (seconds) and "
        "reload it, verified, when a stage lands (a bundle being built); 0 = only "
        "/admin/reload.",
    )
    # --- autoregressive path
    ar_backend: Literal["auto", "onnx", "llama", "openai"] = Field(
        "auto", description="'onnx' = the bundle's folm/ decoder, 'llama' = its llm/ GGUF "
        "model in llama.cpp, 'openai' = an OpenAI-compatible endpoint, 'auto' = the first of "
        "onnx, llama that the bundle has, else openai when openai_base_url is set.",
    )
    fanout_k: int = Field(10, ge=1, description="Sub-queries the fan-out model writes per query.")
    ar_temperature: float | None = Field(
        None, ge=0, description="0 = greedy decoding, else sampled; None = the temperature the "
        "bundle's fan-out model was trained to sample at (folm.json; small policies repeat one "
        "line under greedy decoding).",
    )
    ar_max_new_tokens: int | None = Field(
        None, ge=1, description="Token budget of one fan-out; None = the bundle policy's (an "
        "llm/ policy's llm.json, else service/fanout/format.py's MAX_NEW_TOKENS).")
    ar_decoding: Literal["free", "lines", "context", "catalog"] | None = Field(
        None, description="How fan-out lines are decoded: 'lines' = exactly k non-empty lines, "
        "'context' = each line one of the catalog names in the prompt, 'catalog' = each line any "
        "item name, 'free' = unconstrained (a fan-out may end early; the dense fill completes "
        "it). None = what the bundle's fan-out model was trained under (folm.json 'decoding').",
    )
    ar_context: int | None = Field(
        None, ge=0, le=64, description="Candidate catalog names put in the fan-out prompt; "
        "None = what the bundle's fan-out model was trained with (folm.json 'context'; 0 for an "
        "external endpoint).",
    )
    ar_candidates: Literal["dense", "lexical", "hybrid"] | None = Field(
        None, description="Where the prompt's catalog names come from (service/fanout/"
        "candidates.py); None = what the fan-out model was trained with (folm.json "
        "'candidates'; 'dense' for an external endpoint).",
    )
    fanout_cache_size: int = Field(
        4096, ge=0, description="Fan-outs of the AR route kept per normalised query (LRU), so "
        "a repeated query skips the fan-out model; 0 = no cache.",
    )
    openai_base_url: str | None = Field(
        None, description="OpenAI-compatible base URL, e.g. http://127.0.0.1:8001/v1."
    )
    openai_model: str = Field(AR_STAGE, description="Model name sent to the endpoint.")
    openai_api_key: SecretStr | None = Field(None, description="Bearer key for the endpoint.")
    openai_timeout_s: float = Field(10.0, gt=0, description="Per-attempt HTTP timeout.")
    openai_retries: int = Field(2, ge=0, description="Retries after a failed attempt.")
    openai_backoff_s: float = Field(0.2, ge=0, description="First retry delay; doubles.")
    openai_max_connections: int = Field(8, ge=1, description="Connection pool size.")

    @field_validator("routes")
    @classmethod
    def _valid_routes(cls, value: str | None) -> str | None:
        if value is not None:
            parse_weights(value)
        return value

    @model_validator(mode="after")
    def _queue_fits_batches(self) -> Settings:
        if self.queue_size < self.max_batch_queries:
            raise ValueError("queue_size must be >= max_batch_queries")
        if self.max_wait_ms >= self.admit_wait_fraction * self.request_timeout_ms:
            raise ValueError("max_wait_ms must be below admit_wait_fraction x "
                             "request_timeout_ms, or every request would be refused")
        if self.admin_port is not None and self.admin_port == self.port:
            raise ValueError("admin_port must differ from port (it is the admin API's own)")
        return self

    def route_weights(self, recorded: str | None = None) -> dict[str, float]:
        """The A/B weights: R4T_ROUTES, else the bundle's `recorded` choice, else
        FALLBACK_ROUTES."""
        return parse_weights(self.routes or recorded or FALLBACK_ROUTES)

    @property
    def provider_list(self) -> list[str] | None:
        """None lets the runtime choose (CUDA when available, else CPU)."""
        if self.providers.strip().lower() == "auto":
            return None
        return [p.strip() for p in self.providers.split(",") if p.strip()]

    def public(self) -> dict:
        """The settings without secrets, for /v1/info and logs: no tokens or keys, and a URL's
        credentials and query (where keys travel) cut."""
        data = self.model_dump(mode="json", exclude={"admin_token", "openai_api_key"})
        data["admin_api"] = self.admin_token is not None
        return {name: without_credentials(value) if isinstance(value, str) and "://" in value
                else value for name, value in data.items()}

    def models_root_path(self) -> Path:
        """The folder every reloaded bundle must lie in: R4T_MODELS_ROOT, else the start-up
        bundle's parent."""
        return (self.models_root or self.bundle.resolve().parent).resolve()

