"""Shared plumbing of the `r4t` subcommands, kept free of torch so that `r4t serve` (and the
runtime image, which has no torch) can build the whole command line."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path


def subcommand_group(
    sub: argparse._SubParsersAction, name: str, help_text: str
) -> argparse._SubParsersAction:
    """The subcommands of `r4t <name>`: created once, shared by the stages that add to it."""
    parser = sub.choices.get(name) or sub.add_parser(name, help=help_text)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return parser.add_subparsers(dest="what", required=True)


def lazy(module: str, function: str) -> Callable[[argparse.Namespace], None]:
    """A handler that imports its (torch-using) module only when the command runs."""

    def run(args: argparse.Namespace) -> None:
        getattr(importlib.import_module(module), function)(args)

    return run


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def register_diffusion(sub: argparse._SubParsersAction) -> None:
    """`r4t train diffusion` and `r4t export diffusion` (defaults live in the torch modules)."""
    train = subcommand_group(sub, "train", "train models").add_parser(
        "diffusion", help="train the stage-3 diffusion denoiser")
    train.add_argument("--preset", default="cpu", help="cpu (default), paper or tiny")
    train.add_argument("--head", default=None, choices=("vector", "context"),
                       help="denoiser output: EDM vector (default) or a mixture of the context")
    train.add_argument("--context-source", default=None, choices=("nearest", "prompt"),
                       help="the context items: the prompt's (cpu default) or the nearest")
    train.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    train.add_argument("--batch", type=int, default=None)
    train.add_argument("--lr", type=float, default=None)
    train.add_argument("--seed", type=int, default=None)
    train.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    train.add_argument("--dataset", type=Path, default=None,
                       help="stage-2 run dir (default <bundle>/runs/synthesis)")
    train.add_argument("--run-dir", type=Path, default=None,
                       help="checkpoint dir (default <bundle>/runs/diffusion)")
    train.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    train.set_defaults(func=lazy("training.diffusion_training", "cmd_train_diffusion"))

    export = subcommand_group(sub, "export", "export trained models into the bundle").add_parser(
        "diffusion", help="export the denoiser and its whole sampler to ONNX")
    export.add_argument("--checkpoint", type=Path, default=None,
                        help="default <bundle>/runs/diffusion/checkpoint.pt")
    export.add_argument("--solver", default=None, choices=("euler", "heun"),
                        help="default euler")
    export.add_argument("--steps", type=int, default=None, help="solver steps (default 4)")
    export.add_argument("--draws", type=positive, default=None,
                        help="blocks sampled per query; a row that repeats an item is "
                             "replaced from the next block (default 2)")
    export.add_argument("--cfg-weight", type=float, default=None,
                        help="classifier-free guidance w in D = D_c + w·(D_c − D_u) (default 2)")
    export.add_argument("--form", default=None, choices=("unrolled", "loop"),
                        help="whole-sampler graph form (default unrolled)")
    export.add_argument("--parity-batch", type=int, default=None,
                        help="queries in the ONNX-vs-PyTorch parity check (default 4)")
    export.set_defaults(func=lazy("training.diffusion_export", "cmd_export_diffusion"))
