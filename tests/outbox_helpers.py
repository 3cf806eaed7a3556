"""Shared helpers of the outbox tests: building an outbox on a manual clock, reading its
collections back, and publishing inside a transaction of the test engine or a real server."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mongoq import _driver
from mongoq.outbox import AsyncOutbox, Delivery, Event
from mongoq.testing import ManualClock

PREFIX = "ob_"
SUBSCRIPTIONS: dict[str, list[str]] = {
    "order.created": ["mail", "stats"],
    "order.paid": ["stats"],
}


async def new_outbox(
    db: Any,
    clock: ManualClock,
    *,
    subscriptions: Mapping[str, Iterable[str]] | None = None,
    lease: float = 30,
    completion_history: bool = False,
) -> AsyncOutbox:
    outbox = AsyncOutbox(
        db,
        PREFIX,
        subscriptions=subscriptions if subscriptions is not None else SUBSCRIPTIONS,
        lease=lease,
        completion_history=completion_history,
        clock=clock,
    )
    await outbox.setup()
    return outbox


def order(n: int, key: str | None = None, kind: str = "order.created") -> Event:
    return Event(id=f"e{n}", type=kind, payload={"n": n}, key=key)


async def publish_in_transaction(db: Any, outbox: AsyncOutbox, events: Any) -> Any:
    async def work(session: Any) -> Any:
        return await outbox.publish(events, session=session)

    return await _driver.run_in_transaction(db, work)


async def deliveries(db: Any, prefix: str = PREFIX) -> list[dict[str, Any]]:
    """Every delivery document, in insertion order."""
    return list(await db[f"{prefix}deliveries"].find({}, sort=[("_id", 1)]).to_list(None))


async def events(db: Any, prefix: str = PREFIX) -> dict[str, dict[str, Any]]:
    return {d["_id"]: d for d in await db[f"{prefix}events"].find({}).to_list(None)}


async def lanes(db: Any, prefix: str = PREFIX) -> dict[int, dict[str, Any]]:
    return {d["_id"]: d for d in await db[f"{prefix}lanes"].find({}).to_list(None)}


async def delivery_of(
    db: Any, event_id: str, handler: str, prefix: str = PREFIX
) -> dict[str, Any] | None:
    found: dict[str, Any] | None = await db[f"{prefix}deliveries"].find_one(
        {"event_id": event_id, "handler": handler}
    )
    return found


def pairs(batch: Sequence[Delivery]) -> list[tuple[str, str]]:
    """(event id, handler) of each delivery, in the order given."""
    return [(d.event.id, d.handler) for d in batch]
