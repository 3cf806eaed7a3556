"""The outbox from blocking code: `mongoq_sync.Outbox` and `mongoq_sync.OutboxDispatcher`.

Runs on the embedded in-memory backend: ``python examples/sync_outbox.py``. Handlers are plain
functions, run in worker threads; events of one key reach each handler in publish order.
"""

from __future__ import annotations

import logging

import mongoq_sync
from mongoq import DeliveryContext, Event, PermanentError

log: list[str] = []


def ship(event: Event, context: DeliveryContext) -> None:
    if event.payload.get("address") is None:
        raise PermanentError("no address")  # a dead letter at once, no retries
    log.append(f"ship {event.key} ({event.type}, attempt {context.attempt})")


def main() -> None:
    with mongoq_sync.connect() as db:
        outbox = mongoq_sync.Outbox(db, subscriptions={"order.paid": ["ship"]})
        outbox.setup()
        outbox.publish(
            [
                Event("o-1:paid", "order.paid", {"address": "Kyiv"}, key="o-1"),
                Event("o-2:paid", "order.paid", {}, key="o-2"),
            ],
            session=None,  # no transaction on the embedded backend
        )
        dispatcher = mongoq_sync.OutboxDispatcher(outbox, {"ship": ship}, max_attempts=3)
        print(dispatcher.run(stop_when_empty=True))
        print(log)
        for dead in outbox.list_deliveries(status="dead"):
            print("dead:", dead.event_id, (dead.last_error or "").splitlines()[-1])
        outbox.requeue("o-2:paid", "ship")  # after fixing the data, an operator requeues it
        print(outbox.stats())


if __name__ == "__main__":
    # mongoq logs (never prints): retries at INFO, failures given up at WARNING.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
