"""Autoregressive fan-out decoding with ONNX Runtime and a key/value cache (numpy only).

Loads `folm/` (model.onnx, tokenizer.json, folm.json); prompts are left-padded, one pass fills
the cache, then one token per step for the batch. A fan-out is exactly k lines, so a row stops
at its k-th line break (like vLLM's `stop`) under the line grammar enforced on the logits; a
`NameConstraint` (service/fanout/trie.py) keeps every line a catalog name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from service.deadline import check
from service.errors import BundleError
from service.fanout.format import Generation
from service.fanout.trie import NameConstraint, RowState, name_grammar
from service.runtime.sessions import open_session

MODEL_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"
FOLM_CONFIG = "folm.json"


def sample_categorical(
    logits: np.ndarray, temperature: float, generator: np.random.Generator
) -> np.ndarray:
    """Greedy when temperature is 0, else one draw from softmax(logits / T). (B, V) -> (B,)."""
    if temperature <= 0.0:
        return np.argmax(logits, axis=-1)
    scaled = logits.astype(np.float32, copy=False) / np.float32(temperature)  # (B, V)
    weights = np.exp(scaled - scaled.max(axis=-1, keepdims=True))  # (B, V) unnormalised
    cdf = np.cumsum(weights, axis=-1)  # (B, V)
    u = generator.random((logits.shape[0], 1), dtype=np.float32) * cdf[:, -1:]  # (B, 1)
    picks = (cdf < u).sum(axis=-1)  # (B,) inverse-CDF draw
    return np.minimum(picks, logits.shape[-1] - 1)


def line_tables(decode: Callable[..., str], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token id: the line breaks it writes (V,) and whether its line then has text (V,).

    `decode` is a tokenizer's `decode(ids, skip_special_tokens=...)` (tokenizers or HF).
    """
    texts = [decode([i], skip_special_tokens=False) for i in range(vocab)]
    plain = [decode([i], skip_special_tokens=True) for i in range(vocab)]
    newlines = np.array([t.count("\n") for t in texts], dtype=np.int64)  # (V,)
    opens_line = np.array([bool(t.rsplit("\n", 1)[-1].strip()) for t in plain])  # (V,)
    return newlines, opens_line


def line_grammar(logits: np.ndarray, newlines: np.ndarray, lines: np.ndarray,
                 open_line: np.ndarray, stop: int, eos: int) -> np.ndarray:
    """Logits (B, V) with the fan-out grammar's forbidden tokens at −inf (a copy).

    <eos> is allowed only on the last of `stop` lines once it has text; a line break only after
    text. `lines` (B,) counts each row's line breaks, `open_line` (B,) says its line has text.
    """
    vocab = min(logits.shape[1], len(newlines))
    masked = logits.astype(np.float32, copy=True)  # (B, V)
    breaks = np.flatnonzero(newlines[:vocab] > 0)  # (N,)
    masked[np.ix_(~open_line, breaks)] = -np.inf
    masked[(lines < stop - 1) | ~open_line, eos] = -np.inf
    return masked


def lines_regex(k: int) -> str:
    """`line_grammar`'s rule as one regular expression over characters, for engines that take
    a regex and no logits processor (vLLM's structured outputs): k lines with text, an optional
    last line break. The grammar masks whole tokens, so the two differ at the edges (a token
    holding text then a break opens and ends a line at once); a token the mask forbids is
    scored unmasked in training, never as −inf."""
    line = r"[^\n]*[^\s][^\n]*"
    return rf"(?:{line}\n){{{k - 1}}}{line}\n?"


