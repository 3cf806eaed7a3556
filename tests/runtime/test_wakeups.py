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


async def make_due_elsewhere(db: Any, clock: ManualClock, *task_ids: str) -> None:
    """Tasks put with a delay, made due as another process's write would: nobody here is told."""
    for task_id in task_ids:
        await db[QUEUE].update_one({"_id": task_id}, {"$set": {"lease_until": clock.now()}})


async def test_the_poller_that_claims_something_hands_polling_to_another_slot(
    db: Any, clock: ManualClock
) -> None:
    """Two slots: the poller claims t1 and runs it for long; the other slot now polls, and at
    the next interval claims t2 that another process made due."""
    queue = await new_queue(db, clock)
    await queue.put("t2", delay=3600)
    release = anyio.Event()
    running: list[str] = []

    async def handler(task: Task) -> None:
        running.append(str(task.id))
        if task.id == "t1":
            await release.wait()

    poll = 5.0  # within the lease: t1's holder keeps it across the interval
    with anyio.fail_after(30):  # a hang fails the test instead of the suite
        async with anyio.create_task_group() as group:
            group.start_soon(partial(queue.run, handler, concurrency=2, poll_interval=poll))
            await settle()
            await queue.put("t1")
            await settle()
            assert running == ["t1"]
            await make_due_elsewhere(db, clock, "t2")
            clock.advance(poll)
            await settle()
            assert running == ["t1", "t2"]  # while t1 still runs
            release.set()
            await settle()
            queue.stop()


async def test_a_slot_that_claims_while_the_poller_naps_cuts_the_nap_short(
    db: Any, clock: ManualClock
) -> None:
    """Slot A runs t0; slot B naps as the poller. Another process makes t1 and t2 due; A,
    done, claims t1, and with no slot waiting it wakes the poller, which claims t2: both run
    at once, the clock never moved."""
    queue = await new_queue(db, clock)
    await queue.put_many([NewTask("t1", delay=3600), NewTask("t2", delay=3600)])
    release = {name: anyio.Event() for name in ("t0", "t1", "t2")}
    running: list[str] = []

    async def handler(task: Task) -> None:
        running.append(str(task.id))
        await release[str(task.id)].wait()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(partial(queue.run, handler, concurrency=2, poll_interval=POLL))
            await settle()
            await queue.put("t0")
            await settle()
            assert running == ["t0"]
            await make_due_elsewhere(db, clock, "t1", "t2")
            release["t0"].set()
            await settle()
            assert sorted(running) == ["t0", "t1", "t2"]
            for event in release.values():
                event.set()
            await settle()
            queue.stop()


async def test_a_wake_up_during_a_drained_run_is_not_lost(db: Any, clock: ManualClock) -> None:
    producer = AsyncTaskQueue(db, QUEUE, clock=clock)
    hook = PutAfterTheFirstEmptyClaim(producer)
    worker = await new_queue(instrument(db, hook), clock)
    await worker.put("later", delay=3600)  # keeps the drained run waiting
    ran: list[str] = []

    async def handler(task: Task) -> None:
        ran.append(str(task.id))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            hook.armed = True
            group.start_soon(
                partial(worker.run, handler, poll_interval=POLL, stop_when_drained=True)
            )
            await settle()
            assert not hook.armed
            assert ran == ["t1"]  # t1 came while the claim ran: claimed at once
            worker.stop()


async def test_a_publish_during_the_dispatchers_claim_is_not_lost(
    db: Any, clock: ManualClock
) -> None:
    """The dispatcher's scan has run (nothing due); before its claim returns, e1 is published
    in this process: the dispatcher claims again at once instead of napping its interval."""
    outbox = await new_outbox(db, clock, subscriptions=ONLY_H)
    producer = AsyncOutbox(db, outbox.prefix, subscriptions=ONLY_H, clock=clock)

    class PublishAfterTheFirstScan:
        armed = True

        async def before(self, op: Operation) -> None:
            return None

        async def after(self, op: Operation, error: BaseException | None) -> None:
            if self.armed and op.collection.endswith("deliveries") and op.name == "find":
                self.armed = False
                await producer.publish(Event("e1", "t"), session=None)

    hook = PublishAfterTheFirstScan()
    watched = AsyncOutbox(instrument(db, hook), outbox.prefix, subscriptions=ONLY_H, clock=clock)
    ran: list[str] = []

    async def handle(event: Event, context: DeliveryContext) -> None:
        ran.append(event.id)

    running = dispatcher(watched, {"h": handle}, poll_interval=POLL)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(running.run)
            await settle()
            assert not hook.armed
            assert ran == ["e1"]
            running.stop()


async def test_a_run_leaves_no_listener_behind_and_a_delayed_put_wakes_nobody(
    db: Any, clock: ManualClock
) -> None:
    queue, counter = await counted_queue(db, clock)
    key = wakeups.key_of("tasks", db, QUEUE)

    async def handler(task: Task) -> None:
        return None

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(partial(queue.run, handler, concurrency=SLOTS, poll_interval=POLL))
            await settle()
            assert key in wakeups._listeners
            counter.reset()
            await queue.put("later", delay=5)  # not due: no claim follows
            await settle()
            assert counter.counts[f"{QUEUE}.find_one_and_update"] == 0
            queue.stop()
    assert key not in wakeups._listeners
    async with anyio.create_task_group() as group:  # a cancelled run leaves none either
        group.start_soon(partial(queue.run, handler, poll_interval=POLL))
        await settle()
        group.cancel_scope.cancel()
    assert key not in wakeups._listeners
