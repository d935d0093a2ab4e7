"""A DistDGL job on 127.0.0.1 for tests/test_distdgl.py: 2 partitions, 2 servers, 2 trainers.

Usage: ``python distdgl_job.py MODE OUT_DIR PART_DIR``. Run without
``DGL_ROLE`` it is the launcher: it partitions a small synthetic graph into
``PART_DIR`` (reused when already there) and starts the servers and trainers
with ``examples/train_dist.py``'s :class:`LocalCluster`, each running this
script again with ``DGL_ROLE=server`` or ``DGL_ROLE=client``. It writes
``OUT_DIR/pids.json`` (every process it started, before waiting on them) and
``OUT_DIR/job.json`` (how each ended), and each trainer writes
``OUT_DIR/rank{r}.json``; the servers' and trainers' output is in
``OUT_DIR/{server,trainer}-{i}.log``. This script asserts nothing: the test
reads the files, so a wrong result shows up there.

Modes (what a trainer does):

``equal``
    Two shuffled epochs of ``PingPongLoader`` over a ``DistNodeDataLoader``
    with the ``DistTensor`` s ``feat`` and ``label`` as row sources, training a
    DDP model. Every batch is kept; after each epoch (the producer thread has
    finished, so DGL's RPC is free) ``feat[input_nodes]`` and
    ``label[output_nodes]`` are pulled again on the training thread and
    compared bit for bit with what pingpong delivered -- and with the
    original tables, through DGL's renumbering (``orig_nid``).
``equal-samplers``
    ``equal`` with one DGL sampler process per trainer (``DGL_NUM_SAMPLER=1``):
    the ``DistNodeDataLoader`` samples in it, the producer receives its blocks.
``byvalue-samplers3``
    ``equal`` with three DGL sampler processes per trainer, told first to send
    each batch's small tensors by value (``pingpong.send_sampler_batches_by_value``).
``edge-equal``
    One shuffled epoch of ``PingPongLoader`` over a ``DistEdgeDataLoader``
    (edge prediction, uniform negatives, ``exclude="self"``) with the
    ``DistTensor`` ``feat``; each batch's features are compared with
    ``feat[input_nodes]`` pulled afterwards, and its blocks' edges with its seed
    edges (DGL ignores ``exclude`` on a ``DistGraph``); warnings recorded.
``hetero-equal``
    ``equal`` on a heterogeneous graph (``paper`` and ``author`` nodes, three
    edge types; float32 paper features, float64 author features of another
    width, paper labels), two epochs over a ``DistNodeDataLoader`` with paper
    seeds, one ``DistTensor`` per node type, ``heterogeneous=True``, training
    an R-GCN-style DDP model (the trainers' final weights recorded).
``edge-hetero``
    ``edge-equal`` on the heterogeneous graph: a ``DistEdgeDataLoader`` with
    seed edges of two edge types (``cites``, ``writes``), uniform negatives and
    ``exclude="self"``, one ``DistTensor`` per node type,
    ``heterogeneous=True``; each batch's tables against the rows pulled
    afterwards and the original tables, its blocks' edges against its seed
    edges, type by type; warnings recorded.
``edge-labels``
    Edge classification on DistDGL: a homogeneous graph with an edge label
    ``DistTensor`` (``g.edata["label"]``), one shuffled epoch over a
    ``DistEdgeDataLoader`` (no negatives) with ``edge_labels=``: every batch's
    ``y`` equals the labels pulled afterwards at ``pair_graph.edata[dgl.EID]``
    and the original table; the edge partition's labels are read in place.
``early-exit``
    Eight times: two batches of a training loader, ``break``, then at once a
    whole epoch of a validation loader; then both loaders in one ``zip``; then
    an epoch of the training loader in which the training thread pulls each
    batch's output-node features itself, inside ``pingpong.rpc_turn()``; then
    two loaders over one ``DistNodeDataLoader`` (zip, nested); then, over one
    whose sampler stalls 4 s in one step, a loop left while its producer is in
    that step and at once a new epoch of the same loader, then of another.
    Every batch and pull checked against the original tables; errors recorded.
``temporary`` / ``temporary-samplers``
    Temporary loaders, never named or closed (``for batch in
    PingPongLoader(...)``) over the same ``DistNodeDataLoader``: three left
    after two batches, two whole epochs (each with two validation epochs nested
    in it), then a ``zip`` of two; every batch
    checked against the original tables, each whole epoch's seeds against the
    trainer's share, pingpong threads left afterwards recorded; without and
    with one DGL sampler process per trainer.
``close-thread`` / ``close-thread-samplers``
    ``close()`` from a timer thread while the training loop runs (steps of
    20 ms), three times at different moments; after each, a whole epoch of a
    new loader over the same ``DistNodeDataLoader``; every batch checked
    against the original tables; without and with one DGL sampler process.
``break-samplers``
    With one DGL sampler process per trainer: three epochs left after two
    batches, then two whole epochs; every batch checked against the original
    tables, and each whole epoch's seeds against the trainer's share.
``bad-id``
    The source's third batch gets the id ``N`` (one past the last row) among
    its input nodes. ``feat`` and ``label`` are counted pulls
    (``DelayedRows``, itself a row source, around each ``DistTensor``).
``edge-bad-seed``
    A ``DistNodeDataLoader`` whose seeds include the node id ``N`` and a
    ``DistEdgeDataLoader`` whose seeds include the edge id ``E``, each given to
    a ``PingPongLoader``; the exception of each construction recorded.
``hetero-bad-id``
    ``bad-id`` on the heterogeneous graph: the third batch gets the author id
    one past the last; paper and author features and paper labels are counted
    pulls.
``server-kill`` / ``server-stop``
    Epochs with a loader ``timeout``, each step taking 0.2 s; in the second
    epoch the launcher sends SIGKILL (``server-kill``) or SIGSTOP
    (``server-stop``: alive but silent) to server 1. Each trainer records the
    exception its training loop got and the servers its loader watched
    (:mod:`pingpong.serverwatch`); the launcher records how and when every
    trainer ended. ``server-stop`` stops the server once rank 0 is a few
    steps into the epoch. ``server-kill`` kills it while no DGL message is in
    flight: both trainers' sources hold their producer before the fourth
    batch (the source wrapper writes ``parked-RANK`` and waits), the launcher
    kills the server, waits for it to be gone, and writes ``resume``. (A kill
    at any moment can land while DGL's sender thread is writing a message,
    and then DGL aborts the process whatever pingpong does;
    ``server-kill-random`` does that, for ``benchmarks/server_loss.py``.)
``server-kill-ddp-race``
    ``server-kill`` with trainer 1 parked a batch later than trainer 0: it is
    in DDP's all-reduce of that batch when trainer 0 leaves on its
    ``ServerGoneError``, gets gloo's error, and asks the loader's server watch.
``server-kill-hetero``, ``server-stop-hetero``
    ``server-kill``, ``server-stop`` on the heterogeneous graph (``hetero-equal``'s
    tables, ``heterogeneous=True``, the R-GCN-style model).
``server-kill-own-pull``
    an epoch, then the training thread parks while server 1 is killed, waits
    for the loader's watch to see it, and pulls rows of server 1's partition
    itself in ``pingpong.rpc_turn()``, the loader still open.
``server-kill-random``
    ``server-kill`` at whatever moment rank 0 is three steps into the second
    epoch; the step takes ``PINGPONG_DISTDGL_STEP_S`` seconds (default 0.2).
``server-kill-samplers``, ``server-stop-samplers``, ``bad-id-samplers``
    ``server-kill``, ``server-stop``, ``bad-id`` with one DGL sampler process
    per trainer: the sampling (and its RPCs) runs in that process, the
    producer only receives its batches and pulls the rows.
``equal-samplers2``, ``break-samplers2``, ``bad-id-samplers2``,
``server-stop-samplers2``, ``server-kill-samplers2``
    ``equal``, ``break-samplers``, ``bad-id``, ``server-stop``,
    ``server-kill`` with two DGL sampler processes per trainer
    (``DGL_NUM_SAMPLER=2``): DGL hands the batches out to them in turn and
    receives them from one shared queue, in the order they are finished.
``break-samplers3``
    ``break-samplers`` with three DGL sampler processes per trainer.

``PINGPONG_DISTDGL_BREAK`` breaks a mode on purpose (to see the test fail):
``wrong-pull`` (equal, edge-equal, edge-hetero, edge-labels, hetero-equal: compare against the
rows of the wrong ids), ``no-ddp`` (hetero-equal: each trainer trains alone),
``no-exclude`` (edge-equal, edge-hetero: no ``exclude`` asked for, so no check),
``in-range`` (bad-id, hetero-bad-id, edge-bad-seed: inject ``N - 1``),
``no-rpc-lock`` (early-exit, temporary: the producers do not take turns in DGL's
RPC client), ``no-turn`` (early-exit: the
training thread's own pulls do not take their turn), ``no-drain``
(break-samplers, temporary-samplers: DGL's batches for a pass left early are not
received), ``no-end`` (temporary: a dropped loader and its iterator do not end
their epoch, so its producer runs on), ``no-close`` (close-thread: the timer
does not close the loader), ``no-timeout`` (server-stop:
``timeout=None``), ``no-watch`` (server-*: the loader builds no server
watch, as before pingpong had one), ``no-signal`` (server-*: leave the server alone, so the
trainers run on to the deadline), ``leak`` (any mode: leave a process
running, listed in ``pids.json``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))  # train_dist (it adds the checkout if pingpong
# is not installed) and sage_model

import psutil  # noqa: E402
import torch  # noqa: E402
import train_dist as td  # noqa: E402
from sage_model import SAGE  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import pingpong  # noqa: E402
from pingpong.sources import make_synthetic_graph  # noqa: E402

SPEC = td.GraphSpec(num_nodes=12_000, feat_dim=32, num_classes=4, avg_degree=10.0, seed=3)
FANOUTS = [5, 5]
BATCH_SIZE = 128
TIMEOUT_S = 15.0  # the loader's timeout in the server modes
MODE = ""  # this process's mode (set by main)
BREAK = os.environ.get("PINGPONG_DISTDGL_BREAK", "")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def write_json(path: Path, payload: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)


def local_count(table: Any, ids: torch.Tensor) -> int:
    """How many of ``ids`` the ``DistTensor`` ``table`` holds in this machine's partition,
    by its policy, id by id (what pingpong's ``rows_read_in_place`` must count)."""
    policy = table.part_policy
    return int((policy.to_partid(ids) == policy.part_id).sum())


def local_id_ranges(loader: pingpong.PingPongLoader) -> dict[str, Any]:
    """Each table's local id range as pingpong found it (None: none, or no local part)."""
    return {table.name: None if (local := getattr(table, "local", None)) is None
            else local.id_range for table in loader._store.all_tables}


# --------------------------------------------------------------------------- trainers
def ddp_model(in_feats: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        SAGE(in_feats, 16, SPEC.num_classes, len(FANOUTS), 0.0))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any,
         y: torch.Tensor | None = None) -> float:
    """One training step on ``batch`` (``y``: its labels, if not ``batch.y``); the loss."""
    loss = F.cross_entropy(model(batch.blocks, batch.x), batch.y if y is None else y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss)


