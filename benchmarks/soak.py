"""Reliability soak: many batches, epochs, early exits and faults on the fake device.

Runs the loader on :class:`~pingpong.devices.fake.FakeAsyncDevice` (copy and
consumer streams executed later by worker threads with seeded random delays,
released slots poisoned) with a random configuration per loader, random
early exits and injected faults, and checks every delivered batch:

- order: each batch carries its position in the epoch; a gap is *lost*, a
  repeat *duplicated*, an earlier-than-expected unseen one *reordered*;
- data: on the consumer stream, the batch is hashed on receipt, the "model"
  sleeps on the stream, and the batch is hashed again; both must equal the
  synchronous reference (else *corrupted*; differing hashes are an
  *overwrite detection*, as is a ``SlotOverwriteError`` from ``debug=True``);
- faults: a sampler exception, a bad id, or a failing gather / block
  transfer / event record is injected at a random batch; it must reach the
  training loop with the right type within 1 s;
- shutdown: time from ``break`` / ``close()`` / a surfaced error until the
  producer thread has exited.

Then three short phases: 100 create/iterate/break/close lifecycles per
device (RSS, threads, fds), a table of bad inputs (each must be refused
before any gather is enqueued), and the validation cost relative to the CPU
gather on the real Numba kernel.

Usage::

    python benchmarks/soak.py                 # full: >= 100k batches, >= 300 epochs
    python benchmarks/soak.py --quick         # CI: < 60 s
    python benchmarks/soak.py --batches 20000 --epochs 50 --seed 3 --json out.json

Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import platform
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import psutil
import torch
from _common import positive_int

import pingpong
from pingpong import Batch, PingPongLoader
from pingpong.devices.fake import FakeAsyncDevice, tensor_digest
from pingpong.errors import EpochSupersededError, SlotOverwriteError

NUM_ROWS = 5000
ROW_WIDTH = 16
POOL = 512  # distinct batches; epochs draw from them


# --------------------------------------------------------------------------- data
digest = tensor_digest  # the shared batch hash


def batch_digests(batch: Batch) -> tuple[bytes, bytes]:
    """Digests of a batch's features and labels (on the fake device: when it runs them).
    The soak's tables are single tensors, never dicts."""
    return digest(cast(torch.Tensor, batch.x)), digest(cast("torch.Tensor | None", batch.y))


def make_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[Any, Any]], list[Any]]:
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(NUM_ROWS, ROW_WIDTH, generator=gen)
    labels = torch.randint(0, 40, (NUM_ROWS,), generator=gen)
    pool = []
    for i in range(POOL):
        n_in = int(torch.randint(0 if i % 97 == 0 else 1, 65, (1,), generator=gen))
        n_out = int(torch.randint(1, 17, (1,), generator=gen))
        pool.append(
            (
                torch.randint(0, NUM_ROWS, (n_in,), generator=gen),
                torch.randint(0, NUM_ROWS, (n_out,), generator=gen),
            )
        )
    want = [(digest(features[i]), digest(labels[o])) for i, o in pool]
    return features, labels, pool, want


class InjectedSamplerError(Exception):
    """The source failed (custom type, non-message constructor)."""

    def __init__(self, position: int) -> None:
        super().__init__(f"sampler failed at {position}")
        self.position = position


class InjectedDeviceError(Exception):
    """A device call failed in the producer (gather, block transfer, record)."""


class ModelError(Exception):
    """The training loop failed."""


@dataclass
class Plan:
    """What one epoch does."""

    length: int
    fault: str | None = None  # sampler | validation | gather | move_graphs | record | consumer
    fault_at: int = -1
    exit: str | None = None  # break | break-held | iterator-close | loader-close
    exit_at: int = -1


