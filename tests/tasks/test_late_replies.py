"""The task queue's run loop when replies come late: a handler starts only under a lease its
worker knows is live. A command is applied, its reply is held (`FaultInjector.pause_after`)
past the lease it granted while another worker takes the task over; the late worker must not
start the task. The database and the handlers' start log are asserted, not only summaries.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import anyio

from mongoq import AsyncTaskQueue
from mongoq.testing import CommandCounter, FaultInjector, ManualClock, Operation, instrument
from tests.support.helpers import QUEUE, read, utc, wait_for

LEASE = 30.0


def heartbeats_sent(counter: CommandCounter) -> int:
    """Heartbeats sent so far (updates that move the lease's end, and nothing but its time)."""
    updates = [op.args[1] for op in counter.operations if op.name == "update_one"]
    return sum(
        1
        for update in updates
        if isinstance(update, dict)
        and "lease_until" in {**update.get("$set", {}), **update.get("$max", {})}
        and "status" not in update.get("$set", {})
    )


def heartbeat_of_two(op: Operation) -> bool:
    """The batch's renewal of both its tasks (one update_many fenced on their tokens)."""
    return op.name == "update_many" and "lease_token" in str(op.filter)


async def test_a_batch_dates_its_renewal_from_before_it_was_sent(
    db: Any, clock: ManualClock
) -> None:
    """Worker A claims t1 and t2 in one batch at T. Its renewal is sent at T+10 (the database's
    lease then runs to T+40) and its reply held until T+45; meanwhile B takes both over at T+41.
    When t1's handler ends at T+50, A must not start t2: its lease ended at T+40, not at T+75
    (the reply's time plus a lease)."""
    faults = FaultInjector()
    a = AsyncTaskQueue(instrument(db, faults), QUEUE, clock=clock, lease_ttl=LEASE)
    b = AsyncTaskQueue(db, QUEUE, clock=clock, lease_ttl=LEASE)
    await a.setup()
    await b.put("t1", priority=1)
    await b.put("t2")
    started: list[tuple[str, str | None]] = []

    async def handler(task: Any) -> None:
        started.append((task.id, task.worker_id))
        if task.id == "t1":
            await clock.sleep(50)

    held = faults.pause_after("update_many", match=heartbeat_of_two)
    begin = clock.now()
    async with anyio.create_task_group() as group:
        summary: list[Any] = []

        async def run_a() -> None:
            summary.append(await a.run(handler, batch_size=2, worker_id="A", stop_when_empty=True))

        group.start_soon(run_a)
        await wait_for(lambda: started == [("t1", "A")], "t1 to start")
        clock.advance(10)
        await wait_for(held.reached.is_set, "the renewal to be applied")
        clock.advance(31)  # T+41: the lease of A ended at T+40
        taken = await b.claim_many(2, "B")
        assert sorted(task.id for task in taken) == ["t1", "t2"]
        clock.advance(4)  # T+45: the renewal's reply arrives
        held.release()
        clock.advance(5)  # T+50: t1's handler ends
        await wait_for(lambda: bool(summary), "A's run to return")

    assert started == [("t1", "A")]  # t2 never started by A
    t2 = await read(db, "t2")
    assert t2 is not None
    assert (t2["status"], t2["worker_id"]) == ("processing", "B")
    assert t2["lease_token"] == next(task.lease_token for task in taken if task.id == "t2")
    assert t2["lease_until"] is not None and (t2["lease_until"] - begin).total_seconds() > 40
    assert summary[0].claimed == 2 and summary[0].lost == 2  # t1's completion missed too


async def test_a_claim_whose_reply_comes_after_its_lease_ended_does_not_start_the_task(
    db: Any, clock: ManualClock
) -> None:
    """A's claim is applied at T (lease to T+30) and answered at T+35; B took the task over at
    T+31 and holds it. A never starts it, writes nothing that touches B's claim, and counts
    it lost once."""
    faults = FaultInjector()
    a = AsyncTaskQueue(instrument(db, faults), QUEUE, clock=clock, lease_ttl=LEASE)
    b = AsyncTaskQueue(db, QUEUE, clock=clock, lease_ttl=LEASE)
    await a.setup()
    await b.put("t1")
    started: list[tuple[str, str | None]] = []

    async def handler(task: Any) -> None:
        started.append((task.id, task.worker_id))

    held = faults.pause_after("find_one_and_update")
    summary: list[Any] = []
    async with anyio.create_task_group() as group:

        async def run_a() -> None:
            summary.append(await a.run(handler, worker_id="A", stop_when_empty=True))

        group.start_soon(run_a)
        await wait_for(held.reached.is_set, "A's claim to be applied")
        clock.advance(31)
        taken = await b.claim("B")
        assert taken is not None
        clock.advance(4)
        held.release()
        await wait_for(lambda: bool(summary), "A's run to return")

    assert started == []
    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["status"], doc["worker_id"], doc["lease_token"]) == (
        "processing",
        "B",
        taken.lease_token,
    )
    assert doc["attempts"] == 2  # A's claim and B's: nothing charged or given back by A since
    assert (summary[0].claimed, summary[0].lost) == (1, 1)


