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
from pymongo import ReplaceOne
from pymongo.errors import OperationFailure

from mongoq import NewTask, Task
from mongoq.runtime import changes
from mongoq.tasks import schema
from mongoq.testing import (
    CommandCounter,
    ManualClock,
    Operation,
    instrument,
    memory_database,
    settle,
)
from tests.conftest import skip_without_change_streams
from tests.support.helpers import QUEUE, Sleeper, in_background, napping, new_queue, read, wait_for
from tests.support.test_index_audit import TASKS, exercise_tasks

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
        await wait_for(lambda: napping(queue) and bool(watch.streams), "every slot idle")
        assert watch.pipelines == [changes.TASKS_DUE_OR_STOPPED]
        await make_due_behind_the_workers_back(db, clock, "t1")
        await settle()
        assert ran == [] and napping(queue)  # nothing told it yet: it would wait for its poll
        await watch.streams[0].send.send({"_id": {"token": 1}, "operationType": "update"})
        await wait_for(lambda: ran == ["t1"], "t1 to start")
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
            await wait_for(lambda: napping(queue) and len(watch.pipelines) == 1, "the slot idle")
            assert watch.streams == []
            await make_due_behind_the_workers_back(db, clock, "t1")
            clock.advance(POLL)  # the poll finds t1; the stream is opened again
            await wait_for(lambda: ran == ["t1"], "t1 to start")
            await wait_for(lambda: len(watch.streams) == 1, "the stream to be opened again")
            queue.stop()
    assert any("the change stream failed" in r.getMessage() for r in caplog.records)


#: How a deployment refuses change streams for good, as recorded: a standalone server (40573),
#: and MongoDB-compatible services without them (115 CommandNotSupported, 238 NotImplemented).
REFUSALS = [
    OperationFailure(
        "The $changeStream stage is only supported on replica sets", 40573,
        {"ok": 0.0, "errmsg": "The $changeStream stage is only supported on replica sets",
         "code": 40573, "codeName": "Location40573"},
    ),
    OperationFailure(
        "Change streams are not supported", 115,
        {"ok": 0.0, "errmsg": "Change streams are not supported", "code": 115,
         "codeName": "CommandNotSupported"},
    ),
    OperationFailure(
        "$changeStream is not implemented", 238,
        {"ok": 0.0, "errmsg": "$changeStream is not implemented", "code": 238,
         "codeName": "NotImplemented"},
    ),
]  # fmt: skip
REFUSAL_IDS = ["standalone-40573", "CommandNotSupported-115", "NotImplemented-238"]


