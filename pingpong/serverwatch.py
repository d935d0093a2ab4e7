"""Noticing that a server the loader depends on has died, before DGL's RPC layer does.

DistDGL's trainers pull rows and sample through DGL's RPC client, which keeps
one TCP connection to every server.  When a server process dies, the kernel
closes its end of those connections and the trainer's end goes to
``CLOSE_WAIT``; nothing tells DGL until it next *sends* to that server, and
then its C++ sender thread aborts the whole process (DGL 1.1 and 2.1:
``socket_communicator.cc``, ``Check failed: tmp != -1``, SIGABRT) -- no
Python exception, nothing for a training loop to catch.  A request that was
already sent waits for its reply for ever.

A :class:`ServerWatch` holds a duplicate of each of the process's connections
to the servers and reads its TCP state (``TCP_INFO``: a few microseconds).
It is checked

- on the producer thread before every step of the source and every
  row-source fetch;
- before every message DGL sends, from any thread: while a watch is open,
  ``dgl.distributed.rpc.send_rpc_message`` (which every request of DGL's RPC
  layer goes through, documented to raise ``ConnectionError``) and
  ``dgl.distributed.rpc.fast_pull`` (a ``DistTensor`` pull, which sends its
  requests from C++ without the former) check the open watches first -- so
  no request is handed to DGL's sender thread once a server's death is
  visible;
- on the training thread every ``POLL_S`` while ``next()`` waits (a pull
  already in flight to a dead server never returns).

A failed check raises :class:`~pingpong.errors.ServerGoneError` (a
``ConnectionError``), which ends the epoch and reaches the training loop.
When the epoch fails in some other way first -- with DGL sampler processes,
DGL aborts the sampler process at its send to the dead server and the
trainer's read from it raises ``ConnectionResetError`` or ``EOFError`` -- the
producer runs the check once more, and if it fails the training loop gets its
``ServerGoneError`` with that failure as its ``__cause__``.

What it cannot see: a server whose *machine* vanished without closing the
connection (power loss, a cut cable) stays ``ESTABLISHED`` until TCP gives up;
the loader's ``timeout=`` covers that.  And a server dying while one of
DGL's messages is in flight -- between the check in ``send_rpc_message`` and
the socket write on DGL's sender thread: microseconds on an idle machine,
longer when its cores are busy -- still aborts the process.  Linux only (where
``socket.TCP_INFO`` exists); elsewhere :func:`dgl_server_watch` returns ``None``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import psutil

from .errors import ServerGoneError

__all__ = ["Server", "ServerWatch", "dgl_server_watch"]

logger = logging.getLogger(__name__)

#: ``tcpi_state`` values (linux/tcp_states.h) and their names, for messages.
TCP_ESTABLISHED = 1
TCP_STATE_NAMES = {
    1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
    6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING",
}


@dataclass(frozen=True)
class Server:
    """A server as named in error messages: ``label`` (``"DGL server 1"``), ``ip``, ``port``."""

    label: str
    ip: str
    port: int


_Watch = TypeVar("_Watch", bound="ServerWatch")


class ServerWatch:
    """The TCP state of this process's connections to a set of servers.

    Built from connections that exist now (see :meth:`of_connections`); it
    keeps a duplicate file descriptor of each, so it reads the state of the
    very socket the RPC library uses even if that library closes its own
    descriptor and the number is reused.  ``watched``: each server with that
    duplicate socket (the watch owns and closes them).  Thread-safe; :meth:`close` is
    idempotent.  After it :meth:`check` reads no connection: it raises again a
    loss it saw before the close, and sees no later one -- ask it while the
    loader is open.
    """

    def __init__(self, watched: list[tuple[Server, socket.socket]]) -> None:
        self._watched = watched  # kept after close(): check() then reads none of them
        self._lock = threading.Lock()
        self._gone: str | None = None  # the message, once a server is gone
        self._closed = False

    @classmethod
    def of_connections(cls: type[_Watch], servers: Iterable[Server]) -> _Watch:
        """Watch every TCP connection of this process to one of ``servers``.

        A connection that is no longer ESTABLISHED is watched too: its server
        closed it (a server that died while nothing was sending: ``CLOSE_WAIT``),
        so the watch's first :meth:`check` raises -- rather than no watch, and DGL
        aborting the process at its first send.

        Raises :class:`~pingpong.ServerGoneError` (a ``ConnectionError``) naming a
        server this process has no TCP connection to at all (so the caller can
        decide to watch the others).
        """
        conns = _tcp_connections()
        found = {server: [c for c in conns
                          if c.raddr and (c.raddr.ip, c.raddr.port) == (server.ip, server.port)
                          and c.fd >= 0]
                 for server in servers}
        missing = [server for server, server_conns in found.items() if not server_conns]
        if missing:
            names = ", ".join(f"{s.label} ({s.ip}:{s.port})" for s in missing)
            raise ServerGoneError(f"no TCP connection to {names}")
        watched: list[tuple[Server, socket.socket]] = []
        try:
            for server, server_conns in found.items():
                for conn in server_conns:
                    watched.append((server, socket.fromfd(conn.fd, conn.family, conn.type)))
        except BaseException:
            for _, sock in watched:
                sock.close()
            raise
        return cls(watched)

    @property
    def servers(self) -> list[Server]:
        """The servers watched (one entry per connection; kept after :meth:`close`)."""
        return [server for server, _ in self._watched]

    def check(self) -> None:
        """Raise :class:`~pingpong.errors.ServerGoneError` if a watched connection is no
        longer ESTABLISHED (its server closed it or reset it); the same error again
        on every later call, after :meth:`close` too.  Once closed it reads no
        connection: a loss it had not seen by then goes unreported."""
        self.check_if_open()

    def check_if_open(self) -> bool:
        """:meth:`check`; returns False once :meth:`close` ran (having read no
        connection, but raised a loss seen before the close)."""
        with self._lock:
            is_open = not self._closed
            if self._gone is None and is_open:
                for server, sock in self._watched:
                    state = _tcp_state(sock)
                    if state != TCP_ESTABLISHED:
                        self._gone = _gone_message(server, state)
                        break
            gone = self._gone
        if gone is not None:
            raise ServerGoneError(gone)  # a new object per raise: tracebacks and notes differ
        return is_open

    def close(self) -> None:
        """Close the duplicate descriptors (the RPC library's own are untouched)
        and stop guarding DGL's sends with this watch."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _unguard(self)
        for _, sock in self._watched:
            sock.close()

    def __repr__(self) -> str:
        names = ", ".join(f"{s.label} {s.ip}:{s.port}" for s in self.servers)
        return f"ServerWatch([{names}], closed={self._closed})"


def _tcp_connections() -> list[Any]:
    process = psutil.Process()
    list_connections = getattr(process, "net_connections", None) or process.connections
    return list(list_connections(kind="tcp"))


def _tcp_state(sock: socket.socket) -> int:
    """``tcpi_state`` of ``sock`` (the first byte of ``struct tcp_info``)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def _gone_message(server: Server, state: int) -> str:
    name = TCP_STATE_NAMES.get(state, f"state {state}")
    return (
        f"{server.label} at {server.ip}:{server.port} closed its connection (TCP {name}): "
        "the server process is gone. DGL's RPC client cannot recover from this: its next "
        "send to that server -- a pull, sampling, a barrier, or DGL's own exit hook -- "
        "aborts this process (SIGABRT). Handle the error (log, save what you need) and end "
        "the process with os._exit(); do not call into dgl.distributed again"
    )


def dgl_servers() -> list[Server] | None:
    """The servers of this process's DGL RPC client, or ``None`` if there is none.

    Read from the KVStore client (``dgl.distributed.kvstore.get_kvstore()``),
    which keeps DGL's server namebook ``{server id: [machine, ip, port, group]}``
    in both DGL 1.1 and 2.1; ``None`` in standalone mode or before
    ``dgl.distributed.initialize``.
    """
    if "dgl.distributed" not in sys.modules:  # never imported: no client (and no import cost)
        return None
    from dgl.distributed import kvstore

    client = kvstore.get_kvstore()
    namebook = getattr(client, "_server_namebook", None)
    if not isinstance(namebook, dict) or not namebook:
        return None
    servers = []
    for server_id, entry in sorted(namebook.items()):
        ip, port = str(entry[1]), int(entry[2])
        with contextlib.suppress(OSError):  # a name: its IPv4 address, as the socket shows
            ip = socket.gethostbyname(ip)
        servers.append(Server(f"DGL server {server_id}", ip, port))
    return servers


def has_dgl_client() -> bool:
    """True in a DistDGL client process (after ``dgl.distributed.initialize``, not
    standalone); a client that cannot be read counts as one."""
    if "dgl.distributed" not in sys.modules:  # `import dgl` imports it
        return False
    try:
        return dgl_servers() is not None
    except Exception as exc:  # noqa: BLE001 - a DGL version laid out differently
        logger.info("could not read DGL's RPC client (%s): taken for a DistDGL client", exc)
        return True


def dgl_server_watch() -> ServerWatch | None:
    """A watch over this process's connections to its DGL servers, or ``None``.

    Every loader created in a DistDGL client process (after
    ``dgl.distributed.initialize``) gets one, whatever its source and tables:
    once a server is gone, any DGL call aborts the process, so every loader
    should stop and say so.  ``None`` (logged, never raised: a loader works
    without a watch) where there is nothing to watch or no way to: no
    ``socket.TCP_INFO`` (not Linux), DGL's RPC client not initialised or in
    standalone mode, no TCP connection at all to some server, or DGL's
    internals not as expected (then the loader's ``timeout=`` is the only guard).
    """
    if not hasattr(socket, "TCP_INFO"):
        logger.debug("no socket.TCP_INFO on this platform: DGL servers are not watched")
        return None
    try:
        servers = dgl_servers()
        if servers is None:
            logger.debug("no DGL RPC client in this process: no servers to watch")
            return None
        watch = ServerWatch.of_connections(servers)
    except (ConnectionError, psutil.Error, OSError) as exc:
        logger.info("DGL servers are not watched (%s); only timeout= guards against a lost "
                    "server", exc)
        return None
    except Exception as exc:  # noqa: BLE001 - a DGL version laid out differently
        logger.warning("DGL servers are not watched: reading DGL's client failed (%r); only "
                       "timeout= guards against a lost server", exc)
        return None
    _guard_dgl_sends(watch)
    logger.debug("watching %r", watch)
    return watch


# --------------------------------------------------------------------------- DGL's sends
#: The open watches (one per loader; several may watch the same connections).
_open: tuple[ServerWatch, ...] = ()
#: What DGL's sends check: the open watches grouped by the servers they watch. A
#: send checks the first watch of each group that is still open, so each socket
#: once however many loaders are open, and a watch that closes meanwhile hands
#: over to the next of its group. Replaced whole (readers take no lock).
_guarding: tuple[tuple[ServerWatch, ...], ...] = ()
_guard_lock = threading.Lock()


def _set_open(watches: tuple[ServerWatch, ...]) -> None:
    """Record the open watches and derive :data:`_guarding`; caller holds the lock."""
    global _open, _guarding
    _open = watches
    groups: dict[tuple[Server, ...], list[ServerWatch]] = {}
    for watch in watches:
        groups.setdefault(tuple(sorted(set(watch.servers), key=repr)), []).append(watch)
    _guarding = tuple(tuple(group) for group in groups.values())


#: The functions of ``dgl.distributed.rpc`` that hand a request to DGL's sender
#: thread: ``send_rpc_message`` (every request and response of the RPC layer) and
#: ``fast_pull`` (a ``DistTensor`` pull of remote rows, which builds and sends its
#: requests in C++ without the former). Both are called through the module's
#: globals (``rpc.fast_pull`` from ``kvstore``), so replacing them there guards them.
GUARDED_DGL_SENDS = ("send_rpc_message", "fast_pull")


def _guard_dgl_sends(watch: ServerWatch) -> None:
    """Check ``watch`` before every DGL RPC send until it is closed.

    Wraps each of :data:`GUARDED_DGL_SENDS` in ``dgl.distributed.rpc`` once per
    process; the wrapper checks the open watches, then calls DGL's function.
    Where a DGL version lacks one of them it is not wrapped (logged) and the
    loader's own checks remain.
    """
    from dgl.distributed import rpc

    with _guard_lock:
        for name in GUARDED_DGL_SENDS:
            send = getattr(rpc, name, None)
            if send is None:
                logger.info("dgl.distributed.rpc has no %s: it is not guarded, only the "
                            "loader's calls and DGL's other sends", name)
            elif not getattr(send, "pingpong_guarded", False):
                setattr(rpc, name, _guarded(send))
        _set_open((*_open, watch))


def _unguard(watch: ServerWatch) -> None:
    with _guard_lock:
        _set_open(tuple(w for w in _open if w is not watch))


def _check_open_watches() -> None:
    """Check each set of watched connections once (see :data:`_guarding`)."""
    for group in _guarding:
        for watch in group:
            # ServerGoneError, a ConnectionError as DGL documents; a watch closed
            # since _guarding was read checks nothing: the next one of its group does
            if watch.check_if_open():
                break


def _guarded(send: Any) -> Any:
    """``send`` preceded by :func:`_check_open_watches`."""
    @functools.wraps(send)
    def guarded_send(*args: Any, **kwargs: Any) -> Any:
        _check_open_watches()
        return send(*args, **kwargs)

    guarded_send.pingpong_guarded = True  # type: ignore[attr-defined]
    return guarded_send