def count_sampler_processes() -> int:
    """DGL's sampler processes (DGL_NUM_SAMPLER): spawned children, not the resource
    tracker."""
    return sum("spawn_main" in " ".join(child.cmdline())
               for child in psutil.Process().children())


def trainer_equal(tr: td.Trainer, out: Path, part_dir: Path) -> dict[str, Any]:
    feat, label = tr.g.ndata["feat"], tr.g.ndata["label"]
    orig_nid = torch.load(part_dir / "orig_nid.pt")
    sg = make_synthetic_graph(num_nodes=SPEC.num_nodes, num_classes=SPEC.num_classes,
                              feat_dim=SPEC.feat_dim, avg_degree=SPEC.avg_degree,
                              seed=SPEC.seed)
    # byvalue-: before the loader exists, so every batch request comes after it
    told = (pingpong.send_sampler_batches_by_value()
            if MODE.startswith("byvalue") and BREAK != "not-by-value" else None)
    source = td.make_source(tr.g, tr.train_nids, FANOUTS, BATCH_SIZE, shuffle=True)
    model, opt = ddp_model(feat.shape[1])
    epochs = []
    shared_batches = 0  # batches whose ids came as shared memory (not by value)
    with pingpong.PingPongLoader(source, feat, label, device="cpu", timeout=120) as loader:
        watched = watched_servers(loader)
        sampler_processes = count_sampler_processes()
        for _ in range(2):
            kept = []
            for batch in loader:
                shared_batches += batch.input_nodes.is_shared() or batch.output_nodes.is_shared()
                kept.append(tuple(t.clone() for t in (batch.input_nodes, batch.output_nodes,
                                                      batch.x, batch.y)))
                step(model, opt, batch)
            # The epoch is over: the producer no longer uses DGL's RPC.
            diff_sync = diff_truth = 0
            digest = hashlib.sha256()
            for input_nodes, output_nodes, x, y in kept:
                ref_ids = input_nodes.roll(1) if BREAK == "wrong-pull" else input_nodes
                ref_x, ref_y = feat[ref_ids], label[output_nodes]
                diff_sync += not (same_bits(x, ref_x) and same_bits(y, ref_y))
                diff_truth += not (same_bits(x, sg.features[orig_nid[input_nodes]])
                                   and same_bits(y, sg.labels[orig_nid[output_nodes]]))
                digest.update(bits(x).numpy().tobytes())
            order = torch.cat([k[1] for k in kept])
            seeds = order.sort().values
            # label's policy is the same node policy
            local_rows = sum(local_count(feat, ids) for k in kept for ids in k[:2])
            epochs.append({
                "order_sha256": hashlib.sha256(order.numpy().tobytes()).hexdigest(),
                "batches": len(kept), "len_loader": len(loader),
                "mismatch_vs_sync_pull": diff_sync, "mismatch_vs_original": diff_truth,
                "rows": int(sum(len(k[0]) for k in kept)), "x_digest": digest.hexdigest(),
                "label_rows": int(order.shape[0]), "local_rows": local_rows,
                "seeds_are_train_share": bool(torch.equal(seeds, tr.train_nids.sort().values)),
            })
        stats = {k: float(v) for k, v in loader.stats.items() if isinstance(v, int | float)}
        id_ranges = [None if (local := getattr(t, "local", None)) is None else local.id_range
                     for t in loader._store.all_tables]
    # The local ids by the policy itself, id by id (what the id ranges must equal).
    policy = feat.part_policy
    local_ids = torch.nonzero(policy.to_partid(torch.arange(tr.g.num_nodes()))
                              == policy.part_id).reshape(-1)
    return {"epochs": epochs, "loader": type(loader).__name__, "stats": stats,
            "producer_nice": loader.producer_nice,
            "watched": watched, "sampler_processes": sampler_processes,
            "by_value_told": told, "shared_batches": shared_batches,
            "local_id_ranges": id_ranges,
            "local_ids_by_policy": [int(local_ids[0]), int(local_ids[-1]) + 1,
                                    int(local_ids.numel())],
            "train_share": tr.train_nids.tolist(), "num_nodes": tr.g.num_nodes(),
            "params_sha256": params_sha256(model)}


def edge_prediction_loader(g: Any, eids: Any) -> Any:
    """A shuffled ``DistEdgeDataLoader`` over ``eids`` with one uniform negative per
    edge and ``exclude="self"`` (``no-exclude``: none asked for). DGL's EdgeCollator
    builds the pair graphs: a plain neighbour sampler, negatives as a keyword
    (``as_edge_prediction_sampler`` is for the non-distributed loader)."""
    import dgl

    return dgl.dataloading.DistEdgeDataLoader(
        g, eids, dgl.dataloading.NeighborSampler(FANOUTS),
        negative_sampler=dgl.dataloading.negative_sampler.Uniform(1),
        exclude=None if BREAK == "no-exclude" else "self",
        batch_size=BATCH_SIZE, shuffle=True, drop_last=False)


def trainer_edge_equal(tr: td.Trainer, out: Path, part_dir: Path) -> dict[str, Any]:
    """A shuffled epoch of PingPongLoader over a ``DistEdgeDataLoader`` with uniform
    negatives, excluding each batch's own edges from its message-flow graphs
    (``exclude="self"``): every batch's x against ``feat[input_nodes]`` pulled
    afterwards; the batch's seed edges counted among its blocks' edges."""
    import dgl

    feat = tr.g.ndata["feat"]
    # This trainer's edges: every other one of the first 2,400 (DGL's global edge ids).
    eids = torch.arange(tr.rank, min(tr.g.num_edges(), 2400), 2)
    source = edge_prediction_loader(tr.g, eids)
    kept = []
    seeds_in_blocks = 0
    with warnings.catch_warnings(record=True) as caught, \
            pingpong.PingPongLoader(source, feat, device="cpu", timeout=120) as loader:
        warnings.simplefilter("always")
        for batch in loader:
            seeds = batch.pair_graph.edata[dgl.EID]
            seeds_in_blocks += sum(int(torch.isin(block.edata[dgl.EID], seeds).sum())
                                   for block in batch.blocks)
            kept.append((type(batch).__name__, batch.input_nodes.clone(), batch.x.clone(),
                         seeds.clone(), batch.neg_pair_graph.num_edges()))
        stats = {k: float(v) for k, v in loader.stats.items() if isinstance(v, int | float)}
        len_loader = len(loader)
    # The epoch is over: the producer no longer uses DGL's RPC.
    mismatch = sum(
        not same_bits(x, feat[input_nodes.roll(1) if BREAK == "wrong-pull" else input_nodes])
        for _, input_nodes, x, _, _ in kept)
    seen = torch.cat([k[3] for k in kept]).sort().values
    return {"batch_types": sorted({k[0] for k in kept}), "batches": len(kept),
            "len_loader": len_loader, "mismatch_vs_sync_pull": mismatch,
            "edges_are_share": bool(torch.equal(seen, eids)),
            "negatives": sum(k[4] for k in kept), "stats": stats,
            "seed_edges_in_blocks": seeds_in_blocks,
            "warnings": [str(w.message) for w in caught]}


