"""The GPU launcher: stage 1's GRPO under `accelerate launch`, in processes of its own, so
that their exit frees the GPU memory (TRL's vLLM engine's too) for stage 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from service.artifacts.stages import AR_STAGE

if TYPE_CHECKING:  # it imports torch
    from training.stage1_fanout.grpo import GrpoConfig


def launch_grpo(bundle_dir: Path, config: GrpoConfig, init: Path, gpus: int) -> None:
    """GRPO on the GPUs: `r4t train folm` under `accelerate launch`, data-parallel over as
    many GPUs as split a step's prompts evenly, into the run folder this build prepared (the
    preset's). In its own processes even on one GPU."""
    processes = max(n for n in range(1, gpus + 1) if config.queries_per_step % n == 0)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes",
               str(processes), "-m", "service.command", "--bundle", str(bundle_dir), "train",
               AR_STAGE, "--preset", config.preset, "--init", str(init)]
    print("== " + " ".join(command), flush=True)
    subprocess.run(command, check=True)
