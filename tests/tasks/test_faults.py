"""AsyncTaskQueue under forced interleavings and injected faults.

Every server command is atomic; these tests force the orders in which the commands of several
workers run (`Interleaving`, `FaultInjector(yield_between=True)`) and the failure of a command
before it applied or after it applied with its reply lost, then check the stored state: at most
one holder at a time, and every task recoverable (nothing lost).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from pymongo.errors import AutoReconnect, NetworkTimeout

from mongoq import AsyncTaskQueue, NewTask, ReclaimResult, Task, TaskRunSummary
from mongoq.testing import FaultInjector, ManualClock, instrument
from tests.support.helpers import (
    LEASE_TTL,
    Actors,
    InFlight,
    assert_completes,
    assert_outcomes,
    claim_one,
    encoded,
    expired_claim,
    flaky_tasks,
    later,
    new_queue,
    put_and_claim,
    race,
    read,
    read_all,
    stored_fields,
    wait_for,
)

# ------------------------------------------------------------------------------ interleavings


def claimer(queue: AsyncTaskQueue, worker: str) -> Callable[[], Awaitable[Any]]:
    """An actor that claims one task and completes it with its own name as the result."""

    async def act() -> tuple[Task | None, bool | None]:
        task = await queue.claim(worker)
        if task is None:
            return None, None
        return task, await queue.complete(task, worker)

    return act


async def expired_holder(
    queue: AsyncTaskQueue, clock: ManualClock
) -> Callable[[], Awaitable[tuple[bool, bool]]]:
    """Worker A's actor on t1 once A's lease has expired: it heartbeats, then completes it."""
    task = await expired_claim(queue, clock, "A")

    async def holder() -> tuple[bool, bool]:
        held = await queue.heartbeat(task)
        return held, await queue.complete(task, "A")

    return holder


#: Three actors of two commands each: 6! / (2! 2! 2!) orders.
THREE = {"A": 2, "B": 2, "C": 2}


async def test_claimers_never_share_a_task_in_any_order(db: Any, clock: ManualClock) -> None:
    async def setup(queue: AsyncTaskQueue) -> Actors:
        await queue.put_many([NewTask("t1"), NewTask("t2")])
        return {worker: claimer(queue, worker) for worker in "ABC"}

    async def check(queue: AsyncTaskQueue, results: dict[str, Any]) -> str:
        claimed = {w: task for w, (task, _) in results.items() if task is not None}
        assert sorted(task.id for task in claimed.values()) == ["t1", "t2"]
        assert all(done for task, done in results.values() if task is not None)
        docs = await read_all(db, queue.name)
        for worker, task in claimed.items():
            doc = docs[task.id]
            assert (doc["status"], doc["attempts"]) == ("done", 1)
            assert (doc["worker_id"], doc["result"]) == (worker, worker)
        (empty_handed,) = set(results) - set(claimed)
        return f"{empty_handed} got nothing"

    outcomes = await race(db, clock, THREE, setup, check)
    assert_outcomes(outcomes, 90, {"A got nothing", "B got nothing", "C got nothing"})


async def test_an_expired_holder_and_two_claimers_leave_exactly_one_holder(
    db: Any, clock: ManualClock
) -> None:
    """The old holder heartbeats and completes while two workers try to take its expired lease
    over: whoever gets in first holds the task, and only that one's result is kept."""

    async def setup(queue: AsyncTaskQueue) -> Actors:
        holder = await expired_holder(queue, clock)
        return {"A": holder, "B": claimer(queue, "B"), "C": claimer(queue, "C")}

    async def check(queue: AsyncTaskQueue, results: dict[str, Any]) -> str:
        holders = [w for w in "BC" if results[w][0] is not None]
        if results["A"][0]:
            holders.append("A")
        assert len(holders) == 1, f"holders: {holders}"
        (winner,) = holders
        settled = {"A": results["A"][1], "B": results["B"][1], "C": results["C"][1]}
        assert [w for w, done in settled.items() if done] == [winner]
        doc = await read(db, "t1", queue.name)
        assert doc is not None
        assert (doc["status"], doc["result"], doc["worker_id"]) == ("done", winner, winner)
        assert doc["attempts"] == (1 if winner == "A" else 2)
        return f"{winner} won"

    assert_outcomes(await race(db, clock, THREE, setup, check), 90, {"A won", "B won", "C won"})