class ParkAt:
    """Yields the source's items; before item ``at`` of epoch ``epoch`` (0-based) it
    writes ``OUT/parked-RANK`` and waits (outside any DGL call) for ``OUT/resume``."""

    def __init__(self, source: Any, out: Path, rank: int, epoch: int, at: int) -> None:
        self.source, self.out, self.rank, self.epoch, self.at = source, out, rank, epoch, at
        self.epochs = 0

    def __iter__(self):
        epoch, self.epochs = self.epochs, self.epochs + 1
        iterator = iter(self.source)
        i = 0
        while True:
            if epoch == self.epoch and i == self.at:
                (self.out / f"parked-{self.rank}").touch()
                while not (self.out / "resume").exists():
                    time.sleep(0.01)
            try:
                item = next(iterator)
            except StopIteration:
                return
            yield item
            i += 1


class InjectId:
    """Yields the source's items; item ``at`` gets ``bad_id`` appended to its input nodes."""

    def __init__(self, source: Any, at: int, bad_id: int) -> None:
        self.source, self.at, self.bad_id = source, at, bad_id

    def __iter__(self):
        for i, (input_nodes, output_nodes, blocks) in enumerate(self.source):
            if i == self.at:
                input_nodes = torch.cat([input_nodes, torch.tensor([self.bad_id])])
            yield input_nodes, output_nodes, blocks


def trainer_bad_id(tr: td.Trainer, out: Path, part_dir: Path) -> dict[str, Any]:
    # Counts pulls; a row source itself. local=False: every batch is pulled, none
    # read in place, so the counts say which batches were.
    feat = td.DelayedRows(tr.g.ndata["feat"], local=False)
    label = td.DelayedRows(tr.g.ndata["label"], local=False)
    n = feat.shape[0]
    bad = n - 1 if BREAK == "in-range" else n
    source = InjectId(td.make_source(tr.g, tr.train_nids, FANOUTS, BATCH_SIZE, shuffle=True),
                      at=2, bad_id=bad)
    delivered, pulls_at_delivery = 0, []
    result: dict[str, Any] = {"num_rows": n, "bad_id": bad, "bad_batch": 2,
                              "sampler_processes": count_sampler_processes()}
    with pingpong.PingPongLoader(source, feat, label, device="cpu", timeout=120) as loader:
        try:
            for _ in loader:
                delivered += 1
                pulls_at_delivery.append([feat.pulls, label.pulls])
            result["exception"] = None
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            result["exception"] = type(exc).__name__
            result["is_id_range_error"] = isinstance(exc, pingpong.IdRangeError)
            result["message"] = str(exc)
        result["feature_pulls"] = feat.pulls
        result["label_pulls"] = label.pulls
    result["delivered"] = delivered
    result["pulls_at_delivery"] = pulls_at_delivery
    return result


def trainer_bad_seed(tr: td.Trainer, out: Path, part_dir: Path) -> dict[str, Any]:
    """``edge-bad-seed``: the exception building a loader over DGL's distributed
    loaders with one out-of-range seed raises (``None``: none)."""
    import dgl

    g = tr.g
    result: dict[str, Any] = {"num_nodes": g.num_nodes(), "num_edges": g.num_edges()}
    last = -1 if BREAK == "in-range" else 0
    sources = {
        "node": lambda: dgl.dataloading.DistNodeDataLoader(
            g, torch.cat([tr.train_nids[:50], torch.tensor([g.num_nodes() + last])]),
            dgl.dataloading.NeighborSampler(FANOUTS), batch_size=BATCH_SIZE),
        "edge": lambda: dgl.dataloading.DistEdgeDataLoader(
            g, torch.tensor([0, 1, g.num_edges() + last]),
            dgl.dataloading.NeighborSampler(FANOUTS), batch_size=BATCH_SIZE),
    }
    for kind, make_source in sources.items():
        try:
            with pingpong.PingPongLoader(make_source(), g.ndata["feat"], timeout=120):
                result[kind] = None
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            result[kind] = {"exception": type(exc).__name__, "message": str(exc)}
    return result


class InjectTypedId:
    """Yields a heterogeneous source's items; item ``at`` gets ``bad_id`` appended to
    its input nodes of type ``ntype``."""

    def __init__(self, source: Any, at: int, ntype: str, bad_id: int) -> None:
        self.source, self.at, self.ntype, self.bad_id = source, at, ntype, bad_id

    def __iter__(self):
        for i, (input_nodes, output_nodes, blocks) in enumerate(self.source):
            if i == self.at:
                input_nodes = dict(input_nodes)
                input_nodes[self.ntype] = torch.cat([input_nodes[self.ntype],
                                                     torch.tensor([self.bad_id])])
            yield input_nodes, output_nodes, blocks


def trainer_hetero_bad_id(tr: td.Trainer, out: Path, part_dir: Path) -> dict[str, Any]:
    """``bad-id`` on the heterogeneous DistGraph: batch 2 gets the author id one past
    the last; every table (paper and author features, paper labels) counts its pulls
    (``DelayedRows``, no local reads), so the counts say which batches were pulled."""

    g = tr.g
    tables = {"paper": td.DelayedRows(g.nodes["paper"].data["feat"], local=False),
              "author": td.DelayedRows(g.nodes["author"].data["feat"], local=False),
              "label": td.DelayedRows(g.nodes["paper"].data["label"], local=False)}
    n = g.num_nodes("author")
    bad = n - 1 if BREAK == "in-range" else n
    source = InjectTypedId(paper_loader(g, tr.train_nids), at=2, ntype="author", bad_id=bad)
    delivered, pulls_at_delivery = 0, []
    result: dict[str, Any] = {"num_rows": n, "bad_id": bad, "bad_batch": 2}
    with pingpong.PingPongLoader(source, {t: tables[t] for t in HETERO_NODES},
                                 {"paper": tables["label"]}, heterogeneous=True,
                                 device="cpu", timeout=120) as loader:
        try:
            for _ in loader:
                delivered += 1
                pulls_at_delivery.append({k: t.pulls for k, t in tables.items()})
            result["exception"] = None
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            result["exception"] = type(exc).__name__
            result["is_id_range_error"] = isinstance(exc, pingpong.IdRangeError)
            result["message"] = str(exc)
        result["pulls"] = {k: t.pulls for k, t in tables.items()}
    result["delivered"] = delivered
    result["pulls_at_delivery"] = pulls_at_delivery
    return result


def watched_servers(loader: pingpong.PingPongLoader) -> list[str] | None:
    watch = loader.server_watch
    return None if watch is None else [f"{s.label} {s.ip}:{s.port}" for s in watch.servers]


def trainer_server_loss(tr: td.Trainer, out: Path, part_dir: Path) -> dict[str, Any]:
    """Epochs of slow DDP steps until the launcher disturbs server 1; how the training
    loop ended is recorded, and -- when that was not pingpong's ServerGoneError (the
    other trainer left while this one was in one of DDP's collectives) -- what the
    loader's server watch says then (``watch_after``). ``server-kill-hetero``,
    ``server-stop-hetero``: on the heterogeneous graph, a table per node type, the
    R-GCN-style model."""
    hetero = MODE in HETERO_SERVER_LOSS_MODES
    if hetero:
        feat, label, source, model, opt = hetero_training(tr)
    else:
        feat, label = tr.g.ndata["feat"], tr.g.ndata["label"]
        source = td.make_source(tr.g, tr.train_nids, FANOUTS, BATCH_SIZE, shuffle=True)
        model, opt = ddp_model(feat.shape[1])
    if MODE in PARKED_KILL_MODES:
        # server-kill-ddp-race: trainer 1 parks a batch later, so it has one more
        # batch in hand than trainer 0 when the server is gone
        at = 3 + tr.rank if MODE == "server-kill-ddp-race" else 3
        source = ParkAt(source, out, tr.rank, epoch=1, at=at)
    step_s = float(os.environ.get("PINGPONG_DISTDGL_STEP_S", "0.2"))
    timeout = None if BREAK == "no-timeout" else TIMEOUT_S
    steps = 0
    record: dict[str, Any] = {"timeout": timeout,
                              "sampler_processes": count_sampler_processes()}
    if BREAK == "no-watch":
        import pingpong.loader as loader_module

        loader_module.dgl_server_watch = lambda: None  # type: ignore[assignment]
    with pingpong.PingPongLoader(source, feat, label, heterogeneous=hetero, device="cpu",
                                 timeout=timeout) as loader:
        record["watched"] = watched_servers(loader)
        try:
            for epoch in range(100):
                for i, batch in enumerate(loader):
                    step(model, opt, batch, y=batch.y["paper"] if hetero else None)
                    steps += 1
                    time.sleep(step_s)  # a slow step: the epoch lasts a few seconds
                    if epoch == 1 and i == 2 and tr.leader:
                        (out / "mid-epoch").touch()
            record["exception"] = None
        except BaseException as exc:  # noqa: BLE001 - recorded for the test
            record.update(exception=type(exc).__name__, module=type(exc).__module__,
                          is_batch_timeout=isinstance(exc, pingpong.BatchTimeoutError),
                          message=str(exc)[:2000], at=time.time(), steps=steps,
                          cause=(None if exc.__cause__ is None
                                 else type(exc.__cause__).__name__))
            if not isinstance(exc, pingpong.ServerGoneError) and loader.server_watch is not None:
                try:  # what the docs tell a DDP trainer to do
                    loader.server_watch.check()
                    record["watch_after"] = None
                except pingpong.ServerGoneError as gone:
                    record["watch_after"] = str(gone)
            write_json(out / f"rank{tr.rank}.json", record)
            sys.stdout.flush()
            os._exit(3)  # DGL's exit hook would wait for the lost server
    return record


