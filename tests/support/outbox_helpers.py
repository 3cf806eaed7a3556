"""Shared helpers of the outbox tests: building an outbox on a manual clock (plain, counted or
with injected faults), reading its collections back, dispatching to transactional handlers, and
publishing inside a transaction of the test engine or a real server."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import bson
import pytest

from mongoq import _driver
from mongoq.outbox import AsyncOutbox, Delivery, DeliveryContext, Event, OutboxDispatcher, lane_of
from mongoq.testing import CommandCounter, FaultInjector, ManualClock, instrument

PREFIX = "ob_"
#: "stats" first: set up first, it has slot 0, whose lanes are 0-255 (a lane's ``_id`` is its
#: number); "mail"'s are 256-511.
SUBSCRIPTIONS: dict[str, list[str]] = {
    "order.paid": ["stats"],
    "order.created": ["mail", "stats"],
}
#: One handler, "h", for events of type "t".
ONLY_H: dict[str, list[str]] = {"t": ["h"]}
LEASE = 30
Handler = Callable[[Event, DeliveryContext], Awaitable[Any]]


async def new_outbox(
    db: Any,
    clock: ManualClock,
    *,
    subscriptions: Mapping[str, Iterable[str]] | None = None,
    lease_ttl: float = LEASE,
    completion_history: bool = False,
) -> AsyncOutbox:
    outbox = AsyncOutbox(
        db,
        PREFIX,
        subscriptions=subscriptions if subscriptions is not None else SUBSCRIPTIONS,
        lease_ttl=lease_ttl,
        completion_history=completion_history,
        clock=clock,
    )
    await outbox.setup()
    return outbox


def another(db: Any, clock: ManualClock, subscriptions: Any = SUBSCRIPTIONS) -> AsyncOutbox:
    """Another instance (another process) on the collections `new_outbox` set up."""
    return AsyncOutbox(db, PREFIX, subscriptions=subscriptions, lease_ttl=LEASE, clock=clock)


async def counted_outbox(
    db: Any, clock: ManualClock, counter: CommandCounter, **options: Any
) -> AsyncOutbox:
    """An outbox whose commands `counter` counts from after its setup."""
    outbox = await new_outbox(instrument(db, counter), clock, **options)
    counter.reset()
    return outbox


async def faulty_outbox(
    db: Any, clock: ManualClock, **options: Any
) -> tuple[AsyncOutbox, FaultInjector]:
    """An outbox whose commands pass through a new `FaultInjector` (nothing armed yet), with
    that injector. ``outbox.db`` is the instrumented database: instances built on it (`another`)
    meet the same faults."""
    faults = FaultInjector()
    return await new_outbox(instrument(db, faults), clock, **options), faults


def order(n: int, key: str | None = None, kind: str = "order.created") -> Event:
    return Event(id=f"e{n}", type=kind, payload={"n": n}, key=key)


def event(n: int, key: str | None = None, kind: str = "t") -> Event:
    """An event of type "t" by default: with `ONLY_H`, one delivery to "h"."""
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
    """The lane documents by ``_id`` (``slot * 256 + number``; the first handler set up has
    slot 0: lanes 0-255), without the slots and the counter beside them."""
    docs = await db[f"{prefix}lanes"].find({"n": {"$exists": True}}).to_list(None)
    return {d["_id"]: d for d in docs}


async def lane_ids_of(db: Any, handler: str, prefix: str = PREFIX) -> int:
    """The first lane ``_id`` of `handler` (its slot times 256)."""
    doc = await db[f"{prefix}lanes"].find_one({"_id": "slots"})
    assert doc is not None and handler in doc["handlers"], f"{handler} has no lanes"
    return int(doc["handlers"].index(handler)) * 256


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


def ran(batch: Sequence[Delivery]) -> list[tuple[str, int]]:
    """(event id, attempt) of each delivery, sorted."""
    return sorted((d.event.id, d.attempt) for d in batch)


def attempts(docs: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """(attempts, claims) of each delivery document, by event id."""
    return {d["event_id"]: (d["attempts"], d["claims"]) for d in docs}


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


async def lane_docs(db: Any, prefix: str = PREFIX) -> dict[int, dict[str, Any]]:
    """The lane documents, by ``_id`` (256 a handler)."""
    return await lanes(db, prefix)


def entry(doc: dict[str, Any] | None) -> dict[str, Any]:
    """The lane entry listing the delivery document `doc` at its current generation."""
    assert doc is not None
    listed = {"d": doc["_id"], "g": doc["claims"], "h": doc["handler"]}
    if "key" in doc:
        listed["k"] = doc["key"]
    return listed


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


async def drain(outbox: AsyncOutbox, owner: str = "drainer", limit: int = 100) -> list[Delivery]:
    """Claim (`limit` at a time) and complete until nothing is claimable; returns what ran, in
    order."""
    ran: list[Delivery] = []
    for _ in range(1000):
        batch = await outbox.claim(owner, limit=limit)
        if not batch:
            return ran
        for delivery in batch:
            assert await outbox.complete(delivery), f"{delivery} could not be completed"
        ran += batch
    raise AssertionError("drain did not end")


def paid(event_id: str, key: str | None = None) -> Event:
    """An event with one subscriber, "stats"."""
    return Event(id=event_id, type="order.paid", key=key)


async def bury_head(outbox: AsyncOutbox, error: str | None = None) -> Delivery:
    """Publish e1, e2 and e3 of key k (one delivery each, to "stats") and bury e1, the head,
    claimed by A: e2 and e3 wait behind a dead letter."""
    await outbox.publish([paid("e1", "k"), paid("e2", "k"), paid("e3", "k")], session=None)
    [head] = await outbox.claim("A")
    assert (head.event.id, head.handler) == ("e1", "stats")
    assert await outbox.bury(head, error=error)
    return head


# ------------------------------------------------------------------------------ dispatching


#: The options of `OutboxDispatcher.run` (`run_once` takes those it needs of them).
RUN_OPTIONS = ("worker_id", "concurrency", "poll_interval", "handler_timeout")


class Dispatching:
    """An `OutboxDispatcher` whose runs get the run options a test gave once (worker "w" by
    default); anything else is the dispatcher's own."""

    def __init__(self, dispatcher: OutboxDispatcher, options: dict[str, Any]) -> None:
        self.dispatcher = dispatcher
        self.options = options

    async def run(self, **options: Any) -> Any:
        return await self.dispatcher.run(**{**self.options, **options})

    async def run_once(self, **options: Any) -> Any:
        given = {k: v for k, v in self.options.items() if k != "poll_interval"}
        return await self.dispatcher.run_once(**{**given, **options})

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dispatcher, name)