async def test_a_revision_put_racing_two_workers_is_never_done_for_the_old_revision(
    db: Any, clock: ManualClock
) -> None:
    async def setup(queue: AsyncTaskQueue) -> Actors:
        await queue.put("t1", {"v": 1}, revision="r1")

        async def producer() -> str:
            return await queue.put("t1", {"v": 2}, revision="r2")

        return {"A": claimer(queue, "A"), "B": claimer(queue, "B"), "P": producer}

    async def check(queue: AsyncTaskQueue, results: dict[str, Any]) -> str:
        assert results["P"] == "updated"
        doc = await read(db, "t1", queue.name)
        assert doc is not None
        assert (doc["revision"], doc["payload"]) == ("r2", {"v": 2})
        stale = [w for w in "AB" if results[w][0] is not None and results[w][0].revision == "r1"]
        if doc["status"] == "done":
            winner = doc["result"]
            task, done = results[winner]
            assert done and task.revision == "r2"
            return "r2 done" + (" after r1 was dropped" if stale else "")
        assert (doc["status"], doc["attempts"]) == ("pending", 0)
        assert doc["lease_token"] is None
        return "r2 pending" + (" after r1 was dropped" if stale else "")

    outcomes = await race(db, clock, {"A": 2, "B": 2, "P": 1}, setup, check)
    assert sum(outcomes.values()) == 30
    assert set(outcomes) >= {"r2 done", "r2 pending after r1 was dropped"}


async def test_reclaim_racing_a_late_heartbeat_leaves_one_owner(
    db: Any, clock: ManualClock
) -> None:
    async def setup(queue: AsyncTaskQueue) -> Actors:
        return {"A": await expired_holder(queue, clock), "R": queue.reclaim_expired}

    async def check(queue: AsyncTaskQueue, results: dict[str, Any]) -> str:
        held, completed = results["A"]
        reclaimed: ReclaimResult = results["R"]
        assert reclaimed.failed == 0
        doc = await read(db, "t1", queue.name)
        assert doc is not None
        if held:
            assert completed and reclaimed.requeued == 0
            assert (doc["status"], doc["result"]) == ("done", "A")
            return "holder kept it"
        assert not completed and reclaimed.requeued == 1
        assert (doc["status"], doc["attempts"], doc["lease_token"]) == ("pending", 1, None)
        return "reclaimed"

    outcomes = await race(db, clock, {"A": 2, "R": 2}, setup, check)
    # Only RRAA requeues it: both reclaim commands ran before the heartbeat.
    assert outcomes == {"holder kept it": 5, "reclaimed": 1}


# ----------------------------------------------------------------- many slots, yield between


async def test_concurrent_run_slots_never_process_one_task_twice_at_once(
    db: Any, clock: ManualClock
) -> None:
    queue, ids, books = await flaky_tasks(db, clock, 40)
    summaries: list[TaskRunSummary] = []

    async def worker(worker_id: str, concurrency: int) -> None:
        summaries.append(
            await queue.run(
                books.handler, concurrency=concurrency, stop_when_empty=True, worker_id=worker_id
            )
        )

    async with anyio.create_task_group() as group:
        group.start_soon(worker, "w1", 6)
        group.start_soon(worker, "w2", 6)
    clock.advance(2)  # past the flaky tasks' backoff (1 to 1.5 s)
    async with anyio.create_task_group() as group:
        group.start_soon(worker, "w3", 4)
        group.start_soon(worker, "w4", 4)

    await books.assert_all_done(db, ids)
    assert sum(s.completed for s in summaries) == len(ids)
    assert sum(s.retried for s in summaries) == len(books.flaky)
    assert sum(s.lost + s.failed + s.released for s in summaries) == 0


