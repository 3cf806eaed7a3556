"""The dashboard's actions: requeue, cancel and purge tasks, redrive dead letters, requeue and
purge outbox deliveries. Each reads its target from the fields of a form (checked before
anything is written: a bad field is an `InvalidInput` naming it), says in one sentence what
it will do (the confirmation page shows it), and runs one of the primitive's own operator
calls.

Owns no collections.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from mongoq._text import parse_age
from mongoq._validation import INT64_RANGE, check_id, check_int, check_seconds
from mongoq.errors import InvalidInput
from mongoq.groups import AsyncGroupTransport
from mongoq.outbox import AsyncOutbox
from mongoq.tasks import AsyncTaskQueue
from mongoq.tasks.schema import PURGEABLE

__all__ = ["ACTIONS", "Action", "Done", "field", "item_id"]

_INTEGER = re.compile("-?[0-9]{1,19}")


@dataclass(frozen=True)
class Done:
    """What an action did: how many items it changed, in a sentence."""

    count: int
    text: str


@dataclass(frozen=True)
class Action:
    """`verb` on a `primitive`: `describe` says what the fields ask for, `run` does it."""

    primitive: str
    verb: str
    label: str
    describe: Callable[[str, Mapping[str, str]], str]
    run: Callable[[Any, Mapping[str, str]], Awaitable[Done]]


def field(form: Mapping[str, str], name: str) -> str:
    """A field as sent: ids are never stripped (``" a"`` and ``"a"`` are two tasks)."""
    value = form.get(name, "")
    if not value:
        raise InvalidInput(name, "is required")
    return value


def item_id(form: Mapping[str, str], name: str) -> str | int:
    """An id as the list showed it: text, or an integer when the form says ``<name>_type=int``."""
    value = field(form, name)
    if form.get(f"{name}_type", "str") == "int":
        low, high = INT64_RANGE
        if not _INTEGER.fullmatch(value) or not low <= int(value) <= high:
            # int() would take " 7", "+7", "7_0" and "²"; a stored id is a 64-bit integer
            raise InvalidInput(name, f"must be a 64-bit integer, got {value!r}")
        return int(value)
    return check_id(name, value)


def _age(form: Mapping[str, str], name: str) -> float:
    """Seconds from ``90``, ``30s``, ``15m``, ``12h`` or ``7d``."""
    value = field(form, name)
    seconds = parse_age(value)
    if seconds is None:
        raise InvalidInput(name, f"must be an age such as 90, 30s, 15m, 12h or 7d, got {value!r}")
    return check_seconds(name, seconds)


def _everything(form: Mapping[str, str]) -> bool:
    return form.get("all") == "1"


# -------------------------------------------------------------------------------- tasks


def _describe_task_requeue(name: str, form: Mapping[str, str]) -> str:
    if _everything(form):
        return f"Requeue every failed task of queue {name!r}, with fresh attempts."
    return f"Requeue failed task {item_id(form, 'id')!r} of queue {name!r}, with fresh attempts."


async def _task_requeue(queue: AsyncTaskQueue, form: Mapping[str, str]) -> Done:
    ids = None if _everything(form) else [item_id(form, "id")]
    count = await queue.requeue_failed(ids)
    return Done(count, f"requeued {count} failed task(s)")


def _describe_task_cancel(name: str, form: Mapping[str, str]) -> str:
    task = item_id(form, "id")
    return f"Cancel task {task!r} of queue {name!r} (a running handler stops at its next renewal)."


async def _task_cancel(queue: AsyncTaskQueue, form: Mapping[str, str]) -> Done:
    cancelled = await queue.cancel(item_id(form, "id"))
    return Done(int(cancelled), "cancelled 1 task" if cancelled else "nothing to cancel")


def _purge_status(form: Mapping[str, str]) -> str:
    status = field(form, "status").strip()
    if status not in PURGEABLE:
        raise InvalidInput("status", f"must be one of {', '.join(PURGEABLE)}, got {status!r}")
    return status


def _describe_task_purge(name: str, form: Mapping[str, str]) -> str:
    status, seconds = _purge_status(form), _age(form, "older_than")
    return f"Delete the {status} tasks of queue {name!r} last changed over {seconds:g} s ago."


async def _task_purge(queue: AsyncTaskQueue, form: Mapping[str, str]) -> Done:
    status = _purge_status(form)
    count = await queue.purge(status, _age(form, "older_than"))  # type: ignore[arg-type]
    return Done(count, f"purged {count} {status} task(s)")


# ------------------------------------------------------------------------------- groups


def _seq(form: Mapping[str, str]) -> int:
    value = field(form, "seq").strip()
    if not _INTEGER.fullmatch(value):
        raise InvalidInput("seq", f"must be a positive 64-bit integer, got {value!r}")
    return check_int("seq", int(value), low=1, high=INT64_RANGE[1])


def _describe_redrive(name: str, form: Mapping[str, str]) -> str:
    if _everything(form):
        return f"Publish every dead letter of {name!r} again, at the tail of its group."
    if "group" in form:
        group = item_id(form, "group")
        return f"Publish the dead letters of group {group!r} of {name!r} again."
    return f"Publish dead letter {_seq(form)} of {name!r} again, at the tail of its group."


#: Dead letters one redrive call moves; "every dead letter" calls it until one moves fewer.
REDRIVE_BATCH = 1000


async def _redrive(transport: AsyncGroupTransport, form: Mapping[str, str]) -> Done:
    if _everything(form) or "group" in form:
        group = None if _everything(form) else item_id(form, "group")
        # At most as many as there were: letters buried again while this runs (a poison
        # message its workers bury at once) wait for the next redrive, not loop here.
        there = (await transport.stats()).dead
        count = moved = await transport.redrive(group_id=group, limit=REDRIVE_BATCH)
        while moved == REDRIVE_BATCH and count < there:
            moved = await transport.redrive(group_id=group, limit=REDRIVE_BATCH)
            count += moved
    else:
        count = await transport.redrive([_seq(form)])
    return Done(count, f"redrove {count} dead letter(s)")


# ------------------------------------------------------------------------------- outbox


def _describe_delivery_requeue(name: str, form: Mapping[str, str]) -> str:
    event, handler = field(form, "event_id"), field(form, "handler")
    return f"Requeue the dead delivery of event {event!r} to {handler!r} in outbox {name!r}."


async def _delivery_requeue(outbox: AsyncOutbox, form: Mapping[str, str]) -> Done:
    done = await outbox.requeue(field(form, "event_id"), field(form, "handler"))
    return Done(int(done), "requeued 1 dead delivery" if done else "no such dead delivery")


def _describe_delivery_purge(name: str, form: Mapping[str, str]) -> str:
    seconds = _age(form, "older_than")
    return f"Delete the dead deliveries of outbox {name!r} last updated over {seconds:g} s ago."


async def _delivery_purge(outbox: AsyncOutbox, form: Mapping[str, str]) -> Done:
    seconds = _age(form, "older_than")
    await outbox.clock.refresh()  # the cutoff on the outbox's own clock, as its workers'
    result = await outbox.purge(dead_before=outbox.clock.now() - timedelta(seconds=seconds))
    return Done(result.dead_deliveries, f"purged {result.dead_deliveries} dead deliveries")


ACTIONS: dict[tuple[str, str], Action] = {
    (a.primitive, a.verb): a
    for a in (
        Action("tasks", "requeue", "Requeue", _describe_task_requeue, _task_requeue),
        Action("tasks", "cancel", "Cancel", _describe_task_cancel, _task_cancel),
        Action("tasks", "purge", "Purge", _describe_task_purge, _task_purge),
        Action("groups", "redrive", "Redrive", _describe_redrive, _redrive),
        Action("outbox", "requeue", "Requeue", _describe_delivery_requeue, _delivery_requeue),
        Action("outbox", "purge", "Purge", _describe_delivery_purge, _delivery_purge),
    )
}