def trainer_own_pull_after_loss(tr: td.Trainer, out: Path, part_dir: Path
                                ) -> dict[str, Any]:
    """``server-kill-own-pull``: an epoch; then, the loader still open, the training
    thread parks (``parked-RANK``) while the launcher kills server 1, waits until the
    loader's watch reports the loss, and pulls rows of server 1's partition itself, in
    ``pingpong.rpc_turn()`` -- a ``DistTensor`` pull goes through DGL's
    ``rpc.fast_pull``, which sends from C++, not through ``send_rpc_message``. How
    that pull ended is recorded like ``server-kill``'s training loops."""
    feat, label = tr.g.ndata["feat"], tr.g.ndata["label"]
    source = td.make_source(tr.g, tr.train_nids, FANOUTS, BATCH_SIZE, shuffle=True)
    remote = torch.as_tensor(tr.g.get_partition_book().partid2nids(1))[:64]
    record: dict[str, Any] = {"timeout": TIMEOUT_S, "sampler_processes": 0}
    steps = 0
    with pingpong.PingPongLoader(source, feat, label, device="cpu",
                                 timeout=TIMEOUT_S) as loader:
        record["watched"] = watched_servers(loader)
        assert loader.server_watch is not None
        for _batch in loader:
            steps += 1
        (out / f"parked-{tr.rank}").touch()
        while not (out / "resume").exists():
            time.sleep(0.01)
        seen = False
        for _ in range(100):  # the watch sees the closed connection within a poll or two
            try:
                loader.server_watch.check()
            except pingpong.ServerGoneError:
                seen = True
                break
            time.sleep(0.05)
        record["watch_saw_loss"] = seen
        try:
            with pingpong.rpc_turn():
                rows = feat[remote]
            record.update(exception=None, rows=list(rows.shape))
        except BaseException as exc:  # noqa: BLE001 - recorded for the test
            record_failure_and_exit(out, tr.rank, record, exc, steps)
    return record


def trainer_loader_after_loss(tr: td.Trainer, out: Path, part_dir: Path
                              ) -> dict[str, Any]:
    """``server-kill-between-loaders``: an epoch of one loader, closed; then, no loader
    open, the training thread parks (``parked-RANK``) while the launcher kills
    server 1; then a new loader over the same ``DistNodeDataLoader``, whose first
    epoch must end in ServerGoneError, not in DGL aborting the process at the
    sampler's first send. How it ended is recorded like ``server-kill``'s loops."""
    feat, label = tr.g.ndata["feat"], tr.g.ndata["label"]
    source = td.make_source(tr.g, tr.train_nids, FANOUTS, BATCH_SIZE, shuffle=True)
    record: dict[str, Any] = {"timeout": TIMEOUT_S, "sampler_processes": 0}
    steps = 0
    with pingpong.PingPongLoader(source, feat, label, device="cpu",
                                 timeout=TIMEOUT_S) as first:
        for _batch in first:
            steps += 1
    (out / f"parked-{tr.rank}").touch()
    while not (out / "resume").exists():
        time.sleep(0.01)
    try:
        with pingpong.PingPongLoader(source, feat, label, device="cpu",
                                     timeout=TIMEOUT_S) as loader:
            record["watched"] = watched_servers(loader)
            for _batch in loader:
                steps += 1
        record.update(exception=None, steps=steps)
    except BaseException as exc:  # noqa: BLE001 - recorded for the test
        record_failure_and_exit(out, tr.rank, record, exc, steps)
    return record


def record_failure_and_exit(out: Path, rank: int, record: dict[str, Any],
                            exc: BaseException, steps: int) -> NoReturn:
    """Write how the training loop ended (``exc``) to this rank's report, and leave
    the process with status 3 at once: DGL's exit hook would wait for the lost server."""
    record.update(exception=type(exc).__name__, module=type(exc).__module__,
                  message=str(exc)[:2000], at=time.time(), steps=steps,
                  cause=None if exc.__cause__ is None else type(exc.__cause__).__name__)
    write_json(out / f"rank{rank}.json", record)
    sys.stdout.flush()
    os._exit(3)


def partition_small(mode: str, part_dir: Path) -> Path:
    """Partition the small graph of ``mode`` (``SMALL_GRAPHS``) into
    ``part_dir`` (reused when there); ``orig.pt`` holds DGL's mappings from new ids
    to the original ones and the original tables."""
    import dgl

    meta = part_dir / "pingpong-small.json"
    if meta.exists():
        return part_dir / f"{json.loads(meta.read_text())['graph_name']}.json"
    part_dir.mkdir(parents=True, exist_ok=True)
    g, tables = SMALL_GRAPHS[mode](torch.Generator().manual_seed(5))
    graph_name = f"pp_small_{os.getpid()}"
    with contextlib.redirect_stdout(sys.stderr):  # DGL reports every step on stdout
        orig_nids, orig_eids = dgl.distributed.partition_graph(g, graph_name, 2, str(part_dir),
                                                               return_mapping=True)
    torch.save({"orig_nids": orig_nids, "orig_eids": orig_eids, "tables": tables},
               part_dir / "orig.pt")
    meta.write_text(json.dumps({"graph_name": graph_name}))
    return part_dir / f"{graph_name}.json"


def hetero_graph(gen: torch.Generator) -> tuple[Any, dict[Any, torch.Tensor]]:
    """``hetero-equal``'s and ``edge-hetero``'s graph, and its tables by
    ``(node type, name)``."""
    import dgl

    papers, authors = HETERO_NODES["paper"], HETERO_NODES["author"]

    def edges(num_src: int, num_dst: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(0, num_src, (n,), generator=gen),
                torch.randint(0, num_dst, (n,), generator=gen))

    writes = edges(authors, papers, 5000)
    g = dgl.heterograph({("paper", "cites", "paper"): edges(papers, papers, 8000),
                         ("author", "writes", "paper"): writes,
                         ("paper", "written-by", "author"): (writes[1], writes[0])},
                        num_nodes_dict=HETERO_NODES)
    g.nodes["paper"].data["feat"] = torch.randn(papers, 24, generator=gen)
    g.nodes["paper"].data["label"] = torch.randint(0, 5, (papers,), generator=gen)
    g.nodes["paper"].data["train_mask"] = torch.rand(papers, generator=gen) < 0.5
    g.nodes["author"].data["feat"] = torch.randn(authors, 7, generator=gen).double()
    # edge labels of two types, for edge-hetero's edge_labels= by edge type
    g.edges["cites"].data["label"] = torch.randint(0, 7, (8000,), generator=gen)
    g.edges["writes"].data["label"] = torch.randn(5000, 3, generator=gen)
    tables = {(t, k): g.nodes[t].data[k] for t in HETERO_NODES for k in ("feat", "label")
              if k in g.nodes[t].data}
    return g, {**tables, **{(et, "label"): g.edges[et].data["label"] for et in EDGE_SEED_TYPES}}


def edge_label_graph(gen: torch.Generator) -> tuple[Any, dict[Any, torch.Tensor]]:
    """``edge-labels``' graph (3,000 nodes, 6,000 edges), and its tables by name."""
    import dgl

    g = dgl.graph((torch.randint(0, 3000, (6000,), generator=gen),
                   torch.randint(0, 3000, (6000,), generator=gen)), num_nodes=3000)
    g.ndata["feat"] = torch.randn(3000, 12, generator=gen)
    g.edata["label"] = torch.randint(0, 7, (6000,), generator=gen)
    return g, {"feat": g.ndata["feat"], "label": g.edata["label"]}


HETERO_NODES = {"paper": 3000, "author": 2000}
#: The edge types ``edge-hetero`` takes its seed edges from.
EDGE_SEED_TYPES = ("cites", "writes")
#: Modes that kill server 1 while both trainers' producers are parked (no message in flight).
PARKED_KILL_MODES = ("server-kill", "server-kill-samplers", "server-kill-samplers2",
                     "server-kill-hetero", "server-kill-ddp-race", "server-kill-own-pull",
                     "server-kill-between-loaders")
