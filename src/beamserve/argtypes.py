"""Argument types shared by every `beamserve` subcommand (argparse `type=` callables)."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An integer ≥ 1, or an argparse error that says so."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0, or an argparse error that says so."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def tp_pair(text: str) -> tuple[int, int]:
    """`PREFILL_TP:DECODE_TP`, both ≥ 1."""
    try:
        p, d = (int(x) for x in text.strip().split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not PREFILL_TP:DECODE_TP (for example 8:4)"
        ) from None
    if p < 1 or d < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: TP sizes must be ≥ 1")
    return p, d
