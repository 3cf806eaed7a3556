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

__all__ = ["DELIVERIES_READY", "GROUPS_READY", "TASKS_DUE", "task_changed", "watch"]

log = logging.getLogger("mongoq.worker")

_ONLY_IDS = {"$project": {"_id": 1, "operationType": 1}}

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


def task_changed(task_id: Any) -> list[dict[str, Any]]:
    """Any change of the one task `task_id`: what `AsyncTaskQueue.wait` listens for."""
    return [{"$match": {"documentKey._id": task_id}}, _ONLY_IDS]


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
    once where the backend has no change streams."""
    while True:
        try:
            stream = await _driver.open_change_stream(collection, pipeline)
        except _driver.NoChangeStreams as reason:
            log.info("%s: no change streams here (%s); polling only", name, reason)
            return
        except _driver.DRIVER_ERRORS as exc:
            log.warning("%s: opening a change stream failed (%s); polling meanwhile", name, exc)
            await clock.sleep(retry)
            continue
        try:
            async for _ in stream:
                wake()
        except _driver.DRIVER_ERRORS as exc:
            log.warning("%s: the change stream failed (%s); polling meanwhile", name, exc)
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(*_driver.DRIVER_ERRORS):
                await _driver.close_change_stream(stream)  # gone either way after an error
        await clock.sleep(retry)
