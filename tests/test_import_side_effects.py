"""Importing and using pingpong's CUDA kernels changes no process-wide state.

- NumPy's namespace: numba-cuda <= 0.30 needs ``np.row_stack``, ``np.trapz`` & co.,
  which NumPy 2.4 removed; pingpong fills them in only while it imports numba-cuda
  and loads its NumPy registries (``pingpong.kernels._numpy_compat``), so
  ``hasattr(np, "trapz")`` must tell the truth afterwards.
- ``warnings.filters``: Numba's low-occupancy warning is switched off only around
  pingpong's own launches, never by a process-wide filter.

Each case runs in a fresh interpreter (a module imported once per process, and
filters that pytest resets between tests, would hide a change). The child sets
``NUMBA_ENABLE_CUDASIM`` itself, so every case runs in every tox env; "without
aliases" deletes the aliases this NumPy still has, as NumPy >= 2.4 does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from pingpong.kernels._numpy_compat import REMOVED_NAMES

REPO = Path(__file__).resolve().parents[1]

if importlib.util.find_spec("numba.cuda") is None:  # pragma: no cover - numba-cuda is a test dep
    pytest.skip("needs numba-cuda", allow_module_level=True)

CHILD = r"""
import json, sys, types, warnings
import numpy as np
import pingpong
from pingpong.kernels import _checks
from pingpong.kernels._numpy_compat import REMOVED_NAMES

def numpy_names():
    # Attributes, not submodules (a submodule imported later is a new attribute too).
    return {k for k, v in vars(np).items() if not isinstance(v, types.ModuleType)}

# Numba's CPU target reads np.round_ & co. under NumPy 1.x when it loads (at its
# first compile): load it before the aliases are deleted.
_checks.check_id_range(np.zeros(1, np.int64), 1)
deleted = []
if sys.argv[1] == "without-aliases":
    deleted = [name for name in REMOVED_NAMES if name in vars(np)]
    for name in deleted:
        delattr(np, name)
    np.__all__ = [name for name in np.__all__ if name not in REMOVED_NAMES]
names, filters = numpy_names(), list(warnings.filters)
report = {"deleted": deleted, "missing": [n for n in REMOVED_NAMES if not hasattr(np, n)],
          "steps": []}

def record(step):
    now = numpy_names()
    report["steps"].append({"step": step, "added": sorted(now - names),
                            "removed": sorted(names - now),
                            "filters_same": list(warnings.filters) == filters,
                            "occupancy_flags": occupancy_flags()})

def occupancy_flags():
    # Numba's low-occupancy switch, in every config module loaded (both read the
    # same environment variable, so they start equal).
    names = ("numba.core.config", "numba.cuda.core.config")
    return sorted({getattr(sys.modules[n], "CUDA_LOW_OCCUPANCY_WARNINGS", None)
                   for n in names if n in sys.modules})

import numba.core.config
flags_before = occupancy_flags()
import pingpong.kernels.cuda as kc
from numba import cuda
record("import pingpong.kernels.cuda")
report["flags_before"] = flags_before
report["simulator"] = kc.is_simulator()
rng = np.random.default_rng(0)
table = rng.integers(0, 256, size=(50, 12), dtype=np.uint8).view(np.float32)
ids = rng.integers(0, 50, size=40).astype(np.int64)
expected = table[ids]
if not kc.is_simulator():
    # What numba-cuda's first kernel compile does first: load the CUDA target's
    # registries (numba-cuda 0.30.4 reads np.row_stack there). Needs no GPU.
    from numba.cuda.descriptor import cuda_target
    cuda_target.typing_context.refresh()
    cuda_target.target_context.refresh()
    record("CUDA target registries loaded")
if kc.is_simulator() or cuda.is_available():
    out = cuda.device_array(expected.shape, expected.dtype)
    kc.gather_rows_cuda(cuda.to_device(table), cuda.to_device(ids), out)  # min/max + gather
    got = out.copy_to_host()
    report["gathered"] = got.view(np.uint8).tolist() == expected.view(np.uint8).tolist()
    record("gather")
