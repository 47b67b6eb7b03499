"""argparse value types shared by every command line of the project: `r4t` and the
loadtest tools (a leaf, so a tool needs neither the offline job nor the server to parse)."""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    """An integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_list(text: str) -> tuple[int, ...]:
    """A comma list of integers of at least 1."""
    try:
        return tuple(positive(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be integers separated by commas, got {text!r}"
                                          ) from None


def positive_float(text: str) -> float:
    """A number above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A number from 0 to 1."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def non_negative(text: str) -> int:
    """An integer of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value
