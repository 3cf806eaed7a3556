"""Wake-ups (issue 15): an idle worker polls once an interval whatever its concurrency, and a
put or publish in the same process starts its handler at once, the clock never moved.

Each test runs a worker with a long poll interval on `ManualClock`, acts, waits for what should
follow (a handler's start, a claim sent), never for "nothing left to run", and asserts what ran
and what is stored; the commands are counted where the claim cost is the point.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import anyio

from mongoq import AsyncGroupTransport, AsyncTaskQueue, GroupLease, NewTask, Task
from mongoq.outbox import AsyncOutbox, DeliveryContext, Event
from mongoq.runtime import wakeups
from mongoq.testing import CommandCounter, ManualClock, Operation, instrument, settle
from tests.runtime.test_changes import FakeWatch
from tests.support.group_helpers import PREFIX as GROUPS
from tests.support.group_helpers import group_messages, new_transport
from tests.support.helpers import QUEUE, counted_queue, napping, new_queue, read, wait_for
from tests.support.outbox_helpers import ONLY_H, deliveries, dispatcher, new_outbox

SLOTS = 8
#: Long enough that only a wake-up, never the poll, can explain a handler starting.
POLL = 60.0


def claims(counter: CommandCounter) -> int:
    return counter.counts[f"{QUEUE}.find_one_and_update"]


def queue_loop(queue: Any) -> Any:
    (loop,) = queue._loops
    return loop


def idle(queue: Any, slots: int) -> bool:
    """Every slot of `queue`'s one run is idle: one polls (napping on the clock), the others
    wait for it; no claim is on its way."""
    (loop,) = queue._loops
    return len(loop._naps) == 1 and len(loop._waiting) == slots - 1


async def test_an_idle_worker_of_eight_slots_sends_one_claim_an_interval(
    db: Any, clock: ManualClock
) -> None:
    queue, counter = await counted_queue(db, clock)

    async def handler(task: Task) -> None:
        return None

    async with anyio.create_task_group() as group:
        group.start_soon(partial(queue.run, handler, concurrency=SLOTS, poll_interval=1))
        await wait_for(lambda: idle(queue, SLOTS), "every slot idle")
        assert claims(counter) == SLOTS  # each slot looked once at the start
        counter.reset()
        for _ in range(5):
            clock.advance(1)
            await wait_for(lambda: idle(queue, SLOTS), "the poll to end")
        polled = claims(counter)
        queue.stop()
    assert polled == 5


async def test_a_put_in_the_same_process_starts_the_handler_at_once(
    db: Any, clock: ManualClock
) -> None:
    worker = await new_queue(db, clock)
    worker.collection.watch = FakeWatch()  # on a replica set a stream would wake it too
    producer = AsyncTaskQueue(db, QUEUE, clock=clock)  # another object on the same queue
    ran: list[str] = []

    async def handler(task: Task) -> None:
        ran.append(str(task.id))

    async with anyio.create_task_group() as group:
        group.start_soon(partial(worker.run, handler, concurrency=SLOTS, poll_interval=POLL))
        await wait_for(lambda: idle(worker, SLOTS), "every slot idle")
        await producer.put("t1", {"n": 1})
        await wait_for(lambda: ran == ["t1"], "t1 to start")
        await wait_for(lambda: idle(worker, SLOTS), "every slot idle again")
        await producer.put("later", delay=5)  # not due: nobody claims it before its time
        await settle()
        assert ran == ["t1"] and idle(worker, SLOTS)  # no slot even woke
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
        await wait_for(lambda: idle(worker, SLOTS), "every slot idle")
        await worker.put_many(NewTask(f"t{n}") for n in range(SLOTS))
        every = {f"t{n}" for n in range(SLOTS)}
        await wait_for(lambda: running == every, "every slot to run a task")
        release.set()
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
        await wait_for(lambda: idle(worker, 1), "the slot to nap")
        hook.armed = True
        clock.advance(POLL)  # the poll's claim: it finds nothing, then t1 is put
        # Claimed again at once, not a whole interval later: the clock does not move.
        await wait_for(lambda: ran == ["t1"], "t1 to start")
        assert not hook.armed
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
        await wait_for(lambda: idle(worker, 1), "the slot to nap")
        # t1 due now (by hand: the clock does not move, nothing polls before +60 s)
        await db[QUEUE].update_one({"_id": "t1"}, {"$set": {"lease_until": clock.now()}})
        await anyio.to_thread.run_sync(wakeups.notify, wakeups.key_of("tasks", db, QUEUE))
        await wait_for(lambda: ran == ["t1"], "t1 to start")
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
        await wait_for(lambda: idle(worker, SLOTS), "every slot idle")
        await producer.publish("g", "g0")
        await wait_for(lambda: ran == ["g0"], "g0 to start")
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
        await wait_for(lambda: napping(running), "the dispatcher to nap")
        await producer.publish(Event("e1", "t"), session=None)
        await wait_for(lambda: ran == ["e1"], "e1 to start")
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
            await wait_for(lambda: idle(queue, 2), "both slots idle")
            await queue.put("t1")
            await wait_for(lambda: running == ["t1"], "t1 to start")
            await wait_for(lambda: len(queue_loop(queue)._naps) == 1, "the other slot to poll")
            await make_due_elsewhere(db, clock, "t2")
            clock.advance(poll)
            await wait_for(lambda: running == ["t1", "t2"], "t2 to start while t1 runs")
            release.set()
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
            await wait_for(lambda: idle(queue, 2), "both slots idle")
            await queue.put("t0")
            await wait_for(lambda: running == ["t0"], "t0 to start")
            await wait_for(lambda: len(queue_loop(queue)._naps) == 1, "the other slot to nap")
            await make_due_elsewhere(db, clock, "t1", "t2")
            release["t0"].set()
            await wait_for(lambda: sorted(running) == ["t0", "t1", "t2"], "t1 and t2 to start")
            for event in release.values():
                event.set()
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
            # t1 came while the claim ran: claimed at once, the clock never moved.
            await wait_for(lambda: ran == ["t1"], "t1 to start")
            assert not hook.armed
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
            await wait_for(lambda: ran == ["e1"], "e1 to start")
            assert not hook.armed
            running.stop()


async def test_a_run_leaves_no_listener_behind_and_a_delayed_put_wakes_nobody(
    db: Any, clock: ManualClock
) -> None:
    queue, counter = await counted_queue(db, clock)
    queue.collection.watch = FakeWatch()  # on a replica set a stream would wake it too
    key = wakeups.key_of("tasks", db, QUEUE)

    async def handler(task: Task) -> None:
        return None

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(partial(queue.run, handler, concurrency=SLOTS, poll_interval=POLL))
            await wait_for(lambda: idle(queue, SLOTS), "every slot idle")
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