def dispatcher(outbox: AsyncOutbox, handlers: dict[str, Handler], **options: Any) -> Any:
    """A dispatcher of worker "w" whose retries wait 10 s, unless `options` (the
    dispatcher's, or its runs') say otherwise."""
    options.setdefault("worker_id", "w")
    options.setdefault("backoff", lambda attempt: 10)
    runs = {k: options.pop(k) for k in RUN_OPTIONS if k in options}
    return Dispatching(OutboxDispatcher(outbox, handlers, **options), runs)


async def projection_collection(db: Any) -> Any:
    await _driver.create_collections(db, ["projection"])  # not implicitly, in a transaction
    return db["projection"]


def projecting(db: Any, fail_first: BaseException | None = None) -> Handler:
    """A handler that writes its projection ``{_id: event id, attempt}`` and completes its
    delivery in one transaction; `fail_first` is raised inside the transaction after the
    completion, on the first attempt, so that it aborts both."""

    async def project(event: Event, context: DeliveryContext) -> None:
        async def work(session: Any) -> None:
            await db["projection"].insert_one(
                {"_id": event.id, "attempt": context.attempt}, session=session
            )
            await context.complete(session)
            if fail_first is not None and context.attempt == 1:
                raise fail_first

        await _driver.run_in_transaction(db, work)

    return project
