"""The server watch (pingpong.serverwatch) and the loader's ``health_check``.

Real TCP connections on 127.0.0.1 stand in for DGL's RPC connections (the
watch reads the kernel's TCP state, whoever opened the socket); the DistDGL
job with a real server killed mid-epoch is in tests/test_distdgl.py.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
import torch

import pingpong
from pingpong.errors import ConfigError, ServerGoneError
from pingpong.serverwatch import Server, ServerWatch, dgl_server_watch

needs_tcp_info = pytest.mark.skipif(
    not hasattr(socket, "TCP_INFO"), reason="the watch reads TCP_INFO (Linux)"
)


@contextlib.contextmanager
def connected_pair() -> Iterator[tuple[socket.socket, socket.socket, int]]:
    """(client, server side, port): an established connection to a listener on 127.0.0.1."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        try:
            yield client, served, port
        finally:
            client.close()
            served.close()


def wait_until_gone(watch: ServerWatch, limit_s: float = 5.0) -> ServerGoneError:
    deadline = time.monotonic() + limit_s
    while True:
        try:
            watch.check()
        except ServerGoneError as exc:
            return exc
        assert time.monotonic() < deadline, "the closed connection was never noticed"
        time.sleep(0.01)


@needs_tcp_info
def test_a_live_connection_passes_and_a_closed_one_raises_naming_the_server() -> None:
    with connected_pair() as (client, served, port):
        watch = ServerWatch.of_connections([Server("DGL server 1", "127.0.0.1", port)])
        try:
            for _ in range(3):
                watch.check()  # alive: nothing
            client.sendall(b"ping")
            assert served.recv(4) == b"ping"
            served.close()  # the server's process dies: its end closes
            exc = wait_until_gone(watch)
            assert isinstance(exc, ConnectionError)
            message = str(exc)
            assert f"DGL server 1 at 127.0.0.1:{port}" in message
            assert "CLOSE_WAIT" in message
            assert "os._exit" in message
            with pytest.raises(ServerGoneError) as again:  # it stays gone
                watch.check()
            assert again.value is not exc  # a fresh object: its notes and traceback are its own
            assert str(again.value) == message
        finally:
            watch.close()


@needs_tcp_info
def test_a_connection_its_server_closed_before_the_watch_was_built_is_watched() -> None:
    """From a DistDGL review: a server that died while no loader was open leaves the
    trainer's connection in CLOSE_WAIT; the next loader's watch skipped it (not
    ESTABLISHED), so the loader had no watch and DGL aborted the process at its
    first send. Now it is watched, and the first check raises naming the server."""
    with connected_pair() as (_client, served, port):
        served.close()  # the server's process died before any watch existed
        deadline = time.monotonic() + 5
        while not any(c.status == psutil.CONN_CLOSE_WAIT and c.raddr and c.raddr.port == port
                      for c in psutil.Process().net_connections(kind="tcp")):
            assert time.monotonic() < deadline, "the connection never reached CLOSE_WAIT"
            time.sleep(0.01)
        watch = ServerWatch.of_connections([Server("DGL server 1", "127.0.0.1", port)])
        try:
            with pytest.raises(ServerGoneError, match=rf"DGL server 1 at 127.0.0.1:{port} "
                                                      r"closed its connection \(TCP CLOSE_WAIT\)"):
                watch.check()
        finally:
            watch.close()


@needs_tcp_info
def test_a_reset_connection_raises() -> None:
    with connected_pair() as (_client, served, port):
        watch = ServerWatch.of_connections([Server("s", "127.0.0.1", port)])
        try:
            served.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            served.close()  # linger 0: RST instead of FIN
            exc = wait_until_gone(watch)
            assert "closed its connection (TCP CLOSE)" in str(exc)
        finally:
            watch.close()


@needs_tcp_info
def test_only_the_named_server_is_watched() -> None:
    with connected_pair() as (_, served_a, _port_a), connected_pair() as (_, _served_b, port_b):
        watch = ServerWatch.of_connections([Server("b", "127.0.0.1", port_b)])
        try:
            assert [s.label for s in watch.servers] == ["b"]
            served_a.close()  # another connection of this process ends: not our business
            time.sleep(0.05)
            watch.check()
        finally:
            watch.close()


