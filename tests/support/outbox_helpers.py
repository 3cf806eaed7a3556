"""Shared helpers of the outbox tests: building an outbox on a manual clock, reading its
collections back, and publishing inside a transaction of the test engine or a real server."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import bson
import pytest

from mongoq import _driver
from mongoq.outbox import AsyncOutbox, Delivery, Event, lane_of
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
    """Publish `events` in a transaction of their own (skipped where there are none)."""
    if not await _driver.supports_transactions(db):
        pytest.skip("this server has no transactions (standalone); the replica-set jobs run it")

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


# ---------------------------------------------- lanes and claims (test_outbox_claims/_races)


def keys_in_distinct_lanes(count: int, stem: str = "k") -> list[str]:
    """`count` ordering keys (``<stem><n>``) that all live in different lanes."""
    keys: list[str] = []
    used: set[int] = set()
    for n in range(100_000):
        key = f"{stem}{n}"
        if lane_of(key) not in used:
            used.add(lane_of(key))
            keys.append(key)
            if len(keys) == count:
                return keys
    raise AssertionError("not enough lanes")


def key_in_lane(lane: int, stem: str = "n") -> str:
    """The first key ``<stem><n>`` that lives in `lane`."""
    for n in range(100_000):
        if lane_of(f"{stem}{n}") == lane:
            return f"{stem}{n}"
    raise AssertionError(f"no key found for lane {lane}")


async def stored(db: Any, name: str = "deliveries", prefix: str = PREFIX) -> dict[Any, bytes]:
    """The BSON bytes of every document of a collection, by _id: equal bytes, same document."""
    docs = await db[f"{prefix}{name}"].find({}).to_list(None)
    return {doc["_id"]: bson.encode(doc) for doc in docs}


async def drain(outbox: AsyncOutbox, owner: str = "drainer") -> list[Delivery]:
    """Claim and complete until nothing is claimable; returns what ran, in order."""
    ran: list[Delivery] = []
    for _ in range(1000):
        batch = await outbox.claim(owner, limit=100)
        if not batch:
            return ran
        for delivery in batch:
            assert await outbox.complete(delivery), f"{delivery} could not be completed"
        ran += batch
    raise AssertionError("drain did not end")


def paid(event_id: str, key: str | None = None) -> Event:
    """An event with one subscriber, "stats"."""
    return Event(id=event_id, type="order.paid", key=key)
