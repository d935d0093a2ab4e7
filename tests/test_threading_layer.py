"""Which Numba threading layer pingpong asks for (:mod:`pingpong._numba_threads`).

What it promises: when the user chose no layer, pingpong starts a thread-safe one,
``omp`` before ``tbb`` (Numba's own order is the other way round), or the order the
user gave Numba in ``NUMBA_THREADING_LAYER_PRIORITY``; ``workqueue``, with a
``RuntimeWarning``, only when neither loads.  Why omp first: a DGL ``DataLoader``
with workers forks them in ``iter()``, on pingpong's producer thread, and under TBB
every such fork printed Numba's "Attempted to fork from a non-main thread".

Each case runs in a fresh interpreter (Numba picks a layer once per process).  A
layer is kept from loading by putting ``None`` in ``sys.modules`` for its Numba
module, which is what Numba sees when the library is missing.  The TBB cases need
the ``tbb`` wheel (installed in the main tox environment); a pip-installed libtbb
is found through ``LD_LIBRARY_PATH``, which the tests set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FORK_WARNING = "Attempted to fork from a non-main thread"

RUN_A_LOADER = """
import sys
for module in sys.argv[2].split(",") if sys.argv[2] else []:
    sys.modules["numba.np.ufunc." + module] = None  # as if its library were missing
import warnings
warnings.simplefilter("error", RuntimeWarning)
sys.path.insert(0, sys.argv[1])
import numba, torch
from test_reliability import make_table, seq_triples
from pingpong import PingPongLoader, _numba_threads

if sys.argv[4]:  # the user's order, set in Numba's config in code, not the environment
    numba.config.THREADING_LAYER_PRIORITY = sys.argv[4].split()
features = make_table(300, (8,))
source = seq_triples(300, 4)
if sys.argv[3] == "dgl":  # DGL's own loader, whose workers fork in iter()
    import dgl
    graph = dgl.rand_graph(300, 3000)
    source = dgl.dataloading.DataLoader(
        graph, torch.arange(300), dgl.dataloading.NeighborSampler([4, 4]),
        batch_size=64, num_workers=2)
try:
    with PingPongLoader(source, features) as loader:
        for epoch in range(2):
            for batch in loader:
                assert torch.equal(batch.x, features[batch.input_nodes])
except RuntimeWarning as warning:
    warnings.simplefilter("ignore", RuntimeWarning)
    assert _numba_threads.must_serialise()  # pingpong's own launches take turns ...
    with _numba_threads.parallel_launch_lock():
        assert _numba_threads._launch_lock.locked()  # ... behind this lock
    print("warned", numba.config.THREADING_LAYER, warning)
    raise SystemExit(0)
assert not _numba_threads.must_serialise()  # a thread-safe layer: no turns to take
print(numba.threading_layer())
"""


def run_a_loader(*, block: tuple[str, ...] = (), source: str = "triples",
                 env: dict[str, str] | None = None,
                 config_priority: str = "") -> subprocess.CompletedProcess[str]:
    """Two epochs of a fresh interpreter's loader; stdout names the layer it ran on.
    ``config_priority``: an order the child sets in ``numba.config`` first."""
    given = env or {}
    full = {**os.environ, "DGLBACKEND": "pytorch", **given}
    for name in ("NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY"):
        if name not in given:  # the layer is pingpong's choice unless a test names one
            full.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", RUN_A_LOADER, str(Path(__file__).parent), ",".join(block), source,
         config_priority],
        env=full, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return done


def tbb_env() -> dict[str, str]:
    """The environment under which this Python's Numba loads TBB; skips without it."""
    lib = Path(sys.prefix) / "lib"
    paths = [str(lib), *filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":"))]
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join(paths), "NUMBA_THREADING_LAYER": "tbb"}
    probe = subprocess.run(
        [sys.executable, "-c",
         "import numba; numba.get_num_threads(); print(numba.threading_layer())"],
        env=env, capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != "tbb":
        pytest.skip("Numba cannot load TBB here (pip install tbb)")
    del env["NUMBA_THREADING_LAYER"]
    return env


def test_workqueue_with_a_warning_when_no_thread_safe_layer_loads():
    done = run_a_loader(block=("omppool", "tbbpool"))
    assert done.stdout.startswith("warned workqueue"), done.stdout
    assert "cannot run parallel code from two threads at once" in done.stdout


def test_tbb_is_tried_when_omp_does_not_load():
    done = run_a_loader(block=("omppool",), env=tbb_env())
    assert done.stdout.split() == ["tbb"], done.stdout


def test_omp_is_chosen_over_tbb_so_dgl_workers_fork_quietly():
    """Both load; the loader gets omp, and the DGL loader's two workers, forked on
    the producer thread in each epoch's ``iter()``, print nothing about TBB."""
    pytest.importorskip("dgl")
    done = run_a_loader(source="dgl", env=tbb_env())
    assert done.stdout.split() == ["omp"], done.stdout
    assert FORK_WARNING not in done.stderr


def test_the_users_priority_is_followed():
    done = run_a_loader(env={**tbb_env(), "NUMBA_THREADING_LAYER_PRIORITY": "tbb omp workqueue"})
    assert done.stdout.split() == ["tbb"], done.stdout


def test_an_order_set_in_numbas_config_rather_than_the_environment_is_followed():
    """``numba.config.THREADING_LAYER_PRIORITY`` set in code, where the environment
    says nothing: pingpong follows it too (the safe layers in its order)."""
    done = run_a_loader(env=tbb_env(), config_priority="tbb workqueue omp")
    assert done.stdout.split() == ["tbb"], done.stdout


def test_the_users_layer_is_kept_and_dgl_workers_forked_under_it_deliver_exact_batches():
    """Under a TBB the user chose, DGL's workers are forked on the producer thread
    (Numba's message is printed for most of those forks, not all: TBB recognises its
    starting thread by a thread id, which a later thread can reuse) and every batch
    is exact."""
    pytest.importorskip("dgl")
    done = run_a_loader(source="dgl", env={**tbb_env(), "NUMBA_THREADING_LAYER": "tbb"})
    assert done.stdout.split() == ["tbb"], done.stdout
