"""Change-stream wake-ups: on a replica set a run loop hears of new work from any process.

`watch` keeps a change stream open on a primitive's collection, filtered by the primitive to
the writes that may make work claimable (`TASKS_DUE`, `GROUPS_READY`, `DELIVERIES_READY`), and
calls the loop's wake-up for each event: the loop claims at once instead of at its next poll.
Polling stays on beside it, so nothing depends on the stream: where there is none (the
embedded backend, a standalone server) `watch` says so once and returns; a stream that fails
later is opened again after `retry` seconds of the loop's clock, and what it missed meanwhile
the polls find. Events carry only their ids (``$project``): a wake-up needs no document.
Owns no collections.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from mongoq import _driver
from mongoq.clock import Clock

__all__ = ["DELIVERIES_READY", "GROUPS_READY", "TASKS_DUE", "watch"]

log = logging.getLogger("mongoq.worker")

_ONLY_IDS = {"$project": {"_id": 1, "operationType": 1}}
#: Seconds a failing stream waits at most before it is opened again.
MAX_RETRY = 300.0
#: Seconds closing a stream may take (shielded from the loop's cancellation).
CLOSE_WITHIN = 5.0

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


async def watch(
    collection: Any,
    pipeline: Sequence[Mapping[str, Any]],
    wake: Callable[[], None],
    *,
    clock: Clock,
    retry: float,
    name: str,
) -> None:
    """Call `wake` for every event of `pipeline` on `collection` until cancelled; return at
    once where the backend has no change streams. A stream that keeps failing is opened
    again less and less often (`retry`, doubled each time, up to `MAX_RETRY`), said once."""
    failures = 0
    while True:
        try:
            stream = await _driver.open_change_stream(collection, pipeline)
            try:
                async for _ in stream:
                    failures = 0
                    wake()
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
            (log.warning if failures == 0 else log.debug)(
                "%s: the change stream failed (%s); polling meanwhile", name, exc
            )
        await clock.sleep(min(retry * 2**failures, MAX_RETRY))
        failures = min(failures + 1, 16)
