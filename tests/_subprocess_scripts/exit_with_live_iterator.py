"""Child process: leave the interpreter while a loader is still running.

Usage: ``python exit_with_live_iterator.py SCENARIO``; prints ``EXITING``
right before leaving, and ``LAST_HOOK_AFTER <seconds>`` from the last exit
hook (pingpong's own shutdown work lies between the two), with
``PRODUCERS_ALIVE_AT_THE_LAST_HOOK <n>`` (producer threads still alive then), and
``WARM_UP_ENDED_AFTER <seconds>`` for each kernel warm-up still running at
``EXITING`` (the interpreter waits for its step in progress; see
:mod:`pingpong.kernels._warmup`), or ``WARM_UP_UNFINISHED`` for one whose step
outlasted that wait (bounded by ``EXIT_JOIN_S``).  In ``mid-gather`` it also
prints ``GATHERS_STARTED_AFTER_EXITING <n>`` (gathers of the big table that
began after ``EXITING``) and ``GATHER_ENDED_AFTER <seconds>`` for the last
one to end, if it ended after ``EXITING``: shutdown waits for a gather in
flight, which a loaded machine makes slow.  Scenarios:

- ``stalled-source``: the producer is blocked inside a hung source;
- ``stalled-iter``: the producer is blocked inside the source's ``iter()``
  (``iter(loader)`` gave up waiting for it: ``timeout=``; tried again until a
  producer got there);
- ``stalled-fetch``: the producer is blocked inside a row source's fetch (the
  features are a row source whose second fetch never returns);
- ``waiting-for-slot``: the training loop holds a batch, the producer waits
  for a free slot;
- ``mid-gather``: big batches, so the producer is inside a parallel Numba
  gather when the main thread returns (the loader is garbage-collected then);
- ``slow-producer``: once ``EXITING`` is printed, the producer's next step of
  its own (its bookkeeping, ``LoaderStats.add``, after a fill or as it leaves)
  lasts until 1.5 s after the exit hooks began, as on a machine too busy to run
  it, while the interpreter exits with the loader alive
  (``SLOW_STEP_ENDED_AFTER <seconds>``);
- ``stuck-producer``: the same step lasts 60 s past that (the wait for it is
  bounded);
- ``stuck-producer-hook-twice``: ``stuck-producer`` with pingpong's exit hook
  registered a second time, as a DistDGL client's first epoch that takes RPC
  turns does (the bound is for both runs together);
- ``sys-exit-slow``: ``sys-exit`` with that 1.5 s step, which outlasts the
  loader's close (run as ``sys.exit`` frees the loader, before the exit hooks);
- ``fake-device``: the fake device's streams still have delayed work queued;
- ``sys-exit``: ``sys.exit(3)`` inside the training loop;
- ``exception``: an uncaught exception inside the training loop.

Except for ``mid-gather`` and the three that leave the training loop
(``sys-exit``, ``sys-exit-slow``, ``exception``), the loader and iterator are
kept in a module global, as in a script, so they are still alive when the
interpreter exits.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
from typing import Any

_marked: list[float] = []
_warm_ups_at_exit: list = []
_big_gathers: list[tuple[float, float]] = []  # (start, end) of each, monotonic
_slow_step_ends: list[float] = []  # slow-producer: when its slow step ended, monotonic
_hooks_began: list[float] = []  # when the exit hooks began, monotonic


@atexit.register  # registered first, so it runs after every other exit hook
def _report() -> None:
    if _marked:
        print(f"LAST_HOOK_AFTER {time.monotonic() - _marked[0]:.3f}", flush=True)
    alive = [t for t in threading.enumerate() if t.name.startswith("pingpong-producer")]
    print(f"PRODUCERS_ALIVE_AT_THE_LAST_HOOK {len(alive)}", flush=True)
    if _marked and _slow_step_ends:
        print(f"SLOW_STEP_ENDED_AFTER {_slow_step_ends[0] - _marked[0]:.3f}", flush=True)
    if _marked and sys.argv[1] == "mid-gather":
        after = [(start, end) for start, end in _big_gathers if end > _marked[0]]
        print(f"GATHERS_STARTED_AFTER_EXITING {sum(s > _marked[0] for s, _ in after)}",
              flush=True)
        if after:
            print(f"GATHER_ENDED_AFTER {max(e for _, e in after) - _marked[0]:.3f}",
                  flush=True)
    for warm_up in _warm_ups_at_exit:
        if warm_up.finished_at is not None:
            print(f"WARM_UP_ENDED_AFTER {warm_up.finished_at - _marked[0]:.3f}", flush=True)
        else:
            print("WARM_UP_UNFINISHED", flush=True)


def mark_exiting() -> None:
    from pingpong.kernels import _warmup

    _marked.append(time.monotonic())
    with _warmup._lock:
        _warm_ups_at_exit.extend(_warmup._running)
    print("EXITING", flush=True)


import torch  # noqa: E402 - after the hook above, on purpose

from pingpong import BatchTimeoutError, PingPongLoader  # noqa: E402
from pingpong._exit_hook import _end_all_epochs  # noqa: E402
from pingpong.devices.cpu import CPUDevice  # noqa: E402
from pingpong.devices.fake import FakeAsyncDevice  # noqa: E402
from pingpong.stats import LoaderStats  # noqa: E402

N = 20_000


def small_batches(n: int = 50) -> list:
    gen = torch.Generator().manual_seed(0)
    return [
        (
            torch.randint(0, N, (256,), generator=gen),
            torch.randint(0, N, (64,), generator=gen),
            None,
        )
        for _ in range(n)
    ]


#: Set by the stalled sources as the producer enters the call that never returns.
_entered = threading.Event()


def _hang() -> None:
    _entered.set()
    threading.Event().wait()


class Stalled:
    def __iter__(self):
        yield (torch.arange(10), torch.arange(4), None)
        _hang()


class StalledIter:
    """A source whose ``iter()`` never returns."""

    def __iter__(self) -> Any:
        _hang()


class StalledRows:
    """A row source (pingpong.rowsource) whose first fetch answers and whose later
    ones hang."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.shape = tuple(table.shape)
        self.dtype = table.dtype
        self.calls = 0

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            _hang()
        return self.table[ids]