json.dump(report, sys.stdout)
"""


def run_child(simulator: bool, numpy: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", CHILD, numpy], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("numpy", ["as-is", "without-aliases"])
@pytest.mark.parametrize("simulator", [False, True], ids=["no-simulator", "simulator"])
def test_cuda_kernels_leave_numpy_and_warning_filters_alone(simulator: bool,
                                                            numpy: str) -> None:
    report = run_child(simulator, numpy)
    assert report["simulator"] == simulator
    if numpy == "without-aliases":
        # numba-cuda imported (and, without the simulator, loaded its registries)
        # although NumPy lacks every alias it overloads.
        assert report["missing"] == list(REMOVED_NAMES)
    steps = [step["step"] for step in report["steps"]]
    assert steps[0] == "import pingpong.kernels.cuda"
    if not simulator:
        assert "CUDA target registries loaded" in steps
    else:
        assert steps[-1] == "gather"
    if "gather" in steps:
        assert report["gathered"] is True
    for step in report["steps"]:
        assert step["added"] == [], step      # no placeholder left behind
        assert step["removed"] == [], step
        assert step["filters_same"], step     # no process-wide warning filter
        assert step["occupancy_flags"] == report["flags_before"], step


def test_switched_flag_is_the_one_numbas_launch_configuration_checks() -> None:
    """numba-cuda's own launch-configuration check is silent only inside pingpong's switch.

    Ties :func:`pingpong.kernels.cuda._low_occupancy_warnings_off` to the flag the
    installed numba-cuda really reads (``_LaunchConfiguration.__init__`` in 0.30;
    needs no GPU). Where that class is absent or checks elsewhere, the
    wrapped-kernel tests in tests/test_kernels_cudasim.py still apply.
    """
    kc = pytest.importorskip("pingpong.kernels.cuda")
    if kc.is_simulator():
        pytest.skip("the simulator's launches never warn")
    dispatcher = pytest.importorskip("numba.cuda.dispatcher")
    launch_configuration = getattr(dispatcher, "_LaunchConfiguration", None)
    if launch_configuration is None:
        pytest.skip("this numba-cuda has no _LaunchConfiguration")
    flags_before = [m.CUDA_LOW_OCCUPANCY_WARNINGS for m in kc._OCCUPANCY_CONFIGS]

    def configure() -> list[str]:
        """What ``kernel[1, 32, 0]`` runs the first time it sees that shape."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            launch_configuration(kc._gather_kernel, (1, 1, 1), (32, 1, 1), 0, 0)
        return [str(w.message) for w in caught]

    outside = configure()
    if not outside:
        pytest.skip("Numba's low-occupancy warning is off in this environment")
    assert len(outside) == 1
    assert re.match(kc.LOW_OCCUPANCY_WARNING, outside[0]), outside
    with kc._low_occupancy_warnings_off():
        assert configure() == []
    assert configure() == outside
    assert [m.CUDA_LOW_OCCUPANCY_WARNINGS for m in kc._OCCUPANCY_CONFIGS] == flags_before


def test_the_switch_puts_back_the_saved_value_but_keeps_one_set_meanwhile() -> None:
    """:func:`pingpong.kernels.cuda._low_occupancy_warnings_off` puts back the value
    it found -- unless someone else set the flag while it was off: theirs is kept."""
    kc = pytest.importorskip("pingpong.kernels.cuda")
    modules = kc._OCCUPANCY_CONFIGS
    if not modules:
        pytest.skip("this Numba has no CUDA_LOW_OCCUPANCY_WARNINGS")
    before = [m.CUDA_LOW_OCCUPANCY_WARNINGS for m in modules]

    def flags() -> list[object]:
        return [m.CUDA_LOW_OCCUPANCY_WARNINGS for m in modules]

    try:
        for m in modules:
            m.CUDA_LOW_OCCUPANCY_WARNINGS = 1
        with kc._low_occupancy_warnings_off():
            assert flags() == [0] * len(modules)
        assert flags() == [1] * len(modules)
        for m in modules:
            m.CUDA_LOW_OCCUPANCY_WARNINGS = 0  # the user switched the warning off ...
        with kc._low_occupancy_warnings_off():
            for m in modules:
                m.CUDA_LOW_OCCUPANCY_WARNINGS = 1  # ... and on again during a launch
        assert flags() == [1] * len(modules)
    finally:
        for m, value in zip(modules, before, strict=True):
            m.CUDA_LOW_OCCUPANCY_WARNINGS = value
