"""The exception hierarchy of mongoq.

Every error the library raises on purpose derives from `MongoqError`. Driver errors
(`pymongo.errors.PyMongoError`: lost connections, timeouts) are not wrapped: they mean "the
outcome is unknown", and every primitive is built so that such an outcome is recoverable.
"""

from __future__ import annotations

__all__ = [
    "HandlerTimeout",
    "IndexesMissing",
    "InvalidInput",
    "LeaseLost",
    "MongoqError",
    "PermanentError",
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