# ------------------------------------------------------------------------- faults on commands

SETTLES: dict[str, Callable[[AsyncTaskQueue, Task], Awaitable[bool]]] = {
    "complete": lambda queue, task: queue.complete(task, "result"),
    "fail": lambda queue, task: queue.fail(task, "fatal"),
    "release_for_retry": lambda queue, task: queue.release_for_retry(task, "transient"),
    "release_not_an_attempt": lambda queue, task: queue.release_not_an_attempt(task),
    "heartbeat": lambda queue, task: queue.heartbeat(task),
}


@pytest.fixture
def faults() -> FaultInjector:
    return FaultInjector()


@pytest.fixture
async def queue(db: Any, clock: ManualClock, faults: FaultInjector) -> AsyncTaskQueue:
    # A backoff shorter than the lease: after one lease duration every task is due again.
    return await new_queue(instrument(db, faults), clock, backoff_base=1, backoff_cap=1)


async def recover(db: Any, queue: AsyncTaskQueue, clock: ManualClock) -> None:
    """One lease duration later, the task is either settled for good or runs to completion."""
    clock.advance(LEASE_TTL + 1)
    before = await read(db, "t1")
    assert before is not None
    if before["status"] in ("done", "failed"):
        assert await queue.claim("rescuer") is None
        assert await queue.reclaim_expired() == ReclaimResult(failed=0, requeued=0)
        assert encoded(await read(db, "t1")) == encoded(before)
        return
    await assert_completes(db, queue, await claim_one(queue, "rescuer", expect="t1"), "rescued")


async def claimed(db: Any, queue: AsyncTaskQueue) -> tuple[Task, dict[str, Any] | None]:
    """t1, put and claimed, and its stored document as the claim left it."""
    task = await put_and_claim(queue)
    return task, await read(db, "t1")


async def unchanged_then_recovered(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock, snapshot: dict[str, Any] | None
) -> None:
    """The failed command wrote nothing since `snapshot`, and the lease still recovers t1."""
    assert encoded(await read(db, "t1")) == encoded(snapshot)
    await recover(db, queue, clock)


async def settle_failing(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock, faults: FaultInjector, call: str, when: str
) -> dict[str, Any] | None:
    """Claim t1 and, 5 s later, settle it by `call` with its update failing `when` it applied:
    "before" (the connection broke first) or "after" (its reply was lost). Returns the stored
    document as the claim left it."""
    task, snapshot = await claimed(db, queue)
    clock.advance(5)
    if when == "before":
        faults.fail_before("update_one")
    else:
        faults.fail_after("update_one")

    with pytest.raises(AutoReconnect if when == "before" else NetworkTimeout):
        await SETTLES[call](queue, task)
    return snapshot


async def test_a_claim_whose_reply_was_lost_is_taken_over_after_the_lease(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock, faults: FaultInjector
) -> None:
    await queue.put("t1")
    faults.fail_after("find_one_and_update")

    with pytest.raises(NetworkTimeout):
        await queue.claim("w")

    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["status"], doc["attempts"], doc["worker_id"]) == ("processing", 1, "w")
    assert doc["lease_until"] == later(clock, LEASE_TTL)
    assert await queue.claim("w") is None  # the orphaned lease still holds it
    clock.advance(LEASE_TTL - 1)
    assert await queue.claim("w") is None
    clock.advance(1.001)
    task = await claim_one(queue, "w", expect="t1")
    assert task.attempts == 2
    assert await queue.complete(task, "ok")
    assert await stored_fields(db, "t1", "status", "attempts", "result") == ("done", 2, "ok")


async def test_a_claim_that_failed_before_applying_changes_nothing(
    db: Any, queue: AsyncTaskQueue, faults: FaultInjector
) -> None:
    await queue.put("t1")
    before = await read(db, "t1")
    faults.fail_before("find_one_and_update")

    with pytest.raises(AutoReconnect):
        await queue.claim("w")

    assert encoded(await read(db, "t1")) == encoded(before)
    task = await claim_one(queue, "w", expect="t1")
    assert task.attempts == 1


