"""AsyncTaskQueue: leases, fencing, heartbeats, the `leased` block, retries and reclaim."""

from __future__ import annotations

import traceback
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import anyio
import pytest

from mongoq import AsyncTaskQueue, LeaseLost, PermanentError, ReclaimResult, Task, TaskLease
from mongoq.runtime.loop import WORKER_STOPPED
from mongoq.testing import ManualClock, settle
from tests.support.helpers import (
    LEASE_TTL,
    assert_completes,
    claim_one,
    encoded,
    expired_claim,
    faulty_queue,
    later,
    new_queue,
    put_and_claim,
    read,
    wait_for,
)

HEARTBEAT = LEASE_TTL / 3


@pytest.fixture
async def queue(db: Any, clock: ManualClock) -> AsyncTaskQueue:
    return await new_queue(db, clock)


async def taken_over(queue: AsyncTaskQueue, clock: ManualClock) -> tuple[Task, Task]:
    """Worker "old" claims t1, its lease expires, worker "new" takes the task over."""
    old = await expired_claim(queue, clock, "old", {"v": 1})
    new = await claim_one(queue, "new", expect="t1")
    assert new.lease_token != old.lease_token
    return old, new


# ---------------------------------------------------------------------------------- fencing

STALE_CALLS: dict[str, Callable[[AsyncTaskQueue, Task], Awaitable[bool]]] = {
    "complete": lambda queue, task: queue.complete(task, "stale result"),
    "heartbeat": lambda queue, task: queue.heartbeat(task),
    "fail": lambda queue, task: queue.fail(task, "stale error"),
    "release_for_retry": lambda queue, task: queue.release_for_retry(task, "stale error"),
    "release_not_an_attempt": lambda queue, task: queue.release_not_an_attempt(task),
}


@pytest.mark.parametrize("call", list(STALE_CALLS))
async def test_a_holder_whose_task_was_taken_over_changes_nothing(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock, call: str
) -> None:
    old, new = await taken_over(queue, clock)
    snapshot = await read(db, "t1")
    assert snapshot is not None
    assert (snapshot["status"], snapshot["attempts"]) == ("processing", 2)
    assert (snapshot["worker_id"], snapshot["lease_token"]) == ("new", new.lease_token)
    clock.advance(1)

    assert await STALE_CALLS[call](queue, old) is False

    assert encoded(await read(db, "t1")) == encoded(snapshot)
    await assert_completes(db, queue, new, "fresh result")


