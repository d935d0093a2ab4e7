"""examples/_stacks.py: a process asked for its stacks answers and lives on.

The DistDGL launcher asks each server and trainer for its Python stacks before
it stops a job that overran. Handed to faulthandler, that request killed a busy
trainer with SIGSEGV (CI, DGL 2.1: its producer thread was sampling while
faulthandler read its frames without the GIL). These tests run real processes
and real signals; no DGL needed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from _stacks import ANSWERED_DIR_ENV, request_stacks  # noqa: E402

#: A process with three threads that keep calling (frames come and go all the
#: time) and a main thread in ``main_loop``; "ready" once all run.
BUSY_CHILD = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, sys.argv[1])
    import _stacks
    _stacks.answer_stack_requests()

    def churn(depth):
        return 0 if depth == 0 else 1 + churn(depth - 1)

    def spin():
        while True:
            churn(30)
            t = threading.Thread(target=churn, args=(5,))  # threads come and go too
            t.start()
            t.join()

    for i in range(3):
        threading.Thread(target=spin, name=f"spinner-{i}", daemon=True).start()

    def main_loop():
        print("ready", flush=True)  # from here on the main thread is in main_loop
        while True:
            churn(10)

    main_loop()
""")

#: A process whose main thread sits in one long C call that holds the GIL
#: (``sum`` over a range: no Python code, so no Python signal handler runs).
NATIVE_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import _stacks
    _stacks.answer_stack_requests()
    print("ready", flush=True)
    def in_native_code():
        return sum(range(10**12))
    in_native_code()
""")


def start(source: str, answered_dir: Path) -> subprocess.Popen[str]:
    """Start ``source`` with its stderr in ``answered_dir/stderr``: a file, since
    a pipe that nobody reads fills up after a few answers and blocks the writer."""
    with open(answered_dir / "stderr", "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", source, str(ROOT / "examples")],
                                stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env={**os.environ, ANSWERED_DIR_ENV: str(answered_dir)})
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n", finish(proc, answered_dir)
    return proc


def start_in_native_code(answered_dir: Path) -> subprocess.Popen[str]:
    """:func:`start` ``NATIVE_CHILD``, then wait until its main thread is inside the C
    call: between its "ready" and the call it still runs a few bytecodes, and a
    request that lands there is answered in Python (CI saw it once)."""
    proc = start(NATIVE_CHILD, answered_dir)
    time.sleep(1.0)
    return proc


def finish(proc: subprocess.Popen[str], answered_dir: Path,
           sig: int = signal.SIGTERM) -> tuple[int, str]:
    """Stop ``proc`` with ``sig``; its exit status (negative: the signal that ended
    it) and its stderr."""
    if proc.poll() is None:
        proc.send_signal(sig)
    proc.communicate(timeout=30)
    return proc.returncode, (answered_dir / "stderr").read_text(errors="replace")


def test_many_requests_to_a_busy_process_all_answered_and_it_lives(tmp_path: Path) -> None:
    """300 requests, 5 ms apart, to a process whose threads never stop calling:
    every one answered in Python (so with the GIL), the process still running."""
    proc = start(BUSY_CHILD, tmp_path)
    try:
        answers: list[str] = []
        while len(answers) < 300 and answers.count("python") == len(answers):
            answers.append(request_stacks(proc.pid, tmp_path, answer_s=10.0,
                                          alive=lambda: proc.poll() is None))
            time.sleep(0.005)
        alive = proc.poll() is None
    finally:
        returncode, stderr = finish(proc, tmp_path)
    assert alive, f"died ({returncode}) after {len(answers)} requests:\n{stderr[-3000:]}"
    assert answers == ["python"] * 300
    assert returncode == -signal.SIGTERM
    # Every answer has the main thread in main_loop and the three spinners.
    assert stderr.count("] (most recent call first):") >= 300 * 4
    assert stderr.count(" in main_loop\n") == 300
    assert stderr.count("[spinner-0] (most recent call first):") == 300
    assert " in write_stacks" not in stderr  # the handler's own frame is left out


def test_a_process_in_native_code_answers_through_faulthandler(tmp_path: Path) -> None:
    """The main thread in a long C call cannot run the Python handler: after
    ``answer_s`` the request falls back on SIGUSR2, and faulthandler shows
    where the main thread is."""
    proc = start_in_native_code(tmp_path)
    try:
        notes: list[str] = []
        answer = request_stacks(proc.pid, tmp_path, answer_s=1.0, log=notes.append)
    finally:
        _, stderr = finish(proc, tmp_path, signal.SIGKILL)
    assert answer == "faulthandler"
    assert len(notes) == 1
    assert "did not answer within 1 s" in notes[0]
    assert "(most recent call first)" in stderr
    assert " in in_native_code\n" in stderr, stderr[-3000:]


def test_a_process_gone_is_reported_gone(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    assert request_stacks(proc.pid, tmp_path, answer_s=1.0) == "gone"


@pytest.mark.parametrize("stale", [True, False])
def test_an_earlier_answer_is_not_taken_for_this_one(tmp_path: Path, stale: bool) -> None:
    """A marker left by an earlier request does not count: the process in native
    code still falls back on faulthandler."""
    proc = start_in_native_code(tmp_path)
    try:
        if stale:
            (tmp_path / str(proc.pid)).touch()
        answer = request_stacks(proc.pid, tmp_path, answer_s=0.5)
    finally:
        finish(proc, tmp_path, signal.SIGKILL)
    assert answer == "faulthandler"


def test_a_request_that_arrives_while_the_last_is_answered_leaves_the_handler_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The next request can come as soon as the answer is noted, while the handler
    is still returning (CI saw it once in 300 requests): the handler then runs
    again, nested, and the frame it interrupted is the first handler's own. The
    stacks it writes start below both handlers, at the code they interrupted."""
    import _stacks

    def user_code() -> None:
        _stacks.write_stacks(signal.SIGUSR1, sys._getframe())  # as a signal would call it

    nested: list[bool] = []
    touch = Path.touch

    def touch_then_a_second_request(path: Path, *args: object, **kwargs: object) -> None:
        touch(path)
        if not nested:  # the second request, while the first handler is in touch()
            nested.append(True)
            _stacks.write_stacks(signal.SIGUSR1, sys._getframe())

    monkeypatch.setenv(ANSWERED_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(Path, "touch", touch_then_a_second_request)
    user_code()
    written = capfd.readouterr().err
    current = [block for block in written.split("\n\n") if block.startswith("Current thread")]
    assert nested
    assert len(current) == 2  # two answers, each with this thread's stack
    for block in current:
        frames = block.splitlines()[1:]
        assert "in user_code" in frames[0], block  # where the first signal came in
        assert not any("write_stacks" in line or "touch" in line for line in frames), block
