"""Bad input is refused with a clear exception; failures cross threads intact."""

from __future__ import annotations

import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import make_triples, wait_until
from test_reliability_lifecycle import producer_threads

import pingpong
from pingpong import PingPongLoader
from pingpong._epoch_states import EpochState

N = 100


def _loader_with(bad_inputs: object, labels: bool = True) -> tuple[PingPongLoader, torch.Tensor]:
    features = torch.randn(N, 4)
    good = (torch.arange(10), torch.arange(5), None)
    bad = (bad_inputs, torch.arange(5), None)
    source = [good, bad, good]
    return PingPongLoader(source, features, torch.arange(N) if labels else None), features


@pytest.mark.parametrize(
    ("ids", "exc", "needle"),
    [
        (torch.tensor([0, -1]), IndexError, "= -1"),
        (torch.tensor([N]), IndexError, f"= {N}"),
        (torch.tensor([2**31]), IndexError, str(2**31)),
        (torch.tensor([torch.iinfo(torch.int64).min]), IndexError, str(np.iinfo(np.int64).min)),
        (torch.tensor([torch.iinfo(torch.int64).max]), IndexError, str(np.iinfo(np.int64).max)),
        (torch.tensor([0.0, 1.0]), TypeError, "float32"),
        (torch.tensor([1, 2], dtype=torch.uint8), TypeError, "uint8"),
        (np.array([1, 2], dtype=np.uint32), TypeError, "uint32"),
        (torch.tensor([True]), TypeError, "bool"),
        (torch.zeros(2, 2, dtype=torch.int64), TypeError, "1-D"),
        ([1, 2, 3], TypeError, "list"),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_bad_input_ids_are_refused_and_next_epoch_works(ids, exc, needle):
    loader, features = _loader_with(ids)
    with loader:
        it = iter(loader)
        first = next(it)
        assert torch.equal(first.x, features[:10])
        with pytest.raises(exc, match="input_nodes") as info:
            next(it)
        assert needle in str(info.value)
        if exc is IndexError:
            assert f"N = {N}" in str(info.value)
            assert isinstance(info.value, pingpong.IdRangeError)
        elif needle == "1-D":  # a shape problem: also a ValueError, as errors.py says
            assert isinstance(info.value, pingpong.IdShapeError)
            assert isinstance(info.value, ValueError)
        elif needle != "list":  # a list is no ids at all: a BatchFormError
            assert isinstance(info.value, pingpong.IdTypeError)
        # the epoch ended, and a next() that carries on says so (not StopIteration,
        # which would end a loop that caught the error short without a word)
        failure = rf"failed after 1 batches \({type(info.value).__name__}: "
        with pytest.raises(pingpong.EpochFailedError, match=failure) as again_info:
            next(it)
        assert needle in str(again_info.value)
        assert it.state is EpochState.FAILED
        # the next epoch works up to the bad batch again
        again = iter(loader)
        assert torch.equal(next(again).x, features[:10])


def test_bad_output_ids_checked_only_with_labels():
    features = torch.randn(N, 4)
    source = [(torch.arange(3), torch.tensor([N + 5]), None)]
    with PingPongLoader(source, features, torch.arange(N)) as loader:
        with pytest.raises(IndexError, match=r"output_nodes\[0\] = 105"):
            list(loader)
    with PingPongLoader(source, features) as loader:  # no labels: output ids unused
        assert len(list(loader)) == 1


def test_bad_id_never_reaches_the_slot():
    """Nothing is written for a bad batch: with two slots, bad batch 2 would land
    in batch 0's slot (handed back when batch 1 was asked for), whose rows the
    test kept a view of -- they must still be batch 0's."""
    features = torch.arange(N * 2, dtype=torch.float32).reshape(N, 2)
    source = [
        (torch.arange(50, 58), torch.arange(1), None),
        (torch.arange(60, 68), torch.arange(1), None),
        (torch.tensor([1, 2, N]), torch.arange(1), None),
    ]
    with PingPongLoader(source, features, num_buffers=2) as loader:
        it = iter(loader)
        slot_a = next(it).x  # a view of slot A
        slot_b = next(it).x  # slot A is free again: the producer may fill it now
        with pytest.raises(IndexError):
            next(it)
        assert torch.equal(slot_a, features[50:58])
        assert torch.equal(slot_b, features[60:68])


def _wait_until_the_producer_waits_for_a_slot() -> None:
    """Until a pingpong producer thread is inside ``_take_free_slot``: its batch
    is sampled and its ids checked, and only the gather is still to come."""
    def waiting() -> bool:
        for thread in producer_threads():
            frame = sys._current_frames().get(thread.ident or 0)
            while frame is not None:
                if frame.f_code.co_name == "_take_free_slot":
                    return True
                frame = frame.f_back
        return False

    assert wait_until(waiting, 30.0), "the producer never waited for a slot"


def test_ids_written_after_their_check_are_not_what_is_gathered():
    """From a code review: a batch's ids were checked when it was sampled but read
    again from the source's own tensor when gathered, after waiting for a slot.
    A source that yields one id tensor again and a loop that edits
    ``batch.input_nodes`` in place then reached the kernels, which do not check
    again, with ids never checked (out of range: garbage rows, or a segfault).
    Now each batch is gathered at a private copy of the ids that were checked."""
    features = torch.arange(1000 * 4, dtype=torch.float32).reshape(1000, 4)
    ids = torch.arange(512)
    source = [(ids, ids[:1], None)] * 4
    with PingPongLoader(source, features, num_buffers=2) as loader:
        it = iter(loader)
        first = next(it)
        assert torch.equal(first.x, features[:512])
        # batch 1 waits in the ready queue, batch 2 (ids 0..511, checked) for a slot
        _wait_until_the_producer_waits_for_a_slot()
        first.input_nodes.add_(400)  # the loop edits the ids it was given: 400..911
        assert torch.equal(next(it).x, features[:512])
        assert torch.equal(next(it).x, features[:512])  # gathered at the ids as checked
        assert torch.equal(next(it).x, features[400:912])  # sampled after the edit


class NumpyTyped:
    """An array-like of another library (h5py, zarr, a SciPy sparse matrix): shape,
    a NumPy dtype and ``[ids]``."""

    shape = (N, 4)
    dtype = np.dtype("float32")

    def __getitem__(self, ids: Any) -> np.ndarray:
        return np.zeros((len(ids), 4), dtype=np.float32)


@pytest.mark.parametrize(
    ("features", "labels", "needle"),
    [
        (NumpyTyped(), None, r"features is a test_errors.NumpyTyped, neither a torch tensor "
                             r"nor a NumPy array.*dtype\('float32'\).*np.asarray"),
        (torch.nn.Parameter(torch.randn(N, 4)), None, r"features requires grad.*detach\(\)"),
        (torch.randn(N, 4), torch.randn(N).requires_grad_(), "labels requires grad"),
        (torch.tensor(3.0), None, "0-D"),
        (torch.randn(N, 4).t(), None, "not contiguous"),
        (torch.randn(0, 4), None, "empty"),
        (torch.randn(N, 0), None, "empty"),
        ("not a tensor", None, "torch.Tensor"),
        (SimpleNamespace(shape=(N, 4)), None, "must be a torch.Tensor, got SimpleNamespace"),
        ({}, None, "empty dict"),
        ({"a": torch.randn(N, 2), "b": torch.randn(N + 1, 2)}, None, "different numbers"),
        ({1: torch.randn(N, 2)}, None, "keys must be str"),
        (torch.randn(N, 4), torch.arange(N + 1), "labels has 101 rows"),
        (torch.randn(N, 4), torch.arange(N)[::2], "labels is not contiguous"),
        (torch.randn(N, 4), torch.arange(N - 1), "labels has 99 rows"),
        (torch.randn(N, 4).to_sparse(), None, "dense"),
        (torch.randn(N, 2, dtype=torch.complex64).conj(), None, "lazily conjugated"),
        (torch._neg_view(torch.randn(N, 2)), None, "lazily conjugated or negated"),
        (np.zeros((N, 2), dtype=">f4"), None, "cannot read a NumPy array of dtype '>f4'"),
        (np.array([[object()]] * N), None, "cannot read a NumPy array of dtype '|O'"),
        (np.ma.masked_less(np.arange(N * 2.0).reshape(N, 2), 4), None, "masked array"),
        (np.ma.masked_array(np.ones((N, 2), "f4")), None, "masked array"),  # no entry masked
        (torch.randn(N, 4), np.ma.masked_array(np.arange(N)), "labels is a NumPy masked"),
        (torch.randn(N, 4, device="meta"), None, "must live in host memory.*meta"),
        (np.zeros((N, 4), dtype="f4")[:, ::2], None, r"np.ascontiguousarray\(features\)"),
        (torch.randn(N, 4), {"n": torch.arange(N)}, "labels is a dict.*heterogeneous=True"),
    ],
    ids=lambda v: repr(v)[:24],
)
def test_bad_tables_are_refused_at_construction(features, labels, needle):
    with pytest.raises((ValueError, TypeError), match=needle) as info:
        PingPongLoader(make_triples(N, 1), features, labels)
    assert isinstance(info.value, pingpong.TableError)


@pytest.mark.parametrize("which", ["features", "labels"])
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tables_are_refused_at_construction(which, layout):
    """From an input review: a nested tensor (torch's default, strided layout)
    raised torch's "Internal error: NestedTensorImpl doesn't support sizes" from
    the table checks, not a TableError naming the table."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "prototype stage"
        ragged = torch.nested.nested_tensor([torch.randn(3), torch.randn(5)], layout=layout)
    tables = (ragged, None) if which == "features" else (torch.randn(N, 4), ragged)
    with pytest.raises(pingpong.TableError, match=rf"{which} is a nested tensor"):
        PingPongLoader(make_triples(N, 1), *tables)


@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint8])
def test_quantized_tables_are_refused_at_construction(dtype):
    """Their bytes are integers whose scale lives outside them: refused when built,
    not at the first batch with torch's internal assert."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch deprecates quantized tensors
        table = torch.quantize_per_tensor(torch.randn(N, 4), 0.1, 0, dtype)
    with pytest.raises(pingpong.TableError, match=r"features is a quantized tensor.*int_repr"):
        PingPongLoader(make_triples(N, 1), table)
    with pytest.raises(pingpong.TableError, match="labels is a quantized tensor"):
        PingPongLoader(make_triples(N, 1), torch.randn(N, 2), table[:, 0].contiguous())


@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint8, torch.qint32])
def test_row_sources_of_quantized_rows_are_refused_at_construction(dtype):
    """As quantized host tables are: the first batch died in torch's internal assert
    (a quantized slot, Quantizer.cpp) instead."""

    class QuantizedRows:
        shape = (N, 4)

        def __init__(self) -> None:
            self.dtype = dtype

        def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
            raise AssertionError("never fetched")

    with pytest.raises(pingpong.TableError,
                       match=rf"features is a row source of quantized rows \({dtype}\)"):
        PingPongLoader(make_triples(N, 1), QuantizedRows())


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_buffers": 1}, "num_buffers"),
        ({"num_buffers": 2.0}, "num_buffers"),
        ({"num_buffers": True}, "num_buffers"),
        ({"gather": "magic"}, "gather must be one of"),
        ({"gather": "zerocopy"}, "needs a CUDA device"),
        ({"gather": "staged"}, "needs a CUDA device"),
        ({"gather": "device"}, "needs a CUDA device"),
        ({"device": "tpu"}, "not a valid torch device|not supported"),
        ({"device": "meta"}, "not supported"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1.0}, "timeout"),
        ({"timeout": "5"}, "timeout"),
        ({"timeout": True}, "timeout"),  # a bool is no number of seconds
        ({"gather_threads": 0}, "gather_threads"),
        ({"gather_threads": True}, "gather_threads"),
        ({"gather_threads": 1.0}, "gather_threads"),
        ({"num_buffers": np.bool_(True)}, "num_buffers"),
        ({"num_buffers": np.float64(3)}, "num_buffers"),
        ({"num_buffers": np.int64(1)}, "num_buffers"),
        ({"cache_bytes": np.int64(-1)}, "cache_bytes must be a non-negative int"),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_bad_arguments_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle) as info:
        PingPongLoader(make_triples(N, 1), torch.randn(N, 2), **kwargs)
    assert isinstance(info.value, pingpong.ConfigError)
    if needle in ("needs a CUDA device", "not supported"):  # a device that cannot gather
        assert isinstance(info.value, pingpong.GatherModeUnavailable)


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"gather_threads": 2}, "gather_threads configures a device pingpong makes"),
    ({"sort_ids": "gpu"}, "sort_ids configures a device pingpong makes"),
    ({"gather": "zerocopy"}, "does not match the given device's mode"),
])
def test_settings_of_a_device_pingpong_makes_are_refused_with_a_given_one(kwargs, needle):
    """From a code review: with ``device=`` a Device instance, ``gather_threads`` was
    ignored without a word (and its value not even checked)."""
    from pingpong.devices.fake import FakeAsyncDevice

    device = FakeAsyncDevice()
    try:
        with pytest.raises(pingpong.ConfigError, match=needle):
            PingPongLoader(make_triples(N, 1), torch.randn(N, 2), device=device, **kwargs)
        assert device.closed  # given, it was the loader's: see the test below
    finally:
        device.close()