@needs_tcp_info
@pytest.mark.parametrize("closed", [0, 1], ids=["first", "second"])
def test_every_connection_to_a_server_is_watched(closed: int) -> None:
    """Two connections of this process to one server: the watch holds both, and the
    loss of either one raises."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        served = [listener.accept()[0] for _ in clients]
        try:
            watch = ServerWatch.of_connections([Server("s", "127.0.0.1", port)])
            try:
                assert [s.label for s in watch.servers] == ["s", "s"]  # one per connection
                watch.check()
                served[closed].close()
                assert f"s at 127.0.0.1:{port}" in str(wait_until_gone(watch))
            finally:
                watch.close()
        finally:
            for sock in (*clients, *served):
                sock.close()


@needs_tcp_info
def test_a_server_without_a_connection_is_refused_by_name() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(ConnectionError, match=rf"DGL server 7 \(127.0.0.1:{port}\)"):
        ServerWatch.of_connections([Server("DGL server 7", "127.0.0.1", port)])


@needs_tcp_info
def test_close_drops_only_the_watch_descriptors() -> None:
    proc = psutil.Process()
    with connected_pair() as (client, served, port):
        before = proc.num_fds()
        watch = ServerWatch.of_connections([Server("s", "127.0.0.1", port)])
        assert proc.num_fds() == before + 1  # one duplicate of the client's descriptor
        watch.close()
        watch.close()  # idempotent
        assert proc.num_fds() == before
        client.sendall(b"still open")  # the owner's descriptor is untouched
        assert served.recv(10) == b"still open"
        served.close()
        time.sleep(0.05)
        watch.check()  # closed: reads no connection any more


@needs_tcp_info
def test_after_close_a_loss_seen_before_is_still_raised() -> None:
    """The documented contract after close(): a loss the watch saw while open is
    raised again (a DDP trainer may ask after its loader closed); one it had not
    seen goes unreported, since the watch reads no connection any more."""
    with connected_pair() as (_, served, port), connected_pair() as (_, served2, port2):
        seen = ServerWatch.of_connections([Server("s", "127.0.0.1", port)])
        unseen = ServerWatch.of_connections([Server("t", "127.0.0.1", port2)])
        served.close()
        wait_until_gone(seen)
        seen.close()
        unseen.close()
        served2.close()
        time.sleep(0.05)
        with pytest.raises(ServerGoneError, match=rf"^s at 127\.0\.0\.1:{port} "):
            seen.check()
        with pytest.raises(ServerGoneError):  # what DGL's send guard calls, the same
            seen.check_if_open()
        unseen.check()
        assert unseen.check_if_open() is False


@needs_tcp_info
def test_checks_from_two_threads_while_closing_do_not_fail() -> None:
    with connected_pair() as (_, _served, port):
        watch = ServerWatch.of_connections([Server("s", "127.0.0.1", port)])
        errors: list[BaseException] = []

        def hammer() -> None:
            try:
                for _ in range(2000):
                    watch.check()
            except BaseException as exc:  # noqa: BLE001 - collected for the assert
                errors.append(exc)

        threads = [threading.Thread(target=hammer) for _ in range(2)]
        for t in threads:
            t.start()
        watch.close()
        for t in threads:
            t.join()
        assert errors == []


def test_without_a_dgl_rpc_client_there_is_nothing_to_watch() -> None:
    assert dgl_server_watch() is None  # dgl.distributed perhaps not even imported
    pytest.importorskip("dgl.distributed")
    assert dgl_server_watch() is None  # imported, but initialize() never called


# --------------------------------------------------------------------------- the loader
#: A node-classification item: input ids, output ids, blocks (none here).
Triple = tuple[torch.Tensor, torch.Tensor, list]


def triples(n: int, rows: int = 50, per: int = 4) -> list[Triple]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, rows, (per,), generator=g), torch.arange(2), [])
            for _ in range(n)]


class Rows:
    """A row source whose fetches are logged (with the events of a test) in ``log``."""

    def __init__(self, table: torch.Tensor, log: list[str], name: str) -> None:
        self.table, self.log, self.name = table, log, name
        self.shape, self.dtype = table.shape, table.dtype

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        self.log.append(self.name)
        return self.table[ids]


class Dead(Exception):
    pass


def test_health_check_runs_before_every_source_step_and_fetch() -> None:
    log: list[str] = []
    features, labels = torch.randn(50, 3), torch.arange(50)
    items = triples(4)

    class Source:
        def __iter__(self) -> Iterator[Triple]:
            for item in items:
                log.append("next")
                yield item

    def check() -> None:
        if threading.current_thread() is not threading.main_thread():
            log.append("check")

    loader = pingpong.PingPongLoader(Source(), Rows(features, log, "x"), Rows(labels, log, "y"),
                                     health_check=check)
    got = [b.x.clone() for b in loader]
    loader.close()
    assert [torch.equal(x, features[item[0]]) for x, item in zip(got, items, strict=True)] \
        == [True] * 4
    assert log == ["check", "next", "check", "x", "check", "y"] * 4 + ["check"]


def test_a_failing_check_on_the_producer_ends_the_epoch_before_the_next_fetch() -> None:
    log: list[str] = []
    features = torch.randn(50, 3)
    dead = threading.Event()

    def check() -> None:
        if dead.is_set():
            log.append("dead")
            raise Dead("server 3 is gone")

    loader = pingpong.PingPongLoader(triples(8), Rows(features, log, "x"), num_buffers=2,
                                     health_check=check)
    seen = 0
    with pytest.raises(Dead, match="server 3 is gone"):
        for batch in loader:
            assert torch.equal(batch.x, features[batch.input_nodes])
            seen += 1
            if seen == 2:
                dead.set()
    # Batches prepared before the death may still be delivered (one in the other
    # slot, one fetched and waiting for a slot); no fetch follows a failed check.
    first_dead = log.index("dead")
    assert set(log[first_dead:]) == {"dead"}, log
    assert log[:first_dead].count("x") >= 2
    assert 2 <= seen <= 4
    dead.clear()  # the server is back: the next epoch runs
    assert len(list(loader)) == 8
    loader.close()


def test_a_failing_check_reaches_next_while_the_producer_is_stuck_in_a_fetch() -> None:
    """A pull in flight to a dead server never returns: the training loop must not wait
    for it (no timeout is set here, so only the check can end the wait)."""
    features = torch.randn(50, 3)
    released, dead, fetching = threading.Event(), threading.Event(), threading.Event()

    class Stuck:
        shape, dtype = features.shape, features.dtype
        calls = 0

        def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
            Stuck.calls += 1
            if Stuck.calls == 2:  # the second batch's fetch: the server dies during it
                fetching.set()
                released.wait(30)
            return features[ids]

    def check() -> None:
        if dead.is_set():
            raise Dead("gone")

    loader = pingpong.PingPongLoader(triples(4), Stuck(), timeout=None, health_check=check)
    it = iter(loader)
    first = next(it)
    assert torch.equal(first.x, features[first.input_nodes])
    assert fetching.wait(10)
    dead.set()
    start = time.monotonic()
    with pytest.raises(Dead):
        next(it)
    assert time.monotonic() - start < 2.0
    released.set()
    loader.close()


def test_health_check_must_be_callable() -> None:
    with pytest.raises(ConfigError, match="health_check must be a callable"):
        pingpong.PingPongLoader(triples(1), torch.randn(50, 3), health_check=3)  # type: ignore[arg-type]


def test_a_plain_loader_watches_no_server() -> None:
    with pingpong.PingPongLoader(triples(1), torch.randn(50, 3)) as loader:
        assert loader.server_watch is None


@needs_tcp_info
def test_a_server_watch_as_health_check_surfaces_a_dead_connection() -> None:
    """The watch and the loader together, over a real connection closed mid-epoch."""
    features = torch.randn(50, 3)
    with connected_pair() as (_, served, port):
        watch = ServerWatch.of_connections([Server("server 1", "127.0.0.1", port)])
        loader = pingpong.PingPongLoader(triples(50), features, health_check=watch.check)
        try:
            delivered = 0
            with pytest.raises(ServerGoneError, match=f"server 1 at 127.0.0.1:{port}"):
                for i, batch in enumerate(loader):
                    assert torch.equal(batch.x, features[batch.input_nodes])
                    delivered += 1
                    if i == 3:
                        served.close()
                        time.sleep(0.05)
            assert 4 <= delivered <= 6  # and those prepared before the close (2 at most)
        finally:
            loader.close()
            watch.close()


# --------------------------------------------------------------------------- DGL's sends
@needs_tcp_info
def test_dgl_sends_are_checked_while_a_watch_is_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a watch is open, every DGL RPC message first checks it: a dead server
    gives ServerGoneError in the caller instead of a send (which would make DGL's
    sender thread abort the process). DGL's C send is replaced by a recorder here;
    the real one is exercised by tests/test_distdgl.py. So is ``fast_pull``, through
    which a DistTensor pull sends without ``send_rpc_message``."""
    rpc = pytest.importorskip("dgl.distributed.rpc")
    from pingpong import serverwatch

    sent: list[tuple[object, int]] = []
    monkeypatch.setattr(rpc, "send_rpc_message", lambda msg, target: sent.append((msg, target)))
    pulled: list[tuple[object, ...]] = []
    monkeypatch.setattr(rpc, "fast_pull", lambda *args: pulled.append(args))
    monkeypatch.setattr(serverwatch, "_guarding", ())
    monkeypatch.setattr(serverwatch, "_open", ())
    with connected_pair() as (_, served, port):
        watch = ServerWatch.of_connections([Server("DGL server 1", "127.0.0.1", port)])
        serverwatch._guard_dgl_sends(watch)
        serverwatch._guard_dgl_sends(watch)  # installed again: still one wrapper
        guarded = rpc.send_rpc_message
        assert guarded.pingpong_guarded
        assert guarded.__wrapped__.__name__ == "<lambda>"
        assert rpc.fast_pull.pingpong_guarded  # a DistTensor pull: sent from C++
        rpc.send_rpc_message("request", 1)
        rpc.fast_pull("feat", "ids", "parts")
        assert sent == [("request", 1)]
        assert pulled == [("feat", "ids", "parts")]
        served.close()
        time.sleep(0.05)
        with pytest.raises(ServerGoneError, match="DGL server 1"):
            rpc.send_rpc_message("another", 0)
        with pytest.raises(ServerGoneError, match="DGL server 1"):
            rpc.fast_pull("feat", "more ids", "parts")
        assert sent == [("request", 1)]  # nothing handed to DGL after the death
        assert len(pulled) == 1
        watch.close()
        assert serverwatch._guarding == ()
        rpc.send_rpc_message("after close", 0)  # a closed watch guards nothing
        rpc.fast_pull("after close")
        assert sent[-1] == ("after close", 0)
        assert pulled[-1] == ("after close",)


