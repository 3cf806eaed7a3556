"""Setting aside task documents no worker can use: a field of the wrong type, written by hand,
by another program or by a bad restore (``attempts: "x"``, ``priority: null``). Such a task is
failed at its first encounter with an error that names the field, and one WARNING says so,
instead of stalling every claim behind it, crashing `run()`, or staying ``processing`` forever.

Found only when something fails, never looked for on the path of a good task: a claim the
server refused for a type mismatch (its ``$inc`` of ``attempts``), a claimed document
`Task.from_document` cannot read. (An expired lease whose attempts are no number is buried by
`reclaim_expired`'s own command, `schema.task_burying`; `log_buried` names them.) Every write
is fenced on the document as it was read (`schema.task_unchanged`), so a task that changed
meanwhile is left alone. Writes the queue's collection (``{name}``, see `mongoq.tasks.schema`);
owns none.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Protocol

from mongoq import _driver
from mongoq.runtime.report import Attempt, log_set_aside
from mongoq.tasks import schema
from mongoq.tasks.models import describe_fault, task_fault

__all__ = ["ROUNDS", "log_buried", "set_aside", "set_aside_candidates", "set_aside_first"]

log = logging.getLogger("mongoq.tasks")


class _Queue(Protocol):
    """What a set-aside uses of the queue: its name and its collection."""

    name: str
    collection: Any


#: Documents one claim sets aside before it says "nothing due" for now: each round sets one
#: aside (or finds it changed), so the bound only keeps a claim finite.
ROUNDS = 100
#: The candidates `set_aside_candidates` reads at most (a batched claim's widest window).
_WINDOW = 1000


async def set_aside(
    queue: _Queue, doc: Mapping[str, Any], fence: Mapping[str, Any], now: datetime
) -> bool:
    """Fail the task read as `doc` (fenced by `fence`) with an error naming its first bad field;
    False when it is not unusable after all, or changed meanwhile."""
    fault = task_fault(doc)
    if fault is None:
        return False
    text = f"unreadable task document: {describe_fault(fault)}; set aside"
    fence = {**fence, **schema.task_fields_as_read(doc, (fault[0], "revision"))}
    done = await queue.collection.update_one(fence, schema.task_setting_aside(now, text))
    if done.modified_count:
        log_set_aside(log, _attempt(queue, doc), queue.collection.name, *fault, "failed")
    return bool(done.modified_count)


async def set_aside_first(
    queue: _Queue, due: Mapping[str, Any], now: datetime, refusal: BaseException
) -> None:
    """After the server refused a claim for a type mismatch: set aside the first candidate,
    the one the refused claim would have taken (same filter, order and index); when that one
    is usable (a task put before it meanwhile), every unusable one of the window
    (`set_aside_candidates`, which raises `refusal` again when there is none)."""
    docs = await _driver.find_list(
        queue.collection, due, sort=schema.CLAIM_ORDER, limit=1, hint=schema.CLAIM_INDEX
    )
    if docs and task_fault(docs[0]) is None:
        await set_aside_candidates(queue, due, now, refusal)
    elif docs:
        await set_aside(queue, docs[0], schema.task_unchanged(docs[0], due), now)


async def set_aside_candidates(
    queue: _Queue, due: Mapping[str, Any], now: datetime, refusal: BaseException
) -> None:
    """After the server refused a batched claim's update part-way for a type mismatch: set
    aside every unusable candidate among those it could have read (`_WINDOW`, in claim
    order); `refusal` raised again when none is."""
    docs = await _driver.find_list(
        queue.collection, due, sort=schema.CLAIM_ORDER, limit=_WINDOW,
        projection={"status": 1, "attempts": 1, "priority": 1, "lease_token": 1, "revision": 1},
        hint=schema.CLAIM_INDEX,
    )  # fmt: skip
    unusable = [doc for doc in docs if task_fault(doc) is not None]
    if not unusable:
        raise refusal
    for doc in unusable:
        await set_aside(queue, doc, schema.task_unchanged(doc, due), now)


async def log_buried(queue: _Queue, now: datetime) -> int:
    """After `reclaim_expired` buried tasks at `now`: log those it set aside for a field no
    claim can use (one read), one WARNING each; how many they were."""
    docs = await _driver.find_list(
        queue.collection, schema.tasks_buried_unusable(now),
        projection={"worker_id": 1, "error": 1}, limit=_WINDOW, hint=schema.STATUS_UPDATED.name,
    )  # fmt: skip
    for doc in docs:
        field = "priority" if doc.get("error") == schema.UNUSABLE_PRIORITY_EXPIRED else "attempts"
        log_set_aside(
            log, _attempt(queue, doc), queue.collection.name, field, "no number", "failed"
        )
    return len(docs)


def _attempt(queue: _Queue, doc: Mapping[str, Any]) -> Attempt:
    """The log record's subject: the task of `doc`, its worker if it names one."""
    worker = doc.get("worker_id")
    return Attempt("tasks", queue.name, str(doc["_id"]), None,
                   worker if isinstance(worker, str) else None)  # fmt: skip
