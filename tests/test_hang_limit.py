"""The suite's limit per test: a test that hangs fails, alone, and the run goes on.

``setup.cfg`` gives every test 600 s (pytest-timeout, signal method). A hang in a
pipelined loader usually leaves the training thread waiting on a queue or a join
for a producer that never answers; without a limit, that one test would stall CI
until CI's own limit killed the whole run, with no report of which test it was.
"""
from __future__ import annotations

import sys
from pathlib import Path

from conftest import run_in_own_session

SETUP_CFG = Path(__file__).resolve().parent.parent / "setup.cfg"

# A consumer waiting for a batch that its producer, stuck on a lock, never sends;
# then a test that must still run.
HANGING_TESTS = '''
import queue
import threading

stuck = threading.Lock()
stuck.acquire()


def producer_stuck_on_a_lock(batches):
    with stuck:
        batches.put("never")


def test_waits_for_a_producer_that_never_answers():
    batches = queue.Queue()
    threading.Thread(target=producer_stuck_on_a_lock, args=(batches,),
                     name="stuck-producer", daemon=True).start()
    batches.get()


def test_after_the_hang():
    assert 1 + 1 == 2
'''


def test_the_suite_sets_a_limit_per_test(pytestconfig):
    assert float(pytestconfig.getini("timeout")) == 600
    # the signal method fails the one test; the thread method ends the whole run
    assert pytestconfig.getini("timeout_method") == "signal"


def test_a_hang_fails_that_test_with_every_threads_stack_and_the_run_goes_on(tmp_path):
    test_file = tmp_path / "test_hanging.py"
    test_file.write_text(HANGING_TESTS)
    # the suite's own configuration, with the limit shortened to 2 s
    command = [sys.executable, "-m", "pytest", "-c", str(SETUP_CFG), "--rootdir", str(tmp_path),
               "-p", "no:cacheprovider", "-q", "-o", "timeout=2", str(test_file)]
    returncode, stdout, stderr = run_in_own_session(command, timeout=120)
    assert returncode == 1, stdout + stderr
    assert "1 failed, 1 passed" in stdout, stdout + stderr
    assert "Timeout (>2.0s) from pytest-timeout" in stdout, stdout + stderr
    # the report shows where the other thread is stuck, not only the waiting test
    assert "producer_stuck_on_a_lock" in stdout, stdout + stderr
