"""``gather="auto"`` on CUDA and ``sort_ids``: the choices, checked on the CPU.

The choice itself is a pure function of the tables' size and the GPU's free
memory (``torch.cuda.mem_get_info`` on a real GPU; faked figures here); the
loader applies it and reports it as ``loader.gather_mode`` (a ``cuda`` test in
tests/test_cuda.py checks that on a GPU).
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