async def test_the_same_worker_id_does_not_revive_a_lost_claim(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    """Slots of one worker share its id: the fence is the per-claim token, not the id."""
    first = await expired_claim(queue, clock, "w")
    second = await claim_one(queue, "w", expect="t1")
    snapshot = await read(db, "t1")

    assert await queue.complete(first, "from the first claim") is False
    assert encoded(await read(db, "t1")) == encoded(snapshot)
    await assert_completes(db, queue, second, "from the second claim")


# -------------------------------------------------------------------------------- heartbeat


async def test_leased_block_heartbeats_every_third_of_the_lease(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    task = await put_and_claim(queue)
    claimed_lease = later(clock, LEASE_TTL)
    assert (await read(db, "t1") or {})["lease_until"] == claimed_lease

    async with queue.leased(task) as lease:
        clock.advance(HEARTBEAT - 1)
        await settle()
        assert lease.heartbeats == 0
        assert (await read(db, "t1") or {})["lease_until"] == claimed_lease

        for beat in range(1, 4):
            clock.advance(1 if beat == 1 else HEARTBEAT)
            await wait_for(lambda beat=beat: lease.heartbeats == beat, f"heartbeat {beat}")
            doc = await read(db, "t1")
            assert doc is not None
            assert doc["lease_until"] == later(clock, LEASE_TTL)
            assert (doc["status"], doc["lease_token"]) == ("processing", task.lease_token)

    doc = await read(db, "t1")
    assert doc is not None and (doc["status"], doc["attempts"]) == ("done", 1)
    assert clock.sleepers == 0  # the heartbeat stopped with the block


async def test_a_block_longer_than_the_lease_keeps_it_and_others_claim_nothing(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    task = await put_and_claim(queue, "holder")

    async with queue.leased(task) as lease:
        for step in range(1, 13):  # 12 heartbeats: four lease durations
            clock.advance(HEARTBEAT)
            await wait_for(lambda step=step: lease.heartbeats == step, f"heartbeat {step}")
            assert await queue.claim("other") is None
        assert await queue.reclaim_expired() == ReclaimResult(failed=0, requeued=0)
        doc = await read(db, "t1")
        assert doc is not None
        assert (doc["status"], doc["worker_id"]) == ("processing", "holder")
        assert doc["lease_until"] == later(clock, LEASE_TTL)

    doc = await read(db, "t1")
    assert doc is not None and (doc["status"], doc["attempts"]) == ("done", 1)


@pytest.mark.parametrize("heartbeat", ["released", "held"])
async def test_a_takeover_during_a_heartbeat_loses_the_block_its_lease_for_good(
    db: Any, clock: ManualClock, heartbeat: str
) -> None:
    """Released, the held heartbeat finds the task taken over, stops and never revives it; held
    to the end, nothing tells the block, and its clean exit still raises LeaseLost."""
    queue, faults = await faulty_queue(db, clock)
    task = await put_and_claim(queue, "old")

    with pytest.raises(LeaseLost):
        async with queue.leased(task) as lease:
            # Hold the first heartbeat until the lease has expired and another worker took over.
            beat = faults.pause_before("update_one")
            clock.advance(LEASE_TTL + 1)
            await beat.reached.wait()
            thief = await claim_one(queue, "new", expect="t1")
            snapshot = await read(db, "t1")
            if heartbeat == "held":
                assert not lease.lost
            else:
                beat.release()
                await wait_for(lambda: lease.lost, "the heartbeat to notice")

                assert lease.heartbeats == 0
                assert encoded(await read(db, "t1")) == encoded(snapshot)
                assert clock.sleepers == 0  # the heartbeat loop has ended
                for _ in range(6):  # time goes on: no heartbeat any more
                    clock.advance(HEARTBEAT)
                    await settle()
                assert encoded(await read(db, "t1")) == encoded(snapshot)
        # the clean exit finds the lease lost: LeaseLost, and no write

    assert lease.outcome == "lost"
    assert encoded(await read(db, "t1")) == encoded(snapshot)
    assert snapshot is not None
    assert (snapshot["status"], snapshot["worker_id"]) == ("processing", "new")
    await assert_completes(db, queue, thief, "thief's result")


# ---------------------------------------------------------------------- how a block ends


async def test_a_clean_exit_completes_the_task(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    task = await put_and_claim(queue)
    clock.advance(2)

    async with queue.leased(task) as lease:
        pass

    assert lease.outcome == "completed"
    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["status"], doc["attempts"], doc["result"]) == ("done", 1, None)
    assert (doc["lease_until"], doc["updated_at"]) == (None, clock.now())
    assert doc["lease_token"] == task.lease_token  # the claim that completed it


async def test_a_block_that_settles_itself_is_not_settled_again(
    db: Any, queue: AsyncTaskQueue
) -> None:
    task = await put_and_claim(queue)

    async with queue.leased(task) as lease:
        assert await lease.complete({"answer": 42})

    assert lease.outcome == "completed"
    doc = await read(db, "t1")
    assert doc is not None and (doc["status"], doc["result"]) == ("done", {"answer": 42})


async def test_an_exception_releases_the_task_for_retry_and_propagates(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock, backoff_base=10, backoff_cap=100)
    task = await put_and_claim(queue)
    message = "x" * 3000 + "END"

    with pytest.raises(RuntimeError, match="END") as raised:
        async with queue.leased(task) as lease:
            raise RuntimeError(message)

    assert lease.outcome == "retried"
    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["status"], doc["attempts"]) == ("pending", 1)
    assert doc["worker_id"] is None and doc["lease_token"] is None
    assert later(clock, 10) <= doc["lease_until"] < later(clock, 15)
    stored = "".join(traceback.format_exception(raised.value)).rstrip()[-2000:]
    assert doc["error"] == stored
    assert len(doc["error"]) == 2000 and doc["error"].endswith("END")


async def failed_for_good(
    db: Any, queue: AsyncTaskQueue, attempts: int, task_id: str = "t1"
) -> str:
    """Asserts that the task is stored failed after `attempts` attempts, holds no lease, and
    nothing can claim it; returns its stored error."""
    doc = await read(db, task_id)
    assert doc is not None
    assert (doc["status"], doc["attempts"], doc["lease_until"]) == ("failed", attempts, None)
    assert await queue.claim("w") is None
    return str(doc["error"])


async def test_a_short_error_is_stored_with_its_traceback(db: Any, queue: AsyncTaskQueue) -> None:
    task = await put_and_claim(queue)

    with pytest.raises(KeyError):
        async with queue.leased(task):
            raise KeyError("missing-key")

    error = (await read(db, "t1") or {})["error"]
    assert error.startswith("Traceback (most recent call last):")
    assert error.endswith("KeyError: 'missing-key'")


async def test_a_permanent_error_fails_the_task(db: Any, queue: AsyncTaskQueue) -> None:
    task = await put_and_claim(queue)

    with pytest.raises(PermanentError):
        async with queue.leased(task) as lease:
            raise PermanentError("corrupt video")

    assert lease.outcome == "failed"
    error = await failed_for_good(db, queue, 1)
    assert error.endswith("PermanentError: corrupt video")


async def test_an_exception_on_the_last_attempt_fails_the_task(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock, max_attempts=2, backoff_base=10, backoff_cap=10)
    await queue.put("t1")
    for attempt in (1, 2):
        task = await claim_one(queue)
        assert task.attempts == attempt
        with pytest.raises(ValueError):
            async with queue.leased(task):
                raise ValueError(f"attempt {attempt}")
        clock.advance(15)

    assert (await failed_for_good(db, queue, 2)).endswith("ValueError: attempt 2")


async def hold_until_cancelled(queue: AsyncTaskQueue, task: Task) -> TaskLease:
    """Run a `leased` block that never ends by itself, and cancel it once it is running."""
    lease = queue.leased(task)
    entered = anyio.Event()

    async def hold() -> None:
        async with lease:
            entered.set()
            await anyio.Event().wait()

    async with anyio.create_task_group() as group:
        group.start_soon(hold)
        await entered.wait()
        group.cancel_scope.cancel()
    return lease


async def test_cancelling_the_block_releases_the_task_for_retry(
    db: Any, clock: ManualClock
) -> None:
    """Cancellation (a timeout, a shutdown that cannot wait) counts as an attempt, like a crash:
    a task that always times out must end failed rather than loop (see `leased`)."""
    queue = await new_queue(db, clock, backoff_base=10, backoff_cap=10)
    task = await put_and_claim(queue)
    clock.advance(3)

    lease = await hold_until_cancelled(queue, task)

    assert lease.outcome == "retried"
    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["status"], doc["attempts"]) == ("pending", 1)
    assert later(clock, 10) <= doc["lease_until"] < later(clock, 15)
    assert doc["lease_token"] is None and doc["worker_id"] is None
    assert doc["error"] == WORKER_STOPPED  # the reason, not a traceback of the cancellation
    clock.advance(15)
    assert (await claim_one(queue, expect="t1")).attempts == 2


async def test_a_block_cancelled_every_time_ends_failed(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock, max_attempts=3, backoff_base=1, backoff_cap=1)
    await queue.put("t1")

    for attempt in (1, 2, 3):
        task = await claim_one(queue, expect="t1")
        assert task.attempts == attempt
        await hold_until_cancelled(queue, task)
        clock.advance(2)

    await failed_for_good(db, queue, 3)


# ------------------------------------------------------------------------ retry and backoff


async def test_backoff_doubles_per_attempt_up_to_the_cap_with_jitter(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock, max_attempts=6, backoff_base=10, backoff_cap=50)
    await queue.put("t1")

    for attempt, base_delay in enumerate([10, 20, 40, 50, 50], start=1):
        task = await claim_one(queue)
        assert task.attempts == attempt
        clock.advance(1)
        assert await queue.release_for_retry(task, f"error {attempt}")

        doc = await read(db, "t1")
        assert doc is not None
        assert (doc["status"], doc["attempts"], doc["error"]) == (
            "pending",
            attempt,
            f"error {attempt}",
        )
        assert later(clock, base_delay) <= doc["lease_until"] < later(clock, base_delay * 1.5)
        clock.set(doc["lease_until"] - timedelta(milliseconds=1))
        assert await queue.claim("w") is None  # not before its due time
        clock.advance(0.001)

    # The sixth and last attempt is used up: releasing it fails the task.
    task = await claim_one(queue)
    assert await queue.release_for_retry(task, "error 6")
    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["status"], doc["attempts"], doc["error"]) == ("failed", 6, "error 6")