@pytest.mark.parametrize(
    ("call", "status", "attempts"),
    [
        ("complete", "done", 1),
        ("fail", "failed", 1),
        ("release_for_retry", "pending", 1),
        ("release_not_an_attempt", "pending", 0),
        ("heartbeat", "processing", 1),
    ],
)
async def test_a_settle_whose_reply_was_lost_took_effect_and_is_recoverable(
    db: Any,
    queue: AsyncTaskQueue,
    clock: ManualClock,
    faults: FaultInjector,
    call: str,
    status: str,
    attempts: int,
) -> None:
    await settle_failing(db, queue, clock, faults, call, "after")

    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["status"], doc["attempts"], doc["updated_at"]) == (status, attempts, clock.now())
    if call == "complete":
        assert doc["result"] == "result"
    if call == "heartbeat":
        assert doc["lease_until"] == later(clock, LEASE_TTL)
    await recover(db, queue, clock)


@pytest.mark.parametrize("call", list(SETTLES))
async def test_a_settle_that_failed_before_applying_leaves_the_task_to_its_lease(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock, faults: FaultInjector, call: str
) -> None:
    snapshot = await settle_failing(db, queue, clock, faults, call, "before")

    await unchanged_then_recovered(db, queue, clock, snapshot)
    assert await stored_fields(db, "t1", "attempts") == (2,)


async def test_a_put_whose_reply_was_lost_can_be_replayed(
    db: Any, queue: AsyncTaskQueue, faults: FaultInjector
) -> None:
    faults.fail_after("update_one")
    with pytest.raises(NetworkTimeout):
        await queue.put("t1", {"v": 1}, revision="r1")
    stored = await read(db, "t1")
    assert stored is not None and (stored["status"], stored["payload"]) == ("pending", {"v": 1})

    assert await queue.put("t1", {"v": 1}, revision="r1") == "unchanged"

    assert encoded(await read(db, "t1")) == encoded(stored)


async def test_a_put_many_whose_reply_was_lost_can_be_replayed(
    db: Any, queue: AsyncTaskQueue, faults: FaultInjector
) -> None:
    batch = [NewTask(f"t{i}", {"i": i}, revision=1) for i in range(4)]
    faults.fail_after("bulk_write")
    with pytest.raises(NetworkTimeout):
        await queue.put_many(batch)
    stored = await read_all(db)
    assert sorted(stored) == ["t0", "t1", "t2", "t3"]

    result = await queue.put_many(batch)

    assert (result.inserted, result.updated, result.unchanged) == (0, 0, 4)
    after = await read_all(db)
    assert {k: encoded(v) for k, v in after.items()} == {k: encoded(v) for k, v in stored.items()}


@pytest.mark.parametrize(
    "handler_error",
    [None, "the handler's error"],
    ids=["a failed completion surfaces", "a failed release keeps the block's own exception"],
)
async def test_a_settle_failing_at_the_end_of_a_block_leaves_the_task_to_its_lease(
    db: Any,
    queue: AsyncTaskQueue,
    clock: ManualClock,
    faults: FaultInjector,
    handler_error: str | None,
) -> None:
    task, snapshot = await claimed(db, queue)
    faults.fail_before("update_one")

    with pytest.raises(AutoReconnect if handler_error is None else RuntimeError) as raised:
        async with queue.leased(task):
            if handler_error is not None:
                raise RuntimeError(handler_error)

    if handler_error is not None:
        assert str(raised.value) == handler_error
    assert len(faults.triggered) == 1
    await unchanged_then_recovered(db, queue, clock, snapshot)


