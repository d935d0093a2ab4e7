"""``import pingpong`` where Numba has nowhere to keep its on-disk cache.

A read-only install whose user has no writable home (a hardened container)
leaves Numba no cache location; with ``cache=True`` it then raises at
*decoration*, so the import itself failed ("cannot cache function
'_id_bounds': no locator available"). Numba's ``NUMBA_CACHE_LOCATOR_CLASSES``
reproduces that without root: limited to the IPython-cell locator, no module
file has a location. The kernels must then compile in the process, warn once,
and gather bit for bit. Each of those cases runs in a fresh interpreter (the
decorators run once per process); the ``jit_cached`` tests at the end check the
decorator itself in process, with a stand-in for ``numba.njit``: the options it
passes, the one warning, and that other errors pass through.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pingpong.kernels import _jitcache

REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    import torch
    import pingpong
    from pingpong.sources import BuiltinLoader, CSRGraph, NeighborSampler, make_synthetic_graph

    data = make_synthetic_graph(num_nodes=2000, feat_dim=8, num_classes=4, seed=0)
    graph = CSRGraph.from_edges(data.src, data.dst, data.num_nodes)
    source = BuiltinLoader(graph, data.train_idx, NeighborSampler([3, 2]), 64)
    equal = []
    with pingpong.PingPongLoader(source, data.features, labels=data.labels) as loader:
        for batch in loader:
            equal.append(torch.equal(batch.x, data.features[batch.input_nodes])
                         and torch.equal(batch.y, data.labels[batch.output_nodes]))
    json.dump({"batches": len(equal), "all_equal": all(equal)}, sys.stdout)
""")


def run_child(no_cache_location: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_CACHE_DIR", "NUMBA_CACHE_LOCATOR_CLASSES")}
    if no_cache_location:
        env["NUMBA_CACHE_LOCATOR_CLASSES"] = "IPythonCacheLocator"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("no_cache_location", [True, False], ids=["no-location", "default"])
def test_import_and_gather_without_a_numba_cache_location(no_cache_location: bool) -> None:
    proc = run_child(no_cache_location)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["batches"] > 0
    assert report["all_equal"] is True
    warnings = [line for line in proc.stderr.splitlines()
                if line.startswith("WARNING pingpong: Numba has nowhere to cache")]
    assert len(warnings) == (1 if no_cache_location else 0), proc.stderr[-3000:]
    if no_cache_location:
        assert "NUMBA_CACHE_DIR" in warnings[0]


CUDA_CHILD = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from numba.cuda.core import caching
    caching.CacheImpl._locator_classes = []   # numba-cuda's own list: no location at all
    import pingpong.kernels.cuda as kernels
    import pingpong.kernels.cuda_cached as cached
    json.dump({"cache": [type(getattr(k, "_cache", None)).__name__ for k in
                         (kernels._gather_kernel, cached._cached_gather_kernel)]}, sys.stdout)
""")


def test_cuda_kernels_import_without_a_numba_cuda_cache_location() -> None:
    """The CUDA kernels are decorated at import too; numba-cuda keeps its own list of
    cache locations (it ignores ``NUMBA_CACHE_LOCATOR_CLASSES``), emptied here. No GPU
    is needed to decorate; the kernels then compile without a cache."""
    probe = subprocess.run(
        [sys.executable, "-c", "from numba.cuda.core import caching; "
         "caching.CacheImpl._locator_classes"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"this numba-cuda keeps its cache locations elsewhere: {probe.stderr[-300:]}")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", CUDA_CHILD], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["cache"] == ["NullCache", "NullCache"]
    assert proc.stderr.count("WARNING pingpong: Numba has nowhere to cache") == 1, proc.stderr


class FakeJit:
    """Stands in for ``numba.njit``: records each call's options; refuses ``cache=True``
    with ``error`` (None: accepts it)."""

    def __init__(self, error: RuntimeError | None) -> None:
        self.error = error
        self.calls: list[dict[str, object]] = []

    def __call__(self, **options: object) -> Any:
        self.calls.append(options)
        if options.get("cache") and self.error is not None:
            raise self.error
        return lambda func: ("compiled", func, options)


def kernel() -> None:
    """A function to decorate."""


def test_jit_cached_asks_for_the_cache_with_the_options(monkeypatch, caplog) -> None:
    """In process: where Numba can cache, one ``jit(cache=True, **options)`` and no
    warning (the subprocess test above cannot tell a cached compile from an uncached one)."""
    monkeypatch.setattr(_jitcache, "_warned", False)
    jit = FakeJit(None)
    with caplog.at_level(logging.DEBUG, logger=_jitcache.__name__):
        compiled = _jitcache.jit_cached(jit, parallel=True, nogil=True)(kernel)
    assert jit.calls == [{"cache": True, "parallel": True, "nogil": True}]
    assert compiled == ("compiled", kernel, jit.calls[0])
    assert caplog.records == []


def test_jit_cached_without_a_location_keeps_the_options_and_warns_once(monkeypatch,
                                                                       caplog) -> None:
    monkeypatch.setattr(_jitcache, "_warned", False)
    jit = FakeJit(RuntimeError("cannot cache function 'kernel': no locator available"))
    with caplog.at_level(logging.DEBUG, logger=_jitcache.__name__):
        first = _jitcache.jit_cached(jit, parallel=True, nogil=True)(kernel)
        second = _jitcache.jit_cached(jit, fastmath=True)(kernel)
    assert jit.calls == [{"cache": True, "parallel": True, "nogil": True},
                         {"parallel": True, "nogil": True},
                         {"cache": True, "fastmath": True}, {"fastmath": True}]
    assert first == ("compiled", kernel, {"parallel": True, "nogil": True})
    assert second == ("compiled", kernel, {"fastmath": True})
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.DEBUG]
    assert "kernel" in caplog.records[0].getMessage()
    assert "NUMBA_CACHE_DIR" in caplog.records[0].getMessage()


def test_jit_cached_lets_other_errors_through(monkeypatch) -> None:
    """Only Numba's "cannot cache function" is caught; any other error of the
    decoration (a typing error, say) is raised as it is, not compiled again."""
    monkeypatch.setattr(_jitcache, "_warned", False)
    jit = FakeJit(RuntimeError("something else went wrong"))
    with pytest.raises(RuntimeError, match="something else went wrong"):
        _jitcache.jit_cached(jit)(kernel)
    assert jit.calls == [{"cache": True}]
    assert _jitcache._warned is False
