"""`r4t train folm`: the warm start, then GRPO under one reward, or the reward ablation."""

from __future__ import annotations

import argparse
import time

from service.arguments import non_negative, positive
from service.artifacts.stages import AR_STAGE
from service.errors import InputError
from service.fanout.trie import DECODINGS
from training.commands import given, subcommand_group
from training.stage1_fanout.ablation import ablation_report
from training.stage1_fanout.gguf import hf_checkpoint
from training.stage1_fanout.grpo import (
    ABLATION,
    GRPO_PRESETS,
    LABEL_REWARD,
    PAPER_MODES,
    REWARD_MODES,
    GrpoConfig,
    resolve_config,
    reward_terms_of,
    training_queries_of,
)
from training.stage1_fanout.grpo_run import train_grpo
from training.stage1_fanout.warmstart import resolve_config as warm_config
from training.stage1_fanout.warmstart import warm_start


def cmd_train_folm(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    if args.reward == LABEL_REWARD:
        training_queries_of(args.bundle, LABEL_REWARD)  # no labels: say so before the warm start
    init = hf_checkpoint(args.init) if args.init else warm_start(
        args.bundle, warm_config(args.preset, threads=args.threads), force=args.force_warmstart)
    if args.warmstart_only:
        return
    ablation = args.reward == "ablation"
    modes = list(PAPER_MODES) if ablation else [args.reward]
    flags = given(args, "steps", "lr", "queries_per_step", "decoding", "threads", "beta",
                  "temperature")
    if ablation:  # the flags override ABLATION's settings, as they override the preset's
        flags = {**ABLATION.get(args.preset, {}), **flags}
    finals = {}
    for mode in modes:
        config = resolve_config(args.preset, **flags, reward=mode)
        run_dir = args.bundle / "runs" / "ablation" / mode if ablation else None
        finals[mode] = train_grpo(args.bundle, config, init, run_dir)
    if ablation:
        ablation_report(args.bundle, {"warm start": init, **finals}, decoding=config.decoding,
                        best_of=args.ablation_best_of)
    print(f"stage 1 wall time (this invocation): {time.perf_counter() - started:.0f} s")


def reward_mode(value: str) -> str:
    """argparse type of --reward: a known mode, `ablation` or a loadable `py:` callable."""
    if value != "ablation":
        try:
            reward_terms_of(value)
        except InputError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return value


def register(sub: argparse._SubParsersAction) -> None:
    """`r4t train folm [--preset P] [--reward about|all|ground|ground+align|label|ablation|
    py:module:function]`."""
    what = subcommand_group(sub, "train", "train models")
    folm = what.add_parser(AR_STAGE, help="warm start + GRPO of the fan-out LM")
    folm.add_argument("--preset", default="cpu", choices=sorted(GRPO_PRESETS))
    folm.add_argument("--reward", default=GrpoConfig.reward, type=reward_mode,
                      help=f"one of {', '.join([*REWARD_MODES, LABEL_REWARD, 'ablation'])}, "
                      "or py:module:function, your f(query, item_texts) -> float. 'all' is "
                      "the paper's composite; 'about' the label-free objective chosen on val; "
                      "'label' a positive control: coverage of the "
                      "labeled train queries' groups")
    folm.add_argument("--steps", type=positive, default=None,
                      help="GRPO steps (default: the preset's)")
    folm.add_argument("--ablation-best-of", type=non_negative, default=64,
                      help="the report's best-of-N rows per reward (0: none)")
    folm.add_argument("--lr", type=float, default=None, help="GRPO learning rate")
    folm.add_argument("--beta", type=float, default=None, help="KL weight to the warm start")
    folm.add_argument("--temperature", type=float, default=None, help="GRPO sampling T")
    folm.add_argument("--queries-per-step", type=positive, default=None,
                      help="prompts per GRPO step, each sampled num_generations times "
                           "(default: the preset's)")
    folm.add_argument("--decoding", default=None, choices=DECODINGS,
                      help="how sampled lines are decoded (default: the preset's)")
    folm.add_argument("--init", default=None,
                      help="start from this HF checkpoint folder, .gguf file or GGUF package")
    folm.add_argument("--warmstart-only", action="store_true")
    folm.add_argument("--force-warmstart", action="store_true", help="retrain the warm start")
    folm.add_argument("--threads", type=int, default=None,
                      help="torch threads (default: the preset's)")
    folm.set_defaults(func=cmd_train_folm)