@needs_tcp_info
def test_each_dgl_send_checks_each_set_of_connections_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three loaders open in a trainer watch the same DGL connections: a send checks
    one of their watches, not all three; when that one closes, the next guards --
    also for a send that read the list of watches before the close."""
    rpc = pytest.importorskip("dgl.distributed.rpc")
    from pingpong import serverwatch

    monkeypatch.setattr(rpc, "send_rpc_message", lambda msg, target: None)
    monkeypatch.setattr(serverwatch, "_guarding", ())
    monkeypatch.setattr(serverwatch, "_open", ())
    checks: list[str] = []

    class Counted(ServerWatch):
        name = ""

        def check_if_open(self) -> bool:
            checks.append(self.name)
            return super().check_if_open()

    with connected_pair() as (_, served, port), connected_pair() as (_, _other, port2):
        def watch(name: str, at: int) -> Counted:
            w = Counted.of_connections([Server("DGL server 0", "127.0.0.1", at)])
            w.name = name
            serverwatch._guard_dgl_sends(w)
            return w

        a, b, c = watch("a", port), watch("b", port), watch("c", port2)
        rpc.send_rpc_message("request", 0)
        assert checks == ["a", "c"]
        stale = serverwatch._guarding  # what a send in another thread may hold
        a.close()
        served.close()
        time.sleep(0.05)
        monkeypatch.setattr(serverwatch, "_guarding", stale)
        with pytest.raises(ServerGoneError):  # a is closed: b checked instead
            rpc.send_rpc_message("request", 0)
        assert checks[2:] == ["a", "b"]
        monkeypatch.setattr(serverwatch, "_guarding", tuple(
            tuple(w for w in group if w is not a) for group in stale))
        with pytest.raises(ServerGoneError):  # and once the list is current, b alone
            rpc.send_rpc_message("request", 0)
        assert checks[4:] == ["b"]
        for w in (b, c):
            w.close()
        assert serverwatch._guarding == serverwatch._open == ()


class _Client:
    """What dgl_server_watch reads of DGL's KVClient: its server namebook."""

    def __init__(self, namebook: object) -> None:
        self._server_namebook = namebook


