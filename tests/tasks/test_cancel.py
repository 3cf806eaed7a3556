"""`AsyncTaskQueue.cancel` (issue 15): a pending task ends ``cancelled``; a running one too,
at once in the database, and its holder finds out at its next renewal, its handler cancelled;
no settle of that claim takes effect. Each test reads the stored task back."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from mongoq import InvalidInput, LeaseLost, NewTask, Task
from mongoq.testing import ManualClock, settle
from tests.support.helpers import (
    LEASE_TTL,
    Sleeper,
    claim_one,
    in_background,
    new_queue,
    read,
    wait_for,
)


async def test_a_pending_task_cancelled_is_never_claimed_and_a_second_cancel_changes_nothing(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t1", {"n": 1})
    await queue.put("t2")

    assert await queue.cancel("t1") is True

    stored = await read(db, "t1")
    assert stored is not None
    assert (stored["status"], stored["lease_until"], stored["lease_token"]) == ("cancelled", None,
                                                                              None)  # fmt: skip
    assert (await claim_one(queue)).id == "t2"
    assert await queue.claim("w") is None
    before = await read(db, "t1")
    assert await queue.cancel("t1") is False  # finished already
    assert await queue.cancel("nope") is False  # no such task
    assert await read(db, "t1") == before and await read(db, "nope") is None
    listed = await queue.list_tasks(status="cancelled")
    assert [task.id for task in listed.tasks] == ["t1"]
    assert (await queue.stats()).counts["cancelled"] == 1


async def test_cancel_refuses_a_bad_id_before_anything_is_written(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    with pytest.raises(InvalidInput) as error:
        await queue.cancel({"not": "an id"})  # type: ignore[arg-type]
    assert error.value.field == "task_id"
    assert await db["tasks"].count_documents({}) == 0


async def test_a_running_task_cancelled_in_this_process_stops_its_handler_at_once(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t1")
    sleeper = Sleeper()

    async def cancel() -> None:
        assert await queue.cancel("t1") is True
        assert (await read(db, "t1") or {})["status"] == "cancelled"  # at once
        # No clock move: neither a renewal nor a poll is due; its holder is told.
        await wait_for(lambda: sleeper.seen == ["started", "cancelled"], "the handler to stop")
        queue.stop()

    summary = await in_background(
        clock, queue.run(sleeper, poll_interval=60), started=lambda: sleeper.seen, then=cancel,
        advance=0,
    )  # fmt: skip
    assert (summary.cancelled, summary.lost, summary.retried, summary.completed) == (1, 0, 0, 0)
    stored = await read(db, "t1")
    assert stored is not None and (stored["status"], stored["attempts"]) == ("cancelled", 1)
    assert "error" not in stored or stored["error"] is None  # not recorded as a failure


async def test_a_holder_of_a_cancelled_task_cannot_settle_it(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t1")
    task = await claim_one(queue, expect="t1")
    assert await queue.cancel("t1")

    assert await queue.complete(task, {"late": True}) is False
    assert await queue.release_for_retry(task, "boom") is False
    assert await queue.fail(task, "boom") is False
    assert await queue.heartbeat(task) is False
    stored = await read(db, "t1")
    assert stored is not None and stored["status"] == "cancelled"
    assert stored.get("result") is None and stored.get("error") is None


async def test_a_leased_block_learns_of_the_cancel_from_its_renewal(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t1")
    task = await claim_one(queue, expect="t1")
    with pytest.raises(LeaseLost, match="was cancelled"):
        async with queue.leased(task) as lease:
            assert await queue.cancel("t1")
            clock.advance(LEASE_TTL / 3)
            await wait_for(lambda: lease.lost, "the renewal to find the task gone")
            assert (lease.lost, lease.cancelled) == (True, True)
    assert lease.outcome == "cancelled"
    assert (await read(db, "t1") or {})["status"] == "cancelled"


async def test_a_put_of_a_new_revision_makes_a_cancelled_task_pending_again(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t1", {"v": 1}, revision=1)
    assert await queue.cancel("t1")
    assert await queue.put("t1", {"v": 1}, revision=1) == "unchanged"
    assert (await read(db, "t1") or {})["status"] == "cancelled"
    assert await queue.put("t1", {"v": 2}, revision=2) == "updated"
    assert (await claim_one(queue, expect="t1")).payload == {"v": 2}


async def test_purge_deletes_cancelled_tasks_older_than_asked(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock)
    await queue.put("old")
    assert await queue.cancel("old")
    clock.advance(3600)
    await queue.put("new")
    assert await queue.cancel("new")
    assert await queue.purge("cancelled", older_than=60) == 1
    assert await read(db, "old") is None and (await read(db, "new") or {})["status"] == "cancelled"


async def test_a_task_cancelled_in_a_batch_is_stopped_and_counted_cancelled(
    db: Any, clock: ManualClock
) -> None:
    """run(batch_size=3): t0's handler runs when t0 is cancelled; the batch's renewal finds it
    gone, stops the handler, counts it cancelled (not lost), and the others run on."""
    queue = await new_queue(db, clock)
    await queue.put_many(NewTask(f"t{n}", priority=3 - n) for n in range(3))
    seen: list[str] = []

    async def handler(task: Task) -> None:
        seen.append(str(task.id))
        if task.id == "t0":
            await anyio.sleep_forever()

    results: list[Any] = []
    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:

            async def run() -> None:
                results.append(
                    await queue.run(handler, batch_size=3, poll_interval=60, schedules=False)
                )

            group.start_soon(run)
            await wait_for(lambda: seen == ["t0"], "t0 to start")
            assert await queue.cancel("t0")
            clock.advance(LEASE_TTL / 3)  # the batch's renewal
            await wait_for(lambda: seen == ["t0", "t1", "t2"], "t1 and t2 to run")
            queue.stop()
    (summary,) = results
    assert (summary.cancelled, summary.lost, summary.completed) == (1, 0, 2), summary
    assert seen == ["t0", "t1", "t2"]
    docs = {
        task_id: (await read(db, task_id) or {}).get("status") for task_id in ("t0", "t1", "t2")
    }
    assert docs == {"t0": "cancelled", "t1": "done", "t2": "done"}


async def test_a_cancel_from_another_process_reaches_the_handler_within_two_polls(
    db: Any, clock: ManualClock
) -> None:
    poll = 1.0
    queue = await new_queue(db, clock)
    await queue.put("t1")
    sleeper = Sleeper()

    async def cancel_elsewhere() -> None:
        # Another process's cancel: the database changes, nothing in this process is told.
        cancelled = await db["tasks"].update_one(
            {"_id": "t1"}, {"$set": {"status": "cancelled", "lease_token": None}}
        )
        assert cancelled.modified_count == 1
        for _ in range(2):  # two polls, far from the first renewal (a third of the lease)
            await settle(5)
            clock.advance(poll)
            if sleeper.seen != ["started"]:
                break
        await wait_for(lambda: sleeper.seen == ["started", "cancelled"], "the handler to stop")
        queue.stop()

    summary = await in_background(
        clock, queue.run(sleeper, poll_interval=poll), started=lambda: sleeper.seen,
        then=cancel_elsewhere, advance=0,
    )  # fmt: skip
    assert summary.cancelled == 1


@pytest.mark.parametrize("elsewhere", [False, True], ids=["this-process", "another-process"])
async def test_a_cancel_reaches_a_handler_running_in_a_batch_as_promptly(
    db: Any, clock: ManualClock, elsewhere: bool
) -> None:
    poll = 1.0
    queue = await new_queue(db, clock)
    await queue.put_many([NewTask("t1"), NewTask("t2")])
    sleeper = Sleeper()

    async def cancel() -> None:
        if elsewhere:  # the database changes, nothing in this process is told
            await db["tasks"].update_one(
                {"_id": "t1"}, {"$set": {"status": "cancelled", "lease_token": None}}
            )
            for _ in range(2):  # two polls, far from the batch's renewal
                await settle(5)
                clock.advance(poll)
        else:
            assert await queue.cancel("t1") is True
        await wait_for(lambda: sleeper.seen[:2] == ["started", "cancelled"], "t1 to stop")
        queue.stop(grace=0)

    summary = await in_background(
        clock, queue.run(sleeper, batch_size=2, poll_interval=poll),
        started=lambda: sleeper.seen, then=cancel, advance=0,
    )  # fmt: skip
    assert summary.cancelled == 1
    assert (await read(db, "t1") or {})["status"] == "cancelled"
