"""Change-stream wake-ups: on a replica set a run loop hears of new work from any process.

`watch` keeps a change stream open on a primitive's collection, filtered by the primitive to
the writes that may make work claimable (`TASKS_DUE`, `GROUPS_READY`, `DELIVERIES_READY`), and
calls the loop's wake-up for each event: the loop claims at once instead of at its next poll.
Polling stays on beside it, so nothing depends on the stream: where there is none (the
embedded backend, a standalone server, a compatible service that refuses ``$changeStream`` for
good: `_driver.NO_CHANGE_STREAMS_CODES`) `watch` says so once and returns, and the loop polls
only; a stream that fails otherwise is opened again after `retry` seconds of the loop's clock
(doubled while it keeps failing), and what it missed meanwhile the polls find. Events carry
only their ids (``$project``): a wake-up needs no document. Owns no collections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from pymongo.errors import ConnectionFailure

from mongoq import _driver
from mongoq.clock import Clock

__all__ = [
    "DELIVERIES_READY",
    "GROUPS_READY",
    "TASKS_DUE",
    "TASKS_DUE_OR_STOPPED",
    "TASKS_ENDED",
    "share",
    "stopped_task",
    "watch",
]

log = logging.getLogger("mongoq.worker")

_ONLY_IDS = {"$project": {"_id": 1, "operationType": 1}}
#: Seconds a failing stream waits at most before it is opened again.
MAX_RETRY = 300.0
#: Seconds closing a stream may take (shielded from the loop's cancellation).
CLOSE_WITHIN = 5.0

# What a server emits, and so what the filters below can and cannot hear of:
# - An update event lists only the fields whose values changed
#   (``updateDescription.updatedFields``), and an update that changes nothing emits no event at
#   all. Setting ``status: "pending"`` on a task already pending, ``token: None`` on a lock
#   already free or ``lane: "ready"`` on a delivery already ready matches nothing here, even
#   when the same write makes the work due sooner (a put moving a pending task's run time
#   forward, say). Nothing is lost: every run loop and every wait polls beside its stream, and
#   its next poll finds such work.
# - ``replace`` is an operation type of its own, with the whole new document and no
#   ``updateDescription``. TASKS_DUE accepts it (a replacement by another program may make a
#   task due). TASKS_ENDED does not: no mongoq code path replaces a task document (every task
#   write in mongoq/tasks is an update, an upsert or a delete; tests/runtime/test_changes.py
#   drives the whole task API and finds no replacement), and a task ended by someone else's
#   replacement is seen by the wait's next poll. Groups and deliveries are never replaced
#   either (a group's dead letters are, but no stream watches them).

#: A task inserted, or made pending (a put of a new revision, a retry, a requeue, a reclaim).
TASKS_DUE: list[dict[str, Any]] = [
    {
        "$match": {
            "$or": [
                {"operationType": {"$in": ["insert", "replace"]}},
                {"operationType": "update", "updateDescription.updatedFields.status": "pending"},
            ]
        }
    },
    _ONLY_IDS,
]
#: What a task queue's run loop watches: `TASKS_DUE`, and a task cancelled or removed (ended
#: ``cancelled`` / ``tombstone``), whose holder in this process must stop (`stopped_task`).
TASKS_DUE_OR_STOPPED: list[dict[str, Any]] = [
    {
        "$match": {
            "$or": [
                {"operationType": {"$in": ["insert", "replace"]}},
                {
                    "operationType": "update",
                    "updateDescription.updatedFields.status": {
                        "$in": ["pending", "cancelled", "tombstone"]
                    },
                },
            ]
        }
    },
    {
        "$project": {
            "_id": 1, "operationType": 1, "documentKey": 1,
            "updateDescription.updatedFields.status": 1,
        }
    },
]  # fmt: skip


def stopped_task(event: Mapping[str, Any]) -> Any | None:
    """The id of the task a `TASKS_DUE_OR_STOPPED` event says was cancelled or removed; None
    for an event of work made due."""
    fields = (event.get("updateDescription") or {}).get("updatedFields") or {}
    if fields.get("status") not in ("cancelled", "tombstone"):
        return None
    key = event.get("documentKey") or {}
    return key.get("_id")


#: A group's lock made (a first publish) or released (an ack, a nack without delay).
GROUPS_READY: list[dict[str, Any]] = [
    {
        "$match": {
            "$or": [
                {"operationType": "insert"},
                {
                    "operationType": "update",
                    "updateDescription.updatedFields.token": {"$type": "null"},
                },
            ]
        }
    },
    _ONLY_IDS,
]
#: A delivery appended, or moved back to its lane's ready set (unparked, requeued).
DELIVERIES_READY: list[dict[str, Any]] = [
    {
        "$match": {
            "$or": [
                {"operationType": "insert"},
                {"operationType": "update", "updateDescription.updatedFields.lane": "ready"},
            ]
        }
    },
    _ONLY_IDS,
]


#: A task ended (done, failed, cancelled, removed): what `AsyncTaskQueue.wait` hears of.
TASKS_ENDED: list[dict[str, Any]] = [
    {
        "$match": {
            "operationType": "update",
            "updateDescription.updatedFields.status": {
                "$in": ["done", "failed", "cancelled", "tombstone"]
            },
        }
    },
    {"$project": {"_id": 1, "documentKey": 1}},
]


@dataclass(eq=False)
class _Shared:
    """One change stream shared by the participants of a key on one event loop."""

    owner: object | None = None
    participants: int = 0
    unsupported: bool = False
    released: anyio.Event = field(default_factory=anyio.Event)


_shared: dict[tuple[Any, int], _Shared] = {}
#: Keys whose collection has no change streams (said once per process).
_unsupported: set[tuple[Any, int]] = set()


async def share(
    key: Any,
    collection: Any,
    pipeline: Sequence[Mapping[str, Any]],
    route: Callable[[Mapping[str, Any]], None],
    *,
    clock: Clock,
    retry: float,
    name: str,
) -> None:
    """Take part, until cancelled, in one change stream per `key` (and event loop) of this
    process: one participant at a time holds it open and calls `route` with each event (the
    participants' own route, the same for all); when it leaves, another takes it over (the
    events in between are missed: the participants poll as well). Where there are no
    change streams, every participant returns."""
    client = getattr(getattr(collection, "database", None), "client", None)
    kind = (key, id(client))  # no streams: a fact of the deployment behind this client
    if kind in _unsupported:
        return  # said once already: there are no streams here
    slot = (key, id(asyncio.get_running_loop()))
    entry = _shared.setdefault(slot, _Shared())
    me = object()
    entry.participants += 1
    try:
        while not entry.unsupported:
            if entry.owner is not None:
                await entry.released.wait()
                continue
            entry.owner = me
            try:
                await watch(collection, pipeline, route, clock=clock, retry=retry, name=name)
                entry.unsupported = True  # it returns only where there are no streams
                _unsupported.add(kind)
            finally:
                entry.owner = None
                released, entry.released = entry.released, anyio.Event()
                released.set()
    finally:
        entry.participants -= 1
        if entry.participants == 0 and _shared.get(slot) is entry:
            del _shared[slot]


async def watch(
    collection: Any,
    pipeline: Sequence[Mapping[str, Any]],
    on_event: Callable[[Mapping[str, Any]], None],
    *,
    clock: Clock,
    retry: float,
    name: str,
) -> None:
    """Call `on_event` with every event of `pipeline` on `collection`
    until cancelled; return at
    once where the backend has no change streams. A stream that keeps failing is opened
    again less and less often (`retry`, doubled each time, up to `MAX_RETRY`), said once."""
    failures = 0
    while True:
        try:
            stream = await _driver.open_change_stream(collection, pipeline)
            try:
                async for event in stream:
                    failures = 0
                    on_event(event)
            finally:
                # Bounded: a server gone away must not hold the loop's shutdown.
                with anyio.move_on_after(CLOSE_WITHIN, shield=True):
                    with contextlib.suppress(*_driver.DRIVER_ERRORS):
                        await _driver.close_change_stream(stream)
        except _driver.NoChangeStreams as reason:
            log.info("%s: no change streams here (%s); polling only", name, reason)
            return
        except _driver.DRIVER_ERRORS as exc:
            if _driver.no_change_streams(exc):  # Motor opens the stream at its first read
                log.info("%s: no change streams here (%s); polling only", name, exc)
                return
            # A lost server is the run loop's to say (once); a stream failing on its own is
            # said here, once per run of failures.
            lost = isinstance(exc, ConnectionFailure)
            (log.warning if failures == 0 and not lost else log.debug)(
                "%s: the change stream failed (%s); polling meanwhile", name, exc
            )
        await clock.sleep(min(retry * 2**failures, MAX_RETRY))
        failures = min(failures + 1, 16)