async def test_a_claim_answered_late_but_before_its_lease_ended_renews_before_it_starts(
    db: Any, clock: ManualClock
) -> None:
    """A's claim is applied at T and answered at T+25, with less than a third of its lease
    left: A renews it first (one heartbeat), then runs and completes the task."""
    faults = FaultInjector()
    a = AsyncTaskQueue(instrument(db, faults), QUEUE, clock=clock, lease_ttl=LEASE)
    await a.setup()
    await a.put("t1")
    started: list[float] = []
    begin = clock.now()

    async def handler(task: Any) -> str:
        started.append((clock.now() - begin).total_seconds())
        return "ok"

    held = faults.pause_after("find_one_and_update")
    summary: list[Any] = []
    async with anyio.create_task_group() as group:

        async def run_a() -> None:
            summary.append(await a.run(handler, worker_id="A", stop_when_empty=True))

        group.start_soon(run_a)
        await wait_for(held.reached.is_set, "A's claim to be applied")
        clock.advance(25)
        held.release()
        await wait_for(lambda: bool(summary), "A's run to return")

    assert started == [25.0]
    doc = await read(db, "t1")
    assert doc is not None and (doc["status"], doc["result"]) == ("done", "ok")
    assert (summary[0].claimed, summary[0].completed) == (1, 1)


async def test_two_renewals_in_flight_that_apply_out_of_order_never_move_the_lease_back(
    db: Any, clock: ManualClock
) -> None:
    """A renewal sent at T waits before it applies; one sent at T+5 applies first (lease to
    T+35). When the first applies after it, the lease stays at T+35: a batch's renewal and one
    item's can be in flight at once, and the holder starts handlers on the later one."""
    faults = FaultInjector()
    queue = AsyncTaskQueue(instrument(db, faults), QUEUE, clock=clock, lease_ttl=LEASE)
    await queue.setup()
    await queue.put("t1")
    task = await queue.claim("A")
    assert task is not None
    held = faults.pause_before("update_one")
    answers: list[bool] = []
    async with anyio.create_task_group() as group:

        async def first() -> None:
            answers.append(await queue.heartbeat(task))

        group.start_soon(first)
        await wait_for(held.reached.is_set, "the first renewal to be on its way")
        clock.advance(5)
        assert await queue.heartbeat(task)
        later = clock.now() + timedelta(seconds=LEASE)
        held.release()
        await wait_for(lambda: bool(answers), "the first renewal's answer")

    assert answers == [True]
    doc = await read(db, "t1")
    assert doc is not None and utc(doc["lease_until"]) == later


async def test_a_completion_without_an_answer_stays_unknown_when_a_renewal_found_it_gone(
    db: Any, clock: ManualClock
) -> None:
    """The completion applies; before its reply (then lost) arrives, the heartbeat finds the
    task no longer held (it is done). The run counts it ``unknown``, not ``lost``: it may well
    be done, as it is."""
    faults, counter = FaultInjector(), CommandCounter()
    counter.record = True
    queue = AsyncTaskQueue(instrument(db, counter, faults), QUEUE, clock=clock, lease_ttl=LEASE)
    await queue.setup()
    await queue.put("t1")

    def completion(op: Operation) -> bool:
        update = op.args[1] if op.name == "update_one" else None
        return isinstance(update, dict) and update.get("$set", {}).get("status") == "done"

    held = faults.pause_after("update_one", match=completion)
    faults.fail_after("update_one", match=completion)

    async def handler(task: Any) -> str:
        return "ok"

    summary: list[Any] = []
    async with anyio.create_task_group() as group:

        async def run() -> None:
            summary.append(await queue.run(handler, worker_id="A", stop_when_empty=True))

        group.start_soon(run)
        await wait_for(held.reached.is_set, "the completion to be applied")
        clock.advance(LEASE / 3)  # the heartbeat: the task is done, no longer held
        await wait_for(lambda: heartbeats_sent(counter) >= 1, "the heartbeat")
        held.release()
        await wait_for(lambda: bool(summary), "the run to return")

    doc = await read(db, "t1")
    assert doc is not None and (doc["status"], doc["result"]) == ("done", "ok")
    assert (summary[0].claimed, summary[0].unknown, summary[0].lost) == (1, 1, 0)
