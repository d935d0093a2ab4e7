"""``pingpong._threads``: ``join_within`` (the exit hooks' wait for a group of threads
against one deadline), the producer's exit latch, and ``current_thread_name``."""

from __future__ import annotations

import _thread
import threading
import time

from pingpong._threads import Latch, ThreadExit, current_thread_name, join_within, run_marking_exit


def _blocked(release: threading.Event) -> threading.Thread:
    thread = threading.Thread(target=release.wait, daemon=True)
    thread.start()
    return thread


def test_threads_that_end_are_joined_and_none_is_left() -> None:
    release = threading.Event()
    threads = [_blocked(release) for _ in range(3)]
    threading.Timer(0.05, release.set).start()
    assert join_within(threads, 10.0) == []
    assert not any(t.is_alive() for t in threads)


def test_the_budget_is_for_all_threads_together_and_the_stuck_ones_are_returned() -> None:
    release = threading.Event()
    stuck = [_blocked(release) for _ in range(3)]
    try:
        t0 = time.monotonic()
        left = join_within(stuck, 0.5)
        waited = time.monotonic() - t0
        assert left == stuck
        # one budget for the three: 0.5 s, not 3 x 0.5 s
        assert 0.5 <= waited < 1.4, waited
    finally:
        release.set()
    assert join_within(stuck, 10.0) == []


def test_the_calling_thread_and_threads_never_started_are_skipped() -> None:
    never_started = threading.Thread(target=lambda: None)
    t0 = time.monotonic()
    assert join_within([threading.current_thread(), never_started], 5.0) == []
    assert time.monotonic() - t0 < 1.0


def test_a_thread_exit_is_pending_from_its_start_until_its_mark() -> None:
    """Not before the thread starts (a thread never started never sets its latch,
    and a new pass must not wait for it), while it runs, and not after it marked
    its exit -- even if ``is_alive()`` were wrong (cpython#90882)."""
    release, exited = threading.Event(), Latch()
    thread = threading.Thread(target=run_marking_exit, args=(exited, release.wait, 10))
    mark = ThreadExit.of(thread, exited)
    assert not mark.pending()
    thread.start()
    assert mark.pending()
    release.set()
    thread.join(10)
    assert exited.is_set()
    assert not mark.pending()
    never_started = ThreadExit.of(threading.Thread(target=print), Latch())
    assert not never_started.pending()


def test_a_thread_whose_target_raises_still_marks_its_exit() -> None:
    """``run_marking_exit`` sets the latch however the target ends (a producer that
    raised must not leave a new pass waiting for it)."""
    exited = Latch()
    errors: list[BaseException] = []

    def boom() -> None:
        raise RuntimeError("boom")

    def run() -> None:
        try:
            run_marking_exit(exited, boom)
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert exited.is_set()
    assert [str(e) for e in errors] == ["boom"]  # and the error still propagates


def test_a_latch_wait_returns_when_another_thread_sets_it() -> None:
    """``wait`` blocks up to ``timeout`` for a set from another thread: True once
    set (well before the timeout), False when the timeout passes unset."""
    latch = Latch()
    t0 = time.monotonic()
    assert not latch.wait(0.2)
    assert time.monotonic() - t0 >= 0.15  # it waited (timer granularity aside)
    threading.Timer(0.1, latch.set).start()
    t0 = time.monotonic()
    assert latch.wait(10.0)
    assert time.monotonic() - t0 < 5.0
    assert latch.wait(0.0)  # stays set, and a second wait does not block


def test_current_thread_name_is_none_for_a_thread_threading_does_not_list() -> None:
    assert current_thread_name() == threading.current_thread().name
    seen: list[object] = []
    done = threading.Event()

    def foreign() -> None:
        seen.append(current_thread_name())
        done.set()

    _thread.start_new_thread(foreign, ())
    assert done.wait(10)
    assert seen == [None]  # current_thread() would have registered a _DummyThread
