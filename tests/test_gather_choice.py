"""``gather="auto"`` on CUDA and ``sort_ids``: the choices, checked on the CPU.

The choice itself is a pure function of the tables' size and the GPU's free
memory (``torch.cuda.mem_get_info`` on a real GPU; faked figures here); the
loader applies it and reports it as ``loader.gather_mode`` (a ``cuda`` test in
tests/test_cuda.py checks that on a GPU). ``make_cuda_device`` is run here too,
with a stand-in for the copy stream (it launches nothing until a loader attaches):
the free memory it weighs, and which modes sort ids for each ``sort_ids``.
"""

from __future__ import annotations

import pytest
import torch

import pingpong
from pingpong.devices import SORT_IDS, make_device

cuda_device = pytest.importorskip("pingpong.devices.cuda")

GIB = 2**30


@pytest.mark.parametrize(
    ("table_gib", "free_gib", "chosen"),
    [
        (1, 80, "device"),  # ogbn-products-sized features on an 80 GB GPU
        (40, 80, "device"),  # exactly half of the free memory
        (40.5, 80, "zerocopy"),  # just over half
        (57, 80, "zerocopy"),  # ogbn-papers100M's features
        (0, 0, "device"),  # nothing to hold
        (1, 0, "zerocopy"),  # a full GPU
    ],
)
def test_auto_keeps_tables_on_the_gpu_only_when_they_fit_half_the_free_memory(
    table_gib, free_gib, chosen
):
    assert cuda_device.AUTO_DEVICE_SHARE == 0.5
    assert cuda_device.choose_gather_mode(int(table_gib * GIB), int(free_gib * GIB)) == chosen


def test_sort_ids_values_are_checked_before_anything_is_built():
    assert SORT_IDS == ("auto", "gpu", "none") == cuda_device.SORT_IDS
    for bad in (True, False, "host", None):
        with pytest.raises(pingpong.ConfigError, match="sort_ids"):
            make_device("cpu", "auto", sort_ids=bad)  # type: ignore[arg-type]
    with pytest.raises(pingpong.ConfigError, match="CUDA kernel gathers only"):
        pingpong.PingPongLoader([], torch.zeros(3, 2), sort_ids="gpu")
    assert make_device("cpu", "auto", sort_ids="auto").gather_mode == "cpu"
    # what the CPU does anyway: accepted, so device-agnostic code can pass it everywhere
    assert make_device("cpu", "auto", sort_ids="none").gather_mode == "cpu"
    with pingpong.PingPongLoader([], torch.zeros(3, 2), sort_ids="none") as loader:
        assert loader.gather_mode == "cpu"


def test_the_loader_passes_its_tables_size_to_auto(monkeypatch):
    """The bytes weighed against free memory are every feature and label table."""
    seen = {}

    def fake_make_device(device, gather, gather_threads, sort_ids, table_bytes):
        seen["table_bytes"] = table_bytes
        return make_device("cpu", "auto")

    monkeypatch.setattr(pingpong.loader, "make_device", fake_make_device)
    features = {"a": torch.zeros(10, 4), "b": torch.zeros(10, 2, dtype=torch.float16)}
    labels = torch.zeros(10, dtype=torch.int64)
    pingpong.PingPongLoader([], features, labels, device="cuda").close()
    assert seen["table_bytes"] == 10 * 4 * 4 + 10 * 2 * 2 + 10 * 8


class _NoCopyStream:
    """Stands in for the GPU's copy stream: the modes only keep it until ``attach``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device


@pytest.mark.parametrize(
    ("table_gib", "chosen"), [(40, "device"), (45, "zerocopy"), (81, "zerocopy")]
)
def test_auto_weighs_the_tables_against_the_free_memory_not_the_total(
    monkeypatch, table_gib, chosen
):
    """``make_cuda_device`` applies the choice to the loader's table bytes and the GPU's
    *free* memory (80 GiB of 100 here): 45 GiB fit half of the total, not of the free."""
    asked = []

    def mem_get_info(device=None):
        asked.append(device)
        return 80 * GIB, 100 * GIB

    monkeypatch.setattr(cuda_device, "CopyStream", _NoCopyStream)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    made = cuda_device.make_cuda_device(torch.device("cuda", 1), "auto", None,
                                        table_bytes=table_gib * GIB)
    assert made.gather_mode == chosen
    assert asked == [torch.device("cuda", 1)]


@pytest.mark.parametrize(
    ("gather", "sort_ids", "sorts"),
    [
        ("zerocopy", "auto", True),  # host memory read in address order pays
        ("zerocopy", "gpu", True),
        ("zerocopy", "none", False),
        ("device", "auto", False),  # auto sorts in zerocopy only
        ("device", "gpu", True),
        ("device", "none", False),
        ("staged", "auto", None),  # no kernel, no ids on the GPU
        ("staged", "none", None),
    ],
)
def test_sort_ids_choice_per_gather_mode(monkeypatch, gather, sort_ids, sorts):
    """What ``sort_ids`` makes of each CUDA mode: the GPU tests see the same rows
    either way, so the choice itself is checked here."""
    monkeypatch.setattr(cuda_device, "CopyStream", _NoCopyStream)
    made = cuda_device.make_cuda_device(torch.device("cuda", 0), gather, None, sort_ids)
    assert made.gather_mode == gather
    stager = getattr(made._mode, "ids", None)
    assert (None if stager is None else stager.sort) is sorts


def test_sort_ids_gpu_needs_a_kernel_gather(monkeypatch):
    monkeypatch.setattr(cuda_device, "CopyStream", _NoCopyStream)
    with pytest.raises(pingpong.ConfigError, match="needs a kernel gather"):
        cuda_device.make_cuda_device(torch.device("cuda", 0), "staged", None, "gpu")