class EpochSource:
    """Re-iterable: each pass yields the next plan's items (positions as ``seq``)."""

    def __init__(self, pool: list[Any], seed: int) -> None:
        self.pool = pool
        self.rng = random.Random(seed)
        self.plans: list[Plan] = []
        self.passes = 0
        self.delay_s = 0.0
        self.fault_time: float | None = None
        self.raised: BaseException | None = None
        self.device: FakeAsyncDevice | None = None

    def __iter__(self):
        plan = self.plans[self.passes]
        self.passes += 1
        if self.device is not None:
            # Armed here, in the new producer thread before its first fill: the
            # previous epoch's producer has exited (a parked one could otherwise
            # still make one more device call and shift the count).
            self.device.clear_faults()
            self.device.fault_times.clear()
            if plan.fault in ("gather", "move_graphs", "record"):
                per_batch = 2 if plan.fault == "gather" else 1
                self.device.inject_fault(
                    plan.fault, plan.fault_at * per_batch + 1, lambda: InjectedDeviceError()
                )
        order = [self.rng.randrange(len(self.pool)) for _ in range(plan.length)]
        rng = random.Random(self.rng.random())
        return self._run(plan, order, rng)

    def _run(self, plan: Plan, order: list[int], rng: random.Random):
        for position, index in enumerate(order):
            if self.delay_s and rng.random() < 0.3:
                time.sleep(rng.random() * self.delay_s)
            inputs, outputs = self.pool[index]
            if plan.fault == "sampler" and position == plan.fault_at:
                self.fault_time = time.monotonic()
                self.raised = InjectedSamplerError(position)
                raise self.raised
            if plan.fault == "validation" and position == plan.fault_at:
                self.fault_time = time.monotonic()
                inputs = torch.tensor([0, NUM_ROWS + position])
            yield inputs, outputs, {"seq": position, "item": index}


# --------------------------------------------------------------------------- results
@dataclass
class Tally:
    batches_checked: int = 0
    epochs: int = 0
    loaders: int = 0
    lost: int = 0
    duplicated: int = 0
    reordered: int = 0
    corrupted: int = 0
    overwrite_detections: int = 0
    faults_injected: int = 0
    faults_surfaced_ok: int = 0
    fault_latency_s: list[float] = field(default_factory=list)
    fault_failures: list[str] = field(default_factory=list)
    consumer_faults: int = 0
    shutdown_s: dict[str, list[float]] = field(default_factory=dict)
    close_call_s: list[float] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def shutdown(self, kind: str, seconds: float) -> None:
        self.shutdown_s.setdefault(kind, []).append(seconds)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)  # nearest rank: the smallest value >= q % of them
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pingpong-producer")]


def wait_dead(threads: list[threading.Thread], timeout: float = 5.0) -> float:
    """Seconds until all ``threads`` exited (``timeout`` if they did not)."""
    start = time.monotonic()
    for thread in threads:
        thread.join(max(0.0, timeout - (time.monotonic() - start)))
    return time.monotonic() - start


# --------------------------------------------------------------------------- main soak
FAULT_WEIGHTS = [
    (None, 0.62),
    ("sampler", 0.08),
    ("validation", 0.06),
    ("gather", 0.06),
    ("move_graphs", 0.04),
    ("record", 0.04),
    ("consumer", 0.10),
]
EXITS = [None] * 6 + ["break", "break-held", "iterator-close", "loader-close"]


def make_plan(rng: random.Random, length: int) -> Plan:
    faults, weights = zip(*FAULT_WEIGHTS, strict=True)
    plan = Plan(length=length, fault=rng.choices(faults, weights)[0])
    if plan.fault is not None:
        plan.fault_at = rng.randrange(length)
    plan.exit = rng.choice(EXITS)
    if plan.exit is not None:
        plan.exit_at = rng.randrange(length)
    return plan


def new_loader(
    rng: random.Random, source: EpochSource, features: torch.Tensor, labels: torch.Tensor
) -> tuple[PingPongLoader, FakeAsyncDevice]:
    device = FakeAsyncDevice(
        seed=rng.randrange(2**31),
        max_delay_s=rng.choice([0.0, 0.0002, 0.001]),
        consumer_max_delay_s=rng.choice([0.0, 0.0002, 0.001]),
        host_jitter_s=rng.choice([0.0, 0.0, 0.0001, 0.0005]),
    )
    source.delay_s = rng.choice([0.0, 0.0, 0.0005, 0.002])
    loader = PingPongLoader(
        source,
        features,
        labels,
        device=device,
        num_buffers=rng.choice([2, 2, 3, 4]),
        timeout=30,
        debug=True,
    )
    return loader, device


@dataclass
class Held:
    """An iterator left referenced after ``break``: the next ``iter()``/``close()`` ends it."""

    iterator: Any
    producer: threading.Thread


