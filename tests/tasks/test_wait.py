"""`AsyncTaskQueue.wait` (issue 15): a producer waits for a task's end. A worker of the same
process tells it at once; another process's worker is seen at the next poll; the timeout runs
on the queue's clock. Each test counts the reads, so that a tight poll would show."""

from __future__ import annotations

from datetime import timedelta
from functools import partial
from typing import Any

import anyio
import pytest

from mongoq import InvalidInput, MongoqError, NewTask, NotFound, PermanentError, Task
from mongoq.runtime import changes
from mongoq.testing import ManualClock
from tests.support.helpers import QUEUE, claim_one, counted_queue, new_queue, wait_for


def reads(counter: Any) -> int:
    return int(counter.counts[f"{QUEUE}.find_one"])


async def asleep(clock: ManualClock, seconds: float, what: str = "the wait to sleep") -> None:
    """Until a task sleeps `seconds` from now on the clock (the wait, after its read): never
    "nothing left to run", which a command's round trip ends too early."""
    deadline = clock.now() + timedelta(seconds=seconds)
    await wait_for(lambda: clock.sleeping_until(deadline) == 1, what)


async def test_wait_returns_the_task_a_worker_of_this_process_completes_at_once(
    db: Any, clock: ManualClock
) -> None:
    queue, counter = await counted_queue(db, clock)
    release = anyio.Event()

    async def handler(task: Task) -> dict[str, int]:
        await release.wait()
        return {"sum": 3}

    await queue.put("t1", {"a": 1, "b": 2})
    waited: list[Task] = []
    async with anyio.create_task_group() as group:
        group.start_soon(partial(queue.run, handler, poll_interval=60))

        async def waiter() -> None:
            waited.append(await queue.wait("t1", timeout=3600, poll_interval=90))

        group.start_soon(waiter)
        await asleep(clock, 90)
        assert waited == [] and reads(counter) == 1  # one read, then it waits
        release.set()
        await wait_for(lambda: bool(waited), "the wait to return")
        assert [(t.id, t.status, t.result) for t in waited] == [("t1", "done", {"sum": 3})]
        assert reads(counter) == 2  # told, read once more: no poll in between
        queue.stop()


@pytest.mark.parametrize("ending", ["failed", "cancelled", "tombstone"])
async def test_wait_returns_a_failed_cancelled_or_removed_task(
    db: Any, clock: ManualClock, ending: str
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t1")
    waited: list[Task] = []
    async with anyio.create_task_group() as group:

        async def waiter() -> None:
            waited.append(await queue.wait("t1", poll_interval=60))

        group.start_soon(waiter)
        await asleep(clock, 60)
        if ending == "failed":
            assert await queue.fail(await claim_one(queue, expect="t1"), PermanentError("bad"))
        elif ending == "cancelled":
            assert await queue.cancel("t1")
        else:
            assert await queue.remove("t1")
        await wait_for(lambda: bool(waited), "the wait to return")
        assert [t.status for t in waited] == [ending]


async def test_wait_sees_another_process_finish_the_task_at_its_next_poll(
    db: Any, clock: ManualClock
) -> None:
    from tests.runtime.test_changes import FakeWatch

    queue, counter = await counted_queue(db, clock)
    queue.collection.watch = FakeWatch()  # a stream that tells nothing: only the poll can
    await queue.put("t1")
    waited: list[Task] = []
    async with anyio.create_task_group() as group:

        async def waiter() -> None:
            waited.append(await queue.wait("t1", poll_interval=5))

        group.start_soon(waiter)
        await asleep(clock, 5)
        # Another process completes it: nothing in this process is told.
        await db[QUEUE].update_one({"_id": "t1"}, {"$set": {"status": "done", "result": 7}})
        clock.advance(4.999)
        await asleep(clock, 0.001, "the wait to sleep on")
        assert waited == [] and reads(counter) == 1
        clock.advance(0.001)
        await wait_for(lambda: bool(waited), "the wait to return")
        assert [(t.status, t.result) for t in waited] == [("done", 7)]
        assert reads(counter) == 2


async def test_wait_raises_timeout_error_when_the_task_does_not_finish_in_time(
    db: Any, clock: ManualClock
) -> None:
    queue, counter = await counted_queue(db, clock)
    await queue.put("t1")
    errors: list[BaseException] = []
    async with anyio.create_task_group() as group:

        async def waiter() -> None:
            try:
                await queue.wait("t1", timeout=10, poll_interval=4)
            except TimeoutError as error:
                errors.append(error)

        group.start_soon(waiter)
        await asleep(clock, 4)
        for step, rest in ((4, 4), (4, 2), (1.999, 0.001)):
            clock.advance(step)
            await asleep(clock, rest, "the wait to sleep again")  # read once more, then sleep
        assert errors == []
        clock.advance(0.001)
        await wait_for(lambda: bool(errors), "the wait to time out")
        assert len(errors) == 1 and "did not finish within 10" in str(errors[0])
    assert reads(counter) == 4  # at 0, 4, 8 and 10 s: polls, never a tight loop
    stored = await db[QUEUE].find_one({"_id": "t1"})
    assert stored is not None and stored["status"] == "pending"  # waiting changed nothing


async def test_wait_refuses_bad_arguments_before_reading(db: Any, clock: ManualClock) -> None:
    queue, counter = await counted_queue(db, clock)
    for options, field in [
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1}, "timeout"),
        ({"poll_interval": 0}, "poll_interval"),
    ]:
        with pytest.raises(InvalidInput) as error:
            await queue.wait("t1", **options)
        assert error.value.field == field
    with pytest.raises(InvalidInput) as error:
        await queue.wait({"$gt": ""})  # type: ignore[arg-type]
    assert error.value.field == "task_id"
    assert counter.total == 0


