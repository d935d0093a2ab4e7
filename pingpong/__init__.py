"""pingpong: pipelined, ping-pong-buffered feature loading for mini-batch GNN training.

Wrap a DGL DataLoader (or any re-iterable of ``(input_nodes, output_nodes,
blocks)`` triples) in :class:`PingPongLoader`; each batch arrives with its
features and labels already on the training device.
"""

from __future__ import annotations

from ._rpc import rpc_turn
from .batch import Batch, CustomBatch, EdgeBatch, NegativeEdgeBatch, SubgraphBatch
from .blocks import EdgeBlock, HeteroEdgeBlock, as_edge_block, as_hetero_edge_block
from .errors import (
    BatchExpiredError,
    BatchFormError,
    BatchTimeoutError,
    ConfigError,
    EpochFailedError,
    EpochSupersededError,
    GatherModeUnavailable,
    IdRangeError,
    IdShapeError,
    IdTypeError,
    LoaderClosedError,
    PingPongError,
    ProducerDiedError,
    RpcTurnError,
    ServerGoneError,
    SlotOverwriteError,
    StrayStopIterationError,
    TableError,
)
from .loader import PingPongLoader
from .samplerpickle import send_sampler_batches_by_value

__version__ = "0.1.0"

__all__ = [
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
]