@needs_tcp_info
def test_the_watch_is_built_from_dgls_server_namebook(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    kvstore = pytest.importorskip("dgl.distributed.kvstore")
    from pingpong import serverwatch

    monkeypatch.setattr(serverwatch, "_guarding", ())
    monkeypatch.setattr(serverwatch, "_open", ())
    with connected_pair() as (_, served, port):
        # {server id: [machine id, ip, port, group count]}, as DGL 1.1 and 2.1 keep it
        monkeypatch.setattr(kvstore, "get_kvstore",
                            lambda: _Client({0: [0, "localhost", port, 1]}))
        watch = dgl_server_watch()
        assert watch is not None
        try:
            assert [(s.label, s.ip, s.port) for s in watch.servers] == [
                ("DGL server 0", "127.0.0.1", port)]  # the name resolved, as sockets show it
            watch.check()
            served.close()
            assert "DGL server 0" in str(wait_until_gone(watch))
        finally:
            watch.close()

    with caplog.at_level("INFO", logger="pingpong.serverwatch"):
        monkeypatch.setattr(kvstore, "get_kvstore", lambda: _Client({0: [0, "127.0.0.1", 9, 1]}))
        assert dgl_server_watch() is None  # no connection to it: not watched, no error
        monkeypatch.setattr(kvstore, "get_kvstore", lambda: _Client({0: ["malformed"]}))
        assert dgl_server_watch() is None  # DGL laid out differently: not watched, no error
    messages = [r.getMessage() for r in caplog.records]
    assert any("no TCP connection to DGL server 0 (127.0.0.1:9)" in m
               for m in messages), messages
    assert any("reading DGL's client failed" in m for m in messages), messages


def on_a_producer_thread() -> bool:
    return threading.current_thread().name.startswith("pingpong-producer")


@pytest.mark.parametrize("server_dead", [True, False])
def test_a_source_failure_while_the_check_fails_becomes_the_checks_error(
        server_dead: bool) -> None:
    """A DGL sampler process whose server died ends in ConnectionResetError in the trainer:
    the loop gets what the check says (ServerGoneError there), caused by that error.
    (The check fails only on the producer thread: the training thread's own polls
    while next() waits would otherwise raise it first, uncaused.)"""
    dead = threading.Event()

    class Source:
        def __iter__(self) -> Iterator[Triple]:
            items = triples(6)
            yield from items[:2]
            if server_dead:
                dead.set()
            raise ConnectionResetError(104, "Connection reset by peer")

    def check() -> None:
        if dead.is_set() and on_a_producer_thread():
            raise Dead("server 3 is gone")

    with pingpong.PingPongLoader(Source(), torch.randn(50, 3), health_check=check) as loader:
        with pytest.raises((Dead, ConnectionResetError)) as caught:
            list(loader)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    if server_dead:
        assert type(caught.value) is Dead
        assert isinstance(caught.value.__cause__, ConnectionResetError)
        assert "health check failed after the producer's ConnectionResetError" in notes
        assert "raised in pingpong thread" in "\n".join(caught.value.__cause__.__notes__)
    else:
        assert type(caught.value) is ConnectionResetError
        assert caught.value.__cause__ is None
        assert "raised in pingpong thread" in notes


def test_a_source_failure_that_says_what_the_check_says_is_kept() -> None:
    """DGL's guarded send raises the watch's own error inside the source: the loop
    gets that error as it was, not the check's copy of it caused by it."""
    dead = threading.Event()

    class Source:
        def __iter__(self) -> Iterator[Triple]:
            yield triples(1)[0]
            dead.set()
            raise Dead("server 3 is gone")  # from inside a DGL send: the check's words

    def check() -> None:
        if dead.is_set() and on_a_producer_thread():
            raise Dead("server 3 is gone")

    with pingpong.PingPongLoader(Source(), torch.randn(50, 3), health_check=check) as loader:
        with pytest.raises(Dead, match="server 3 is gone") as caught:
            list(loader)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert caught.value.__cause__ is None
    assert "health check failed after" not in notes
    assert "raised in pingpong thread" in notes


@pytest.mark.parametrize("message", ["fixed", "changing"])
def test_a_failing_check_is_not_its_own_cause(message: str) -> None:
    calls = []

    def check() -> None:
        if on_a_producer_thread():
            calls.append(1)
            raise Dead("server 3 is gone" + (f" (call {len(calls)})" if message == "changing"
                                              else ""))

    with pingpong.PingPongLoader(triples(3), torch.randn(50, 3), health_check=check) as loader:
        with pytest.raises(Dead, match="server 3 is gone") as caught:
            list(loader)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "raised in pingpong thread" in notes  # the producer's failure, not a poll's
    assert "health check failed after" not in notes
    assert caught.value.__cause__ is None


def test_a_check_raising_systemexit_after_a_failure_keeps_the_failure() -> None:
    dead = threading.Event()

    class Source:
        def __iter__(self) -> Iterator[Triple]:
            yield triples(1)[0]
            dead.set()
            raise ConnectionResetError(104, "Connection reset by peer")

    def check() -> None:
        if dead.is_set() and on_a_producer_thread():
            raise SystemExit(3)

    with pingpong.PingPongLoader(Source(), torch.randn(50, 3), health_check=check) as loader:
        with pytest.raises(ConnectionResetError):
            list(loader)