def test_numpy_integers_are_ints():
    """Counts from a NumPy array or a sweep (``np.int64(3)``) are taken as the ints
    they are, and stored as Python ints; their type hints say so (mypy checks this
    file in the lint env)."""
    features = torch.randn(N, 2)
    with PingPongLoader(make_triples(N, 3), features, num_buffers=np.int64(3),
                        gather_threads=np.int32(1), cache_bytes=np.int64(0)) as loader:
        assert type(loader.num_buffers) is int
        assert loader.num_buffers == 3
        for batch, (input_nodes, _, _) in zip(loader, make_triples(N, 3), strict=True):
            assert torch.equal(batch.x, features[input_nodes])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_is_refused():
    with pytest.raises(pingpong.GatherModeUnavailable, match="is_available"):
        PingPongLoader(make_triples(N, 1), torch.randn(N, 2), device="cuda")


def test_one_shot_iterator_source_is_refused():
    with pytest.raises(pingpong.ConfigError, match="one-shot iterator") as info:
        PingPongLoader(iter(make_triples(N, 2)), torch.randn(N, 2))
    assert isinstance(info.value, TypeError)
    with pytest.raises(pingpong.ConfigError, match="one-shot iterator"):
        PingPongLoader((t for t in make_triples(N, 2)), torch.randn(N, 2))
    with pytest.raises(pingpong.ConfigError, match="iterable") as info:
        PingPongLoader(42, torch.randn(N, 2))  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)