async def test_backoff_is_not_due_before_its_lower_bound(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock, backoff_base=20, backoff_cap=20)
    await queue.put("t1")
    assert await queue.release_for_retry(await claim_one(queue), "transient")

    clock.advance(19.999)
    assert await queue.claim("w") is None
    assert (await read(db, "t1") or {})["status"] == "pending"
    clock.advance(10.001)  # past the upper bound (30 s)
    assert (await claim_one(queue)).attempts == 2


async def test_jitter_factor_is_drawn_from_one_to_one_and_a_half(
    db: Any, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    draws: list[tuple[float, float]] = []

    def uniform(low: float, high: float) -> float:
        draws.append((low, high))
        return 1.25

    monkeypatch.setattr("mongoq.tasks.settles.random.uniform", uniform)
    queue = await new_queue(db, clock, backoff_base=8, backoff_cap=1000)
    task = await put_and_claim(queue)

    assert await queue.release_for_retry(task)

    assert draws == [(1.0, 1.5)]
    assert (await read(db, "t1") or {})["lease_until"] == later(clock, 10)


async def test_release_not_an_attempt_gives_the_attempt_back(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    task = await put_and_claim(queue)
    assert (await read(db, "t1") or {})["attempts"] == 1

    assert await queue.release_not_an_attempt(task)

    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["status"], doc["attempts"]) == ("pending", 0)
    assert doc["lease_until"] == later(clock, 5)  # a short pause, not a hot loop
    assert doc["lease_token"] is None
    clock.advance(4.999)
    assert await queue.claim("w") is None
    clock.advance(0.001)
    task = await claim_one(queue)
    assert task.attempts == 1

    assert await queue.release_not_an_attempt(task, delay=30)
    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["attempts"], doc["lease_until"]) == (0, later(clock, 30))


