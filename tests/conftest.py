"""Shared fixtures: leak checks and small sources for the loader tests."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
import torch

if TYPE_CHECKING:
    import pingpong
    from pingpong.kernels._warmup import WarmUpThread


def wait_until(predicate: Any, timeout: float) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds passed; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return bool(predicate())


def pingpong_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pingpong-")]


def wait_for_no_pingpong_threads(timeout: float = 3.0) -> list[threading.Thread]:
    """Wait until no pingpong thread is alive; return those still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = pingpong_threads()
        if not alive:
            return []
        time.sleep(0.01)
    return pingpong_threads()


#: How long a stopped kernel warm-up may still run: ``close()`` stops it at its next
#: step, but the step in progress -- one Numba compilation, which took over 6 s on a
#: busy 2-core CI machine (torch221 env) -- runs to its end (docs: design.rst).
WARM_UP_STEP_BOUND_S = 120.0


@pytest.fixture(autouse=True)
def no_leaked_pingpong_threads() -> Iterator[None]:
    """Every test must leave no ``pingpong-*`` thread behind (after GC): producers
    and other threads within 3 s, a stopped warm-up once its compilation in
    progress ends (within ``WARM_UP_STEP_BOUND_S``)."""
    yield
    if not pingpong_threads():
        return
    import gc

    gc.collect()  # an unreachable iterator may still hold a producer
    leaked = wait_for_no_pingpong_threads()
    still_compiling = [t for t in leaked if t.name.startswith("pingpong-warmup-")]
    assert leaked == still_compiling, f"leaked threads: {[t.name for t in leaked]}"
    for thread in still_compiling:
        thread.join(WARM_UP_STEP_BOUND_S)
    assert not any(t.is_alive() for t in still_compiling), \
        f"leaked warm-up threads: {[t.name for t in still_compiling if t.is_alive()]}"


def still_running(pid: int) -> bool:
    """Process ``pid`` exists and is not a zombie (one that exited but was not reaped
    yet holds no memory or handles, so it counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` have the same dtype and shape and the same bytes, element by
    element (NaN payloads and -0.0 included); any layout, 0-d, empty, any device."""
    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def same_bits_on_the_consumer_stream(device: Any, got: torch.Tensor,
                                     want: torch.Tensor) -> bool:
    """:func:`same_bits` run as the model would read ``got``: on the fake asynchronous
    ``device``'s consumer stream, after the batch's ready event."""
    return bool(device.consumer_submit(lambda: same_bits(got, want)).result())


def warm_up_of(loader: pingpong.PingPongLoader) -> WarmUpThread:
    """The warm-up a CPU loader's device started (it must have started one)."""
    from pingpong.devices.cpu import CPUDevice

    device = loader._device
    assert isinstance(device, CPUDevice)
    assert device.warm_up is not None
    return device.warm_up


def make_triples(
    num_rows: int,
    num_batches: int,
    *,
    seed: int = 0,
    max_inputs: int = 300,
    batch_out: int = 32,
    last_out: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, list[str]]]:
    """A list source of random ``(input_nodes, output_nodes, blocks)`` triples.

    Input sizes vary per batch (so slots must grow); ``last_out`` makes the last
    batch partial.  Blocks are a marker list so identity can be checked.
    """
    gen = torch.Generator().manual_seed(seed)
    triples = []
    for b in range(num_batches):
        n_in = int(torch.randint(1, max_inputs + 1, (1,), generator=gen))
        n_out = batch_out if (last_out is None or b < num_batches - 1) else last_out
        inputs = torch.randint(0, num_rows, (n_in,), generator=gen)
        outputs = torch.randint(0, num_rows, (n_out,), generator=gen)
        triples.append((inputs, outputs, [f"block-{b}"]))
    return triples


@pytest.fixture
def dgl():
    return pytest.importorskip("dgl")


def default_sigint() -> None:
    """``preexec_fn`` for a child that must react to Ctrl-C like one run from a terminal.

    A process started in the background by a shell without job control (``cmd &``,
    ``nohup``) inherits SIGINT *ignored*, and so would every child of a test run
    started that way: Python then installs no KeyboardInterrupt handler and a
    SIGINT does nothing. Restoring the default makes the child's Python install it.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_in_own_session(
    command: list[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> tuple[int, str, str]:
    """Run ``command``; return ``(returncode, stdout, stderr)``.

    The command runs in its own session, so that on a timeout it is killed
    together with every process it started (DDP ranks, say), and the test
    fails with its output instead of leaving them behind.
    """
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=None if env is None else dict(env), cwd=cwd,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:  # a process that left the session may still hold the pipes open
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = "", "(output lost: a process outside the session kept the pipes)"
        pytest.fail(f"{' '.join(command)} ran over {timeout} s:\n{stdout}{stderr}")
    return proc.returncode, stdout, stderr