def test_a_source_that_resets_and_returns_itself_is_told_how_to_fix_it():
    class Resettable:
        def __init__(self) -> None:
            self.items = make_triples(N, 2)
            self.k = 0

        def __iter__(self) -> Resettable:
            self.k = 0
            return self

        def __next__(self) -> Any:
            if self.k == len(self.items):
                raise StopIteration
            self.k += 1
            return self.items[self.k - 1]

    with pytest.raises(pingpong.ConfigError, match=r"returns self .* a new iterator"):
        PingPongLoader(Resettable(), torch.randn(N, 2))


def test_len_of_a_loader_whose_source_has_none_is_a_pingpong_error():
    class NoLength:
        def __iter__(self) -> Iterator[Any]:
            return iter(make_triples(N, 2))

    with PingPongLoader(NoLength(), torch.randn(N, 2)) as loader:
        with pytest.raises(pingpong.ConfigError, match="has no len"):
            len(loader)
        assert len(list(loader)) == 2  # list() asks for a length hint and goes on


def test_a_type_error_inside_the_sources_len_is_named_not_hidden():
    """From a lifecycle probe: a bug inside the source's ``__len__`` that raised
    ``TypeError`` became "has no len()" with the cause suppressed."""
    class BuggyLength:
        def __iter__(self) -> Iterator[Any]:
            return iter(make_triples(N, 2))

        def __len__(self) -> int:
            return len(None)  # type: ignore[arg-type]  # the user's bug

    with PingPongLoader(BuggyLength(), torch.randn(N, 2)) as loader:
        with pytest.raises(pingpong.ConfigError,
                           match=r"has no len\(\), so neither has the loader \(len\(source\) "
                                 r"raised TypeError: object of type 'NoneType' has no len\(\)\)"
                           ) as info:
            len(loader)
        assert isinstance(info.value.__cause__, TypeError)


