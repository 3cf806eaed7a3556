"""The transactional outbox: `AsyncOutbox` stores events in the caller's MongoDB
transaction and hands out one delivery per subscribed handler; `OutboxDispatcher` runs the
handlers.

Guarantees:

- **Atomic with your writes.** `publish(events, session=s)` writes in `s`'s transaction: a
  rolled-back change never leaks an event, a committed one always has it.
- **Idempotent by event id.** Publishing an id again adds deliveries only for handlers the event
  never had; a handler that completed never runs twice because of a replay.
- **At least once, per handler.** Each handler's delivery is retried with backoff and buried as
  a dead letter after its attempts; a crashed worker's deliveries come back after one lease and
  are charged the attempt they lost, exactly once.
- **Per-key order.** Deliveries of one key and handler run one at a time, in sequence (commit)
  order.
- **Exclusive lanes, fenced settles.** Each handler's deliveries live in 256 lanes of its own
  that workers lease; a completion and a takeover never both succeed, and a worker that lost
  its lane changes nothing.
"""

from __future__ import annotations

from mongoq.outbox.dispatcher import DeliveryContext, Handler, OutboxDispatcher, default_backoff
from mongoq.outbox.models import (
    Delivery,
    DeliveryInfo,
    Event,
    OutboxRunSummary,
    OutboxStats,
    PublishResult,
    PurgeResult,
    lane_of,
)
from mongoq.outbox.store import AsyncOutbox

__all__ = [
    "AsyncOutbox",
    "Delivery",
    "DeliveryContext",
    "DeliveryInfo",
    "OutboxRunSummary",
    "Event",
    "Handler",
    "OutboxDispatcher",
    "OutboxStats",
    "PublishResult",
    "PurgeResult",
    "default_backoff",
    "lane_of",
]
