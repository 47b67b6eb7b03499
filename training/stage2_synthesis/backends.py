"""Stage 2's teachers: where a run's samples come from. The ONNX and OpenAI-compatible ones are
the service's own fan-out backends (service/backends/), asked for n samples per prompt; HF
`generate` on the in-process checkpoint is the one only training has (it needs torch).
`open_teacher_sampler` (`training.stage2_synthesis.synthesis`) picks one per run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.fanout.format import Generation
from service.fanout.trie import NAME_SCOPES


class TorchFanoutBackend:
    """HF `generate` on an in-process checkpoint, under the served grammar; the service's
    FanoutBackend protocol."""

    name = "torch"

    def __init__(self, checkpoint: Path, k: int, temperature: float, max_new_tokens: int,
                 decoding: str = "lines", names: list[str] | None = None,
                 device: str = "cpu") -> None:
        from training.stage1_fanout.grammar import constrain_generation
        from training.stage1_fanout.policy import load_policy

        self.model, self.tokenizer = load_policy(checkpoint)
        self.model.to(device).eval()
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        constrain_generation(self.model, self.tokenizer, k, decoding, names or ())  # as served

    def generate(self, prompts: list[str], deadline: float | None = None, n: int = 1,
                 seed: int | None = None) -> list[Generation]:
        """`deadline` is not checked: stage 2 has none."""
        return [g for prompt in prompts for g in self._sample(prompt, n, seed or 0)]

    def _sample(self, prompt: str, n: int, seed: int) -> list[Generation]:
        import torch

        torch.manual_seed(seed)
        enc = self.tokenizer([prompt], return_tensors="pt").to(self.model.device)
        with torch.no_grad():
            out = self.model.generate(
                **enc, do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0,
                max_new_tokens=self.max_new_tokens, num_return_sequences=n,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
            )
        new = out[:, enc["input_ids"].shape[1] :]  # (n, T)
        ended = (new == self.tokenizer.eos_token_id).int()  # (n, T)
        lengths = torch.where(ended.any(1), ended.argmax(1) + 1,
                              torch.full_like(ended[:, 0], new.shape[1]))  # (n,)
        texts = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        return [Generation(text, int(length)) for text, length in zip(texts, lengths,
                                                                      strict=True)]

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "temperature": self.temperature,
                "max_new_tokens": self.max_new_tokens}

    def close(self) -> None:
        return None


def chosen_backend(backend: str, decoding: str) -> str:
    """`auto`: vLLM where a GPU runs it and the decoding is one regex, else HF generate (on
    the GPU if any)."""
    if backend != "auto":
        return backend
    from training.device import device_of

    return "vllm" if device_of().vllm and decoding not in NAME_SCOPES else "torch"
