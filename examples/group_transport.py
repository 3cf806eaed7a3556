"""Per-group FIFO: events of one order are handled one at a time, in publish order, while
different orders are handled in parallel and a busy order cannot starve quiet ones.

Runs on the embedded in-memory backend: ``python examples/group_transport.py``.
"""

from __future__ import annotations

import asyncio
import logging

import mongoq
from mongoq import GroupLease, NewMessage, PermanentError

handled: list[tuple[str, str]] = []


async def handle(lease: GroupLease) -> None:
    if lease.event["type"] == "corrupt":
        raise PermanentError("cannot parse")  # straight to the dead letters
    handled.append((str(lease.group_id), lease.event["type"]))


async def main() -> None:
    db = mongoq.connect()
    orders = mongoq.AsyncGroupTransport(db, "orders", lease_ttl=30, max_deliveries=5)
    await orders.setup()

    await orders.publish("order-1", {"type": "created"}, priority=1)  # priority: first publish
    await orders.publish_many(
        [
            NewMessage("order-1", {"type": "paid"}),
            NewMessage("order-2", {"type": "created"}),
            NewMessage("order-1", {"type": "shipped"}),
            NewMessage("order-2", {"type": "corrupt"}),
        ]
    )
    summary = await orders.run(handle, concurrency=4, stop_when_empty=True)
    print(summary)
    for group in ("order-1", "order-2"):
        print(group, [event for g, event in handled if g == group])  # publish order per group
    for dead in await orders.dead_letters():
        print("dead:", dead.group_id, dead.event, dead.error.splitlines()[-1] if dead.error else "")
    print(await orders.stats())


if __name__ == "__main__":
    # mongoq logs (never prints): retries at INFO, failures given up at WARNING.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(main())
