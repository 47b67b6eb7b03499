"""Where the offline job computes: CUDA when torch sees a GPU, else the CPU, chosen at run time.

The same presets and code run on both; only this record differs, and each stage writes it into
its run's config so a result says what it ran on.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict, dataclass
from typing import Any

from service.errors import InputError

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Device:
    kind: str  # "cuda" or "cpu"
    count: int  # GPUs visible (0 on the CPU)
    bf16: bool  # the GPU computes in bfloat16
    vllm: bool  # vLLM is installed, and a GPU is there to run it
    name: str  # the GPU's (or "cpu")

    @property
    def torch(self) -> str:
        return "cuda" if self.kind == "cuda" else "cpu"

    def record(self) -> dict[str, Any]:
        return asdict(self)


def device_of(requested: str = "auto") -> Device:
    """`auto`: CUDA when available, else the CPU; `cuda` refuses a machine without one."""
    import torch

    if requested not in DEVICES:
        raise InputError(f"unknown device {requested!r}; use one of {DEVICES}")
    cuda = torch.cuda.is_available() and requested != "cpu"
    if requested == "cuda" and not cuda:
        raise InputError("--device cuda: torch sees no GPU (the CPU wheel, or no driver)")
    if not cuda:
        return Device("cpu", 0, False, False, "cpu")
    return Device("cuda", torch.cuda.device_count(), torch.cuda.is_bf16_supported(),
                  importlib.util.find_spec("vllm") is not None, torch.cuda.get_device_name(0))


def world_size() -> int:
    """Processes of this run (`accelerate launch` and torchrun set WORLD_SIZE; 1 otherwise)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def distributed() -> bool:
    """True inside an `accelerate launch` (or torchrun) worker."""
    return world_size() > 1