async def test_a_failed_heartbeat_is_retried_and_the_lease_kept(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock, faults: FaultInjector
) -> None:
    task, _ = await claimed(db, queue)
    faults.fail_before("update_one")

    async with queue.leased(task) as lease:
        clock.advance(LEASE_TTL / 3)
        await wait_for(lambda: len(faults.triggered) == 1, "the failing heartbeat")
        await wait_for(lambda: clock.sleepers == 1, "the heartbeat to sleep again")
        assert not lease.lost and lease.heartbeats == 0
        clock.advance(LEASE_TTL / 3)
        await wait_for(lambda: lease.heartbeats == 1, "the next heartbeat")
        assert (await read(db, "t1") or {})["lease_until"] == later(clock, LEASE_TTL)

    doc = await read(db, "t1")
    assert doc is not None and (doc["status"], doc["attempts"]) == ("done", 1)


async def test_run_survives_transient_claim_errors(
    db: Any, clock: ManualClock, faults: FaultInjector
) -> None:
    in_flight = InFlight()
    # Faults first: a command failed before it was sent never counts as in flight.
    queue = await new_queue(instrument(db, faults, in_flight), clock)
    ids = ["t1", "t2", "t3"]
    await queue.put_many([NewTask(task_id) for task_id in ids])
    faults.fail_before("find_one_and_update", times=2)
    faults.fail_after("find_one_and_update")  # then one claim applies but its reply is lost
    handled: list[Any] = []

    async def handler(task: Task) -> str:
        handled.append(task.id)
        return f"done {task.id}"

    summary: list[TaskRunSummary] = []

    async def worker() -> None:
        summary.append(await queue.run(handler, poll_interval=5, worker_id="w", schedules=False))

    def napping() -> bool:  # the slot, the reclaim timer and the poll of cancels sleep, idle
        return clock.sleepers == 3 and in_flight.count == 0

    async with anyio.create_task_group() as group:
        group.start_soon(worker)
        for _ in range(20):  # at most 100 s of the clock
            await wait_for(napping, "the worker to nap")
            if len(handled) == len(ids):
                break
            clock.advance(5)
        queue.stop()

    assert len(faults.triggered) == 3
    assert sorted(handled) == ids
    assert (summary[0].claimed, summary[0].completed, summary[0].lost) == (3, 3, 0)
    docs = await read_all(db)
    assert {task_id: doc["status"] for task_id, doc in docs.items()} == dict.fromkeys(ids, "done")
    assert sorted(doc["attempts"] for doc in docs.values()) == [1, 1, 2]  # one orphaned claim
    assert all(doc["result"] == f"done {task_id}" for task_id, doc in docs.items())


async def run_once(queue: AsyncTaskQueue) -> TaskRunSummary:
    """Process whatever is due with a handler that returns "result", then stop."""

    async def handler(task: Task) -> str:
        return "result"

    return await queue.run(handler, stop_when_empty=True, worker_id="w")


async def test_run_reports_a_completion_whose_reply_was_lost_as_unknown(
    db: Any, queue: AsyncTaskQueue, faults: FaultInjector
) -> None:
    await queue.put("t1")
    faults.fail_after("update_one")  # the completion applies, its reply is lost

    summary = await run_once(queue)

    doc = await read(db, "t1")
    assert doc is not None and (doc["status"], doc["result"]) == ("done", "result")
    # The worker cannot know the outcome: `unknown`, not `lost` (which means taken over).
    assert (summary.claimed, summary.unknown, summary.lost, summary.completed) == (1, 1, 0, 0)


async def test_run_retries_a_task_whose_completion_failed_before_applying(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock, faults: FaultInjector
) -> None:
    await queue.put("t1")
    faults.fail_before("update_one")

    summary = await run_once(queue)

    assert (summary.claimed, summary.retried) == (1, 1)
    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["status"], doc["attempts"]) == ("pending", 1)
    assert "AutoReconnect" in doc["error"]
    clock.advance(2)  # past the backoff
    assert (await run_once(queue)).completed == 1
    doc = await read(db, "t1")
    assert doc is not None and (doc["status"], doc["attempts"]) == ("done", 2)