async def test_where_there_are_no_change_streams_the_worker_says_so_once_and_polls(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    queue = await new_queue(db, clock)
    watch = FakeWatch(errors=[REFUSALS[0]])  # a standalone's
    queue.collection.watch = watch
    await queue.put("t1", delay=3600)
    ran: list[str] = []

    async def handler(task: Task) -> None:
        ran.append(str(task.id))

    with caplog.at_level(logging.INFO, logger="mongoq.worker"):
        async with anyio.create_task_group() as group:
            group.start_soon(partial(queue.run, handler, poll_interval=POLL))
            await wait_for(lambda: napping(queue), "the slot to nap")
            await make_due_behind_the_workers_back(db, clock, "t1")
            clock.advance(POLL)
            await wait_for(lambda: ran == ["t1"], "the poll to find t1")
            for _ in range(2):
                await wait_for(lambda: napping(queue), "the slot to nap again")
                clock.advance(POLL)
            await wait_for(lambda: napping(queue), "the slot to nap again")
            queue.stop()
    assert ran == ["t1"] and len(watch.pipelines) == 1  # never tried again
    said = [r.getMessage() for r in caplog.records if "no change streams" in r.getMessage()]
    assert len(said) == 1


class RecordedServer:
    """A database handle that answers ``hello`` as the server it was recorded from did."""

    mongoq_backend = "pymongo"

    def __init__(self, hello: dict[str, Any]) -> None:
        self.client = self  # its own client: asked afresh, never a cached topology
        self.hello = hello

    async def command(self, name: str) -> dict[str, Any]:
        assert name == "hello"
        return self.hello


#: ``hello`` as MongoDB 7.0 answers it, standalone and as a replica-set member (abridged).
STANDALONE_HELLO = {"isWritablePrimary": True, "maxWireVersion": 21, "ok": 1.0}
MEMBER_HELLO = {**STANDALONE_HELLO, "setName": "rs0", "hosts": ["localhost:27017"]}


async def test_the_replica_set_only_tests_skip_on_a_standalone_server() -> None:
    # A standalone refuses $changeStream (40573): the test would wait out its time limit.
    with pytest.raises(pytest.skip.Exception, match="standalone"):
        await skip_without_change_streams(RecordedServer(STANDALONE_HELLO))
    await skip_without_change_streams(RecordedServer(MEMBER_HELLO))  # runs there


async def test_a_worker_on_a_replica_set_is_woken_by_another_clients_write(
    db: Any, clock: ManualClock
) -> None:
    await skip_without_change_streams(db)
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


@pytest.mark.parametrize("refusal", REFUSALS, ids=REFUSAL_IDS)
async def test_a_stream_refused_at_its_opening_ends_the_watch_as_having_no_streams(
    clock: ManualClock, caplog: pytest.LogCaptureFixture, refusal: OperationFailure
) -> None:
    """Every definite refusal means polling only: said once, never opened again (the clock
    never moves here, so a retry would wait for ever and fail the time bound)."""
    watch = FakeWatch(errors=[refusal])
    with caplog.at_level(logging.INFO, logger="mongoq.worker"):
        with anyio.fail_after(10):
            await changes.watch(
                type("C", (), {"watch": staticmethod(watch)})(), changes.TASKS_DUE,
                lambda _: None, clock=clock, retry=POLL, name="test",
            )  # fmt: skip
    assert len(watch.pipelines) == 1
    said = [r.getMessage() for r in caplog.records if "no change streams" in r.getMessage()]
    assert len(said) == 1 and str(refusal.code) in said[0]


@pytest.mark.parametrize("refusal", REFUSALS, ids=REFUSAL_IDS)
async def test_a_stream_refused_at_its_first_read_ends_the_watch_as_having_no_streams(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, refusal: OperationFailure
) -> None:
    """Motor opens a stream at its first read: a standalone's refusal comes from the
    iteration, not the open. It still means polling only, said once, never retried."""

    class RefusedOnRead(FakeStream):
        async def __anext__(self) -> dict[str, Any]:
            raise refusal

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


async def test_no_task_write_is_a_replacement_so_the_end_filter_hears_updates_only() -> None:
    """`changes.TASKS_ENDED` hears of updates, not of ``replace`` events (an operation type of
    their own): right only while mongoq never replaces a task document. The whole task API,
    driven once (the index audit's workload), sends no replacement to the tasks."""
    counter = CommandCounter()
    counter.record = True
    await exercise_tasks(instrument(memory_database(), counter), ManualClock())
    writes = [op for op in counter.operations if op.collection == TASKS]
    assert {"find_one_and_update", "update_one", "update_many"} <= {op.name for op in writes}
    replacing = [
        op.name for op in writes
        if op.name in ("replace_one", "find_one_and_replace")
        or any(isinstance(request, ReplaceOne) for request in _bulk_requests(op))
    ]  # fmt: skip
    assert replacing == [], "a task write replaces the document: let TASKS_ENDED hear `replace`"


def _bulk_requests(op: Operation) -> list[Any]:
    return list(op.args[0]) if op.name == "bulk_write" and op.args else []


async def test_a_cancel_event_from_another_process_stops_the_running_handler_at_once(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    watch = FakeWatch()
    queue.collection.watch = watch
    await queue.put("t1")
    sleeper = Sleeper()

    async def cancel_elsewhere() -> None:
        await wait_for(lambda: bool(watch.streams), "the change stream")
        # Another process cancels it: the database changes, and its change event comes.
        await db[QUEUE].update_one(
            {"_id": "t1"}, {"$set": {"status": "cancelled", "lease_token": None}}
        )
        await watch.streams[0].send.send({
            "_id": {"token": 2}, "operationType": "update", "documentKey": {"_id": "t1"},
            "updateDescription": {"updatedFields": {"status": "cancelled"}},
        })  # fmt: skip
        await wait_for(lambda: sleeper.seen == ["started", "cancelled"], "the handler to stop")
        queue.stop()

    summary = await in_background(
        clock, queue.run(sleeper, poll_interval=POLL), started=lambda: sleeper.seen,
        then=cancel_elsewhere, advance=0,
    )  # fmt: skip
    assert (summary.cancelled, summary.lost) == (1, 0)
    assert (await read(db, "t1") or {})["status"] == "cancelled"
