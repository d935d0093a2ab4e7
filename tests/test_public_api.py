"""The public API is what ``pingpong.__all__`` says, and every name resolves."""

from __future__ import annotations

import inspect

import pingpong

EXPECTED = {
    "Batch",
    "BatchExpiredError",
    "BatchFormError",
    "BatchTimeoutError",
    "ConfigError",
    "CustomBatch",
    "EdgeBatch",
    "EdgeBlock",
    "EpochFailedError",
    "EpochSupersededError",
    "GatherModeUnavailable",
    "HeteroEdgeBlock",
    "IdRangeError",
    "IdShapeError",
    "IdTypeError",
    "LoaderClosedError",
    "NegativeEdgeBatch",
    "PingPongError",
    "PingPongLoader",
    "ProducerDiedError",
    "RpcTurnError",
    "ServerGoneError",
    "SlotOverwriteError",
    "StrayStopIterationError",
    "SubgraphBatch",
    "TableError",
    "__version__",
    "as_edge_block",
    "as_hetero_edge_block",
    "rpc_turn",
    "send_sampler_batches_by_value",
}


def test_all_is_pinned_and_resolves():
    assert set(pingpong.__all__) == EXPECTED
    for name in pingpong.__all__:
        assert getattr(pingpong, name) is not None


def test_loader_signature_matches_the_documented_api():
    params = inspect.signature(pingpong.PingPongLoader).parameters
    assert list(params)[:3] == ["source", "features", "labels"]
    keyword_only = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert {"device", "num_buffers", "gather", "timeout"} <= keyword_only
    assert params["num_buffers"].default == 2
    assert params["gather"].default == "auto"
    assert params["timeout"].default is None
    assert params["device"].default == "cpu"


def test_batch_fields_and_kernel_entry_points():
    assert pingpong.Batch._fields == ("input_nodes", "output_nodes", "blocks", "x", "y")
    from pingpong.kernels import gather_rows_cpu, gather_rows_cuda

    assert callable(gather_rows_cpu)
    assert callable(gather_rows_cuda)
    for exc in (pingpong.IdRangeError, pingpong.TableError, pingpong.BatchTimeoutError):
        assert issubclass(exc, pingpong.PingPongError)
    assert issubclass(pingpong.IdRangeError, IndexError)
    assert issubclass(pingpong.BatchTimeoutError, TimeoutError)
    assert issubclass(pingpong.ServerGoneError, ConnectionError)
    assert issubclass(pingpong.ServerGoneError, pingpong.PingPongError)


def test_the_type_hints_of_count_arguments_evaluate_at_run_time():
    """Tools that read hints at run time (pydantic, jsonargparse, typeguard) need
    ``typing.get_type_hints`` to work; the ``Count`` alias once was a string, which
    made every ``Count | None`` parameter fail there."""
    import typing

    import numpy as np

    from pingpong.hotrows import RowCounter, rows_within
    from pingpong.sources import BuiltinLoader, make_synthetic_graph

    functions: list[tuple[typing.Any, str]] = [
        (pingpong.PingPongLoader.__init__, "gather_threads"),
        (pingpong.PingPongLoader.__init__, "num_buffers"),
        (BuiltinLoader.__init__, "num_replicas"),
        (BuiltinLoader.set_epoch, "epoch"),
        (make_synthetic_graph, "num_nodes"),
        (pingpong.send_sampler_batches_by_value, "max_bytes"),
        (RowCounter.hottest, "k"),
        (rows_within, "budget_bytes"),
    ]
    for function, name in functions:
        hint = typing.get_type_hints(function)[name]
        assert int in typing.get_args(hint), (function, name)
        assert np.integer[typing.Any] in typing.get_args(hint), (function, name)
        inspect.signature(function, eval_str=True)