async def test_waits_share_one_change_stream_and_hand_it_over(db: Any, clock: ManualClock) -> None:
    """Two waits in one process, one stream (a test double): each end it reports wakes the
    wait for that task only; when the wait holding the stream returns, the other opens it
    again. Never two streams at once: a stream holds a pooled connection."""
    from tests.runtime.test_changes import FakeWatch

    queue, counter = await counted_queue(db, clock)
    watch = FakeWatch()
    queue.collection.watch = watch  # on the counting wrapper: it counts no stream
    await queue.put_many([NewTask("t1"), NewTask("t2")])
    waited: list[str] = []
    async with anyio.create_task_group() as group:
        for task_id in ("t1", "t2"):

            async def waiter(task_id: str = task_id) -> None:
                waited.append(str((await queue.wait(task_id, poll_interval=3600)).id))

            group.start_soon(waiter)
        await wait_for(lambda: clock.sleeping_until(clock.now() + timedelta(hours=1)) == 2,
                       "both waits to sleep")  # fmt: skip
        assert len(watch.streams) == 1
        assert watch.pipelines[0] == changes.TASKS_ENDED
        # Another process completes t1 (nothing told here), then the stream says so.
        await db[QUEUE].update_one({"_id": "t1"}, {"$set": {"status": "done"}})
        await watch.streams[0].send.send({"_id": {"t": 1}, "documentKey": {"_id": "t1"}})
        await wait_for(lambda: waited == ["t1"], "t1's wait to return")
        await wait_for(lambda: len(watch.streams) == 2, "the stream to be handed over")
        assert watch.streams[0].closed
        await db[QUEUE].update_one({"_id": "t2"}, {"$set": {"status": "failed"}})
        await watch.streams[1].send.send({"_id": {"t": 2}, "documentKey": {"_id": "t2"}})
        await wait_for(lambda: waited == ["t1", "t2"], "t2's wait to return")
    assert watch.streams[1].closed
    assert reads(counter) == 4  # a read each at the start and at its end: no poll


async def test_wait_for_a_task_that_does_not_exist_raises_not_found_at_once(
    db: Any, clock: ManualClock
) -> None:
    queue, counter = await counted_queue(db, clock)
    await queue.put("t1")
    outcomes: list[BaseException] = []
    async with anyio.create_task_group() as group:

        async def waiter() -> None:
            try:
                await queue.wait("t2", timeout=3600, poll_interval=60)
            except Exception as error:
                outcomes.append(error)

        group.start_soon(waiter)
        # The clock never moves here: a wait that sleeps instead of raising is caught asleep.
        await wait_for(lambda: bool(outcomes) or clock.sleeping_until(clock.now() + timedelta(
            seconds=60)) == 1, "the wait to raise or to sleep")  # fmt: skip
        group.cancel_scope.cancel()
    assert outcomes, "the wait slept instead of raising"
    [error] = outcomes
    assert isinstance(error, NotFound), error
    assert isinstance(error, LookupError) and isinstance(error, MongoqError)
    assert str(error) == f"no task 't2' in the queue {QUEUE!r}"
    assert reads(counter) == 1  # one read, no poll
    assert await db[QUEUE].count_documents({}) == 1  # nothing written


async def test_wait_for_a_task_removed_for_good_meanwhile_raises_not_found(
    db: Any, clock: ManualClock
) -> None:
    """A task deleted while it is waited for (its tombstone gone too: a purge, a hand's
    delete) can never finish: the next read says so instead of waiting out the timeout."""
    from tests.runtime.test_changes import FakeWatch

    queue, counter = await counted_queue(db, clock)
    queue.collection.watch = FakeWatch()  # another process deletes it: nothing is told here
    await queue.put("t1")
    errors: list[BaseException] = []
    async with anyio.create_task_group() as group:

        async def waiter() -> None:
            try:
                await queue.wait("t1", timeout=3600, poll_interval=5)
            except NotFound as error:
                errors.append(error)

        group.start_soon(waiter)
        await asleep(clock, 5)
        await db[QUEUE].delete_one({"_id": "t1"})
        clock.advance(5)
        await wait_for(lambda: bool(errors), "the wait to raise")
    assert reads(counter) == 2 and "no task 't1'" in str(errors[0])