# ---------------------------------------------------------------------------------- reclaim


async def test_reclaim_buries_exhausted_expired_tasks_before_requeueing_the_others(
    db: Any, clock: ManualClock
) -> None:
    queue, faults = await faulty_queue(db, clock, max_attempts=2)
    await queue.put("exhausted", priority=3)
    await queue.put("expired", priority=2)
    await queue.put("waiting", delay=1000)
    await claim_one(queue, expect="exhausted")
    clock.advance(LEASE_TTL + 1)
    await claim_one(queue, expect="exhausted")  # takeover: its second and last attempt
    await claim_one(queue, expect="expired")
    clock.advance(LEASE_TTL + 1)  # both leases expired
    await queue.put("live", priority=9)
    await claim_one(queue, expect="live")
    before = {task_id: await read(db, task_id) for task_id in ("live", "waiting")}

    requeue = faults.pause_before(
        "update_many", match=lambda op: op.filter.get("attempts") == {"$lt": 2}
    )
    result: list[ReclaimResult] = []

    async def reclaim() -> None:
        result.append(await queue.reclaim_expired())

    async with anyio.create_task_group() as group:
        group.start_soon(reclaim)
        await requeue.reached.wait()
        # Between the two commands: the exhausted task is buried, the other not yet touched.
        assert (await read(db, "exhausted") or {})["status"] == "failed"
        assert (await read(db, "expired") or {})["status"] == "processing"
        requeue.release()

    assert result == [ReclaimResult(failed=1, requeued=1)]
    exhausted = await read(db, "exhausted")
    assert exhausted is not None
    assert (exhausted["status"], exhausted["attempts"], exhausted["lease_until"]) == (
        "failed",
        2,
        None,
    )
    assert "lease expired" in exhausted["error"]
    expired = await read(db, "expired")
    assert expired is not None
    assert (expired["status"], expired["attempts"], expired["lease_until"]) == (
        "pending",
        1,
        clock.now(),
    )
    assert expired["worker_id"] is None and expired["lease_token"] is None
    for task_id, doc in before.items():
        assert encoded(await read(db, task_id)) == encoded(doc)
    assert await queue.reclaim_expired() == ReclaimResult(failed=0, requeued=0)


