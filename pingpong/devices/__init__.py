"""Devices that slots live on; :func:`make_device` picks one for a loader."""

from __future__ import annotations

import torch

from .._integers import Count
from ..errors import ConfigError, GatherModeUnavailable
from .base import COMPLETED, CompletedEvent, Device, Event
from .cpu import CPUDevice

__all__ = [
    "COMPLETED",
    "CPUDevice",
    "CompletedEvent",
    "Device",
    "Event",
    "GATHER_MODES",
    "make_device",
]

#: Every value the ``gather`` argument accepts.
GATHER_MODES = ("auto", "cpu", "zerocopy", "staged", "device")
#: Every value the ``sort_ids`` argument accepts: ``auto`` sorts on the GPU in
#: ``zerocopy`` (where reading host memory in address order pays) and nowhere else
#: (see :mod:`pingpong.devices.cuda`).
SORT_IDS = ("auto", "gpu", "none")
_CUDA_MODES = ("zerocopy", "staged", "device")


def _as_torch_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device {device!r} is not a valid torch device: {exc}") from None


def make_device(
    device: str | torch.device | Device,
    gather: str,
    gather_threads: Count | None = None,
    sort_ids: str = "auto",
    table_bytes: int = 0,
) -> Device:
    """The :class:`Device` implementing ``gather`` on ``device``.

    ``device`` may also be a :class:`Device` instance (e.g. the fake
    asynchronous device of the tests); it is used as is, and ``gather`` must
    then be ``"auto"`` or that device's own mode.  ``table_bytes`` (all host
    tables together) is what ``gather="auto"`` weighs against the GPU's free
    memory; ``sort_ids`` is ``"auto"``, ``"gpu"`` or ``"none"`` (CUDA kernel
    gathers only; see the loader).

    Raises:
        ConfigError: unknown ``gather``, ``sort_ids`` or device string.
        GatherModeUnavailable: the mode cannot run there (a CUDA mode on the
            CPU, ``cpu`` on a GPU, CUDA requested without a usable GPU).
    """
    if sort_ids not in SORT_IDS:
        raise ConfigError(
            f"sort_ids must be one of {SORT_IDS} (ids are sorted on the GPU, never on the "
            f"host: a host argsort lost end to end on the H200), got {sort_ids!r}"
        )
    if isinstance(device, Device):
        if gather not in ("auto", device.gather_mode):
            raise ConfigError(
                f"gather={gather!r} does not match the given device's mode "
                f"{device.gather_mode!r}; pass gather='auto'"
            )
        if sort_ids != "auto":
            raise ConfigError("sort_ids configures a device pingpong makes, not a given one")
        if gather_threads is not None:
            raise ConfigError(
                "gather_threads configures a device pingpong makes, not a given one, "
                f"got {gather_threads!r}")
        return device
    if gather not in GATHER_MODES:
        raise ConfigError(f"gather must be one of {GATHER_MODES}, got {gather!r}")
    target = _as_torch_device(device)
    if target.type == "cpu":
        if gather in _CUDA_MODES:
            raise GatherModeUnavailable(
                f"gather={gather!r} needs a CUDA device; with device='cpu' use "
                "gather='cpu' or 'auto'"
            )
        if sort_ids == "gpu":  # "none" is what the CPU gather does: device-agnostic code
            raise ConfigError("sort_ids='gpu' applies to the CUDA kernel gathers only; "
                              "the CPU gather never sorts")
        return CPUDevice(gather_threads)
    if target.type == "cuda":
        if gather == "cpu":
            raise GatherModeUnavailable(
                "gather='cpu' delivers batches in host memory; with device='cuda' "
                f"use one of {_CUDA_MODES} or 'auto'"
            )
        if not torch.cuda.is_available():
            raise GatherModeUnavailable(
                f"device={str(target)!r} requested but torch.cuda.is_available() is False "
                "(no GPU, or a CPU-only torch build)"
            )
        from .cuda import make_cuda_device

        return make_cuda_device(target, gather, gather_threads, sort_ids, table_bytes)
    raise GatherModeUnavailable(
        f"device type {target.type!r} is not supported; use 'cpu' or 'cuda'"
    )
