"""Shared helpers of the dashboard tests (and of ``tools/dashboard_screenshot.py``): a database
with one primitive of each kind in the states an operator looks for, and an httpx client on
the dashboard's ASGI app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from mongoq import AsyncGroupTransport, AsyncTaskQueue
from mongoq.dashboard import create_app
from mongoq.outbox import AsyncOutbox, Event
from mongoq.testing import ManualClock

TOKEN = "test-token-0123456789"
BASE_URL = "http://127.0.0.1:8188"
#: What a failed task's handler said: markup, to show that every page escapes it.
HOSTILE_ERROR = "SMTP 550 <script>alert(1)</script> mailbox unavailable"


@dataclass
class Seeded:
    queue: AsyncTaskQueue
    transport: AsyncGroupTransport
    outbox: AsyncOutbox


async def seed(db: Any, clock: ManualClock) -> Seeded:
    """A task queue ``emails`` (``welcome-1`` done, ``bounce-2`` failed with `HOSTILE_ERROR`,
    ``7`` failed (an integer id), ``digest-3`` pending, ``report-4`` running), a group
    transport ``orders`` (a dead letter in group ``o-1``, group ``o-2`` parked by a nack)
    and an outbox ``shop_`` (the delivery of ``e1`` to ``stats`` dead)."""
    queue = AsyncTaskQueue(db, "emails", clock=clock, max_attempts=3)
    await queue.setup()
    for task_id in ("welcome-1", "bounce-2", 7, "report-4"):
        await queue.put(task_id, {"to": f"{task_id}@example.org"})
        task = await queue.claim("worker-a")
        assert task is not None and task.id == task_id
        if task_id == "welcome-1":
            await queue.complete(task, {"sent": True})
        elif task_id == "bounce-2":
            await queue.fail(task, HOSTILE_ERROR)
        elif task_id == 7:
            await queue.fail(task, "ValueError: no such template")
    await queue.put("digest-3", {"to": "all@example.org"})

    transport = AsyncGroupTransport(db, "orders", clock=clock)
    await transport.setup()
    await transport.publish("o-1", {"order": 1})
    lease = await transport.claim("worker-b")
    assert lease is not None
    await transport.dead_letter(lease, "PermanentError: card declined")
    await transport.publish("o-2", {"order": 2})
    lease = await transport.claim("worker-b")
    assert lease is not None
    await transport.nack(lease, 300, error="TimeoutError: payment service")

    outbox = AsyncOutbox(db, "shop_", subscriptions={"order.paid": ["stats"]}, clock=clock)
    await outbox.setup()
    await outbox.publish([Event(id="e1", type="order.paid", key="k")], session=None)
    [head] = await outbox.claim("worker-c")
    await outbox.bury(head, error="KeyError: 'amount'")
    clock.advance(90)  # ages to show
    return Seeded(queue, transport, outbox)


@asynccontextmanager
async def client(app: Any, **headers: str) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url=BASE_URL, headers=headers, follow_redirects=False
    ) as http:
        yield http


def app_of(db: Any, clock: ManualClock, **options: Any) -> Any:
    return create_app(db, clock=clock, token=TOKEN, sample_interval=None, **options)
