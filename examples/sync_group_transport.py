"""Per-group FIFO from blocking code: `mongoq_sync.GroupTransport`.

Runs on the embedded in-memory backend: ``python examples/sync_group_transport.py``.
"""

from __future__ import annotations

import logging

import mongoq_sync
from mongoq import GroupLease, NewMessage


def main() -> None:
    with mongoq_sync.connect() as db:
        orders = mongoq_sync.GroupTransport(db, "orders", lease_ttl=30)
        orders.setup()
        orders.publish_many(
            NewMessage(f"order-{n % 2}", {"step": step}) for n in range(2) for step in range(3)
        )

        lease = orders.claim("script")
        assert lease is not None
        print("handling", lease.group_id, lease.event)
        orders.ack(lease)

        seen: list[tuple[str, int]] = []

        def handle(lease: GroupLease) -> None:  # a plain function, run in a worker thread
            seen.append((str(lease.group_id), lease.event["step"]))

        print(orders.run(handle, concurrency=2, stop_when_empty=True))
        print(sorted(seen))


if __name__ == "__main__":
    # mongoq logs (never prints): retries at INFO, failures given up at WARNING.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
