"""argparse value types the examples share (an invalid value is an argparse error)."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1), got {text}")
    return value


def fanout_list(text: str) -> list[int]:
    """``"15,10,5"`` -> ``[15, 10, 5]``; each fanout positive or -1 (all neighbours)."""
    try:
        fanouts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 15,10,5, got {text!r}") from None
    if any(f == 0 or f < -1 for f in fanouts):
        raise argparse.ArgumentTypeError(f"fanouts must be positive or -1, got {text!r}")
    return fanouts
