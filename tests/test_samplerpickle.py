"""Small tensors sent by value between processes (:mod:`pingpong.samplerpickle`).

The DGL path -- the sampler processes of a DistDGL trainer -- is tested in
``test_distdgl.py`` (mode ``byvalue-samplers3``); here the reduction itself, and a
real child process that installs it and sends through a ``multiprocessing`` queue.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest
import torch
from conftest import same_bits

import pingpong
from pingpong import samplerpickle


def _tensors() -> dict[str, torch.Tensor]:
    """What the child sends: small tensors of every kind a batch holds, and others."""
    gen = torch.Generator().manual_seed(0)
    return {
        "ids": torch.randint(0, 1 << 40, (3000,), generator=gen),
        "int32": torch.randint(-100, 100, (7, 5), generator=gen, dtype=torch.int32),
        "float": torch.randn(64, 16, generator=gen),
        "bfloat16": torch.randn(9, 3, generator=gen).to(torch.bfloat16),
        "bool": torch.rand(33, generator=gen) > 0.5,
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "strided": torch.arange(40, dtype=torch.int64).reshape(8, 5).t(),  # not contiguous
        "big": torch.randn(300, 1024, generator=gen),  # 1.2 MB: over the limit
    }


def _child(queue: mp.Queue, max_bytes: int | None) -> None:
    if max_bytes is not None:
        samplerpickle.install_in_this_process(max_bytes)
    queue.put(_tensors())
    queue.get()  # the parent's "done": keep the shared segments until it has them


def _receive(max_bytes: int | None) -> dict[str, torch.Tensor]:
    ctx = mp.get_context("spawn")  # as DGL starts its sampler processes
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue, max_bytes), daemon=True)
    child.start()
    try:
        received = queue.get(timeout=120)
        queue.put("done")
    finally:
        child.join(60)
    assert child.exitcode == 0
    return received


def test_a_child_that_installed_it_sends_small_tensors_by_value_and_big_ones_shared() -> None:
    """With a limit of 16 KiB (not the default 1 MiB, so that the limit given is
    the one used): the 24 000 bytes of ``ids`` and the 1.2 MB of ``big`` go as
    shared memory, the rest by value."""
    received = _receive(1 << 14)
    sent = _tensors()
    assert received.keys() == sent.keys()
    for name, tensor in sent.items():
        assert same_bits(received[name], tensor), name
        # by value: a private copy; over the limit: torch's shared memory, as before
        assert received[name].is_shared() == (name in ("big", "ids")), name


def test_without_it_every_tensor_comes_as_shared_memory() -> None:
    """The control: what the child sends when it did not install anything."""
    received = _receive(None)
    for name, tensor in _tensors().items():
        assert same_bits(received[name], tensor), name
        if tensor.numel():  # torch sends an empty tensor without a segment
            assert received[name].is_shared(), name


@pytest.mark.parametrize("name", list(_tensors()))
def test_the_reduction_round_trips_through_pickle(name: str) -> None:
    tensor = _tensors()[name]
    reduced = samplerpickle.by_value_reduction(tensor, 1 << 20)
    if name == "big":
        assert reduced is None
        return
    assert reduced is not None
    rebuild, args = reduced
    data, dtype, shape = pickle.loads(pickle.dumps(args))
    copy = rebuild(data, dtype, shape)
    assert same_bits(copy, tensor)
    assert copy.is_contiguous()
    if data.size:  # rebuilt on the received bytes themselves, not on another copy
        assert copy.data_ptr() == data.ctypes.data


def test_what_is_left_to_torch() -> None:
    limit = 1 << 20
    reduce = samplerpickle.by_value_reduction
    assert reduce(torch.ones(4, requires_grad=True), limit) is None  # autograd
    assert reduce(torch.nn.Parameter(torch.ones(4)), limit) is None  # a subclass
    assert reduce(torch.ones(4).to_sparse(), limit) is None  # not strided
    assert reduce(torch.ones(256), 1023) is None  # 1024 bytes > 1023
    assert reduce(torch.ones(256), 1024) is not None
    complex_ = torch.tensor([1 + 2j, 3 - 1j])
    assert reduce(complex_.conj(), limit) is None  # a lazy conjugate: its bits are not its value
    assert reduce(complex_._neg_view(), limit) is None  # a lazy negation, likewise
    assert reduce(complex_, limit) is not None
    assert reduce(torch.ones(4, device="meta"), limit) is None  # not a CPU tensor


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_max_bytes_is_checked(bad: object) -> None:
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0"):
        pingpong.send_sampler_batches_by_value(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_bytes"):
        samplerpickle.install_in_this_process(bad)  # type: ignore[arg-type]
    assert samplerpickle.installed_max_bytes() is None  # nothing was installed here


def test_every_sampler_process_is_told_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """With sampler processes (a stand-in for DGL's pool): each is asked to run
    ``install_in_this_process`` with the limit given, and their number comes back."""
    pytest.importorskip("dgl")
    from dgl.distributed import dist_context

    class Pool:  # DGL's SamplerPool.submit_task_to_all_workers: each worker runs func(args)
        def __init__(self) -> None:
            self.tasks: list[tuple[object, object]] = []

        def submit_task_to_all_workers(self, func: object, args: object) -> None:
            self.tasks.append((func, args))

    pool = Pool()
    monkeypatch.setattr(dist_context, "get_sampler_pool", lambda: (pool, 3))
    assert pingpong.send_sampler_batches_by_value(4096) == 3
    assert pool.tasks == [(samplerpickle.install_in_this_process, 4096)]
    assert samplerpickle.installed_max_bytes() is None  # the trainer itself installs nothing


def test_without_sampler_processes_there_is_nothing_to_do() -> None:
    pytest.importorskip("dgl")
    assert pingpong.send_sampler_batches_by_value() == 0  # no dgl.distributed.initialize