async def test_reclaim_and_claim_leave_live_leases_alone(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    await queue.put("t1")
    await claim_one(queue)
    clock.advance(LEASE_TTL - 0.001)  # the lease ends in a millisecond
    snapshot = await read(db, "t1")

    assert await queue.reclaim_expired() == ReclaimResult(failed=0, requeued=0)
    assert await queue.claim("other") is None
    assert (await queue.stats()).expired == 0
    assert encoded(await read(db, "t1")) == encoded(snapshot)


# ------------------------------------------------------------------------------------ crash


async def test_a_task_whose_worker_crashed_runs_again_after_the_lease(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    await queue.put("t1", {"v": 1})
    await claim_one(queue, "crashed")  # and the Task object is dropped

    clock.advance(LEASE_TTL - 1)
    assert await queue.claim("w") is None
    clock.advance(1.001)
    task = await claim_one(queue, "survivor", expect="t1")
    assert (task.attempts, task.payload) == (2, {"v": 1})
    assert await queue.complete(task, "ok")

    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["status"], doc["attempts"], doc["worker_id"], doc["result"]) == (
        "done",
        2,
        "survivor",
        "ok",
    )


async def test_a_task_that_crashes_every_time_ends_failed_after_max_attempts(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock, max_attempts=3)
    await queue.put("poison")

    for attempt in (1, 2, 3):
        task = await claim_one(queue, f"worker-{attempt}", expect="poison")
        assert task.attempts == attempt
        clock.advance(LEASE_TTL + 1)  # the worker crashed; its lease expires

    assert await queue.claim("w") is None  # no attempts left to take it over with
    doc = await read(db, "poison")
    assert doc is not None and (doc["status"], doc["attempts"]) == ("processing", 3)

    assert await queue.reclaim_expired() == ReclaimResult(failed=1, requeued=0)
    assert "lease expired on the last attempt" in await failed_for_good(db, queue, 3, "poison")


async def test_a_crash_reclaimed_by_reclaim_expired_runs_again(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    await expired_claim(queue, clock, "crashed")

    assert await queue.reclaim_expired() == ReclaimResult(failed=0, requeued=1)
    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["status"], doc["attempts"], doc["lease_until"]) == ("pending", 1, clock.now())
    task = await claim_one(queue, "survivor")
    assert task.attempts == 2


@pytest.mark.parametrize("recovery", ["reclaim", "takeover"])
async def test_a_new_revision_put_during_a_crashed_last_attempt_still_runs(
    db: Any, clock: ManualClock, recovery: str
) -> None:
    """A revision put while its task is processed gets runs of its own, even when the holder
    then crashes on what was the old revision's last attempt: nothing is lost."""
    queue = await new_queue(db, clock, max_attempts=2, backoff_base=1, backoff_cap=1)
    await queue.put("t1", {"v": 1}, revision="r1")
    assert await queue.release_for_retry(await claim_one(queue), "transient")
    clock.advance(2)
    await claim_one(queue, "crashed")  # r1's last attempt
    assert await queue.put("t1", {"v": 2}, revision="r2") == "updated"

    clock.advance(LEASE_TTL + 1)  # the holder crashed; nobody will settle r1
    if recovery == "reclaim":
        assert await queue.reclaim_expired() == ReclaimResult(failed=0, requeued=1)
        doc = await read(db, "t1")
        assert doc is not None
        assert (doc["status"], doc["revision"], doc["attempts"]) == ("pending", "r2", 0)

    task = await claim_one(queue, "w", expect="t1")
    assert (task.revision, task.payload, task.attempts) == ("r2", {"v": 2}, 1)
    await assert_completes(db, queue, task, "r2 done")
