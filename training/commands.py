"""Shared plumbing of the `r4t` subcommands, kept free of torch so that `r4t serve` (and the
runtime image, which has no torch) can build the whole command line."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Mapping
from typing import Any


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


def given(source: argparse.Namespace | Mapping[str, Any], *names: str) -> dict[str, Any]:
    """The values among `names` that are set (not None): of a parsed command line, the flags
    the user gave, to override a preset or a config's defaults with
    (`replace(preset, **given(args, "steps", "lr"))`); of a mapping, every such key when no
    names are given."""
    if isinstance(source, Mapping):
        pairs = source.items() if not names else ((n, source.get(n)) for n in names)
    else:
        pairs = ((n, getattr(source, n, None)) for n in names)
    return {name: value for name, value in pairs if value is not None}