class FanoutDecoder:
    """ONNX Runtime decoder of a fan-out LM; no torch."""

    def __init__(
        self, folm_dir: Path, providers: list[str] | None = None, threads: int = 0
    ) -> None:
        folm_dir = Path(folm_dir)
        for name in (MODEL_FILE, TOKENIZER_FILE, FOLM_CONFIG):
            if not (folm_dir / name).is_file():
                raise BundleError(f"{folm_dir} has no {name}: run `r4t export folm` first")
        self.config: dict[str, Any] = json.loads((folm_dir / FOLM_CONFIG).read_text())
        self.tokenizer = Tokenizer.from_file(str(folm_dir / TOKENIZER_FILE))
        self.session = open_session(folm_dir / MODEL_FILE, providers, threads)
        self.providers: list[str] = self.session.get_providers()
        self.n_layers = int(self.config["n_layers"])
        vocab = self.tokenizer.get_vocab_size()
        self.newlines, self.opens_line = line_tables(self.tokenizer.decode, vocab)  # (V,), (V,)

    def _prompt_batch(self, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded prompt ids and mask, both (B, P) int64."""
        encoded = [e.ids for e in self.tokenizer.encode_batch(prompts)]
        width = max(len(ids) for ids in encoded)
        ids = np.full((len(encoded), width), self.config["pad_id"], dtype=np.int64)  # (B, P)
        mask = np.zeros((len(encoded), width), dtype=np.int64)  # (B, P)
        for i, row in enumerate(encoded):
            ids[i, width - len(row) :] = row
            mask[i, width - len(row) :] = 1
        return ids, mask

    def _empty_cache(self, batch: int) -> dict[str, np.ndarray]:
        shape = (batch, int(self.config["n_kv_heads"]), 0, int(self.config["head_dim"]))
        return {
            f"{kind}.{i}": np.zeros(shape, dtype=np.float32)
            for i in range(self.n_layers) for kind in ("past_key", "past_value")
        }

    def _step(
        self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One forward pass: last-position logits (B, V) and the grown cache."""
        outputs = self.session.run(
            None, {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **past}
        )
        present = {}
        for i in range(self.n_layers):
            present[f"past_key.{i}"] = outputs[1 + 2 * i]  # (B, H_kv, P+T, Dh)
            present[f"past_value.{i}"] = outputs[2 + 2 * i]
        return outputs[0][:, -1, :], present  # (B, V)

    def generate(
        self,
        prompts: list[str],
        temperature: float = 0.0,
        max_new_tokens: int | None = None,
        seed: int | None = None,
        max_lines: int | None = None,
        enforce_lines: bool = True,
        names: NameConstraint | None = None,
        deadline: float | None = None,
    ) -> list[Generation]:
        """Decode one completion per prompt (greedy at temperature 0).

        A row stops at <eos> or its `max_lines`-th line break (default k; 0: no stop), its text
        cut before it. `enforce_lines` masks <eos> before the last line and empty lines; `names`
        also keeps every line a catalog name. Past `deadline` (monotonic), DeadlineError.
        """
        if not prompts:
            return []
        budget = int(max_new_tokens or self.config["max_new_tokens"])
        stop = int(self.config.get("k", 0) if max_lines is None else max_lines)
        lines = np.zeros(len(prompts), dtype=np.int64)  # (B,) line breaks so far
        open_line = np.zeros(len(prompts), dtype=bool)  # (B,) current line has text
        grammar = enforce_lines and stop > 0
        tries = names.tries(prompts) if names is not None and stop > 0 else None
        states = [RowState() for _ in prompts] if tries is not None else None
        eos, rng = int(self.config["eos_id"]), np.random.default_rng(seed)
        ids, mask = self._prompt_batch(prompts)
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)  # (B, P)
        logits, past = self._step(ids, mask, positions, self._empty_cache(len(prompts)))
        next_pos = positions[:, -1:] + 1  # (B, 1)
        tokens = np.zeros((len(prompts), budget), dtype=np.int64)  # (B, budget)
        done = np.zeros(len(prompts), dtype=bool)
        lengths = np.full(len(prompts), budget, dtype=np.int64)
        for step in range(budget):
            if grammar or tries is not None:
                logits = line_grammar(logits, self.newlines, lines, open_line, stop, eos)
            if tries is not None and states is not None:
                logits = name_grammar(logits, tries, states, lines, stop)
            token = sample_categorical(logits, temperature, rng)  # (B,)
            token = np.where(done, eos, token)
            for i in np.flatnonzero(~done) if tries is not None and states else ():
                row_trie = tries[i]
                if row_trie is not None:
                    row_trie.advance(states[i], int(token[i]))
            tokens[:, step] = token
            known = np.minimum(token, len(self.newlines) - 1)  # (B,) ids past the vocab clamp
            lines += np.where(done, 0, self.newlines[known])
            open_line = np.where(self.newlines[known] > 0, self.opens_line[known],
                                 open_line | self.opens_line[known])
            newly = ((token == eos) | ((lines >= stop) & (stop > 0))) & ~done
            lengths[newly] = step + 1
            done |= newly
            if done.all() or step == budget - 1:
                break
            check(deadline, "fan-out decoding")
            mask = np.concatenate([mask, np.ones((len(prompts), 1), dtype=np.int64)], axis=1)
            logits, past = self._step(token[:, None], mask, next_pos, past)
            next_pos = next_pos + 1
        return [self._finish(tokens[i, : lengths[i]], eos, stop) for i in range(len(prompts))]

    def _finish(self, row: np.ndarray, eos: int, stop: int) -> Generation:
        body = row[:-1] if len(row) and row[-1] == eos else row
        text = self.tokenizer.decode(body.tolist(), skip_special_tokens=True)
        if stop > 0:
            text = "\n".join(text.split("\n")[:stop])  # cut at the stop-th line break
        return Generation(text=text, n_tokens=len(row))
