"""Wake-ups (issue 15): an idle worker polls once an interval whatever its concurrency, and a
put or publish in the same process starts its handler at once, the clock never moved.

Each test runs a worker with a long poll interval on `ManualClock`, acts, lets every task run
until it blocks (`settle`), and asserts what ran and what is stored; the commands are counted
where the claim cost is the point.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import anyio

from mongoq import AsyncGroupTransport, AsyncTaskQueue, GroupLease, NewTask, Task
from mongoq.outbox import AsyncOutbox, DeliveryContext, Event
from mongoq.runtime import wakeups
from mongoq.testing import CommandCounter, ManualClock, Operation, instrument, settle
from tests.support.group_helpers import PREFIX as GROUPS
from tests.support.group_helpers import group_messages, new_transport
from tests.support.helpers import QUEUE, counted_queue, new_queue, read
from tests.support.outbox_helpers import ONLY_H, deliveries, dispatcher, new_outbox

SLOTS = 8
#: Long enough that only a wake-up, never the poll, can explain a handler starting.
POLL = 60.0


def claims(counter: CommandCounter) -> int:
    return counter.counts[f"{QUEUE}.find_one_and_update"]


async def test_an_idle_worker_of_eight_slots_sends_one_claim_an_interval(
    db: Any, clock: ManualClock
) -> None:
    queue, counter = await counted_queue(db, clock)

    async def handler(task: Task) -> None:
        return None

    async with anyio.create_task_group() as group:
        group.start_soon(partial(queue.run, handler, concurrency=SLOTS, poll_interval=1))
        await settle()
        assert claims(counter) == SLOTS  # each slot looked once at the start
        counter.reset()
        for _ in range(5):
            clock.advance(1)
            await settle()
        polled = claims(counter)
        queue.stop()
    assert polled == 5


async def test_a_put_in_the_same_process_starts_the_handler_at_once(
    db: Any, clock: ManualClock
) -> None:
    worker = await new_queue(db, clock)
    producer = AsyncTaskQueue(db, QUEUE, clock=clock)  # another object on the same queue
    ran: list[str] = []

    async def handler(task: Task) -> None:
        ran.append(str(task.id))

    async with anyio.create_task_group() as group:
        group.start_soon(partial(worker.run, handler, concurrency=SLOTS, poll_interval=POLL))
        await settle()
        await producer.put("t1", {"n": 1})
        await settle()
        assert ran == ["t1"]
        await producer.put("later", delay=5)  # not due: nobody claims it before its time
        await settle()
        assert ran == ["t1"]
        worker.stop()
    assert (await read(db, "t1") or {}).get("status") == "done"
    assert (await read(db, "later") or {}).get("status") == "pending"


async def test_a_burst_wakes_one_slot_after_another_until_every_slot_runs(
    db: Any, clock: ManualClock
) -> None:
    """Idle, the slots wait behind one poller; a put of eight tasks wakes the poller, and each
    slot that claims one wakes the next: all eight run at once, the clock never moved."""
    worker = await new_queue(db, clock)
    running: set[str] = set()
    release = anyio.Event()

    async def handler(task: Task) -> None:
        running.add(str(task.id))
        await release.wait()

    async with anyio.create_task_group() as group:
        group.start_soon(partial(worker.run, handler, concurrency=SLOTS, poll_interval=POLL))
        await settle()
        await worker.put_many(NewTask(f"t{n}") for n in range(SLOTS))
        await settle()
        assert running == {f"t{n}" for n in range(SLOTS)}
        release.set()
        await settle()
        worker.stop()
    for n in range(SLOTS):
        assert (await read(db, f"t{n}") or {}).get("status") == "done"


class PutAfterTheFirstEmptyClaim:
    """A hook: right after the worker's first claim that found nothing has run, and before
    the worker reads its reply, a producer puts a task (as another process's slot would)."""

    def __init__(self, producer: AsyncTaskQueue) -> None:
        self.producer = producer
        self.armed = False

    async def before(self, op: Operation) -> None:
        return None

    async def after(self, op: Operation, error: BaseException | None) -> None:
        if self.armed and op.name == "find_one_and_update" and op.returned is None:
            self.armed = False
            await self.producer.put("t1")


async def test_a_wake_up_that_comes_while_the_claim_runs_is_not_lost(
    db: Any, clock: ManualClock
) -> None:
    producer = AsyncTaskQueue(db, QUEUE, clock=clock)
    hook = PutAfterTheFirstEmptyClaim(producer)
    worker = await new_queue(instrument(db, hook), clock)
    ran: list[str] = []

    async def handler(task: Task) -> None:
        ran.append(str(task.id))

    async with anyio.create_task_group() as group:
        group.start_soon(partial(worker.run, handler, concurrency=1, poll_interval=POLL))
        await settle()
        hook.armed = True
        clock.advance(POLL)  # the poll's claim: it finds nothing, then t1 is put
        await settle()
        assert not hook.armed
        assert ran == ["t1"]  # claimed again at once, not a whole interval later
        worker.stop()


async def test_a_wake_up_from_another_thread_reaches_the_worker_through_its_loop(
    db: Any, clock: ManualClock
) -> None:
    worker = await new_queue(db, clock)
    await worker.put("t1", delay=5)
    ran: list[str] = []

    async def handler(task: Task) -> None:
        ran.append(str(task.id))

    async with anyio.create_task_group() as group:
        group.start_soon(partial(worker.run, handler, poll_interval=POLL))
        await settle()
        # t1 due now (by hand: the clock does not move, nothing polls before +60 s)
        await db[QUEUE].update_one({"_id": "t1"}, {"$set": {"lease_until": clock.now()}})
        await anyio.to_thread.run_sync(wakeups.notify, wakeups.key_of("tasks", db, QUEUE))
        await settle()
        assert ran == ["t1"]
        worker.stop()


async def test_a_publish_in_the_same_process_wakes_the_group_workers(
    db: Any, clock: ManualClock
) -> None:
    worker = await new_transport(db, clock)
    producer = AsyncGroupTransport(db, GROUPS, clock=clock)
    ran: list[Any] = []

    async def handler(lease: GroupLease) -> None:
        ran.append(lease.event)

    async with anyio.create_task_group() as group:
        group.start_soon(partial(worker.run, handler, concurrency=SLOTS, poll_interval=POLL))
        await settle()
        await producer.publish("g", "g0")
        await settle()
        assert ran == ["g0"]
        worker.stop()
    assert await group_messages(db) == {}


async def test_a_plain_publish_in_the_same_process_wakes_the_outbox_dispatcher(
    db: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(db, clock, subscriptions=ONLY_H)
    producer = AsyncOutbox(db, outbox.prefix, subscriptions=ONLY_H, clock=clock)
    ran: list[str] = []

    async def handle(event: Event, context: DeliveryContext) -> None:
        ran.append(event.id)

    running = dispatcher(outbox, {"h": handle}, poll_interval=POLL)
    async with anyio.create_task_group() as group:
        group.start_soon(running.run)
        await settle()
        await producer.publish(Event("e1", "t"), session=None)
        await settle()
        assert ran == ["e1"]
        running.stop()
    assert await deliveries(db) == []