#: Server-loss modes on the heterogeneous graph.
HETERO_SERVER_LOSS_MODES = ("server-kill-hetero", "server-stop-hetero")
SMALL_GRAPHS = {"hetero-equal": hetero_graph, "edge-hetero": hetero_graph,
                "hetero-bad-id": hetero_graph, "server-kill-hetero": hetero_graph,
                "server-stop-hetero": hetero_graph,
                "edge-labels": edge_label_graph}


def sampler_processes(mode: str) -> int:
    """DGL sampler processes per trainer in ``mode``: ``N`` for a mode ending in
    ``-samplersN``, one for ``-samplers``, else none."""
    base, _, count = mode.rpartition("-samplers")
    return 0 if not base else int(count or 1)


def paper_loader(g: Any, papers: torch.Tensor) -> Any:
    """A shuffled ``DistNodeDataLoader`` over the heterogeneous graph's ``papers``."""
    import dgl

    return dgl.dataloading.DistNodeDataLoader(
        g, {"paper": papers}, dgl.dataloading.NeighborSampler(FANOUTS),
        batch_size=BATCH_SIZE, shuffle=True, drop_last=False)


def init_plain_trainer() -> td.Trainer:
    """A trainer without node shares (its modes choose the seeds themselves)."""
    g, rank, world_size, part_config, _book = td.connect_trainer(threads=1)
    none = torch.empty(0, dtype=torch.int64)
    return td.Trainer(g, rank, world_size, part_config, none, none, none)


def init_hetero_trainer() -> td.Trainer:
    """``td.init_trainer`` for the heterogeneous graph: this rank's share of the papers
    to train on, the same size on both ranks (no validation or test nodes)."""
    import dgl
    import torch.distributed as dist

    g, rank, world_size, part_config, book = td.connect_trainer(threads=1)
    share = dgl.distributed.node_split(g.nodes["paper"].data["train_mask"], book,
                                       ntype="paper", force_even=True)
    count = torch.tensor([len(share)])
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    none = torch.empty(0, dtype=torch.int64)
    return td.Trainer(g, rank, world_size, part_config, share[: int(count)], none, none)


def hetero_training(tr: td.Trainer) -> tuple[dict[str, Any], dict[str, Any], Any,
                                             torch.nn.Module, torch.optim.Optimizer]:
    """The heterogeneous modes' set-up: a feature table per node type, the papers'
    labels, the papers' shuffled ``DistNodeDataLoader`` over this rank's share, and
    ``HeteroSAGE`` under DDP with its optimiser."""
    feats = {t: tr.g.nodes[t].data["feat"] for t in HETERO_NODES}
    labels = {"paper": tr.g.nodes["paper"].data["label"]}
    source = paper_loader(tr.g, tr.train_nids)
    model, opt = hetero_ddp_model(tr.g, {t: f.shape[1] for t, f in feats.items()})
    return feats, labels, source, model, opt


def trainer_hetero_equal(tr: td.Trainer, out: Path, part_dir: Path) -> dict[str, Any]:
    """Two shuffled epochs over a heterogeneous DistGraph: every batch's tables, node
    type by node type, against the rows pulled afterwards and the original tables."""

    feats, labels, source, model, opt = hetero_training(tr)
    truth = torch.load(part_dir / "hetero-equal" / "orig.pt")
    share = tr.train_nids
    losses = []
    epochs = []
    with pingpong.PingPongLoader(source, feats, labels, heterogeneous=True, device="cpu",
                                 timeout=120) as loader:
        for _ in range(2):
            kept = []
            for batch in loader:
                kept.append(({t: i.clone() for t, i in batch.input_nodes.items()},
                             batch.output_nodes["paper"].clone(),
                             {t: x.clone() for t, x in batch.x.items()},
                             batch.y["paper"].clone()))
                losses.append(step(model, opt, batch, batch.y["paper"]))
            diff_sync = diff_truth = rows = local_rows = 0
            types_seen: set[str] = set()
            for input_nodes, seeds, x, y in kept:
                types_seen |= {t for t, ids in input_nodes.items() if len(ids)}
                for t, ids in [*input_nodes.items(), ("paper", seeds)]:
                    rows += len(ids)  # the labels' policy is the papers' node policy
                    local_rows += local_count(feats[t], ids)
                for t, ids in input_nodes.items():
                    ref = ids.roll(1) if BREAK == "wrong-pull" else ids
                    original = truth["tables"][(t, "feat")][truth["orig_nids"][t][ids]]
                    diff_sync += not same_bits(x[t], feats[t][ref])
                    diff_truth += not same_bits(x[t], original)
                diff_sync += not same_bits(y, labels["paper"][seeds])
                diff_truth += not same_bits(
                    y, truth["tables"][("paper", "label")][truth["orig_nids"]["paper"][seeds]])
            order = torch.cat([k[1] for k in kept])
            epochs.append({
                "batches": len(kept), "len_loader": len(loader),
                "mismatch_vs_sync_pull": diff_sync, "mismatch_vs_original": diff_truth,
                "node_types_seen": sorted(types_seen), "rows": rows, "local_rows": local_rows,
                "order_sha256": hashlib.sha256(order.numpy().tobytes()).hexdigest(),
                "seeds_are_train_share": bool(torch.equal(order.sort().values,
                                                          share.sort().values)),
            })
        stats = {k: float(v) for k, v in loader.stats.items() if isinstance(v, int | float)}
        id_ranges = local_id_ranges(loader)
    return {"epochs": epochs, "stats": stats, "local_id_ranges": id_ranges,
            "dtypes": {t: str(x.dtype) for t, x in kept[0][2].items()},
            "losses": losses, "params_sha256": params_sha256(model)}


class HeteroSAGE(torch.nn.Module):
    """Two R-GCN-style layers (a mean SAGE convolution per edge type, summed per
    destination type) over per-type input projections; float64 inputs are cast."""

    def __init__(self, etypes: list[str], in_feats: dict[str, int], hidden: int,
                 classes: int) -> None:
        import dgl.nn as dglnn

        super().__init__()
        self.proj = torch.nn.ModuleDict({t: torch.nn.Linear(n, hidden)
                                         for t, n in in_feats.items()})
        self.layers = torch.nn.ModuleList(
            dglnn.HeteroGraphConv({et: dglnn.SAGEConv(hidden, out, "mean") for et in etypes},
                                  aggregate="sum")
            for out in (hidden, classes))

    def forward(self, blocks: list[Any], x: dict[str, torch.Tensor]) -> torch.Tensor:
        h = {t: self.proj[t](v.float()) for t, v in x.items()}
        for i, (layer, block) in enumerate(zip(self.layers, blocks, strict=True)):
            h = layer(block, (h, {t: v[: block.num_dst_nodes(t)] for t, v in h.items()}))
            if i == 0:
                h = {t: F.relu(v) for t, v in h.items()}
        return h["paper"]


