"""Batch sources pingpong can wrap without DGL.

- :mod:`pingpong.sources.builtin` -- :class:`CSRGraph`, a uniform
  :class:`NeighborSampler` and :class:`BuiltinLoader`, yielding DGL-style
  ``(input_nodes, output_nodes, blocks)`` triples with
  :class:`~pingpong.blocks.EdgeBlock` blocks.
- :mod:`pingpong.sources.synthetic` -- :func:`make_synthetic_graph`, a seeded
  node-classification graph for examples, tests and benchmarks.

Any re-iterable of DGL-style triples is a valid source for
:class:`pingpong.PingPongLoader`; these are just the ones that ship with it.
"""

from __future__ import annotations

from .builtin import BuiltinLoader, CSRGraph, NeighborSampler, SampledTriple
from .synthetic import GRAPH_KINDS, SyntheticGraph, make_synthetic_graph

__all__ = [
    "GRAPH_KINDS",
    "BuiltinLoader",
    "CSRGraph",
    "NeighborSampler",
    "SampledTriple",
    "SyntheticGraph",
    "make_synthetic_graph",
]
