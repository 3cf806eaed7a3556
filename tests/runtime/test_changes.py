"""Change-stream wake-ups (issue 15): on a replica set a worker hears of work another process
made claimable, at once, and polls on beside the stream.

On the embedded lanes the stream is a test double set on the queue's collection (`FakeWatch`);
the last test runs against a real replica set (``MONGOQ_TEST_URI``). Work is made due by a raw
write, which tells this process nothing: only the stream (or a poll) can wake the worker.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import anyio
import pytest
from pymongo.errors import OperationFailure

from mongoq import NewTask, Task
from mongoq.runtime import changes
from mongoq.tasks import schema
from mongoq.testing import ManualClock, settle
from tests.conftest import SERVERS
from tests.support.helpers import QUEUE, new_queue, read

POLL = 60.0


class FakeStream:
    """What `collection.watch()` returns: events the test sends, then the end of the stream."""

    def __init__(self) -> None:
        self.send, self.receive = anyio.create_memory_object_stream[dict[str, Any]](10)
        self.closed = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        try:
            return await self.receive.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def close(self) -> None:
        self.closed = True


class FakeWatch:
    """A ``watch`` method for a collection: records each pipeline, hands out `streams` (or
    raises what `errors` holds first)."""

    def __init__(self, errors: list[BaseException] | None = None) -> None:
        self.pipelines: list[list[Any]] = []
        self.errors = list(errors or [])
        self.streams: list[FakeStream] = []

    def __call__(self, pipeline: list[Any]) -> FakeStream:
        self.pipelines.append(pipeline)
        if self.errors:
            raise self.errors.pop(0)
        self.streams.append(FakeStream())
        return self.streams[-1]


async def make_due_behind_the_workers_back(db: Any, clock: ManualClock, task_id: str) -> None:
    """A task due now, written as another process would: nothing here is told."""
    await db[QUEUE].update_one({"_id": task_id}, {"$set": {"lease_until": clock.now()}})


async def put_behind_the_workers_back(db: Any, clock: ManualClock, task_id: str) -> None:
    """A put as another process sends it (the same upsert): nothing here is told, but a
    change stream sees an insert."""
    await db[QUEUE].update_one(
        schema.task_by_id(task_id), schema.task_putting(NewTask(task_id), clock.now()),
        upsert=True,
    )  # fmt: skip


async def test_a_change_event_wakes_an_idle_worker_at_once(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock)
    watch = FakeWatch()
    queue.collection.watch = watch  # the collection object the queue holds
    await queue.put("t1", delay=3600)
    ran: list[str] = []

    async def handler(task: Task) -> None:
        ran.append(str(task.id))

    async with anyio.create_task_group() as group:
        group.start_soon(partial(queue.run, handler, poll_interval=POLL, concurrency=4))
        await settle()
        assert watch.pipelines == [changes.TASKS_DUE]
        await make_due_behind_the_workers_back(db, clock, "t1")
        await settle()
        assert ran == []  # nothing told it yet: it would wait for its poll
        await watch.streams[0].send.send({"_id": {"token": 1}, "operationType": "update"})
        await settle()
        assert ran == ["t1"]
        queue.stop()
    assert (await read(db, "t1") or {}).get("status") == "done"
    assert watch.streams[0].closed


async def test_a_failed_stream_is_opened_again_and_polling_goes_on_meanwhile(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    queue = await new_queue(db, clock)
    watch = FakeWatch(errors=[OperationFailure("interrupted", 11601)])
    queue.collection.watch = watch
    await queue.put("t1", delay=3600)
    ran: list[str] = []

    async def handler(task: Task) -> None:
        ran.append(str(task.id))

    with caplog.at_level(logging.WARNING, logger="mongoq.worker"):
        async with anyio.create_task_group() as group:
            group.start_soon(partial(queue.run, handler, poll_interval=POLL))
            await settle()
            assert len(watch.pipelines) == 1 and watch.streams == []
            await make_due_behind_the_workers_back(db, clock, "t1")
            clock.advance(POLL)  # the poll finds t1; the stream is opened again
            await settle()
            assert ran == ["t1"]
            assert len(watch.streams) == 1
            queue.stop()
    assert any("the change stream failed" in r.getMessage() for r in caplog.records)


async def test_where_there_are_no_change_streams_the_worker_says_so_once_and_polls(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    queue = await new_queue(db, clock)
    standalone = OperationFailure(
        "The $changeStream stage is only supported on replica sets", 40573
    )
    watch = FakeWatch(errors=[standalone])
    queue.collection.watch = watch
    await queue.put("t1", delay=3600)
    ran: list[str] = []

    async def handler(task: Task) -> None:
        ran.append(str(task.id))

    with caplog.at_level(logging.INFO, logger="mongoq.worker"):
        async with anyio.create_task_group() as group:
            group.start_soon(partial(queue.run, handler, poll_interval=POLL))
            await settle()
            await make_due_behind_the_workers_back(db, clock, "t1")
            for _ in range(3):
                clock.advance(POLL)
                await settle()
            queue.stop()
    assert ran == ["t1"] and len(watch.pipelines) == 1  # never tried again
    said = [r.getMessage() for r in caplog.records if "no change streams" in r.getMessage()]
    assert len(said) == 1


async def test_a_worker_on_a_replica_set_is_woken_by_another_clients_write(
    db: Any, request: pytest.FixtureRequest, clock: ManualClock
) -> None:
    if request.node.callspec.params["db"] not in SERVERS:
        pytest.skip("change streams need a real replica set: set MONGOQ_TEST_URI")
    queue = await new_queue(db, clock)
    started: list[str] = []
    woken = anyio.Event()

    async def handler(task: Task) -> None:
        started.append(str(task.id))
        woken.set()

    async with anyio.create_task_group() as group:
        group.start_soon(partial(queue.run, handler, poll_interval=3600))
        await anyio.sleep(1)  # the first claim (nothing) and the stream's opening, on the wire
        # Put as another process does, a new task each round until the stream wakes the
        # worker: at most 20 s of waiting on the network (the clock never moves, and the next
        # poll is an hour away: only the stream can wake it).
        with anyio.fail_after(20):
            for number in range(40):
                await put_behind_the_workers_back(db, clock, f"t{number}")
                with anyio.move_on_after(0.5):
                    await woken.wait()
                if started:
                    break
        queue.stop()
    assert started and (await read(db, started[0]) or {}).get("status") == "done"


async def test_a_stream_refused_at_its_first_read_ends_the_watch_as_having_no_streams(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Motor opens a stream at its first read: a standalone's refusal comes from the
    iteration, not the open. It still means polling only, said once, never retried."""

    class RefusedOnRead(FakeStream):
        async def __anext__(self) -> dict[str, Any]:
            raise OperationFailure("only supported on replica sets", 40573)

    watch = FakeWatch()
    watch.streams = []
    opened: list[int] = []

    def lazy(pipeline: list[Any]) -> FakeStream:
        opened.append(1)
        return RefusedOnRead()

    with caplog.at_level(logging.INFO, logger="mongoq.worker"):
        with anyio.fail_after(10):
            await changes.watch(
                type("C", (), {"watch": staticmethod(lazy)})(), changes.TASKS_DUE, lambda _: None,
                clock=clock, retry=POLL, name="test",
            )  # fmt: skip
    assert opened == [1]
    assert any("no change streams" in r.getMessage() for r in caplog.records)


async def test_a_stream_that_keeps_failing_is_opened_again_less_and_less_often(
    clock: ManualClock,
) -> None:
    opened: list[float] = []
    start = clock.now()

    def failing(pipeline: list[Any]) -> FakeStream:
        opened.append((clock.now() - start).total_seconds())
        raise OperationFailure("not authorized", 13)

    collection = type("C", (), {"watch": staticmethod(failing)})()
    async with anyio.create_task_group() as group:
        group.start_soon(partial(
            changes.watch, collection, changes.TASKS_DUE, lambda _: None, clock=clock, retry=1,
            name="test",
        ))  # fmt: skip
        for _ in range(40):
            await settle()
            clock.advance(1)
        group.cancel_scope.cancel()
    assert opened[:6] == [0, 1, 3, 7, 15, 31]  # 1, 2, 4, 8, 16 s apart
