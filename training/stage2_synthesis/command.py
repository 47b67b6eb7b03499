"""`r4t synthesize`: stage 2 from the policy (synthesis.py) or from an item-picking teacher
(teachers.py), one command over both."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from service.arguments import positive
from service.artifacts.stages import AR_STAGE
from service.errors import InputError
from service.fanout.trie import DECODINGS
from training.stage2_synthesis.synthesis import (
    BACKENDS,
    EXTRA_CHOICES,
    SYNTHESIS_PRESETS,
    SYNTHESIS_RUN,
    TEACHERS,
    SynthesisConfig,
    commit_synthesis,
    synthesize,
)
from training.stage2_synthesis.teachers import AMONG, RANKED_CONTEXT, synthesize_blocks


def cmd_synthesize(args: argparse.Namespace) -> None:
    config = replace(
        SynthesisConfig(), samples_per_query=args.samples, temperature=args.temperature,
        extra_queries=args.extra_queries, extra_samples=args.extra_samples,
        extra_choice=args.extra_choice,
        backend=args.backend, endpoint=args.endpoint, model=args.model,
        keep_top_frac=args.keep_top_frac, threads=args.threads, seed=args.seed,
        decoding=args.decoding, teacher=args.teacher,
    )
    if args.teacher != AR_STAGE:  # blocks the ranker or the labels pick
        if args.teacher == "oracle" and not args.run_dir:
            raise InputError("--teacher oracle writes a positive control's dataset: name its "
                             "--run-dir (then `r4t train diffusion --dataset DIR "
                             "--context-source ranked`)")
        run_dir = Path(args.run_dir) if args.run_dir else args.bundle / "runs" / SYNTHESIS_RUN
        synthesize_blocks(args.bundle, args.teacher, config, args.context, run_dir, args.among)
        if not args.run_dir:  # the bundle's own stage 2
            commit_synthesis(args.bundle, config, run_dir, args.context, args.among)
        return
    from training.stage1_fanout.export import default_checkpoint

    checkpoint = (Path(args.checkpoint) if args.checkpoint
                  else default_checkpoint(args.bundle, AR_STAGE))
    run_dir = Path(args.run_dir) if args.run_dir else None
    queries = None
    if args.limit:
        from training.data.splits import query_texts

        queries = query_texts(args.bundle, "train")[: args.limit]
    run_dir = synthesize(args.bundle, config, checkpoint, run_dir, queries)
    if not (args.checkpoint or args.run_dir or args.limit):  # the bundle's own stage 2
        commit_synthesis(args.bundle, config, run_dir)


def register(sub: argparse._SubParsersAction) -> None:
    """`r4t synthesize [--samples N] [--temperature T] [--backend B]`: SynthesisConfig's
    defaults."""
    syn = sub.add_parser("synthesize", help="stage 2: sample the frozen policy into a dataset")
    syn.add_argument("--samples", type=int, default=SynthesisConfig.samples_per_query,
                     help="samples per training query")
    syn.add_argument("--extra-queries", type=int, default=SynthesisConfig.extra_queries,
                     help="also sample this many catalog names (no val/test query) as queries")
    syn.add_argument("--extra-choice", default=SynthesisConfig.extra_choice,
                     choices=EXTRA_CHOICES, help="how the extra names are drawn: uniformly, or "
                     "by breadth (∝ log(1 + texts holding the name))")
    syn.add_argument("--extra-samples", type=int, default=SynthesisConfig.extra_samples,
                     help="samples per extra query")
    syn.add_argument("--temperature", type=float, default=SynthesisConfig.temperature)
    syn.add_argument("--decoding", default=SynthesisConfig.decoding, choices=DECODINGS,
                     help="how sampled lines are decoded (local/torch backends)")
    syn.add_argument("--backend", default=SynthesisConfig.backend, choices=BACKENDS,
                     help="vllm: a vLLM server on the policy for the run; auto: vllm where a "
                          "GPU runs it, else torch (default: %(default)s)")
    syn.add_argument("--endpoint", default=SynthesisConfig.endpoint,
                     help="OpenAI-compatible base URL (http)")
    syn.add_argument("--model", default=SynthesisConfig.model,
                     help="model name for the http backend")
    syn.add_argument("--checkpoint", default=None,
                     help="policy HF folder (default: the cpu preset's GRPO run's final/)")
    syn.add_argument("--keep-top-frac", type=float, default=SynthesisConfig.keep_top_frac,
                     help="keep each query's best fraction by reward (default: keep all)")
    syn.add_argument("--run-dir", default=None, help="default models/<bundle>/runs/synthesis")
    syn.add_argument("--limit", type=int, default=None, help="first N training queries")
    syn.add_argument("--seed", type=int, default=SynthesisConfig.seed)
    syn.add_argument("--teacher", default=SYNTHESIS_PRESETS["cpu"].teacher, choices=TEACHERS,
                     help="folm: sample the policy (the bundle's stage 2); ranker: sample the "
                          "bundle's ranker; oracle: blocks of one item per labeled group (a "
                          "positive control), both among the ranker's best --context items")
    syn.add_argument("--context", type=positive, default=RANKED_CONTEXT,
                     help="--teacher ranker|oracle: the student's context size")
    syn.add_argument("--among", default="ranked", choices=AMONG,
                     help="--teacher ranker|oracle: the student's context: the ranker's best "
                          "--context candidates, or the query's --context nearest items")
    syn.add_argument("--threads", type=int, default=SynthesisConfig.threads)
    syn.set_defaults(func=cmd_synthesize)
