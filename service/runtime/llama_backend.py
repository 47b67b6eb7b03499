"""The AR path's third backend: a pretrained LLM from a GGUF file, decoded in-process by
llama.cpp (llama-cpp-python), loaded from a bundle's `llm/` folder (`model.gguf`, `llm.json`).

The backend reads the project's prompt (query and catalog line, service.fanout.format), turns it
into the mode's chat (service.fanout.instruction) and decodes under the mode's GBNF grammar, so
every answer is the k lines the path parses. llama.cpp decodes one sequence at a time: a batch is
a loop, its cost linear in the batch (what Figure 5's AR curve measures). Greedy by default.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from service.errors import BundleError
from service.fanout import instruction
from service.fanout.format import Generation, prompt_context, prompt_query

LLM_DIR = "llm"
GGUF_FILE = "model.gguf"
LLM_CONFIG = "llm.json"


@dataclass(frozen=True)
class LlamaConfig:
    """How the GGUF policy is prompted and decoded (recorded in the bundle's llm.json)."""

    mode: str = "names"  # service.fanout.instruction.LLM_MODES
    k: int = 10
    context: int = 24  # catalog names in the prompt (names mode; 0 otherwise)
    candidates: str = "hybrid"  # their source (service.fanout.candidates)
    temperature: float = 0.0
    # > 1 discourages a token already written: a small model otherwise repeats one line
    repeat_penalty: float = 1.3
    max_new_tokens: int = 160
    # "chat": the GGUF's chat template; "text": one plain few-shot transcript (a base model's
    # way); "auto": chat when the GGUF carries a template, else text
    prompting: str = "auto"
    n_ctx: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in instruction.LLM_MODES:
            raise BundleError(f"unknown LLM mode {self.mode!r}; use one of "
                              f"{instruction.LLM_MODES}")

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
        self._lock = threading.Lock()  # one llama context: one decode at a time
        self.llm = Llama(model_path=str(model_path), n_ctx=config.n_ctx, n_threads=self.threads,
                         n_threads_batch=self.threads, seed=config.seed, verbose=False)
        self._free = self._compile([]) if config.mode != "names" else None
        has_template = "tokenizer.chat_template" in self.llm.metadata
        self.prompting = config.prompting if config.prompting != "auto" else \
            ("chat" if has_template else "text")

    def _compile(self, names: list[str]) -> Any:
        text = instruction.grammar(self.config.mode, names, self.config.k)
        return self._grammar.from_string(text, verbose=False)

    def generate(self, prompts: list[str]) -> list[Generation]:
        with self._lock:
            return [self._one(prompt) for prompt in prompts]

    def _one(self, prompt: str) -> Generation:
        c = self.config
        names = prompt_context(prompt) if c.mode == "names" else []
        query = prompt_query(prompt)
        options = {"grammar": self._free or self._compile(names), "temperature": c.temperature,
                   "max_tokens": c.max_new_tokens, "seed": c.seed,
                   "repeat_penalty": c.repeat_penalty}
        if self.prompting == "chat":
            out = self.llm.create_chat_completion(
                messages=instruction.messages(c.mode, query, names, c.k), **options)
            text = out["choices"][0]["message"]["content"] or ""
        else:
            out = self.llm.create_completion(instruction.transcript(c.mode, query, names, c.k),
                                             **options)
            text = out["choices"][0]["text"]
        return Generation(text, int(out.get("usage", {}).get("completion_tokens", 0)))

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "providers": [f"llama.cpp:{self.threads}threads"],
                "model": self.model_path.name, **asdict(self.config),
                "prompting": self.prompting}

    def close(self) -> None:
        self.llm.close()
