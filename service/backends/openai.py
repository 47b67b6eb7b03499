"""The AR path's second backend: an OpenAI-compatible `/v1/completions` endpoint over httpx.

One HTTP call per batch (`prompt` is a list; answers come back by `index`), a pooled
keep-alive client, a timeout per attempt, and retries with exponential backoff on transport
errors, 429 and 5xx (honouring a short Retry-After), all within the batch's deadline: no
attempt or backoff outlasts it. Runs in the AR batcher's worker thread.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from service.artifacts.stages import AR_STAGE
from service.deadline import check, left_s
from service.errors import UnavailableError
from service.fanout.format import MAX_NEW_TOKENS, Generation
from service.redaction import without_credentials

RETRYABLE_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
MAX_RETRY_AFTER_S = 5.0
CONNECT_TIMEOUT_S = 3.0  # a loopback or in-cluster endpoint connects in far less
MIN_TIMEOUT_S = 0.001  # httpx reads 0 as "fail at once"; a deadline this close still gets a try


@dataclass(frozen=True)
class OpenAIConfig:
    base_url: str  # e.g. http://127.0.0.1:8001/v1
    model: str = AR_STAGE
    api_key: str | None = None
    timeout_s: float = 10.0
    retries: int = 2
    backoff_s: float = 0.2
    max_connections: int = 8
    temperature: float = 0.0
    max_tokens: int = MAX_NEW_TOKENS
    seed: int | None = None
    regex: str | None = None  # vLLM's structured outputs: every completion matches it


class OpenAICompletionBackend:
    """Fan-out completions from an OpenAI-compatible server."""

    name = "openai"

    def __init__(self, config: OpenAIConfig) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._client = httpx.Client(
            base_url=config.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(config.timeout_s,
                                  connect=min(config.timeout_s, CONNECT_TIMEOUT_S)),
            limits=httpx.Limits(
                max_connections=config.max_connections,
                max_keepalive_connections=config.max_connections,
            ),
        )
        self._rng = random.Random()

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {
            "backend": self.name, "model": c.model,
            "providers": [f"openai:{without_credentials(c.base_url)}"],
            "temperature": c.temperature, "max_tokens": c.max_tokens,
            "timeout_s": c.timeout_s, "retries": c.retries,
        }

    def generate(self, prompts: list[str], deadline: float | None = None, n: int = 1,
                 seed: int | None = None) -> list[Generation]:
        """Each completion's tokens: the call's `usage` spread evenly (the API reports only
        the total)."""
        c = self.config
        body: dict[str, Any] = {"model": c.model, "prompt": list(prompts), "n": n,
                                "max_tokens": c.max_tokens, "temperature": c.temperature}
        chosen = c.seed if seed is None else seed
        if chosen is not None:
            body["seed"] = chosen
        if c.regex:
            body["structured_outputs"] = {"regex": c.regex}
        payload = self._post("/completions", body, deadline)
        texts = self._texts(payload, len(prompts) * n)
        shares = _shares(_completion_tokens(payload), len(texts))
        return [Generation(text, tokens) for text, tokens in zip(texts, shares, strict=True)]

    def close(self) -> None:
        self._client.close()

    def _post(self, path: str, body: dict[str, Any], deadline: float | None
              ) -> dict[str, Any]:
        last = "no attempt made"
        for attempt in range(self.config.retries + 1):
            delay = self.config.backoff_s * 2**attempt * (0.5 + self._rng.random())
            check(deadline, f"the completion call ({last})")
            timeout_s = max(left_s(deadline, self.config.timeout_s), MIN_TIMEOUT_S)
            try:
                response = self._client.post(path, json=body, timeout=httpx.Timeout(
                    timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S)))
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 200:
                    return self._json(response)
                last = f"HTTP {response.status_code}: {response.text[:200]}"
                if response.status_code not in RETRYABLE_STATUS:
                    break
                delay = max(delay, _retry_after(response))
            if attempt < self.config.retries:
                time.sleep(max(left_s(deadline, delay), 0.0))
        check(deadline, f"the completion call ({last})")  # a 504 when that is what cut it
        raise UnavailableError(f"completion endpoint {without_credentials(self.config.base_url)} "
                               f"failed: {last}")

    @staticmethod
    def _json(response: httpx.Response) -> dict[str, Any]:
        try:
            payload = response.json()
        except ValueError as exc:
            raise UnavailableError(f"completion endpoint sent invalid JSON: {exc}") from exc
        if not isinstance(payload, dict):
            raise UnavailableError("completion endpoint sent a non-object JSON body")
        return payload

    @staticmethod
    def _texts(payload: dict[str, Any], n: int) -> list[str]:
        """Choices by index; a missing or odd choice becomes "" (a malformed fan-out)."""
        texts = [""] * n
        choices = payload.get("choices")
        if not isinstance(choices, list):
            raise UnavailableError("completion endpoint sent no 'choices' list")
        for position, choice in enumerate(choices):
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", position)
            text = choice.get("text")
            if isinstance(index, int) and 0 <= index < n and isinstance(text, str):
                texts[index] = text
        return texts


def _completion_tokens(payload: dict[str, Any]) -> int:
    usage = payload.get("usage")
    tokens = usage.get("completion_tokens", 0) if isinstance(usage, dict) else 0
    return tokens if isinstance(tokens, int) and tokens > 0 else 0


def _shares(total: int, n: int) -> list[int]:
    """`total` split over n parts as evenly as integers allow."""
    return [total // n + (i < total % n) for i in range(n)] if n else []


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(float(response.headers.get("Retry-After", 0)), MAX_RETRY_AFTER_S)
    except ValueError:
        return 0.0
