"""`r4t train diffusion` and `r4t export diffusion`: stage 3's command line, free of torch (its
handlers import the torch modules only when they run)."""

from __future__ import annotations

import argparse
from pathlib import Path

from service.arguments import positive
from service.routes.diffusion import CONTEXT_SOURCES
from training.commands import lazy, subcommand_group
from training.device import DEVICES

# the ODE solvers a sampler is exported with (`solver` in diffusion.json; Euler the paper's)
SOLVER_NAMES = ("euler", "heun")


def register_diffusion(sub: argparse._SubParsersAction) -> None:
    """`r4t train diffusion` and `r4t export diffusion`. Their defaults live in the torch
    modules (training presets; `training.stage3_diffusion.export.ExportConfig`), so the help says
    where a default comes from rather than restating it."""
    train = subcommand_group(sub, "train", "train models").add_parser(
        "diffusion", help="train the stage-3 diffusion denoiser")
    train.add_argument("--preset", default="cpu",
                       help="training and denoiser preset: cpu, paper or tiny "
                            "(default: %(default)s)")
    train.add_argument("--context-source", default=None, choices=CONTEXT_SOURCES,
                       help="the context items: the query's nearest, the prompt's, or the "
                            "ranker's best (default: the preset's)")
    for size, what in (("context", "context items, C"), ("layers", "transformer blocks"),
                       ("hidden", "width"),
                       ("mlp", "MLP width"), ("heads", "attention heads; divide --hidden")):
        train.add_argument(f"--{size}", type=positive, default=None,
                           help=f"the denoiser's {what} (default: the preset's)")
    train.add_argument("--steps", type=int, default=None, help="default: the preset's")
    train.add_argument("--batch", type=int, default=None, help="default: the preset's")
    train.add_argument("--lr", type=float, default=None, help="default: the preset's")
    train.add_argument("--seed", type=int, default=None, help="default: the preset's")
    train.add_argument("--target-order", default=None,
                       help="an ordered model's row i: the block's i-th item by cosine to the "
                            "query (query), as its teacher wrote it (teacher) or in its "
                            "context's order (context); default: the preset's")
    train.add_argument("--threads", type=int, default=0,
                       help="torch threads (default: %(default)s, torch's own choice)")
    train.add_argument("--dataset", type=Path, default=None,
                       help="stage-2 run dir (default: <bundle>/runs/synthesis)")
    train.add_argument("--run-dir", type=Path, default=None,
                       help="checkpoint dir (default: <bundle>/runs/diffusion)")
    train.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    train.add_argument("--device", default="auto", choices=DEVICES,
                       help="auto: CUDA when torch sees a GPU (default: %(default)s)")
    train.set_defaults(func=lazy("training.stage3_diffusion.trainer", "cmd_train_diffusion"))

    export = subcommand_group(sub, "export", "export trained models into the bundle").add_parser(
        "diffusion", help="export the denoiser and its whole sampler to ONNX")
    export.add_argument("--checkpoint", type=Path, default=None,
                        help="default: <bundle>/runs/diffusion/checkpoint.pt")
    export.add_argument("--solver", default=None, choices=SOLVER_NAMES,
                        help="default: ExportConfig's")
    export.add_argument("--steps", type=positive, default=None,
                        help="solver steps (default: ExportConfig's)")
    export.add_argument("--draws", type=positive, default=None,
                        help="blocks sampled per query; a row that repeats an item is "
                             "replaced from the next block (default: ExportConfig's)")
    export.add_argument("--cfg-weight", type=float, default=None,
                        help="classifier-free guidance w in D = D_c + w·(D_c − D_u) "
                             "(default: ExportConfig's)")
    export.add_argument("--form", default=None, choices=("unrolled", "loop"),
                        help="whole-sampler graph form (default: ExportConfig's)")
    export.add_argument("--parity-batch", type=int, default=None,
                        help="queries in the ONNX-vs-PyTorch parity check "
                             "(default: ExportConfig's)")
    export.set_defaults(func=lazy("training.stage3_diffusion.export", "cmd_export_diffusion"))
