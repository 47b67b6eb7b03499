"""The AR path's pretrained-LLM backend: a GGUF from the bundle's `llm/` folder, decoded
in-process by llama.cpp (llama-cpp-python).

It reads the project's prompt as the mode's chat (service.fanout.instruction) and decodes under
the mode's GBNF grammar, so every answer is lines the path parses (distinct names in names mode).
llama.cpp decodes one sequence at a time: a batch is a loop, its cost linear in its size.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from service.deadline import check
from service.errors import BundleError, UnavailableError
from service.fanout import instruction
from service.fanout.format import (
    MAX_NEW_TOKENS,
    PROMPT_RECIPE,
    Generation,
    prompt_context,
    prompt_query,
)

LLM_DIR = "llm"
GGUF_FILE = "model.gguf"
LLM_CONFIG = "llm.json"
LLM_MODEL = f"{LLM_DIR}/{GGUF_FILE}"  # where a bundle holds its GGUF policy
PROMPTINGS = ("auto", "chat", "text")


@dataclass(frozen=True)
class LlamaConfig:
    """How the GGUF policy is prompted and decoded (recorded in the bundle's llm.json)."""

    mode: str = "names"  # service.fanout.instruction.LLM_MODES
    k: int = PROMPT_RECIPE.k
    context: int = PROMPT_RECIPE.context  # catalog names in the prompt (names mode; 0 otherwise)
    candidates: str = PROMPT_RECIPE.candidates  # their source (service.fanout.candidates)
    temperature: float = 0.0
    # > 1 discourages a token already written: a small model otherwise repeats one line
    repeat_penalty: float = 1.3
    max_new_tokens: int = MAX_NEW_TOKENS
    # "chat": the GGUF's chat template; "text": one plain few-shot transcript (a base model's
    # way); "auto": chat when the GGUF carries a template, else text
    prompting: str = "auto"
    n_ctx: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        bad = []
        if self.mode not in instruction.LLM_MODES:
            bad.append(f"unknown mode {self.mode!r}; use one of {instruction.LLM_MODES}")
        if self.prompting not in PROMPTINGS:
            bad.append(f"unknown prompting {self.prompting!r}; use one of {PROMPTINGS}")
        if self.k < 1 or self.max_new_tokens < 1:
            bad.append("k and max_new_tokens must be at least 1")
        if self.mode == "names" and self.context < self.k:
            bad.append(f"names mode chooses k={self.k} among the prompt's names: it needs "
                       f"context ≥ k (got {self.context})")
        if bad:
            raise BundleError("llm policy: " + "; ".join(bad))

    @property
    def lines(self) -> int:
        return instruction.mode_lines(self.mode, self.k)


def read_llm_config(directory: Path, **overrides: Any) -> LlamaConfig:
    """The folder's llm.json with `overrides` (those not None) applied."""
    path = directory / LLM_CONFIG
    recorded = json.loads(path.read_text()) if path.is_file() else {}
    known = set(LlamaConfig.__dataclass_fields__)
    values = {key: value for key, value in recorded.items() if key in known}
    values.update({key: value for key, value in overrides.items() if value is not None})
    return LlamaConfig(**values)


class LlamaCppFanoutBackend:
    """Fan-out completions from a GGUF model run in-process by llama.cpp."""

    name = "llama.cpp"

    def __init__(self, model_path: Path, config: LlamaConfig, threads: int = 0) -> None:
        try:
            from llama_cpp import Llama, LlamaGrammar
        except ImportError as exc:
            raise BundleError("the llm/ route needs llama-cpp-python: pip install "
                              "'r4t[llm]'") from exc
        if not model_path.is_file():
            raise BundleError(f"no GGUF model at {model_path}")
        self.config, self.model_path = config, model_path
        self.threads = threads or max(1, len(os.sched_getaffinity(0)))
        self._grammar = LlamaGrammar
        self._lock = threading.Lock()  # one llama context: one decode at a time, then close
        self._closed = False
        # swa_full: a sliding-window model (Gemma 3) keeps every cell, so the prompt prefix
        # llama-cpp-python reuses from the previous query is whole
        self.llm = Llama(model_path=str(model_path), n_ctx=config.n_ctx, n_threads=self.threads,
                         n_threads_batch=self.threads, seed=config.seed, swa_full=True,
                         verbose=False)
        # freed by close(), else at exit while modules still exist (Llama.__del__ runs too late)
        self._release = weakref.finalize(self, self.llm.close)
        self._free = self._compile(config.mode, [], config.k)  # free lines of the mode
        has_template = "tokenizer.chat_template" in self.llm.metadata
        self.prompting = config.prompting if config.prompting != "auto" else \
            ("chat" if has_template else "text")
        self._chat = self._formatter() if self.prompting == "chat" else None

    def _formatter(self) -> Any:
        """The GGUF's chat template, compiled once."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        vocab = self.llm._model
        return Jinja2ChatFormatter(self.llm.metadata["tokenizer.chat_template"],
                                   vocab.token_get_text(vocab.token_eos()),
                                   vocab.token_get_text(vocab.token_bos()))

    def _compile(self, mode: str, names: list[str], lines: int, check: bool = True) -> Any:
        """The grammar of `lines` lines in `mode`, parsed here when `check`: llama-cpp-python
        parses it only when sampling and would add a failed parse to its sampler chain
        unchecked. A grammar over a subset of names already checked needs no second check."""
        import llama_cpp

        text = instruction.grammar(mode, names, lines)
        if check:
            parsed = llama_cpp.llama_sampler_init_grammar(self.llm._model.vocab, text.encode(),
                                                          b"root")
            if not parsed:
                raise UnavailableError(f"llama.cpp refused the fan-out grammar: {text[:200]!r}")
            llama_cpp.llama_sampler_free(parsed)
        return self._grammar.from_string(text, verbose=False)

    def generate(self, prompts: list[str], deadline: float | None = None, n: int = 1,
                 seed: int | None = None) -> list[Generation]:
        """Past `deadline`, DeadlineError: checked between tokens (a stopping criterion),
        lines and prompts, so the worker is free again soon after the batch's caller left.
        The j-th of a prompt's n completions is sampled with seed + j."""
        first = self.config.seed if seed is None else seed
        with self._lock:
            if self._closed:
                raise UnavailableError("the llama.cpp backend is closed (reload or shutdown)")
            return [self._one(prompt, deadline, first + j) for prompt in prompts
                    for j in range(n)]

    def _head(self, query: str, names: list[str]) -> str:
        """The text the answer continues: the chat rendered by the GGUF's template, or the
        plain transcript."""
        if self._chat is None:
            return instruction.transcript(self.config.mode, query, names, self.config.k)
        chat = instruction.messages(self.config.mode, query, names, self.config.k)
        return self._chat(messages=chat).prompt

    def _one(self, prompt: str, deadline: float | None, seed: int) -> Generation:
        c = self.config
        names = prompt_context(prompt) if c.mode == "names" else []
        head = self._head(prompt_query(prompt), names)
        if c.mode == "names" and names:
            return self._distinct_names(head, names, deadline, seed)
        out = self._complete(head, self._free, c.max_new_tokens, deadline, seed)
        return Generation(out["choices"][0]["text"], _tokens(out))

    def _distinct_names(self, head: str, names: list[str], deadline: float | None,
                        seed: int) -> Generation:
        """k lines, each one of the names not yet written: one completion per line, the
        previous lines in its prompt (llama.cpp reuses the cached prefix), so the model
        chooses k distinct names and cannot loop on one."""
        left = instruction.distinct_names(names)
        lines: list[str] = []
        budget = self.config.max_new_tokens
        while len(lines) < self.config.k and left and budget > 0:
            prefix = head + "".join(f"{line}\n" for line in lines)
            grammar = self._compile("names", left, 1, check=not lines)  # the first: all names
            out = self._complete(prefix, grammar, budget, deadline, seed)
            budget -= _tokens(out)
            line = out["choices"][0]["text"].strip()
            if line not in left:  # cut by the budget
                break
            lines.append(line)
            left.remove(line)
        spent = self.config.max_new_tokens - budget
        return Generation("\n".join(lines), spent)

    def _complete(self, text: str, grammar: Any, max_tokens: int, deadline: float | None,
                  seed: int) -> dict[str, Any]:
        c = self.config
        check(deadline, "llama.cpp decoding")
        out = self.llm.create_completion(text, grammar=grammar, temperature=c.temperature,
                                         max_tokens=max_tokens, seed=seed,
                                         repeat_penalty=c.repeat_penalty,
                                         stopping_criteria=self._until(deadline))
        check(deadline, "llama.cpp decoding")  # the criterion cut it short: no answer
        return out

    def _until(self, deadline: float | None) -> Any:
        """A stopping criterion that ends a completion at `deadline` (None: none)."""
        if deadline is None:
            return None
        from llama_cpp import StoppingCriteriaList

        return StoppingCriteriaList([lambda ids, logits: time.monotonic() >= deadline])

    def describe(self) -> dict[str, Any]:
        recorded = {key: value for key, value in asdict(self.config).items()
                    if key not in ("k", "context", "candidates")}  # the path reports those
        return {"backend": self.name, "providers": [f"llama.cpp:{self.threads}threads"],
                "model": self.model_path.name, **recorded, "prompting": self.prompting}

    def close(self) -> None:
        """Frees the model after the decode in progress, if any (a reload's batcher may give
        up on a long batch and close while its worker thread still decodes)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._release()


def _tokens(out: dict[str, Any]) -> int:
    return int(out.get("usage", {}).get("completion_tokens", 0))
