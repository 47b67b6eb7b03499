"""Stage 2's teacher clients: where a run's samples come from. Each backend answers one
prompt with n sampled fan-outs and the tokens they cost; `open_teacher_sampler`
(`training.stage2_synthesis.synthesis`) picks one per run."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from service.fanout.trie import NAME_SCOPES, NameConstraint


class TeacherSampler(Protocol):
    """What every backend answers: (n sampled texts, tokens generated) for one prompt."""

    def sample(self, prompt: str, n: int, temperature: float, max_new_tokens: int,
               seed: int) -> tuple[list[str], int]: ...


class OnnxSampler:
    """The exported policy decoded by ONNX Runtime with a KV cache, in this process."""

    def __init__(self, folm_dir: Path, threads: int, decoding: str = "lines",
                 names: list[str] | None = None) -> None:
        from service.fanout.decoding import FanoutDecoder

        self.decoder = FanoutDecoder(folm_dir, threads=threads)
        self.free = decoding == "free"
        self.names = NameConstraint(self.decoder.tokenizer, int(self.decoder.config["eos_id"]),
                                    decoding, names or ()) if decoding in NAME_SCOPES else None

    def sample(self, prompt: str, n: int, temperature: float, max_new_tokens: int,
               seed: int) -> tuple[list[str], int]:
        gens = self.decoder.generate([prompt] * n, temperature, max_new_tokens, seed,
                                     enforce_lines=not self.free, names=self.names)
        return [g.text for g in gens], sum(g.n_tokens for g in gens)


class TorchSampler:
    """HF `generate` on an in-process checkpoint; returns (texts, tokens generated)."""

    def __init__(self, checkpoint: Path, k: int, decoding: str = "lines",
                 names: list[str] | None = None, device: str = "cpu") -> None:
        from training.stage1_fanout.grammar import constrain_generation
        from training.stage1_fanout.policy import load_policy

        self.model, self.tokenizer = load_policy(checkpoint)
        self.model.to(device).eval()
        constrain_generation(self.model, self.tokenizer, k, decoding, names or ())  # as served

    def sample(self, prompt: str, n: int, temperature: float, max_new_tokens: int,
               seed: int) -> tuple[list[str], int]:
        import torch

        torch.manual_seed(seed)
        enc = self.tokenizer([prompt], return_tensors="pt").to(self.model.device)
        with torch.no_grad():
            out = self.model.generate(
                **enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                max_new_tokens=max_new_tokens, num_return_sequences=n,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
            )
        new = out[:, enc["input_ids"].shape[1] :]  # (n, T)
        eos = self.tokenizer.eos_token_id
        ended = (new == eos).int()
        lengths = torch.where(ended.any(1), ended.argmax(1) + 1, torch.full_like(ended[:, 0],
                                                                               new.shape[1]))
        texts = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        return texts, int(lengths.sum())


class HttpSampler:
    """An OpenAI-compatible completions endpoint (e.g. vLLM's `/v1/completions`)."""

    def __init__(self, endpoint: str, model: str, timeout: float = 120.0,
                 regex: str | None = None) -> None:
        import httpx

        self.model, self.regex = model, regex  # regex: vLLM's structured outputs
        self.client = httpx.Client(base_url=endpoint.rstrip("/"), timeout=timeout)

    def sample(self, prompt: str, n: int, temperature: float, max_new_tokens: int,
               seed: int) -> tuple[list[str], int]:
        body = {"model": self.model, "prompt": prompt, "n": n,
                "temperature": temperature, "max_tokens": max_new_tokens, "seed": seed}
        if self.regex:
            body["structured_outputs"] = {"regex": self.regex}
        response = self.client.post("/v1/completions", json=body)
        response.raise_for_status()
        payload = response.json()
        choices = sorted(payload["choices"], key=lambda c: c.get("index", 0))
        tokens = int(payload.get("usage", {}).get("completion_tokens", 0))
        return [c["text"] for c in choices], tokens


def chosen_backend(backend: str, decoding: str) -> str:
    """`auto`: vLLM where a GPU runs it and the decoding is one regex, else HF generate (on
    the GPU if any)."""
    if backend != "auto":
        return backend
    from training.device import device_of

    return "vllm" if device_of().vllm and decoding not in NAME_SCOPES else "torch"