_alive: list = []


def _time_gathers_of(row_bytes: int) -> None:
    """Record when each CPU gather of rows ``row_bytes`` wide starts and ends."""
    gather = CPUDevice.gather

    def timed(self: CPUDevice, table: Any, ids: Any, out: Any) -> None:
        if table.byte_rows.shape[1] != row_bytes:
            return gather(self, table, ids, out)
        start = time.monotonic()
        try:
            return gather(self, table, ids, out)
        finally:
            _big_gathers.append((start, time.monotonic()))

    setattr(CPUDevice, "gather", timed)  # noqa: B010 - the method, for this process


def _slow_producer_steps_once_exiting(seconds: float) -> None:
    """After ``EXITING``, the first ``LoaderStats.add`` on a producer thread lasts
    until ``seconds`` after the exit hooks began (:func:`_exit_hooks_begin`, so
    that it outlasts pingpong's join however long the interpreter took to get
    there); records when it ended."""
    add = LoaderStats.add

    def slow(self: LoaderStats, **amounts: float) -> None:
        if (_marked and not _slow_step_ends
                and threading.current_thread().name.startswith("pingpong-producer")):
            give_up = time.monotonic() + 120
            while not _hooks_began and time.monotonic() < give_up:
                time.sleep(0.01)
            time.sleep(max(0.0, (_hooks_began or [give_up])[0] + seconds - time.monotonic()))
            _slow_step_ends.append(time.monotonic())
        add(self, **amounts)

    setattr(LoaderStats, "add", slow)  # noqa: B010 - the method, for this process


def _exit_hooks_begin() -> None:
    """Registered after pingpong's exit hook (the loader's first epoch registers
    it), so it runs before: the exit hooks' start."""
    atexit.register(lambda: _hooks_began.append(time.monotonic()))


def main() -> None:
    scenario = sys.argv[1]
    features = torch.randn(N, 16)
    labels = torch.arange(N)
    if scenario == "stalled-source":
        loader = PingPongLoader(Stalled(), features, labels)
        it = iter(loader)
        next(it)
        assert _entered.wait(60)  # the producer is inside the hung source
    elif scenario == "stalled-iter":
        loader = PingPongLoader(StalledIter(), features, labels, timeout=0.5)
        for _ in range(120):  # until a producer got into iter(source) within the 0.5 s
            with contextlib.suppress(BatchTimeoutError):
                iter(loader)
            if _entered.is_set():
                break
        it = None
    elif scenario == "stalled-fetch":
        loader = PingPongLoader(small_batches(), StalledRows(features), labels)
        it = iter(loader)
        next(it)
        assert _entered.wait(60)  # the producer is inside the hung fetch
    elif scenario == "waiting-for-slot":
        loader = PingPongLoader(small_batches(), features, labels)
        it = iter(loader)
        next(it)
    elif scenario == "mid-gather":
        big = torch.randn(N, 256)
        _time_gathers_of(big.shape[1] * big.element_size())
        gen = torch.Generator().manual_seed(1)
        source = [(torch.randint(0, N, (200_000,), generator=gen), torch.arange(8), None)] * 20
        loader = PingPongLoader(source, big, labels, num_buffers=3)
        it = iter(loader)
        next(it)  # one slot held; the producer gathers the next ones now
    elif scenario in ("slow-producer", "stuck-producer", "stuck-producer-hook-twice"):
        _slow_producer_steps_once_exiting(1.5 if scenario == "slow-producer" else 60.0)
        loader = PingPongLoader(small_batches(), features, labels)
        it = iter(loader)
        next(it)
        if scenario == "stuck-producer-hook-twice":
            atexit.register(_end_all_epochs)  # as _Process.register does for DGL's hook
        _exit_hooks_begin()
    elif scenario == "fake-device":
        device = FakeAsyncDevice(seed=0, max_delay_s=0.05)
        loader = PingPongLoader(small_batches(), features, labels, device=device)
        it = iter(loader)
        for _ in range(3):
            batch = next(it)
            device.consumer_submit(batch.x.sum)
    elif scenario in ("sys-exit", "sys-exit-slow", "exception"):
        if scenario == "sys-exit-slow":  # past the loader's close, which sys.exit runs
            _slow_producer_steps_once_exiting(1.5)
        loader = PingPongLoader(small_batches(), features, labels)
        for i, _batch in enumerate(loader):
            if i == 2:
                _exit_hooks_begin()
                mark_exiting()
                if scenario in ("sys-exit", "sys-exit-slow"):
                    sys.exit(3)
                raise RuntimeError("the training loop failed")
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    if scenario != "mid-gather":
        _alive.append((loader, it))
    mark_exiting()


if __name__ == "__main__":
    main()