def run_epoch(
    loader: PingPongLoader,
    device: FakeAsyncDevice,
    source: EpochSource,
    plan: Plan,
    want: list[Any],
    tally: Tally,
    rng: random.Random,
    held: Held | None,
) -> tuple[bool, Held | None]:
    """One epoch.  Returns (loader still open, iterator left held)."""
    source.fault_time = None
    source.raised = None
    source.device = device  # device faults are armed when the pass begins
    model_sleep = rng.choice([0.0, 0.0, 0.0002, 0.001])
    futures: list[tuple[int, Any, Any]] = []
    seen: set[int] = set()
    expected = 0
    start = time.monotonic()
    it = iter(loader)
    if held is not None:  # iter() had to stop the previous, still referenced, epoch
        tally.shutdown("break-held (next iter)", start_to_dead(start, held.producer))
        try:
            next(held.iterator)
            tally.unexpected.append("a superseded iterator yielded a batch")
        except EpochSupersededError:
            pass
    producer = loader._core.epoch.thread  # type: ignore[union-attr]
    tally.epochs += 1
    caught: BaseException | None = None
    caught_at = 0.0
    open_loader, left_held = True, None
    try:
        for batch in it:
            seq = batch.blocks["seq"]
            if seq in seen:
                tally.duplicated += 1
            elif seq > expected:
                tally.lost += seq - expected
            elif seq < expected:
                tally.reordered += 1
            seen.add(seq)
            expected = max(expected, seq + 1)
            item = batch.blocks["item"]
            first = device.consumer_submit(functools.partial(batch_digests, batch))
            if model_sleep:
                device.consumer_submit(lambda: time.sleep(model_sleep))
            second = device.consumer_submit(functools.partial(batch_digests, batch))
            futures.append((item, first, second))
            if plan.fault == "consumer" and seq == plan.fault_at:
                tally.consumer_faults += 1
                raise ModelError(seq)
            if plan.exit is not None and seq == plan.exit_at:
                start = time.monotonic()
                if plan.exit == "break":
                    pass  # measured below, once the loop let go of the iterator
                elif plan.exit == "break-held":
                    left_held = Held(it, producer)
                elif plan.exit == "iterator-close":
                    it.close()
                    tally.shutdown("iterator-close", start_to_dead(start, producer))
                else:
                    watch = DeathWatch(producer)
                    start = time.monotonic()
                    loader.close()
                    tally.close_call_s.append(time.monotonic() - start)
                    tally.shutdown("loader-close", watch.seconds_since(start))
                    open_loader = False
                break
        else:
            if expected != plan.length:
                tally.lost += plan.length - expected
        if plan.exit == "break" and plan.exit_at < expected:
            start = time.monotonic()
            del it
            tally.shutdown("break", start_to_dead(start, producer))
    except SlotOverwriteError:
        tally.overwrite_detections += 1
    except ModelError:
        start = time.monotonic()
        it = None  # type: ignore[assignment]  # what leaving a `for` loop by an exception does
        tally.shutdown("consumer-error", start_to_dead(start, producer))
    except BaseException as exc:  # noqa: BLE001 - classified below
        caught, caught_at = exc, time.monotonic()
    check_fault(plan, source, device, caught, caught_at, producer, expected, tally)
    # verify the data once the consumer stream ran it
    for item, first, second in futures:
        a, b = first.result(), second.result()
        tally.batches_checked += 1
        tally.corrupted += int(a != want[item] or b != want[item])
        tally.overwrite_detections += int(a != b)
        if a != want[item] or b != want[item]:
            tally.unexpected.append(
                f"corrupt batch (item {item}, plan {plan}, first ok {a == want[item]}, "
                f"second ok {b == want[item]}, x ok {a[0] == want[item][0]})"
            )
    return open_loader, left_held


def start_to_dead(start: float, producer: threading.Thread) -> float:
    producer.join(5.0)
    return time.monotonic() - start


class DeathWatch:
    """Records when a thread exits, while the caller does something else (e.g.
    ``loader.close()``, which also drains the fake device's queued work)."""

    def __init__(self, thread: threading.Thread) -> None:
        self.died_at: float | None = None
        self._watcher = threading.Thread(
            target=self._run, args=(thread,), name="soak-deathwatch", daemon=True
        )
        self._watcher.start()

    def _run(self, thread: threading.Thread) -> None:
        thread.join()
        self.died_at = time.monotonic()

    def seconds_since(self, start: float, timeout: float = 5.0) -> float:
        self._watcher.join(timeout)
        return (self.died_at if self.died_at is not None else time.monotonic()) - start


