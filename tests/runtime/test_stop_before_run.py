"""A stop that comes before `run()` is not lost, the same for every primitive: the run that
starts while it holds (one called just before, whose loop was not running yet, or one called
after a stop with none running) claims nothing and returns; the run after it starts afresh.
(The outbox dispatcher's case: tests/outbox/test_dispatcher_faults.py.)"""

from __future__ import annotations

from typing import Any

import anyio

from mongoq.groups.models import GroupLease
from mongoq.tasks.models import Task
from mongoq.testing import ManualClock
from tests.support.group_helpers import messages, new_transport
from tests.support.helpers import new_queue, read


async def test_a_task_queue_stopped_before_its_run_starts_returns_at_once(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t1")
    ran: list[Any] = []

    async def handler(task: Task) -> None:
        ran.append(task.id)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            outcome: list[Any] = []

            async def run() -> None:
                outcome.append(await queue.run(handler))  # would poll forever unless stopped

            group.start_soon(run)
            queue.stop()  # before the run's loop exists: the run has not started yet
    assert (outcome[0].claimed, ran) == (0, [])
    doc = await read(db, "t1")
    assert doc is not None and (doc["status"], doc["attempts"]) == ("pending", 0)
    with anyio.fail_after(10):
        summary = await queue.run(handler, stop_when_empty=True)
    assert (summary.completed, ran) == (1, ["t1"])


async def test_a_group_transport_stopped_before_its_run_starts_returns_at_once(
    db: Any, clock: ManualClock
) -> None:
    transport = await new_transport(db, clock)
    await transport.publish("g", {"n": 1})
    ran: list[Any] = []

    async def handler(lease: GroupLease) -> None:
        ran.append(lease.group_id)

    transport.stop()  # with no run going: it holds for the next one
    with anyio.fail_after(10):
        first = await transport.run(handler)
    assert (first.claimed, ran, len(await messages(db))) == (0, [], 1)
    with anyio.fail_after(10):
        second = await transport.run(handler, stop_when_empty=True)
    assert (second.acked, ran, await messages(db)) == (1, ["g"], {})
