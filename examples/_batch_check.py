"""Test hook of ``train_sage.py --dump-batches``: each training batch checked
against the rank's own tables (:class:`BatchCheck`).

DGL's sampling does not repeat from run to run, so a test of a DDP job with
DGL's sampler has no precomputed reference to compare batches with; each rank
compares them itself with what the synchronous loop reads for the same
sampled ids, and reports the result in its ``.meta.json``.

Also :func:`params_digest`, the weights' digest by which the DDP tests of
``train_sage.py`` and ``train_dist.py`` compare the ranks' trained weights.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
from typing import Any

import torch

from pingpong.blocks import as_edge_block


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe: a NaN equals the same NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a = a.detach().to("cpu").contiguous().reshape(-1)
    b = b.detach().to("cpu").contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _dgl_ids(block: Any, side: str) -> torch.Tensor | None:
    """A DGL block's original node ids (``srcdata``/``dstdata[dgl.NID]``); None for others."""
    dgl = sys.modules.get("dgl")  # a DGL block means DGL is imported; never import it here
    if dgl is None or not isinstance(block, dgl.DGLGraph):
        return None
    frame = block.srcdata if side == "src" else block.dstdata
    return frame.get(dgl.NID)


class BatchCheck:
    """Test hook (``--dump-batches``): each training batch against the rank's own tables.

    What the synchronous loop reads for the batch's sampled ids in this
    process: ``x`` must be ``features.index_select(0, input_nodes)`` and ``y``
    ``labels.index_select(0, output_nodes)``, bit for bit, from the tables the
    loader gathers from (under ``--nprocs``/torchrun the shared ones); the
    blocks must fit the ids: one per layer, chained (each layer's destination
    nodes are the next one's source nodes), the first with
    ``len(input_nodes)`` source nodes and the last with ``len(output_nodes)``
    destination nodes, which are a prefix of the input nodes (the local-id
    convention); for DGL blocks also the first block's ``srcdata[dgl.NID]``
    equals ``input_nodes`` and the last one's ``dstdata[dgl.NID]``
    ``output_nodes`` (:class:`~pingpong.blocks.EdgeBlock` has no node ids).
    Reads only: no random numbers, no writes.
    """

    KEEP = 10  # differing steps listed in the report

    def __init__(self, features: torch.Tensor, labels: torch.Tensor, num_layers: int) -> None:
        self.features = features
        self.labels = labels
        self.num_layers = num_layers
        self.checked = 0
        self.differing = 0
        self.first: list[dict[str, Any]] = []

    def blocks_fit(self, input_nodes: torch.Tensor, output_nodes: torch.Tensor,
                   blocks: list[Any]) -> bool:
        if len(blocks) != self.num_layers:
            return False
        edges = [as_edge_block(b) for b in blocks]
        if (edges[0].num_src_nodes != len(input_nodes)
                or edges[-1].num_dst_nodes != len(output_nodes)
                or any(a.num_dst_nodes != b.num_src_nodes
                       for a, b in itertools.pairwise(edges))
                or not same_bits(input_nodes[:len(output_nodes)], output_nodes)):
            return False
        src, dst = _dgl_ids(blocks[0], "src"), _dgl_ids(blocks[-1], "dst")
        return ((src is None or same_bits(src, input_nodes))
                and (dst is None or same_bits(dst, output_nodes)))

    def __call__(self, epoch: int, step: int, batch: Any) -> None:
        input_nodes = batch.input_nodes.detach().to("cpu")
        output_nodes = batch.output_nodes.detach().to("cpu")
        wrong = []
        if not same_bits(batch.x, self.features.index_select(0, input_nodes)):
            wrong.append("x")
        if not same_bits(batch.y, self.labels.index_select(0, output_nodes)):
            wrong.append("y")
        if not self.blocks_fit(input_nodes, output_nodes, list(batch.blocks)):
            wrong.append("blocks")
        self.checked += 1
        if wrong:
            self.differing += 1
            if len(self.first) < self.KEEP:
                self.first.append({"epoch": epoch, "step": step, "differs": wrong})

    def summary(self) -> dict[str, Any]:
        return {"batches_checked": self.checked, "batches_differing": self.differing,
                "first_differing": self.first}


def params_digest(model: torch.nn.Module) -> str:
    """SHA-256 over the model's parameters, bit for bit."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