def check_fault(
    plan: Plan,
    source: EpochSource,
    device: FakeAsyncDevice,
    caught: BaseException | None,
    caught_at: float,
    producer: threading.Thread,
    delivered: int,
    tally: Tally,
) -> None:
    expected_type: type[BaseException] | None = {
        "sampler": InjectedSamplerError,
        "validation": pingpong.IdRangeError,
        "gather": InjectedDeviceError,
        "move_graphs": InjectedDeviceError,
        "record": InjectedDeviceError,
    }.get(plan.fault or "")
    fault_time = source.fault_time
    if plan.fault in ("gather", "move_graphs", "record"):
        fault_time = device.fault_times.pop() if device.fault_times else None
    # The fault is due in the training loop unless it left the epoch earlier (an
    # early exit before the faulty batch; the producer may have hit it already).
    due = expected_type is not None and (plan.exit is None or plan.exit_at >= plan.fault_at)
    if not due:
        if caught is not None:
            tally.unexpected.append(f"{type(caught).__name__}: {caught}")
        return
    assert expected_type is not None
    if fault_time is None:
        tally.fault_failures.append(f"{plan.fault}: injected fault never fired")
        return
    if delivered != plan.fault_at:
        tally.unexpected.append(f"{plan.fault} at {plan.fault_at}: {delivered} delivered")
    tally.faults_injected += 1
    if caught is None:
        tally.fault_failures.append(f"{plan.fault}: never surfaced")
        return
    latency = caught_at - fault_time
    tally.fault_latency_s.append(latency)
    same_object = source.raised is None or caught is source.raised
    if isinstance(caught, expected_type) and same_object and latency < 1.0:
        tally.faults_surfaced_ok += 1
    else:
        tally.fault_failures.append(
            f"{plan.fault}: got {type(caught).__name__} after {latency:.3f}s"
        )
    tally.shutdown("error", time.monotonic() - caught_at + wait_dead([producer]))


