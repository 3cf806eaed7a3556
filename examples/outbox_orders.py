"""A transactional outbox: an order service writes an order and its event in ONE transaction,
and a dispatcher delivers the event to two handlers, each on its own, in per-order sequence.

- ``mail`` sends a confirmation (at least once: it must be idempotent);
- ``stats`` keeps a projection, and completes its delivery inside the same transaction as its
  write, so the projection counts each event exactly once even if a worker crashes.

``python examples/outbox_orders.py`` runs on the embedded in-memory backend, which has no
transactions: the writes then happen one after another (``session=None``). Point
``MONGOQ_URI`` at a replica set to see the transactional path.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from pymongo import ReadPreference
from pymongo.write_concern import WriteConcern

import mongoq
from mongoq.outbox import AsyncOutbox, DeliveryContext, Event, OutboxDispatcher

sent: list[str] = []


async def in_transaction(db: Any, work: Callable[[Any], Awaitable[None]]) -> None:
    """Run `work(session)` in a transaction where the database has them, else without."""
    if await mongoq.supports_transactions(db):
        async with db.client.start_session() as session:
            # Primary reads and majority writes whatever the client's defaults (a transaction
            # with secondary reads is refused; one with w=1 can be rolled back by a failover).
            await session.with_transaction(
                work,
                read_preference=ReadPreference.PRIMARY,
                write_concern=WriteConcern(w="majority"),
            )
    else:
        await work(None)


async def place_order(db: Any, outbox: AsyncOutbox, order_id: str, total: int) -> None:
    async def work(session: Any) -> None:
        await db.orders.insert_one({"_id": order_id, "total": total}, session=session)
        await outbox.publish(
            [
                Event(f"{order_id}:created", "order.created", {"total": total}, key=order_id),
                Event(f"{order_id}:paid", "order.paid", {"total": total}, key=order_id),
            ],
            session=session,
        )

    await in_transaction(db, work)


async def main() -> None:
    db = mongoq.connect(os.environ.get("MONGOQ_URI"), "outbox_example")
    outbox = AsyncOutbox(
        db, subscriptions={"order.created": ["mail", "stats"], "order.paid": ["stats"]}
    )
    await outbox.setup()

    for number in range(1, 4):
        await place_order(db, outbox, f"order-{number}", total=10 * number)
    # A retried publish (same event ids) delivers nothing new: the outbox deduplicates by id.
    again = await outbox.publish(Event("order-1:created", "order.created", {}), session=None)
    print("republished:", again)

    async def mail(event: Event, context: DeliveryContext) -> None:
        sent.append(f"{event.key}: {event.type}")

    async def stats(event: Event, context: DeliveryContext) -> None:
        async def work(session: Any) -> None:
            await db.revenue.update_one(
                {"_id": event.type}, {"$inc": {"total": event.payload["total"]}},
                upsert=True, session=session,
            )  # fmt: skip
            if session is not None:  # completes with the projection, or not at all
                await context.complete(session)

        await in_transaction(db, work)

    dispatcher = OutboxDispatcher(outbox, {"mail": mail, "stats": stats})
    print(await dispatcher.run(concurrency=4, stop_when_empty=True))
    print("mail sent:", sent)
    print("revenue:", await db.revenue.find({}, sort=[("_id", 1)]).to_list(None))
    print(await outbox.stats())
    await mongoq.close(db)


if __name__ == "__main__":
    # mongoq logs (never prints): retries at INFO, failures given up at WARNING.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(main())