def hetero_ddp_model(g: Any, in_feats: dict[str, int]
                     ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``HeteroSAGE`` under DDP, the same initial weights on every trainer (the last
    layer's convolutions into authors feed no loss: ``find_unused_parameters``).
    ``no-ddp`` breaks it: each trainer trains its own model."""
    torch.manual_seed(0)
    model: torch.nn.Module = HeteroSAGE(list(g.etypes), in_feats, 16, 5)
    if BREAK != "no-ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def params_sha256(model: torch.nn.Module) -> str:
    """A digest of the model's weights, bit for bit (a DDP model's own module's)."""
    module = getattr(model, "module", model)
    digest = hashlib.sha256()
    for t in module.state_dict().values():
        digest.update(bits(t).numpy().tobytes())
    return digest.hexdigest()


def trainer_edge_hetero(tr: td.Trainer, out: Path, part_dir: Path) -> dict[str, Any]:
    """A shuffled epoch of edge prediction on the heterogeneous DistGraph: seed edges
    of two edge types, uniform negatives, ``exclude="self"``, edge labels by edge type
    (keyed by a name and by a canonical triple); every batch's tables against the
    rows pulled afterwards and the original tables, node type by node type and edge
    type by edge type; the batch's seed edges counted among its blocks' edges."""
    import dgl

    g = tr.g
    feats = {t: g.nodes[t].data["feat"] for t in HETERO_NODES}
    writes = ("author", "writes", "paper")
    edge_labels = {"cites": g.edges["cites"].data["label"],
                   writes: g.edges["writes"].data["label"]}
    etype_of = {"cites": ("paper", "cites", "paper"), writes: writes}
    truth = torch.load(part_dir / "edge-hetero" / "orig.pt")
    # This trainer's edges of each seed type: every other one of the first 1,200.
    eids = {et: torch.arange(tr.rank, min(g.num_edges(et), 1200), 2) for et in EDGE_SEED_TYPES}
    source = edge_prediction_loader(g, eids)
    kept = []
    labels: list[dict[Any, torch.Tensor]] = []
    seeds_in_blocks = 0
    with warnings.catch_warnings(record=True) as caught, \
            pingpong.PingPongLoader(source, feats, heterogeneous=True, device="cpu",
                                    edge_labels=edge_labels, timeout=120) as loader:
        warnings.simplefilter("always")
        for batch in loader:
            pair = batch.pair_graph
            seeds = {et: pair.edges[et].data[dgl.EID].clone() for et in pair.canonical_etypes}
            labels.append({key: y.clone() for key, y in batch.y.items()})
            for block in batch.blocks:
                for et, ids in seeds.items():
                    if et in block.canonical_etypes:
                        seeds_in_blocks += int(torch.isin(block.edges[et].data[dgl.EID],
                                                          ids).sum())
            kept.append((type(batch).__name__,
                         {t: i.clone() for t, i in batch.input_nodes.items()},
                         {t: x.clone() for t, x in batch.x.items()}, seeds,
                         batch.neg_pair_graph.num_edges()))
        stats = {k: float(v) for k, v in loader.stats.items() if isinstance(v, int | float)}
        len_loader = len(loader)
    # The epoch is over: the producer no longer uses DGL's RPC.
    diff_sync = diff_truth = 0
    label_diff_sync = label_diff_truth = label_rows = 0
    types_seen: set[str] = set()
    for (_name, input_nodes, x, seeds, _neg), y in zip(kept, labels, strict=True):
        types_seen |= {t for t, ids in input_nodes.items() if len(ids)}
        for t, ids in input_nodes.items():
            ref = ids.roll(1) if BREAK == "wrong-pull" else ids
            diff_sync += not same_bits(x[t], feats[t][ref])
            diff_truth += not same_bits(
                x[t], truth["tables"][(t, "feat")][truth["orig_nids"][t][ids]])
        for key, table in edge_labels.items():
            etype = etype_of[key]
            ids = seeds[etype]
            ref = ids.roll(1) if BREAK == "wrong-pull" else ids
            label_rows += len(ids)
            label_diff_sync += not same_bits(y[key], table[ref])
            orig = truth["orig_eids"].get(etype, truth["orig_eids"].get(etype[1]))
            label_diff_truth += not same_bits(
                y[key], truth["tables"][(etype[1], "label")][orig[ids]])
    seen = {}
    for et in EDGE_SEED_TYPES:
        ids = [k[3][c] for k in kept for c in k[3] if c[1] == et]
        seen[et] = bool(torch.equal(torch.cat(ids).sort().values, eids[et]))
    return {"batch_types": sorted({k[0] for k in kept}), "batches": len(kept),
            "len_loader": len_loader, "mismatch_vs_sync_pull": diff_sync,
            "mismatch_vs_original": diff_truth, "node_types_seen": sorted(types_seen),
            "label_mismatch_vs_sync_pull": label_diff_sync,
            "label_mismatch_vs_original": label_diff_truth, "label_rows": label_rows,
            "label_keys": sorted(str(k) for k in (labels[0] if labels else {})),
            "edges_are_share": seen, "negatives": sum(k[4] for k in kept), "stats": stats,
            "seed_edges_in_blocks": seeds_in_blocks,
            "warnings": [str(w.message) for w in caught]}


def trainer_edge_labels(tr: td.Trainer, out: Path, part_dir: Path) -> dict[str, Any]:
    """One shuffled epoch of edge classification: x against ``feat[input_nodes]`` and
    y against ``label[pair_graph.edata[dgl.EID]]``, pulled afterwards, and the originals."""
    import dgl

    g = tr.g
    feat, label = g.ndata["feat"], g.edata["label"]
    truth = torch.load(part_dir / "edge-labels" / "orig.pt")
    eids = torch.arange(tr.rank, g.num_edges(), 4)  # from both partitions
    source = dgl.dataloading.DistEdgeDataLoader(
        g, eids, dgl.dataloading.NeighborSampler(FANOUTS), batch_size=BATCH_SIZE,
        shuffle=True, drop_last=False)
    kept = []
    with pingpong.PingPongLoader(source, feat, edge_labels=label, device="cpu",
                                 timeout=120) as loader:
        for batch in loader:
            kept.append((type(batch).__name__, batch.input_nodes.clone(), batch.x.clone(),
                         batch.pair_graph.edata[dgl.EID].clone(), batch.y.clone()))
        stats = {k: float(v) for k, v in loader.stats.items() if isinstance(v, int | float)}
        id_ranges = local_id_ranges(loader)
    diff_sync = diff_truth = rows = local_rows = 0
    for _name, input_nodes, x, edge_ids, y in kept:
        ref_edges = edge_ids.roll(1) if BREAK == "wrong-pull" else edge_ids
        diff_sync += not (same_bits(x, feat[input_nodes]) and same_bits(y, label[ref_edges]))
        diff_truth += not (
            same_bits(x, truth["tables"]["feat"][truth["orig_nids"][input_nodes]])
            and same_bits(y, truth["tables"]["label"][truth["orig_eids"][edge_ids]]))
        for table, ids in ((feat, input_nodes), (label, edge_ids)):
            rows += len(ids)
            local_rows += local_count(table, ids)
    return {"batch_types": sorted({k[0] for k in kept}), "batches": len(kept),
            "len_loader": len(loader), "mismatch_vs_sync_pull": diff_sync,
            "mismatch_vs_original": diff_truth, "rows": rows, "local_rows": local_rows,
            "edges_are_share": bool(torch.equal(torch.cat([k[3] for k in kept]).sort().values,
                                                eids)),
            "stats": stats, "local_id_ranges": id_ranges}


class AgainstOriginal:
    """Checks batches against the original tables, through DGL's renumbering (the
    partition's ``orig_nid.pt``); counts the checks and the wrong ones."""

    def __init__(self, part_dir: Path) -> None:
        self.orig_nid = torch.load(part_dir / "orig_nid.pt")
        self.sg = make_synthetic_graph(num_nodes=SPEC.num_nodes, num_classes=SPEC.num_classes,
                                       feat_dim=SPEC.feat_dim, avg_degree=SPEC.avg_degree,
                                       seed=SPEC.seed)
        self.checked = self.wrong = 0

    def rows(self, x: torch.Tensor, ids: torch.Tensor) -> None:
        """``x`` must be the original features of the (DistGraph) node ids ``ids``."""
        self.wrong += not same_bits(x, self.sg.features[self.orig_nid[ids]])

    def batch(self, batch: Any) -> None:
        """A batch's ``x`` and ``y``, counted as one check."""
        self.wrong += not (same_bits(batch.x, self.sg.features[self.orig_nid[batch.input_nodes]])
                           and same_bits(batch.y,
                                         self.sg.labels[self.orig_nid[batch.output_nodes]]))
        self.checked += 1


def break_rpc_lock_if_asked() -> None:
    """``no-rpc-lock``: the producers no longer take turns in DGL's RPC client."""
    if BREAK == "no-rpc-lock":
        from pingpong import _rpc

        _rpc.RPC_LOCK = None


def break_drain_if_asked() -> None:
    """``no-drain``: as before pingpong received DGL's batches for a pass left early."""
    if BREAK == "no-drain":
        from pingpong.forms._dgl_dist import DistLoaderSource

        DistLoaderSource.drop_abandoned_batches = lambda self: 0  # type: ignore[method-assign]


def train_and_val_sources(tr: td.Trainer, part_dir: Path
                          ) -> tuple[Any, Any, AgainstOriginal, Any, Any]:
    """``feat``, ``label``, a checker against the original tables, and two
    ``DistNodeDataLoader`` s: training (batch 16, shuffled) and validation (256
    nodes, batch 64)."""
    return (tr.g.ndata["feat"], tr.g.ndata["label"], AgainstOriginal(part_dir),
            td.make_source(tr.g, tr.train_nids, FANOUTS, 16, shuffle=True),
            td.make_source(tr.g, tr.val_nids[:256], FANOUTS, 64, shuffle=False))


def trainer_early_exit(tr: td.Trainer, out: Path, part_dir: Path) -> dict[str, Any]:
    """Leave a training loader's epoch after two batches, then at once run a whole epoch
    of a second loader (validation), eight times; then both loaders in one ``zip``;
    then an epoch with a pull of its own per batch, in ``pingpong.rpc_turn()``. Every
    batch and pull checked against the original tables."""
    break_rpc_lock_if_asked()
    feat, label, truth, train, val = train_and_val_sources(tr, part_dir)
    check = truth.batch
    errors: list[str] = []
    with pingpong.PingPongLoader(train, feat, label, device="cpu", timeout=60) as train_loader, \
            pingpong.PingPongLoader(val, feat, label, device="cpu", timeout=60) as val_loader:
        try:
            for _ in range(8):
                for i, batch in enumerate(train_loader):
                    check(batch)
                    if i == 1:
                        break
                for batch in val_loader:
                    check(batch)
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            errors.append(f"break, then another loader: {type(exc).__name__}: {exc}"[:300])
        try:
            for train_batch, val_batch in zip(train_loader, val_loader, strict=False):
                check(train_batch)
                check(val_batch)
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            errors.append(f"zip: {type(exc).__name__}: {exc}"[:300])
        own_pulls = 0
        try:  # the training thread's own pulls, mid-epoch, taking their turn
            for batch in train_loader:
                check(batch)
                with (contextlib.nullcontext() if BREAK == "no-turn"
                      else pingpong.rpc_turn()):
                    pulled = feat[batch.output_nodes]
                truth.rows(pulled, batch.output_nodes)
                own_pulls += 1
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            errors.append(f"own pulls: {type(exc).__name__}: {exc}"[:300])
        checked_before = truth.checked
        try:
            shared = two_loaders_over_one_source(val_loader, val, feat, label, check)
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            errors.append(f"two loaders, one source: {type(exc).__name__}: {exc}"[:300])
            shared = []
        shared_checked = truth.checked - checked_before
        val_batches, train_batches = len(val_loader), len(train_loader)
    under_a_stuck_step = new_passes_under_a_stuck_step(tr, feat, label, check)
    return {"checked": checked_before, "wrong": truth.wrong, "errors": errors,
            "val_batches": val_batches, "train_batches": train_batches, "own_pulls": own_pulls,
            "shared": shared, "shared_checked": shared_checked,
            "under_a_stuck_step": under_a_stuck_step}


def stalling_sampler(fanouts: list[int], stall_s: float) -> Any:
    """DGL's neighbour sampler whose next ``sample_blocks`` after ``arm()`` first
    sleeps ``stall_s`` (``stalling`` is set as it starts): a DGL step that outlasts
    pingpong's 2 s wait for an ended producer."""
    import threading

    import dgl

    class Stalling(dgl.dataloading.NeighborSampler):
        def arm(self) -> None:
            self.stalling = threading.Event()
            self.armed = True

        def sample_blocks(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(self, "armed", False):
                self.armed = False
                self.stalling.set()
                time.sleep(stall_s)
            return super().sample_blocks(*args, **kwargs)

    return Stalling(fanouts)


def new_passes_under_a_stuck_step(tr: td.Trainer, feat: Any, label: Any,
                                  check: Any) -> list[str]:
    """Over a ``DistNodeDataLoader`` (256 validation nodes, batch 64) whose sampler
    stalls 4 s in one step: an epoch left while its producer is in that step, then
    at once a whole epoch of the same loader, then (again) of a second loader over
    the same DGL loader.  For each: what the new epoch did -- "whole" when it
    gave every seed once and waited for the stuck step (its producer restarts
    DGL's loader only with the turn in DGL's RPC client), or the error."""
    import dgl

    seeds = tr.val_nids[:256]
    sampler = stalling_sampler(FANOUTS, stall_s=4.0)
    source = dgl.dataloading.DistNodeDataLoader(tr.g, seeds, sampler, batch_size=64,
                                                shuffle=False, drop_last=False)
    outcomes = []
    with pingpong.PingPongLoader(source, feat, label, device="cpu", timeout=60) as loader, \
            pingpong.PingPongLoader(source, feat, label, device="cpu", timeout=60) as other:
        for name, next_loader in (("same loader", loader), ("another loader", other)):
            try:
                sampler.arm()
                epoch = iter(loader)
                if not sampler.stalling.wait(30):
                    outcomes.append(f"{name}: the sampler never stalled")
                    continue
                del epoch  # ended; its producer is in the stalled step, holding the turn
                start = time.monotonic()
                got = []
                for batch in next_loader:
                    check(batch)
                    got.append(batch.output_nodes)
            except Exception as exc:  # noqa: BLE001 - recorded for the test
                outcomes.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
                time.sleep(4.5)  # the stalled step ends before the next round
                continue
            waited = time.monotonic() - start
            whole = bool(torch.equal(torch.cat(got).sort().values, seeds.sort().values))
            outcomes.append(f"{name}: " + ("whole" if whole and waited > 2.0 else
                                           f"{len(got)} batches, waited {waited:.1f} s"))
    return outcomes


def two_loaders_over_one_source(loader: pingpong.PingPongLoader, source: Any, feat: Any,
                                label: Any, check: Any) -> list[str]:
    """A second loader over ``loader``'s ``DistNodeDataLoader``, whose ``iter()``
    restarts the one iterator both would read: in ``zip``, and as a loop nested in
    ``loader``'s; then a whole epoch of each.  What each pattern did."""
    outcomes = []
    with pingpong.PingPongLoader(source, feat, label, device="cpu", timeout=60) as other:
        try:
            for first, second in zip(loader, other, strict=False):
                check(first)
                check(second)
            outcomes.append("zip: no error")
        except pingpong.EpochSupersededError:
            outcomes.append("zip: superseded")
        outer = iter(loader)
        check(next(outer))
        for batch in other:
            check(batch)
        try:
            next(outer)
            outcomes.append("nested: no error")
        except pingpong.EpochSupersededError:
            outcomes.append("nested: superseded")
        for whole in (loader, other):
            for batch in whole:
                check(batch)
    return outcomes


def trainer_temporary(tr: td.Trainer, out: Path, part_dir: Path) -> dict[str, Any]:
    """Temporary loaders, as users write them: never named, never closed. Three times
    ``for i, batch in enumerate(PingPongLoader(train, ...))`` left after two batches;
    then two whole epochs, each through a new temporary loader, with a whole
    validation epoch (another temporary loader) nested after batches 3 and 6; then
    ``zip(PingPongLoader(train, ...), PingPongLoader(val, ...))``. Every batch checked
    against the original tables, each whole epoch's seeds against the trainer's
    share; pingpong threads alive afterwards counted."""
    import gc
    import threading

    break_rpc_lock_if_asked()
    break_drain_if_asked()
    if BREAK == "no-end":  # a dropped loader and its iterator leave their producer running
        from pingpong import _epoch
        from pingpong import loader as loader_module

        loader_module._close = lambda *args, **kwargs: None  # type: ignore[assignment]
        _epoch.EpochIterator.__del__ = lambda self: None  # type: ignore[method-assign]
    feat, label, truth, train, val = train_and_val_sources(tr, part_dir)
    check = truth.batch
    errors: list[str] = []
    whole, whole_batches = [], []
    zipped = nested = 0
    try:
        for _ in range(3):
            for i, batch in enumerate(pingpong.PingPongLoader(train, feat, label, device="cpu",
                                                              timeout=60)):
                check(batch)
                if i == 1:
                    break
        for _ in range(2):
            seeds = []
            for i, batch in enumerate(pingpong.PingPongLoader(train, feat, label, device="cpu",
                                                              timeout=60)):
                check(batch)
                seeds.append(batch.output_nodes.clone())
                if i in (3, 6):  # a nested validation epoch, its own temporary loader
                    for val_batch in pingpong.PingPongLoader(val, feat, label, device="cpu",
                                                             timeout=60):
                        check(val_batch)
                        nested += 1
            whole.append(bool(torch.equal(torch.cat(seeds).sort().values,
                                          tr.train_nids.sort().values)))
            whole_batches.append(len(seeds))
        for train_batch, val_batch in zip(
                pingpong.PingPongLoader(train, feat, label, device="cpu", timeout=60),
                pingpong.PingPongLoader(val, feat, label, device="cpu", timeout=60),
                strict=False):
            check(train_batch)
            check(val_batch)
            zipped += 1
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        errors.append(f"{type(exc).__name__}: {exc}"[:300])
    gc.collect()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(
            t.name.startswith("pingpong-") for t in threading.enumerate()):
        time.sleep(0.05)
    return {"checked": truth.checked, "wrong": truth.wrong, "errors": errors,
            "whole_epochs_are_share": whole, "whole_epoch_batches": whole_batches,
            "train_batches": train.expected_idxs, "val_batches": val.expected_idxs,
            "nested_val_batches": nested, "zipped": zipped,
            "expected_zipped": min(train.expected_idxs, val.expected_idxs),
            "pingpong_threads_left": sorted(t.name for t in threading.enumerate()
                                            if t.name.startswith("pingpong-")),
            "sampler_processes": count_sampler_processes()}


def trainer_close_thread(tr: td.Trainer, out: Path, part_dir: Path) -> dict[str, Any]:
    """``close()`` from another thread mid-epoch, three times at different moments
    (steps of 20 ms; a timer started at the first batch closes the loader after 0,
    0.1 and 0.3 s); after each, a new loader over the same ``DistNodeDataLoader``
    runs a whole epoch. Every batch checked against the original tables, each whole
    epoch's seeds against the share."""
    import threading

    feat, label, truth, train, _val = train_and_val_sources(tr, part_dir)
    rounds = []
    for delay_s in (0.0, 0.1, 0.3):
        loader = pingpong.PingPongLoader(train, feat, label, device="cpu", timeout=60)
        timing: dict[str, float] = {}

        def close_later(loader: pingpong.PingPongLoader = loader,
                        timing: dict[str, float] = timing) -> None:
            start = time.monotonic()
            if BREAK != "no-close":
                loader.close()
            timing["close_s"] = time.monotonic() - start

        timer = threading.Timer(delay_s, close_later)
        delivered, ended_by = 0, "the end of the epoch"
        try:
            for batch in loader:
                truth.batch(batch)
                delivered += 1
                if delivered == 1:  # the epoch has begun (a sampler process starts slowly)
                    timer.start()
                time.sleep(0.02)
        except pingpong.LoaderClosedError:
            ended_by = "LoaderClosedError"
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            ended_by = f"{type(exc).__name__}: {exc}"[:300]
        if timer.ident is not None:  # started
            timer.join()
        loader.close()
        seeds = []
        try:
            with pingpong.PingPongLoader(train, feat, label, device="cpu",
                                         timeout=60) as after:
                for batch in after:
                    truth.batch(batch)
                    seeds.append(batch.output_nodes.clone())
            share = bool(torch.equal(torch.cat(seeds).sort().values,
                                     tr.train_nids.sort().values))
            after_error = None
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            share, after_error = False, f"{type(exc).__name__}: {exc}"[:300]
        rounds.append({"delay_s": delay_s, "delivered": delivered, "ended_by": ended_by,
                       "close_s": timing.get("close_s"), "next_epoch_is_share": share,
                       "next_epoch_batches": len(seeds), "next_epoch_error": after_error})
    return {"rounds": rounds, "train_batches": train.expected_idxs,
            "checked": truth.checked, "wrong": truth.wrong,
            "sampler_processes": count_sampler_processes()}


def trainer_break_samplers(tr: td.Trainer, out: Path, part_dir: Path) -> dict[str, Any]:
    """With DGL sampler processes: three epochs left after two batches, then two whole
    epochs; every batch checked against the original tables, each whole epoch's seeds
    compared with the trainer's share."""
    break_drain_if_asked()
    feat, label = tr.g.ndata["feat"], tr.g.ndata["label"]
    truth = AgainstOriginal(part_dir)
    check = truth.batch
    source = td.make_source(tr.g, tr.train_nids, FANOUTS, 16, shuffle=True)
    whole = []
    with pingpong.PingPongLoader(source, feat, label, device="cpu", timeout=120) as loader:
        for _ in range(3):
            for i, batch in enumerate(loader):
                check(batch)
                if i == 1:
                    break
        for _ in range(2):
            seeds = []
            for batch in loader:
                check(batch)
                seeds.append(batch.output_nodes.clone())
            order = torch.cat(seeds)
            whole.append({"batches": len(seeds), "len_loader": len(loader),
                          "seeds_are_train_share": bool(torch.equal(
                              order.sort().values, tr.train_nids.sort().values))})
        dropped = loader._source.dropped_batches  # type: ignore[attr-defined]
    return {"checked": truth.checked, "wrong": truth.wrong, "whole_epochs": whole,
            "dropped": dropped, "sampler_processes": count_sampler_processes()}


TRAINERS = {"equal": trainer_equal, "equal-samplers": trainer_equal,
            "early-exit": trainer_early_exit, "break-samplers": trainer_break_samplers,
            "edge-labels": trainer_edge_labels, "edge-hetero": trainer_edge_hetero,
            "hetero-equal": trainer_hetero_equal, "hetero-bad-id": trainer_hetero_bad_id,
            "edge-equal": trainer_edge_equal, "bad-id": trainer_bad_id,
            "edge-bad-seed": trainer_bad_seed,
            "bad-id-samplers": trainer_bad_id, "server-stop-samplers": trainer_server_loss,
            "server-kill": trainer_server_loss, "server-kill-random": trainer_server_loss,
            "server-kill-samplers": trainer_server_loss,
            "server-kill-hetero": trainer_server_loss,
            "server-stop-hetero": trainer_server_loss,
            "server-kill-ddp-race": trainer_server_loss,
            "server-kill-own-pull": trainer_own_pull_after_loss,
            "server-kill-between-loaders": trainer_loader_after_loss,
            "server-stop": trainer_server_loss,
            "equal-samplers2": trainer_equal, "break-samplers2": trainer_break_samplers,
            "byvalue-samplers3": trainer_equal,
            "bad-id-samplers2": trainer_bad_id, "server-stop-samplers2": trainer_server_loss,
            "server-kill-samplers2": trainer_server_loss,
            "break-samplers3": trainer_break_samplers,
            "temporary": trainer_temporary, "temporary-samplers": trainer_temporary,
            "close-thread": trainer_close_thread,
            "close-thread-samplers": trainer_close_thread}


def trainer_main(mode: str, out: Path, part_dir: Path) -> None:

    global MODE
    MODE = mode
    if mode.startswith("hetero") or mode in HETERO_SERVER_LOSS_MODES:
        tr = init_hetero_trainer()
    elif mode in ("edge-labels", "edge-hetero"):
        tr = init_plain_trainer()
    else:
        tr = td.init_trainer(threads=1)
    record = TRAINERS[mode](tr, out, part_dir)
    write_json(out / f"rank{tr.rank}.json", {"rank": tr.rank, "pid": os.getpid(), **record})
    td.end_trainer(tr.rank)


# --------------------------------------------------------------------------- launcher
def launcher_main(mode: str, out: Path, part_dir: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    part_config = (partition_small(mode, part_dir / mode) if mode in SMALL_GRAPHS else
                   td.partition_synthetic(SPEC, part_dir, 2, log=lambda s: None))
    command = [sys.executable, str(Path(__file__).resolve()), mode, str(out), str(part_dir)]
    job: dict[str, Any] = {"mode": mode, "break": BREAK, "events": []}
    signal.signal(signal.SIGTERM, td._raise_system_exit)
    with tempfile.TemporaryDirectory(prefix="pingpong-distdgl-") as tmp:
        cluster = td.LocalCluster(command, part_config, Path(tmp), num_parts=2, log_dir=out,
                                  trainer_log_dir=out,
                                  num_samplers=sampler_processes(mode),
                                  graph_format="csc,coo" if mode.startswith("edge") else "csc")
        try:
            cluster.start()
            pids = cluster.pids()
            if BREAK == "leak":  # a process this launcher "forgets" to stop
                leak = subprocess.Popen(["sleep", "600"], start_new_session=True,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                pids.append({"role": "leak", "index": 0, "pid": leak.pid, "pgid": leak.pid,
                             "token": cluster.token})
            write_json(out / "pids.json", pids)
            job["trainers"] = wait_for_trainers(cluster, mode, out, job)
            if all(t["returncode"] == 0 for t in job["trainers"].values()):
                cluster.wait_for_servers()  # DGL shuts them down; stop() would interrupt it
        finally:
            cluster.stop()
        job["servers"] = {str(p.index): td.describe_exit(p.popen.returncode)
                          for p in cluster.servers}
    write_json(out / "job.json", job)
    return 0


def wait_for_trainers(cluster: td.LocalCluster, mode: str, out: Path,
                      job: dict[str, Any]) -> dict[str, Any]:
    """Wait until every trainer has ended; record how and when.

    Deadlines: 110 s for the whole job; after a server was disturbed,
    ``TIMEOUT_S + 45`` s. A trainer still running then is asked for its Python
    stacks (they go to its log), killed and marked ``hung``.
    """
    start = time.monotonic()
    deadline = start + 110.0
    disturbed_at = None
    ended: dict[str, Any] = {}
    while True:
        now = time.monotonic()
        parked = all((out / f"parked-{p.index}").exists() for p in cluster.trainers)
        ready = parked if mode in PARKED_KILL_MODES else (out / "mid-epoch").exists()
        if (disturbed_at is None and mode.startswith("server-") and BREAK != "no-signal"
                and ready):
            sig = signal.SIGSTOP if mode.startswith("server-stop") else signal.SIGKILL
            victim = cluster.servers[1].popen
            os.kill(victim.pid, sig)
            if mode in PARKED_KILL_MODES:
                victim.wait(10)  # gone, its sockets closed: then the producers go on
                (out / "resume").touch()
            disturbed_at = now
            deadline = min(deadline, now + TIMEOUT_S + 45.0)
            job["events"].append({"t": now - start, "signal": sig.name, "server": 1,
                                  "pid": victim.pid})
        for p in cluster.trainers:
            code = p.popen.poll()
            if code is not None and str(p.index) not in ended:
                ended[str(p.index)] = {
                    "exit": td.describe_exit(code), "returncode": code,
                    "t": now - start,
                    "after_disturbance_s": None if disturbed_at is None else now - disturbed_at,
                    "hung": False}
        if len(ended) == len(cluster.trainers):
            return ended
        if now > deadline:
            cluster.dump_stacks()  # into the logs, which a failing test shows
            for p in cluster.trainers:
                if str(p.index) not in ended:
                    ended[str(p.index)] = {"exit": "still running at the deadline",
                                           "returncode": None, "t": now - start,
                                           "hung": True}
            return ended
        time.sleep(0.05)


def main() -> int:
    mode, out, part_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    if td.run_role(lambda: trainer_main(mode, out, part_dir)):
        return 0
    return launcher_main(mode, out, part_dir)


if __name__ == "__main__":
    sys.exit(main())
