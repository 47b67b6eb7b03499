"""The `r4t` command: catalog, bundle, ship, index, eval, table, export, llm, synthesize, train
and serve. One table names each subcommand, its help and the module that registers it; a
module is imported only to build the subcommand that runs, so `r4t serve` imports nothing from
training/ (which the runtime image does not hold)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from service.errors import R4TError
from service.extras import missing_extra
from service.settings import DEFAULT_BUNDLE

TRAINING = "training.cli"  # its register(sub) adds every subcommand but serve (torch-free)

# name -> (module whose register(sub) adds it, its one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "catalog": (TRAINING, "build the catalog, index and benchmark stages"),
    "bundle": (TRAINING, "build or complete every stage of a bundle"),
    "ship": (TRAINING, "copy the bundle's stages 1-3 and their val figures into the "
             "repository's shipped folder, which builds adopt"),
    "index": (TRAINING, "load the bundle's catalog into a Milvus collection (served with "
              "R4T_INDEX=milvus)"),
    "eval": (TRAINING, "evaluate methods on a benchmark split"),
    "table": (TRAINING, "print the bundle's evaluation table"),
    "frontier": (TRAINING, "every route's coverage@10 against its CPU per answer relative to "
                 "single's, one run"),
    "export": (TRAINING, "export trained models into the bundle"),
    "llm": (TRAINING, "a pretrained GGUF LLM as the bundle's AR policy (llm/)"),
    "synthesize": (TRAINING, "stage 2: sample the frozen policy into a dataset"),
    "train": (TRAINING, "train models"),
    "serve": ("service.api.server",
              "serve the bundle over HTTP (settings: R4T_* environment variables)"),
}
EVERY = None  # build_parser(EVERY): every subcommand built in full


def build_parser(command: str | None = EVERY) -> argparse.ArgumentParser:
    """The command line. `command` names the one subcommand built in full (importing only its
    module); the others are one-line stand-ins, enough for `r4t --help`. By default, all."""
    parser = argparse.ArgumentParser(prog="r4t", description=__doc__)
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE, help="bundle folder")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {m for name, (m, _) in COMMANDS.items() if command in (EVERY, name)}
    for module in sorted(modules, key=[m for m, _ in COMMANDS.values()].index):
        importlib.import_module(module).register(sub)
    for name, (_, help_text) in COMMANDS.items():  # in the table's order
        if name not in sub.choices:
            sub.add_parser(name, help=help_text)
    order = list(COMMANDS)
    sub._choices_actions.sort(key=lambda action: order.index(action.dest))
    return parser


def chosen(argv: list[str]) -> str:
    """The subcommand named on the command line ('' when none is)."""
    tokens = iter(argv)
    for token in tokens:
        if token == "--bundle":
            next(tokens, None)
        elif not token.startswith("-"):
            return token
    return ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name = chosen(argv)
    args = build_parser(name if name in COMMANDS else "").parse_args(argv)
    try:
        args.func(args)
    except R4TError as exc:
        print(f"r4t: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # an optional package this install lacks: say which install
        needed = missing_extra(exc)
        if needed is None:
            raise
        print(f"r4t: error: r4t {args.command} needs {exc.name}, which is in {needed}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