def test_ids_on_the_meta_device_are_an_id_type_error():
    features = torch.randn(N, 2)
    items: list[Any] = [(torch.arange(5, device="meta"), torch.arange(2), [])]
    with PingPongLoader(items, features) as loader:
        with pytest.raises(pingpong.IdTypeError, match="meta device"):
            next(iter(loader))


@pytest.mark.parametrize(("ids", "needle"), [
    (torch.tensor([1, 2]).to_sparse(), r"input_nodes is a torch.sparse_coo tensor"),
    (np.ma.array([1, 2, 3], mask=[0, 1, 0]), r"input_nodes is a NumPy masked array.*"
                                              r"compressed\(\)"),
], ids=["sparse-tensor", "masked-array"])
def test_sparse_and_masked_ids_are_an_id_type_error(ids, needle):
    """They reached torch's and Numba's own errors (TypeError, NumbaTypeError)."""
    with PingPongLoader([(ids, torch.arange(2), [])], torch.randn(N, 2)) as loader:
        with pytest.raises(pingpong.IdTypeError, match=needle):
            next(iter(loader))


def test_a_lazily_negated_view_of_ids_is_read_as_its_values():
    """``torch._neg_view`` holds -ids in memory: read as the values it stands for
    (``.numpy()`` of it was torch's RuntimeError)."""
    features = torch.randn(N, 2)
    ids = torch._neg_view(torch.tensor([-1, -7, -3]))
    with PingPongLoader([(ids, torch.arange(2), [])], features) as loader:
        batch = next(iter(loader))
        assert torch.equal(batch.x, features[torch.tensor([1, 7, 3])])


