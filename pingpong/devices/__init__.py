"""Devices that slots live on; :func:`make_device` picks one for a loader."""

from __future__ import annotations

import torch

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
_CUDA_MODES = ("zerocopy", "staged", "device")


def _as_torch_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device {device!r} is not a valid torch device: {exc}") from None


def make_device(
    device: str | torch.device | Device,
    gather: str,
    gather_threads: int | None = None,
    sort_ids: bool = False,
) -> Device:
    """The :class:`Device` implementing ``gather`` on ``device``.

    ``device`` may also be a :class:`Device` instance (e.g. the fake
    asynchronous device of the tests); it is used as is, and ``gather`` must
    then be ``"auto"`` or that device's own mode.

    Raises:
        ConfigError: unknown ``gather`` or device string.
        GatherModeUnavailable: the mode cannot run there (a CUDA mode on the
            CPU, ``cpu`` on a GPU, CUDA requested without a usable GPU).
    """
    if isinstance(device, Device):
        if gather not in ("auto", device.gather_mode):
            raise ConfigError(
                f"gather={gather!r} does not match the given device's mode "
                f"{device.gather_mode!r}; pass gather='auto'"
            )
        if sort_ids:
            raise ConfigError("sort_ids configures a device pingpong makes, not a given one")
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
        if sort_ids:
            raise ConfigError("sort_ids applies to gather='zerocopy' on CUDA only")
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

        mode = "zerocopy" if gather == "auto" else gather
        if sort_ids and mode != "zerocopy":
            raise ConfigError(f"sort_ids applies to gather='zerocopy' only, not {mode!r}")
        return make_cuda_device(target, mode, gather_threads, sort_ids)
    raise GatherModeUnavailable(
        f"device type {target.type!r} is not supported; use 'cpu' or 'cuda'"
    )
