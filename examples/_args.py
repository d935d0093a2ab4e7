"""argparse value types the examples share (an invalid value is an argparse error)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

#: What each example's ``--fanouts`` help ends with: argparse reads a value that
#: starts with ``-`` as an option, so a leading ``-1`` needs the ``=`` form.
FANOUTS_HOW = "each positive or -1 for all neighbours; a leading -1 as --fanouts=-1,10"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def buffer_count(text: str) -> int:
    """``--num-buffers``: ping-pong needs two slots at least."""
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be 2 or more (one slot filling while "
                                          f"the training loop reads another), got {text}")
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


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
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


def check_json_target(parser: argparse.ArgumentParser, path: Path | None) -> None:
    """Refuse a ``--json`` file whose folder does not exist -- before any training,
    not after it (a parser error, exit status 2)."""
    if path is not None and not path.parent.is_dir():
        parser.error(f"--json {path}: no such folder {str(path.parent)!r}")
