"""Exceptions raised by pingpong.

Every pingpong exception derives from :class:`PingPongError` *and* from the
built-in exception a user would catch for that problem, so ``except IndexError``
works for out-of-range ids and ``except ValueError`` for a bad table:

=================================  =============================================
exception                          raised when
=================================  =============================================
:class:`IdRangeError`              an id is negative or ``>= N`` (``IndexError``)
:class:`IdTypeError`               ids are not int32/int64, or not 1-D
                                   (``TypeError``; the shape case is also a
                                   ``ValueError``), a sparse tensor or a
                                   masked array; or, for
                                   ``heterogeneous=True``, not a dict by node
                                   type where the loader has more than one
                                   feature table or more than one node label
                                   table (a node type that has a
                                   table but is absent from a batch gets zero
                                   rows); or edge label ids not a dict by
                                   edge type where the loader has several
                                   edge label tables, or a dict where it has
                                   one table
:class:`BatchFormError`            a source item has a form pingpong cannot
                                   read (``TypeError``); the message names
                                   what it saw and the forms it reads
:class:`TableError`                a feature or label table cannot be used: not
                                   a tensor, 0-D, not on the host, not
                                   contiguous, empty, mismatched lengths, a
                                   lazy conjugate/negative view, keyed by a
                                   node or edge type the source's DGL graph
                                   lacks, fewer rows than that graph's nodes
                                   or seeds need, given new memory or a new
                                   shape, strides or dtype after the loader
                                   was built, a row source's rows of
                                   the wrong shape, dtype or layout, a row
                                   source of quantized rows (``ValueError``
                                   and ``TypeError``)
:class:`ConfigError`               an argument is invalid: the loader's, the built-in
                                   sampler's, a helper's (``ValueError`` and
                                   ``TypeError``); also a source that is no
                                   re-iterable, ``len()`` of a loader whose
                                   source has none, and ``next()`` on an
                                   iterator while another thread is in its
                                   ``next()``
:class:`GatherModeUnavailable`     the requested gather mode cannot run on this
                                   device or build (a ``ConfigError``)
:class:`BatchTimeoutError`         no batch arrived (or the source's ``iter()``
                                   did not return) within ``timeout`` seconds
                                   (``TimeoutError``)
:class:`ServerGoneError`           a DGL server this process pulls from or
                                   samples through closed its connection
                                   (``ConnectionError``); see
                                   :mod:`pingpong.serverwatch`
:class:`ProducerDiedError`         the producer thread ended without delivering
                                   an end-of-epoch marker or an exception
                                   (``RuntimeError``)
:class:`LoaderClosedError`         a closed loader was iterated, or it was
                                   closed (from any thread) while ``next()``
                                   waited (``RuntimeError``)
:class:`EpochFailedError`          ``next()`` on an iterator whose epoch failed
                                   (an earlier ``next()`` raised; the message
                                   names that failure) (``RuntimeError``)
:class:`EpochSupersededError`      ``next()`` on an iterator whose epoch was
                                   ended by a newer ``iter(loader)`` (a nested
                                   loop over one loader, or over two loaders of
                                   one DataLoader with persistent workers, or
                                   of one datapipe: GraphBolt's DataLoader)
                                   (``RuntimeError``)
:class:`RpcTurnError`              ``next()`` on a DistDGL loader by a thread
                                   inside :func:`pingpong.rpc_turn` (its
                                   producer could never take its turn)
                                   (``RuntimeError``)
:class:`StrayStopIterationError`   the source's ``iter()``, a ``form=``, a row
                                   source or a health check raised
                                   ``StopIteration``, which is not the end of an
                                   epoch (``RuntimeError``)
:class:`BatchExpiredError`         ``batch.record_stream()`` or ``clone()``
                                   (``copy``, ``pickle``) after the batch's
                                   slot was handed back (``RuntimeError``)
:class:`SlotOverwriteError`        ``debug=True`` only: a slot was refilled while
                                   the training loop held it (``RuntimeError``)
=================================  =============================================

Exceptions raised by the *source* (the sampler) or inside the producer thread
are not wrapped: the consumer re-raises the original exception object, whose
traceback still holds the producer's frames, with a note saying it crossed
threads.  One exception: if the loader's health check (``health_check=``, the
DistDGL server watch) fails right after such a failure, the training loop gets
the check's exception (e.g. :class:`ServerGoneError`) with the original as its
``__cause__`` -- the dead server is the likely cause of the failure.
"""

