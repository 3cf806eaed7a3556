"""What the dashboard reads of one item, for its page: a task (`AsyncTaskQueue.get`), a group
of a group transport (its lock, its messages oldest first, its dead letters) and a delivery of
an outbox (its stored document or its completion record, its event, the event's deliveries to
other handlers).

The group transport and the outbox have no call that reads one group or one delivery: those
are read here, read-only, with each primitive's own filters and indexes
(`mongoq.groups.schema`, `mongoq.outbox.schema`), which keep the layout theirs; the dead
letters come from `AsyncGroupTransport.dead_letters`. Owns no collections.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from mongoq import _driver
from mongoq.clock import stored_instant
from mongoq.errors import InvalidInput
from mongoq.groups import AsyncGroupTransport
from mongoq.groups import schema as group_schema
from mongoq.groups.models import (
    DeadLetter,
    GroupId,
    count_of,
    lock_fault,
    message_fault,
    priority_of,
)
from mongoq.outbox import AsyncOutbox
from mongoq.outbox import schema as outbox_schema
from mongoq.outbox.models import DeliveryInfo, Event

log = logging.getLogger("mongoq.dashboard")

__all__ = ["DeliveryView", "EventView", "GroupMessage", "GroupView", "read_delivery", "read_group"]


@dataclass(frozen=True)
class GroupMessage:
    """A message of a group, as stored: `held_until` is the end of the lease stamped on it
    (the head a consumer holds), None when no lease holds it."""

    seq: Any
    published_at: datetime | None
    deliveries: int
    priority: int
    last_error: str | None
    held_until: datetime | None
    event: Any
    #: which stored field no run loop can use, if one (`mongoq.groups.models.message_fault`)
    unreadable: str | None = None


@dataclass(frozen=True)
class GroupView:
    """One group: its state (``ready``, ``in_flight``, ``parked``; None without a lock, when
    no message of it waits), its priority and when it is next claimable (the lease's end while
    in flight, the retry's while parked), its messages oldest first (`more`: there are more
    than shown) and its dead letters oldest first; read at `now` on the transport's clock."""

    group_id: GroupId
    now: datetime
    state: str | None
    priority: int | None
    available_at: datetime | None
    messages: list[GroupMessage]
    more: bool
    dead: list[DeadLetter]
    #: which field of the group's lock no claim can use, if one
    unreadable: str | None = None

    @property
    def found(self) -> bool:
        return self.state is not None or bool(self.messages) or bool(self.dead)


async def read_group(transport: AsyncGroupTransport, group_id: GroupId, limit: int) -> GroupView:
    """The group `group_id`, with at most `limit` messages and `limit` dead letters."""
    await transport.clock.refresh()
    now = transport.clock.now()
    lock = await transport.locks.find_one(group_schema.lock_of(group_id))
    docs = await _driver.find_list(
        transport.messages, group_schema.messages_of(group_id), sort=group_schema.SEQ_ORDER,
        limit=limit + 1, hint=group_schema.GROUP_HEAD.name,
    )  # fmt: skip
    dead = await transport.dead_letters(group_id=group_id, limit=limit)
    messages = [_message(doc, now) for doc in docs[:limit]]
    return GroupView(
        group_id, now,
        None if lock is None else group_schema.lock_state(lock, now),
        None if lock is None else priority_of(lock.get("priority", 0)),
        None if lock is None else stored_instant(lock.get("available_at")),
        messages, len(docs) > limit, dead, None if lock is None else _fault(lock_fault(lock)),
    )  # fmt: skip


def _message(doc: dict[str, Any], now: datetime) -> GroupMessage:
    until = stored_instant(doc.get("stamp_until"))
    held = until if doc.get("token") is not None and until is not None and until > now else None
    error = doc.get("last_error")
    return GroupMessage(
        seq=doc.get("_id"),
        published_at=stored_instant(doc.get("published_at")),
        deliveries=count_of(doc.get("deliveries") or 0) or 0,
        priority=priority_of(doc.get("priority", 0)) or 0,
        last_error=error if isinstance(error, str) else None,
        held_until=held,
        event=doc.get("event"),
        unreadable=_fault(message_fault(doc)),
    )


def _fault(fault: tuple[str, str] | None) -> str | None:
    return None if fault is None else f"field {fault[0]!r} holds {fault[1]}"


@dataclass(frozen=True)
class EventView:
    """An outbox event as stored: the `event` itself, `finished` the handlers whose delivery
    completed or died."""

    event: Event
    finished: list[str]
    completed_at: datetime | None


@dataclass(frozen=True)
class DeliveryView:
    """One delivery of an outbox: the event `event_id` to `handler`. `delivery` is its stored
    document while unfinished or dead, else its completion record (with
    ``completion_history``), else None; `finished` says the event records it finished
    (completed or died); `others` are the event's deliveries to other handlers, stored or
    recorded."""

    event_id: str
    handler: str
    now: datetime
    delivery: DeliveryInfo | None
    event: EventView | None
    finished: bool
    others: list[DeliveryInfo]

    @property
    def found(self) -> bool:
        return self.delivery is not None or self.finished


async def read_delivery(outbox: AsyncOutbox, event_id: str, handler: str) -> DeliveryView:
    """The delivery of `event_id` to `handler`, its event and the event's other deliveries."""
    await outbox.clock.refresh()
    now = outbox.clock.now()
    of_event = outbox_schema.deliveries_of_events([event_id])
    stored = await _driver.find_list(outbox.deliveries, of_event, sort=[("_id", 1)])
    infos = [DeliveryInfo.from_document(doc, False) for doc in stored]
    if outbox.completion_history:
        records = await _driver.find_list(outbox.history, of_event, sort=[("_id", 1)])
        infos += [DeliveryInfo.from_document({**doc, "status": "completed"}, False)
                  for doc in records]  # fmt: skip
    doc = await outbox.events.find_one(outbox_schema.event_by_id(event_id))
    event = None if doc is None else _event(doc)
    if doc is not None and event is None:
        log.warning("dashboard: event %r in %s cannot be read as an event; shown without it",
                    event_id, outbox.events.name, extra={"mongoq_item": event_id})  # fmt: skip
    mine = [info for info in infos if info.handler == handler]
    finished = event is not None and handler in event.finished
    return DeliveryView(
        event_id, handler, now, mine[0] if mine else None, event, finished,
        [info for info in infos if info.handler != handler],
    )  # fmt: skip


def _event(doc: dict[str, Any]) -> EventView | None:
    """The event of a stored document; None for one that cannot be read as an event (its
    deliveries show why: the outbox sets them aside naming the field)."""
    try:
        event = Event.from_document(doc)
    except (KeyError, TypeError, ValueError, InvalidInput):
        return None
    finished = doc.get("finished")
    return EventView(
        event=event,
        finished=[name for name in finished if isinstance(name, str)]
        if isinstance(finished, list) else [],
        completed_at=stored_instant(doc.get("completed_at")),
    )  # fmt: skip