#: ``raise`` of a built-in exception that pingpong keeps: an internal invariant (a
#: pingpong bug if seen), the test-only fake device's own stream failures, module
#: ``__getattr__`` (which must raise AttributeError), and control flow caught at once.
BUILTIN_RAISES_KEPT = {
    ("slots.py", "RuntimeError"),
    ("fake.py", "RuntimeError"),
    ("fake.py", "TimeoutError"),
    ("__init__.py", "AttributeError"),  # pingpong.kernels.__getattr__
    ("_numpy_compat.py", "AttributeError"),  # a __getattr__ too
    ("__init__.py", "TypeError"),  # forms: control flow caught two lines below
}


def test_every_exception_pingpong_raises_is_a_pingpong_error():
    """README: "Every exception derives from PingPongError" -- read from the source:
    no ``raise ValueError(...)`` and the like outside the internal ones kept above."""
    import ast
    import builtins
    from pathlib import Path

    builtin_exceptions = {name for name, value in vars(builtins).items()
                          if isinstance(value, type) and issubclass(value, BaseException)}
    found = set()
    root = Path(pingpong.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            # raise ValueError(...), and return ValueError(...) from a factory
            made = node.exc if isinstance(node, ast.Raise) else (
                node.value if isinstance(node, ast.Return) else None)
            if (isinstance(made, ast.Call) and isinstance(made.func, ast.Name)
                    and made.func.id in builtin_exceptions):
                found.add((path.name, made.func.id, made.lineno))
    # AssertionError: an internal invariant; StopIteration: the end of an epoch
    unexpected = sorted(f for f in found if f[:2] not in BUILTIN_RAISES_KEPT
                        and f[1] not in ("AssertionError", "StopIteration"))
    assert not unexpected
    assert {f[:2] for f in found} >= BUILTIN_RAISES_KEPT  # the allow-list is not stale


def test_malformed_source_item():
    with PingPongLoader([(torch.arange(3), torch.arange(3))], torch.randn(N, 2)) as loader:
        with pytest.raises(pingpong.BatchFormError, match=r"tuple of length 2") as info:
            list(loader)
    assert "(input_nodes, output_nodes, blocks)" in str(info.value)  # lists what it reads
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("where", ["input_nodes", "output_nodes"])
@pytest.mark.parametrize("python", [list, tuple, range])
def test_ids_given_as_a_python_sequence_are_named_in_the_form_error(where, python):
    """From an input review: ``([0, 1, 2], output_nodes, blocks)`` got the list of
    the forms pingpong reads -- the very one the item had -- without saying that
    its ids must be a tensor or array."""
    ids = torch.arange(3)
    bad = range(3) if python is range else python(range(3))
    item: tuple[Any, Any, list[Any]] = (bad, ids, []) if where == "input_nodes" else (ids, bad, [])
    with PingPongLoader([item], torch.randn(N, 2)) as loader:
        with pytest.raises(pingpong.BatchFormError) as info:
            next(iter(loader))
    element = 0 if where == "input_nodes" else 1
    assert (f"a form pingpong cannot read; its {where} (element {element}) is a Python "
            f"{python.__name__}: ids are a torch.Tensor or NumPy array (torch.as_tensor(ids)); "
            "it reads:") in str(info.value)


@pytest.mark.parametrize("item", [
    (torch.arange(3), [0, 1], torch.arange(2), []),  # element 1 of an edge form: a graph
    [(torch.arange(3), torch.arange(3), [])] * 3,  # three batches in one item
    (["a", "b"], torch.arange(2), []),  # not ids at all
], ids=["edge-form", "list-of-batches", "strings"])
def test_the_python_ids_hint_is_given_only_where_it_is_true(item):
    """From a review of the hint: it named element 1 "output_nodes" in a 4-tuple,
    where an edge form has its pair graph, and called a list of three batches
    a list of input_nodes."""
    with PingPongLoader([item], torch.randn(N, 2)) as loader:
        with pytest.raises(pingpong.BatchFormError) as info:
            next(iter(loader))
    assert "a form pingpong cannot read; it reads:" in str(info.value)


class SamplerError(Exception):
    """A custom exception type the source raises."""

    def __init__(self, code: int) -> None:  # a constructor that is not (msg,)
        super().__init__(f"sampler broke with code {code}")
        self.code = code


def _failing_source(fail_at: int):
    class Source:
        def __iter__(self):
            for i, triple in enumerate(make_triples(N, 10)):
                if i == fail_at:
                    raise SamplerError(fail_at)
                yield triple

    return Source()


@pytest.mark.parametrize("fail_at", [0, 1, 5])
def test_source_exception_keeps_type_object_and_traceback(fail_at):
    with PingPongLoader(_failing_source(fail_at), torch.randn(N, 2)) as loader:
        received = 0
        start = None
        with pytest.raises(SamplerError) as info:
            for _ in loader:
                received += 1
                start = time.monotonic()
        assert received == fail_at
        assert info.value.code == fail_at
        text = "".join(traceback.format_exception(info.value))
        assert "__iter__" in text
        assert "raise SamplerError" in text
        assert "pingpong-producer" in text  # the note naming the thread
        if start is not None:
            assert time.monotonic() - start < 1.0
        # next epoch still works until the fault
        it = iter(loader)
        for _ in range(fail_at):
            next(it)
        with pytest.raises(SamplerError):
            next(it)


class RowsUntil:
    """A row source whose fetch raises ``StopIteration`` (a user's bug) on one call."""

    def __init__(self, table: torch.Tensor, failing_call: int) -> None:
        self.table, self.failing_call, self.calls = table, failing_call, 0
        self.shape, self.dtype = tuple(table.shape), table.dtype

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.failing_call:
            next(iter([]))  # the bug: StopIteration escapes
        return self.table[ids]


@pytest.mark.parametrize(
    "where", ["form", "row source", "health_check", "health_check on the training thread"])
@pytest.mark.parametrize("sample_ahead", [False, True], ids=["sync", "ahead"])
def test_stop_iteration_in_user_code_is_an_error_not_an_early_end(where, sample_ahead):
    """As PEP 479 does for generators: the loop must not end quietly after 2 of 6 batches."""
    features = torch.randn(N, 3)
    items = list(range(6))
    broken = {"on": True}
    on_training_thread = where == "health_check on the training thread"

    def form(item: int) -> tuple[torch.Tensor, None]:
        if where == "form" and broken["on"] and item == 2:
            next(iter([]))
        if on_training_thread and broken["on"] and item == 2:
            time.sleep(0.5)  # the training thread, waiting, calls the health check
        return torch.tensor([item]), None

    checks = {"n": 0}

    def health_check() -> None:
        checks["n"] += 1
        if not broken["on"]:
            return
        if where == "health_check" and checks["n"] == 1:
            next(iter([]))
        if on_training_thread and threading.current_thread() is threading.main_thread():
            next(iter([]))

    table: Any = RowsUntil(features, 3) if where == "row source" else features
    with PingPongLoader(items, table, form=form, sample_ahead=sample_ahead,
                        health_check=health_check) as loader:
        got = []
        it = None
        with pytest.raises(pingpong.StrayStopIterationError,
                           match="StopIteration raised inside") as info:
            it = iter(loader)
            for batch in it:
                got.append(batch.item)
        assert isinstance(info.value.__cause__, StopIteration)
        if it is not None:  # a next() after it names what the loop got (a self-review)
            with pytest.raises(pingpong.EpochFailedError,
                               match=r"\(StrayStopIterationError: StopIteration raised"):
                next(it)
        if where == "health_check":
            assert got == []  # the producer's first call, before the first item
        elif on_training_thread and sample_ahead:
            assert got == [0]  # item 2's form runs ahead, while batch 1 is waited for
        else:
            assert got == [0, 1]
        broken["on"] = False
        if where == "row source":
            table.failing_call = 0
        assert [b.item for b in loader] == items  # the next epoch is whole


def test_consumer_exception_mid_epoch_then_new_epoch():
    source = make_triples(N, 10)
    features = torch.randn(N, 3)
    with PingPongLoader(source, features) as loader:
        with pytest.raises(ZeroDivisionError):
            for i, _ in enumerate(loader):
                if i == 2:
                    raise ZeroDivisionError
        got = [b.x.clone() for b in loader]
    assert len(got) == 10
    assert all(torch.equal(g, features[t[0]]) for g, t in zip(got, source, strict=False))


class StallingSource:
    """Yields one batch, then blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __iter__(self):
        triples = make_triples(N, 2)
        yield triples[0]
        self.release.wait(10)
        yield triples[1]


def test_timeout_raises_timeout_error():
    source = StallingSource()
    with PingPongLoader(source, torch.randn(N, 2), timeout=0.3) as loader:
        it = iter(loader)
        next(it)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"timeout=0\.3"):
            next(it)
        elapsed = time.monotonic() - start
        assert 0.25 <= elapsed < 1.0
        source.release.set()


def test_no_timeout_waits_for_a_slow_source():
    source = StallingSource()
    threading.Timer(0.5, source.release.set).start()
    with PingPongLoader(source, torch.randn(N, 2), timeout=None) as loader:
        assert len(list(loader)) == 2


def test_dead_producer_is_noticed(monkeypatch):
    import pingpong._epoch as epoch_module

    def dies_silently(*args, **kwargs):
        return None  # ends without a terminal message

    monkeypatch.setattr(epoch_module, "produce", dies_silently)
    # timeout: a loader that missed the death fails the test instead of hanging it
    with PingPongLoader(make_triples(N, 3), torch.randn(N, 2), timeout=60) as loader:
        with pytest.raises(pingpong.ProducerDiedError):
            next(iter(loader))


def test_a_constructor_failing_after_the_device_is_made_closes_it(monkeypatch):
    """From a code review: only part of ``__init__`` after the device was made was
    covered, so a failure in the rest (building the lifecycle, the DistDGL
    server watch) left the device open, with no finaliser to close it (on
    CUDA: pinned tables and the warm-up thread)."""
    from pingpong.devices.fake import FakeAsyncDevice

    def fail(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("injected failure")

    device = FakeAsyncDevice()
    monkeypatch.setattr(pingpong.loader, "LoaderCore", fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        PingPongLoader([(torch.arange(3), torch.arange(1), None)], torch.randn(N, 2),
                       device=device)
    assert device.closed


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"num_buffers": 1}, pingpong.ConfigError),  # the arguments' checks
    ({"features": torch.randn(N, 2).to_sparse()}, pingpong.TableError),  # the tables'
    ({"labels": torch.zeros(2, dtype=torch.long)}, pingpong.TableError),  # the seeds'
    ({"source": 3}, pingpong.ConfigError),  # the first check of all
])
def test_a_constructor_refusing_before_the_device_is_made_closes_a_given_one(kwargs, error):
    """A given device is the loader's from the call on: refused before the loader
    took it (its arguments, tables or seeds), it was left open -- on the fake
    device, two worker threads nobody could stop (found by a mutation audit)."""
    from pingpong.devices.fake import FakeAsyncDevice

    device = FakeAsyncDevice()
    arguments: dict[str, Any] = {"source": make_triples(N, 2), "features": torch.randn(N, 2),
                                 **kwargs}
    try:
        with pytest.raises(error):
            PingPongLoader(device=device, **arguments)
        assert device.closed
    finally:
        device.close()


class _ListWithWorkerSetting(list):
    num_workers = "auto"  # not an int: a setting of the user's own


def test_a_source_whose_num_workers_is_not_an_int_is_read_as_having_none():
    """From a code review: ``int(source.num_workers)`` raised a bare ``ValueError``."""
    features = torch.randn(N, 2)
    source = _ListWithWorkerSetting([(torch.arange(3), torch.arange(1), None)])
    with PingPongLoader(source, features) as loader:
        assert [torch.equal(b.x, features[:3]) for b in loader] == [True]


class _StallsOnce:
    """A re-iterable source whose first pass stalls before its batch ``stall_at``."""

    def __init__(self, triples: list, stall_at: int, stall_s: float) -> None:
        self.triples, self.stall_at, self.stall_s = triples, stall_at, stall_s
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        for i, triple in enumerate(self.triples):
            if i == self.stall_at and self.passes == 1:
                time.sleep(self.stall_s)
            yield triple


def test_a_loop_that_catches_a_timeout_and_goes_on_is_told_the_epoch_failed():
    """A retrying loop (catch ``BatchTimeoutError``, call ``next()`` again) used to
    get ``StopIteration`` and end its epoch short without a word; it now gets
    :class:`EpochFailedError` naming the timeout and the batches delivered."""
    triples = make_triples(N, 6)
    features = torch.randn(N, 4)
    source = _StallsOnce(triples, stall_at=3, stall_s=1.0)
    with PingPongLoader(source, features, timeout=0.2) as loader:
        it = iter(loader)
        delivered: list[torch.Tensor] = []
        errors: list[Exception] = []
        while True:
            try:
                delivered.append(next(it).x.clone())
            except pingpong.BatchTimeoutError as exc:
                errors.append(exc)
                continue  # the retry
            except StopIteration:
                break
            except pingpong.EpochFailedError as exc:
                errors.append(exc)
                break
        assert len(delivered) == 3
        assert len(errors) == 2
        assert isinstance(errors[1], pingpong.EpochFailedError)
        assert "failed after 3 batches (BatchTimeoutError: no batch within timeout=0.2 s" in str(
            errors[1])
        assert "iter(loader) starts a new epoch" in str(errors[1])
        # and so it does, whole and exact
        again = [batch.x.clone() for batch in loader]
        assert len(again) == len(triples)
        for batch_x, (inputs, _, _) in zip(again, triples, strict=True):
            assert torch.equal(batch_x, features[inputs])


class _UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


def test_a_failure_whose_message_cannot_be_read_is_still_the_one_raised():
    """The epoch records what ended it as text; an exception whose ``__str__``
    raises must still reach the loop as itself, and the next ``next()`` names
    its type."""

    class Source:
        def __iter__(self):
            yield (torch.arange(10), torch.arange(5), None)
            raise _UnprintableError

    with PingPongLoader(Source(), torch.randn(N, 4)) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(_UnprintableError):
            next(it)
        with pytest.raises(pingpong.EpochFailedError,
                           match=r"failed after 1 batches \(_UnprintableError\)"):
            next(it)


def test_a_kernel_given_ids_in_the_other_byte_order_says_how_to_convert_them():
    """The kernels take ids as they are (no copy): int64 in the other byte order
    are refused, with the conversion named; other dtypes get no such hint."""
    from pingpong.kernels import gather_rows_cpu

    table, out = np.zeros((5, 2), np.float32), np.zeros((2, 2), np.float32)
    with pytest.raises(pingpong.IdTypeError,
                       match=r"in this machine's byte order \(it is >i8: pass "
                             r"ids.astype\('int64'\)\), got >i8"):
        gather_rows_cpu(table, np.array([1, 2], ">i8"), out)
    with pytest.raises(pingpong.IdTypeError, match=r"int32 or int64, got >u8$"):
        gather_rows_cpu(table, np.array([1, 2], ">u8"), out)
    assert not out.any()