from __future__ import annotations


class PingPongError(Exception):
    """Base class of every exception pingpong raises itself."""


class IdRangeError(PingPongError, IndexError):
    """An id lies outside ``[0, N)``; raised before any row is read."""


class IdTypeError(PingPongError, TypeError):
    """Ids have a dtype that cannot index rows (float, bool, unsigned...)."""


class IdShapeError(IdTypeError, ValueError):
    """Ids are not a 1-D sequence."""


class TableError(PingPongError, ValueError, TypeError):
    """A feature or label table cannot be used as given."""


class ConfigError(PingPongError, ValueError, TypeError):
    """A loader argument is invalid."""


class GatherModeUnavailable(ConfigError):
    """The requested gather mode cannot run on this device or build."""


class BatchTimeoutError(PingPongError, TimeoutError):
    """No batch arrived within the loader's ``timeout`` (``next()``), or the
    source's ``iter()`` did not return within it (``iter(loader)``)."""


class ServerGoneError(PingPongError, ConnectionError):
    """A server the source or a row source depends on has closed its connection.

    Raised (on the producer thread before the next call to it, or on the
    training thread while ``next()`` waits) instead of letting the RPC layer
    abort the process; see :mod:`pingpong.serverwatch`.
    """


class ProducerDiedError(PingPongError, RuntimeError):
    """The producer thread ended without an end-of-epoch marker or an error."""


class LoaderClosedError(PingPongError, RuntimeError):
    """The loader was closed: before ``iter()``, or while an epoch was running."""


class EpochFailedError(PingPongError, RuntimeError):
    """``next()`` on an epoch that has failed: an earlier ``next()`` (or
    ``iter(loader)``'s wait) raised, and the epoch ended there.

    A ``for`` loop never sees it; a loop that catches the failure (say a
    :class:`BatchTimeoutError`) and calls ``next()`` on the same iterator
    again gets this instead of a ``StopIteration`` that would end its epoch
    short without a word.  The message names the failure and how many
    batches the epoch delivered; ``iter(loader)`` starts a new epoch.
    """


class EpochSupersededError(PingPongError, RuntimeError):
    """``next()`` on an epoch that a newer ``iter(loader)`` ended.

    A loader runs one epoch at a time; a second ``iter()`` (a nested loop over
    the same loader, ``zip(loader, loader)``) ends the first, and the first
    iterator then raises this instead of stopping silently.  So does
    ``iter()`` on another loader over the same ``DataLoader`` with persistent
    workers, or the same datapipe (GraphBolt's ``gb.DataLoader``), whose one
    iterator both would read.
    """


class RpcTurnError(PingPongError, RuntimeError):
    """``next()`` on a loader whose producer takes turns in DGL's RPC client, from the
    thread that holds :func:`pingpong.rpc_turn`: the producer could never take its
    turn, so the wait would never end. Raised before waiting; the epoch goes on."""


class StrayStopIterationError(PingPongError, RuntimeError):
    """Code pingpong ran for the training loop -- the source's ``iter()``, a
    ``form=``, a row source, a health check -- raised ``StopIteration`` (the
    cause): raised out of ``next()`` as it is, it would end the loop's ``for`` as
    if the epoch were over (the rule PEP 479 set for generators)."""


class BatchExpiredError(PingPongError, RuntimeError):
    """A batch was used through pingpong after its slot was handed back."""


class BatchFormError(PingPongError, TypeError):
    """A source item has a form pingpong cannot read; raised before any row is read."""


class SlotOverwriteError(PingPongError, RuntimeError):
    """Debug check (``PingPongLoader(debug=True)``): a slot was refilled while the
    training loop still held the batch in it -- a broken slot protocol."""
