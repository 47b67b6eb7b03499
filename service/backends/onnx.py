"""The AR path's first backend: the bundle's own fan-out model (folm/model.onnx), decoded in
process by service.fanout.decoding.FanoutDecoder under one of the name constraints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from service.errors import BundleError
from service.fanout.format import Generation
from service.fanout.trie import DECODINGS, NAME_SCOPES, NameConstraint


class OnnxFanoutBackend:
    """The bundle's fan-out model decoded by service.fanout.decoding.FanoutDecoder.

    `decoding` (service/fanout/trie.py DECODINGS): "free", "lines" (exactly k non-empty lines),
    "context" (each line a name from the prompt's catalog line) or "catalog" (any item name,
    from `catalog_names`); None = what the model was trained under (folm.json, else "lines").
    """

    name = "onnx"

    def __init__(
        self, decoder: Any, temperature: float | None, max_new_tokens: int, seed: int | None,
        decoding: str | None = None, catalog_names: Sequence[str] = (),
    ) -> None:
        if temperature is None:
            temperature = float(decoder.config.get("temperature", 0.0))
        decoding = decoding or str(decoder.config.get("decoding", "lines"))
        if decoding not in DECODINGS:
            raise BundleError(f"unknown fan-out decoding {decoding!r}; use one of {DECODINGS}")
        self.decoder, self.temperature, self.decoding = decoder, temperature, decoding
        self.max_new_tokens, self.seed = max_new_tokens, seed
        self.names = NameConstraint(decoder.tokenizer, int(decoder.config["eos_id"]), decoding,
                                    catalog_names) if decoding in NAME_SCOPES else None

    def generate(self, prompts: list[str], deadline: float | None = None, n: int = 1,
                 seed: int | None = None) -> list[Generation]:
        return self.decoder.generate(
            [prompt for prompt in prompts for _ in range(n)], temperature=self.temperature,
            max_new_tokens=self.max_new_tokens, seed=self.seed if seed is None else seed,
            enforce_lines=self.decoding != "free", names=self.names, deadline=deadline,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name, "providers": list(self.decoder.providers),
            "temperature": self.temperature, "max_new_tokens": self.max_new_tokens,
            "decoding": self.decoding, "config": self.decoder.config,
        }

    def close(self) -> None:
        return None