def main_soak(args: argparse.Namespace, tally: Tally) -> dict[str, Any]:
    rng = random.Random(args.seed)
    features, labels, pool, want = make_data(args.seed)
    length = max(4, args.batches // args.epochs)
    source = EpochSource(pool, args.seed)
    start = time.monotonic()
    loader: PingPongLoader | None = None
    device: FakeAsyncDevice | None = None
    epochs_this_loader = 0
    held: Held | None = None
    while tally.batches_checked < args.batches or tally.epochs < args.epochs:
        if loader is None or epochs_this_loader >= rng.randint(1, 4):
            if loader is not None:
                watch = DeathWatch(held.producer) if held is not None else None
                t_close = time.monotonic()
                loader.close()
                tally.close_call_s.append(time.monotonic() - t_close)
                if watch is not None:
                    tally.shutdown("break-held (close)", watch.seconds_since(t_close))
                held = None
            loader, device = new_loader(rng, source, features, labels)
            tally.loaders += 1
            epochs_this_loader = 0
        assert device is not None
        plan = make_plan(rng, rng.randint(max(2, length // 2), length * 3 // 2))
        source.plans.append(plan)
        still_open, held = run_epoch(loader, device, source, plan, want, tally, rng, held)
        epochs_this_loader += 1
        if not still_open:
            loader, held = None, None
        if args.progress and tally.epochs % 10 == 0:
            rate = tally.batches_checked / (time.monotonic() - start)
            print(f"  epoch {tally.epochs}: {tally.batches_checked} batches ({rate:.0f}/s)")
    if loader is not None:
        loader.close()
    return {"wall_s": time.monotonic() - start}


# --------------------------------------------------------------------------- lifecycles
def lifecycle_phase(cycles: int) -> dict[str, Any]:
    process = psutil.Process()
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(2000, 32, generator=gen)
    triples = [
        (torch.randint(0, 2000, (256,), generator=gen), torch.arange(8), None) for _ in range(6)
    ]

    def cycle(kind: str, i: int) -> None:
        device = FakeAsyncDevice(seed=i, max_delay_s=0.0005) if kind == "fake" else "cpu"
        loader = PingPongLoader(triples, features, device=device)
        for j, _ in enumerate(loader):
            if j == 2:
                break
        loader.close()

    out: dict[str, Any] = {}
    for kind in ("cpu", "fake"):
        for i in range(10):
            cycle(kind, i)
        gc.collect()
        time.sleep(0.1)
        rss0, fds0, threads0 = (
            process.memory_info().rss,
            process.num_fds(),
            threading.active_count(),
        )
        start = time.monotonic()
        for i in range(cycles):
            cycle(kind, i)
        gc.collect()
        time.sleep(0.1)
        out[kind] = {
            "cycles": cycles,
            "rss_growth_mb": (process.memory_info().rss - rss0) / 2**20,
            "fd_delta": process.num_fds() - fds0,
            "thread_delta": threading.active_count() - threads0,
            "seconds": time.monotonic() - start,
        }
    return out


# --------------------------------------------------------------------------- bad inputs
def bad_input_phase() -> dict[str, Any]:
    n = 100
    features, labels = torch.randn(n, 4), torch.arange(n)
    bad_ids: list[tuple[str, Any]] = [
        ("-1", torch.tensor([0, -1])),
        ("N", torch.tensor([n])),
        ("2**31", torch.tensor([2**31])),
        ("int64 min", torch.tensor([torch.iinfo(torch.int64).min])),
        ("int64 max", torch.tensor([torch.iinfo(torch.int64).max])),
        ("int32 min", torch.tensor([-(2**31)], dtype=torch.int32)),
        ("float32", torch.tensor([0.0, 1.0])),
        ("float64 numpy", np.array([1.0])),
        ("uint8", torch.tensor([1], dtype=torch.uint8)),
        ("uint32 numpy", np.array([1], dtype=np.uint32)),
        ("uint64 numpy", np.array([1], dtype=np.uint64)),
        ("int16", torch.tensor([1], dtype=torch.int16)),
        ("bool", torch.tensor([True])),
        ("2-D", torch.zeros(2, 2, dtype=torch.int64)),
        ("0-D", torch.tensor(1)),
        ("list", [1, 2]),
        ("None", None),
        ("object array", np.array([1, None], dtype=object)),
    ]
    results = []
    for name, ids in bad_ids:
        good = (torch.arange(10), torch.arange(5), None)
        source = [good, good, (ids, torch.arange(5), None)]
        device = FakeAsyncDevice(seed=0, max_delay_s=0.0005)
        ok, detail = False, ""
        with PingPongLoader(source, features, labels, device=device) as loader:
            try:
                list(loader)
                detail = "accepted"
            except (IndexError, TypeError, ValueError) as exc:
                gathers = device.calls["gather"]
                ok = gathers == 2 * 2 and "input_nodes" in str(exc)
                detail = f"{type(exc).__name__}, gathers enqueued: {gathers}"
            except Exception as exc:  # noqa: BLE001 - a wrong type is a failure
                detail = f"wrong type {type(exc).__name__}"
        results.append({"input": f"ids {name}", "refused_before_read": ok, "detail": detail})
    bad_tables: list[tuple[str, Any, Any]] = [
        ("non-contiguous", torch.randn(n, 4).t(), None),
        ("empty rows", torch.randn(0, 4), None),
        ("empty width", torch.randn(n, 0), None),
        ("0-D", torch.tensor(1.0), None),
        ("mismatched labels", torch.randn(n, 4), torch.arange(n + 1)),
        ("strided labels", torch.randn(n, 4), torch.arange(2 * n)[::2]),
        ("meta device", torch.empty(n, 4, device="meta"), None),
        ("sparse", torch.randn(n, 4).to_sparse(), None),
    ]
    for name, table, table_labels in bad_tables:
        try:
            PingPongLoader([(torch.arange(3), torch.arange(3), None)], table, table_labels).close()
            ok, detail = False, "accepted"
        except pingpong.TableError as exc:
            ok, detail = True, str(exc)[:60]
        results.append({"input": f"table {name}", "refused_before_read": ok, "detail": detail})
    refused = sum(1 for r in results if r["refused_before_read"])
    return {"cases": results, "refused_pct": 100.0 * refused / len(results)}


# --------------------------------------------------------------------------- validation cost
def validation_phase(quick: bool) -> dict[str, Any]:
    """``validate_s / gather_s`` from the loader's stats, on the CPU device."""
    out = {}
    gen = torch.Generator().manual_seed(1)
    rows = 20_000 if quick else 100_000
    table = torch.randn(rows, 128, generator=gen)
    for batch_ids in (1_000, 20_000):
        triples = [
            (torch.randint(0, rows, (batch_ids,), generator=gen), torch.arange(4), None)
            for _ in range(20)
        ]
        with PingPongLoader(triples, table) as loader:
            for _ in loader:  # warm up
                pass
            loader.reset_stats()
            for _ in range(2 if quick else 5):
                for _ in loader:
                    pass
            stats = loader.stats
        out[f"{batch_ids}_ids"] = {
            "table": f"{rows} x 128 float32",
            "validate_s": stats["validate_s"],
            "gather_s": stats["gather_s"],
            "overhead_pct": 100.0 * stats["validate_s"] / stats["gather_s"],
        }
    return out


# --------------------------------------------------------------------------- driver
def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "logical_cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pingpong": pingpong.__version__,
        "load_average_start": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=positive_int, default=100_000,
                        help="batches to check (min)")
    parser.add_argument("--epochs", type=positive_int, default=300, help="epochs (min)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a short run for CI (< 60 s)")
    parser.add_argument("--cycles", type=positive_int, default=100,
                        help="lifecycles per device")
    parser.add_argument("--json", type=Path, default=Path("results/soak.json"))
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    if args.json.is_dir():  # refused now, not after the soak
        parser.error(f"--json {args.json}: is a folder; give a file name")
    if args.quick:
        args.batches = min(args.batches, 4_000)
        args.epochs = min(args.epochs, 50)
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine(),
    }
    t0 = time.monotonic()
    threads0 = threading.active_count()
    fds0 = psutil.Process().num_fds()
    tally = Tally()
    report["soak"] = main_soak(args, tally)
    gc.collect()
    time.sleep(0.2)
    report["lifecycles"] = lifecycle_phase(args.cycles)
    report["bad_inputs"] = bad_input_phase()
    report["validation_overhead"] = validation_phase(args.quick)
    gc.collect()
    time.sleep(0.2)
    shutdown_all = [s for values in tally.shutdown_s.values() for s in values]
    report["results"] = {
        "batches_checked": tally.batches_checked,
        "epochs": tally.epochs,
        "loaders": tally.loaders,
        "lost": tally.lost,
        "duplicated": tally.duplicated,
        "reordered": tally.reordered,
        "corrupted": tally.corrupted,
        "overwrite_detections": tally.overwrite_detections,
        "faults_injected": tally.faults_injected,
        # None: no fault was injected (a short run with an unlucky seed), so
        # nothing to judge -- not a failure
        "faults_surfaced_ok_pct": (
            100.0 * tally.faults_surfaced_ok / tally.faults_injected
            if tally.faults_injected
            else None
        ),
        "fault_latency_p50_s": percentile(tally.fault_latency_s, 50),
        "fault_latency_max_s": max(tally.fault_latency_s, default=float("nan")),
        "fault_failures": tally.fault_failures,
        "consumer_faults": tally.consumer_faults,
        "shutdown_p99_s": percentile(shutdown_all, 99),
        "shutdown_max_s": max(shutdown_all, default=float("nan")),
        "loader_close_call_p99_s": percentile(tally.close_call_s, 99),
        "loader_close_call_max_s": max(tally.close_call_s, default=float("nan")),
        "shutdown_by_kind": {
            kind: {"n": len(v), "p50_s": percentile(v, 50), "p99_s": percentile(v, 99)}
            for kind, v in sorted(tally.shutdown_s.items())
            if kind != "break-held"
        },
        "unexpected_errors": tally.unexpected,
        "rss_growth_mb_100_lifecycles": {
            k: v["rss_growth_mb"] for k, v in report["lifecycles"].items()
        },
        "thread_delta": threading.active_count() - threads0,
        "fd_delta": psutil.Process().num_fds() - fds0,
        "bad_inputs_refused_before_read_pct": report["bad_inputs"]["refused_pct"],
        "validation_overhead_pct_of_gather": {
            k: v["overhead_pct"] for k, v in report["validation_overhead"].items()
        },
    }
    report["total_wall_s"] = time.monotonic() - t0
    report["machine"]["load_average_end"] = os.getloadavg()
    res = report["results"]
    passed = (
        res["lost"] == res["duplicated"] == res["reordered"] == res["corrupted"] == 0
        and res["overwrite_detections"] == 0
        and res["faults_surfaced_ok_pct"] in (None, 100.0)
        and not res["unexpected_errors"]
        and res["shutdown_max_s"] < 2.0
        and all(v < 5.0 for v in res["rss_growth_mb_100_lifecycles"].values())
        and all(
            v["fd_delta"] == 0 and v["thread_delta"] == 0 for v in report["lifecycles"].values()
        )
        and res["thread_delta"] == 0
        and res["bad_inputs_refused_before_read_pct"] == 100.0
    )
    report["passed"] = passed
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(res, indent=2, default=str))
    if res["faults_surfaced_ok_pct"] is None:
        print("no fault was injected in this run: fault surfacing not tested "
              "(more batches or another --seed)")
    print(
        f"total {report['total_wall_s']:.1f} s; {'PASSED' if passed else 'FAILED'}; "
        f"JSON: {args.json}"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
