"""argparse value types the examples share (an invalid value is an argparse error)."""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path
from typing import Any

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


#: The largest ``--seed``: DGL's random seed is a C int.
MAX_SEED = 2**31 - 1


def seed_value(text: str) -> int:
    """``--seed``: an int in ``[0, MAX_SEED]`` (``dgl.seed`` takes nothing larger)."""
    value = int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must lie in [0, {MAX_SEED}], got {text}")
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


def add_device_flags(p: argparse.ArgumentParser) -> None:
    """``--device`` and pingpong's ``--gather`` mode."""
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--gather", choices=["auto", "cpu", "zerocopy", "staged", "device"],
                   default="auto", help="pingpong gather mode (CUDA modes need --device cuda)")


def nice_increment(text: str) -> int:
    """``--producer-nice``: how much the producer raises its nice value, 0-19."""
    from pingpong._producer_nice import MAX_NICE

    value = int(text)
    if not 0 <= value <= MAX_NICE:
        raise argparse.ArgumentTypeError(f"must be from 0 to {MAX_NICE}, got {text}")
    return value


def add_producer_flags(p: argparse.ArgumentParser) -> None:
    """``--sampler-threads`` and ``--producer-nice``: pingpong's ``sampler_threads`` and
    ``producer_nice`` (None: the loader's defaults)."""
    p.add_argument("--sampler-threads", type=positive_int, default=None,
                   help="pingpong: OpenMP threads DGL's sampler uses on the producer thread "
                        "(default: on the CPU as many as the gather's, half the cores; "
                        "on CUDA, the process default)")
    p.add_argument("--producer-nice", type=nice_increment, default=None,
                   help="pingpong: how much the producer thread raises its nice value, "
                        "0-19 (Linux; default: 10 on the CPU, 0 on CUDA)")


def check_device_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A parser error for ``--device cuda`` without CUDA, or a CUDA gather mode on the CPU."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    if args.device == "cpu" and args.gather in ("zerocopy", "staged", "device"):
        parser.error(f"--gather {args.gather} needs --device cuda (on the CPU: auto or cpu)")


def check_json_target(parser: argparse.ArgumentParser, path: Path | None) -> None:
    """Refuse a ``--json`` file that cannot be written -- its folder missing, a
    folder itself, no write permission -- before any training, not after it (a
    parser error, exit status 2).  Writability is tried by opening the file
    for appending (a file that did not exist is removed again)."""
    if path is None:
        return
    if not path.parent.is_dir():
        parser.error(f"--json {path}: no such folder {str(path.parent)!r}")
    if path.is_dir():
        parser.error(f"--json {path}: is a folder; give a file name (say {path / 'run.json'})")
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        parser.error(f"--json {path}: cannot write it ({exc.strerror or exc})")
    if not existed:
        path.unlink(missing_ok=True)


def add_minibatch_training_flags(p: argparse.ArgumentParser) -> None:
    """The flags the heterogeneous examples share (train_rgcn, train_rating): fanouts,
    batch size, width, optimiser, epochs, slots, seed and ``--json``."""
    p.add_argument("--fanouts", type=fanout_list, default=[10, 10],
                   help="comma-separated, outermost layer first (default 10,10); "
                        + FANOUTS_HOW)
    p.add_argument("--batch-size", type=positive_int, default=1024)
    p.add_argument("--hidden", type=positive_int, default=64)
    p.add_argument("--lr", type=positive_float, default=0.01)
    p.add_argument("--epochs", type=positive_int, default=3)
    p.add_argument("--num-buffers", type=buffer_count, default=2)
    p.add_argument("--seed", type=seed_value, default=0)
    p.add_argument("--json", type=Path, default=None, help="write a JSON summary here")


def parse_dgl_example_args(parser: argparse.ArgumentParser, argv: list[str] | None,
                           why: str) -> argparse.Namespace:
    """Parse ``argv``; a parser error (exit status 2) without DGL (``why`` it is
    needed) or for a ``--json`` target in no folder -- before any work."""
    args = parser.parse_args(argv)
    if importlib.util.find_spec("dgl") is None:
        parser.error(f"this example needs DGL ({why})")
    check_json_target(parser, args.json)
    return args


def refuse_empty_splits(parser: argparse.ArgumentParser, splits: dict[str, Any],
                        what: str, grow: str) -> None:
    """Exit (status 2) naming the first empty split: its metric would print as a
    plain 0.0000.  ``what`` names the split's items, ``grow`` the flags to raise."""
    for name, ids in splits.items():
        if len(ids) == 0:
            sizes = "/".join(str(len(i)) for i in splits.values())
            parser.exit(2, f"{parser.prog}: error: the {name} split has no {what} "
                           f"({'/'.join(splits)} {sizes}); raise {grow}\n")
