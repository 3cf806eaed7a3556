"""The exception hierarchy of mongoq.

Every error the library raises on purpose derives from `MongoqError`. Driver errors
(`pymongo.errors.PyMongoError`: lost connections, timeouts) are not wrapped: they mean "the
outcome is unknown", and every primitive is built so that such an outcome is recoverable. The
one exception is no server at all: `ServerUnavailable` says so in one line, and is still the
driver's `ServerSelectionTimeoutError`, so code that retries on driver errors retries on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pymongo.errors import ServerSelectionTimeoutError

__all__ = [
    "HandlerAbandoned",
    "HandlerTimeout",
    "IndexesMissing",
    "InvalidInput",
    "LeaseLost",
    "MongoqError",
    "NotFound",
    "PermanentError",
    "ServerUnavailable",
    "UnreadableDocument",
]


class MongoqError(Exception):
    """Base class of the errors mongoq raises itself."""


class InvalidInput(MongoqError, ValueError):
    """An argument was rejected before anything was written.

    The message names the offending field, e.g. ``task_id: must be a non-empty string or an
    int, got dict``.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class LeaseLost(MongoqError):
    """The caller no longer holds the lease it acted under.

    Raised where no ``False`` return can carry the news, e.g. when the automatic completion at
    the end of an ``async with queue.leased(task)`` block finds the task taken over.
    """


class PermanentError(MongoqError):
    """Raised by a handler to fail its work item now, without further retries."""


class IndexesMissing(MongoqError):
    """A query names an index that the collection does not have: the primitive's indexes were
    never created. Run the primitive's ``setup()`` once, at deploy time or when the service
    starts; a run loop stops with this error
    rather than log a failure on every poll.
    """


class HandlerTimeout(MongoqError, TimeoutError):
    """A handler ran past the `timeout` its run loop was given and was cancelled; the attempt
    counts as failed (retried with backoff, given up after the last attempt)."""


class HandlerAbandoned(LeaseLost):
    """A handler was cancelled (past its time limit, its lease lost, its worker stopping) and
    did not end within the grace that follows (it swallowed the cancellation, or blocks in a
    thread). It is left running: its lease is no longer renewed, its item is not settled (the
    lease expires and the item is claimable again), and its slot is free for other work.
    Counted ``lost``. ``asyncio.run`` waits for every task at its end: a process holding one
    that never ends does not exit by itself (`mongoq worker` exits all the same)."""


class UnreadableDocument(MongoqError):
    """A stored document mongoq cannot use and cannot repair safely (a field of the wrong type,
    written by hand or by another program): the message names the collection, the document
    and the field, what it holds and what to do. E.g. a group transport's sequence counter
    (``{prefix}_counters``) whose value holds no number: the counter is the only record of the
    seqs already handed out, so a publish refuses rather than risk giving a seq twice."""

    def __init__(
        self, collection: str, document_id: Any, field: str, found: str, remedy: str
    ) -> None:
        super().__init__(
            f"{collection}: document {document_id!r} cannot be used: field {field!r} holds "
            f"{found}; {remedy}"
        )
        self.collection = collection
        self.document_id = document_id
        self.field = field
        self.found = found


class NotFound(MongoqError, LookupError):
    """What a call needs to exist does not, and waiting would not bring it: e.g. `wait` for a
    task id the queue does not have (never put, or deleted for good). A `LookupError`, as
    ``KeyError`` is; the message names the item and where it was looked for."""


class ServerUnavailable(MongoqError, ServerSelectionTimeoutError):
    """No server answered within the client's timeout (`mongoq.connect`'s `timeout`): one line
    naming the hosts (never credentials) and the seconds waited, e.g. ``cannot reach the
    MongoDB server at 127.0.0.1:27017 (connection refused; gave up after 5 s)``. Raised by the
    first call that needs the server; a run loop raises it only when given `give_up_after`."""

    def __init__(
        self,
        message: str,
        *,
        hosts: Sequence[str] = (),
        waited: float | None = None,
        driver_error: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.hosts = tuple(hosts)
        self.driver_error = driver_error  # the driver's own error, whole topology included
        self.waited = waited  # seconds (PyMongo's errors have a `timeout` flag of their own)
