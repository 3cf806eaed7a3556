"""Task documents no worker can use (a field of the wrong type, written by hand, by another
program, by a bad restore) are set aside at their first encounter: failed with an error naming
the field and what it holds, one WARNING naming the collection, the id and the field. They never
raise out of `run()`, never hold back the good tasks behind them, never stay ``processing``, and
never break `get`, `list_tasks`, `wait` or `stats`. Each test reads the stored documents back."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest

from mongoq import InvalidInput, Task
from mongoq.testing import ManualClock
from tests.support.helpers import (
    LEASE_TTL,
    in_background,
    napping,
    new_queue,
    read,
    set_asides,
)

#: The shapes a claim cannot use, by field: what a hand edit leaves, and what the error names.
SHAPES = [
    pytest.param("attempts", "x", "a string", id="attempts-string"),
    pytest.param("attempts", None, "null", id="attempts-null"),
    pytest.param("attempts", True, "a bool", id="attempts-bool"),
    pytest.param("attempts", float("nan"), "a float", id="attempts-nan"),
    pytest.param("priority", "high", "a string", id="priority-string"),
    pytest.param("priority", None, "null", id="priority-null"),
    pytest.param("priority", {"n": 1}, "a document", id="priority-document"),
    pytest.param("priority", True, "a bool", id="priority-bool"),
    pytest.param("priority", "5", "a string", id="priority-numeral"),
]


async def _spoiled(db: Any, clock: ManualClock, field: str, value: Any, **options: Any) -> Any:
    """A queue with good tasks g1..g3 and one task "bad" whose `field` was set to `value` by
    hand; "bad" is the most urgent (put first, highest priority) so every claim meets it first."""
    queue = await new_queue(db, clock, **options)
    await queue.put("bad", {"n": 0}, priority=5)
    for n in (1, 2, 3):
        await queue.put(f"g{n}", {"n": n})
    await db["tasks"].update_one({"_id": "bad"}, {"$set": {field: value}})
    return queue


async def _run_all(queue: Any, **options: Any) -> list[str]:
    ran: list[str] = []

    async def handler(task: Task) -> None:
        ran.append(str(task.id))

    await queue.run(handler, stop_when_drained=True, poll_interval=1, **options)
    return ran


@pytest.mark.parametrize(("field", "value", "kind"), SHAPES)
@pytest.mark.parametrize("batch_size", [1, 10])
async def test_a_task_no_worker_can_use_is_failed_at_its_first_claim_and_the_rest_run(
    db: Any,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
    field: str,
    value: Any,
    kind: str,
    batch_size: int,
) -> None:
    queue = await _spoiled(db, clock, field, value)
    caplog.set_level(logging.WARNING, "mongoq")

    ran = await _run_all(queue, batch_size=batch_size)

    assert sorted(ran) == ["g1", "g2", "g3"]
    bad = await read(db, "bad")
    assert bad is not None
    assert bad["status"] == "failed"
    assert bad["lease_until"] is None and bad["lease_token"] is None
    assert f"field '{field}' holds {kind}" in bad["error"]
    for n in (1, 2, 3):
        assert (await read(db, f"g{n}") or {})["status"] == "done"
    assert set_asides(caplog) == [("tasks", "bad", field, "failed")]
    (line,) = [r for r in caplog.records if hasattr(r, "mongoq_field")]
    assert "'bad'" in line.getMessage() and "tasks" in line.getMessage()


@pytest.mark.parametrize(("field", "value", "kind"), SHAPES)
async def test_a_claim_sets_aside_what_it_cannot_use_and_returns_the_next_task(
    db: Any, clock: ManualClock, field: str, value: Any, kind: str
) -> None:
    queue = await _spoiled(db, clock, field, value)

    task = await queue.claim("w")

    assert task is not None and task.id == "g1"
    assert (await read(db, "g1") or {})["lease_token"] == task.lease_token
    many = await queue.claim_many(10, "w")
    assert sorted(t.id for t in many) == ["g2", "g3"]
    # (A null priority sorts last: met by the batch, not the first claim.)
    assert (await read(db, "bad") or {})["status"] == "failed"
    assert await queue.claim("w") is None


async def test_a_claim_of_only_unusable_tasks_says_nothing_is_due(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    for n in range(3):
        await queue.put(f"bad{n}")
    await db["tasks"].update_many({}, {"$set": {"attempts": "x"}})

    assert await queue.claim("w") is None
    assert await queue.claim_many(5, "w") == []

    docs = await db["tasks"].find({}).to_list(None)
    assert [doc["status"] for doc in docs] == ["failed"] * 3


@pytest.mark.parametrize("attempts", ["x", None, "missing", float("nan")])
async def test_an_expired_lease_whose_attempts_are_no_number_is_failed_by_reclaim(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, attempts: Any
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("bad")
    await queue.put("good")
    claimed = [await queue.claim("w"), await queue.claim("w")]
    assert all(task is not None for task in claimed)
    spoil = {"$unset": {"attempts": ""}} if attempts == "missing" else {
        "$set": {"attempts": attempts}
    }  # fmt: skip
    await db["tasks"].update_one({"_id": "bad"}, spoil)
    clock.advance(LEASE_TTL + 1)
    caplog.set_level(logging.WARNING, "mongoq")

    result = await queue.reclaim_expired()

    assert (result.failed, result.requeued) == (1, 1)
    bad = await read(db, "bad")
    assert bad is not None and bad["status"] == "failed" and bad["lease_until"] is None
    assert "field 'attempts' holds no number" in bad["error"]
    assert (await read(db, "good") or {})["status"] == "pending"
    assert set_asides(caplog) == [("tasks", "bad", "attempts", "failed")]


async def test_listings_pages_and_stats_show_an_unreadable_task_marked(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("bad", {"n": 0})
    await queue.put("good")
    await db["tasks"].update_one({"_id": "bad"}, {"$set": {"priority": "high", "attempts": "x"}})

    page = await queue.list_tasks()
    by_id = {task.id: task for task in page.tasks}
    assert by_id["bad"].unreadable == "field 'attempts' holds a string ('x')"
    assert by_id["good"].unreadable is None
    got = await queue.get("bad")
    assert got is not None and got.status == "pending" and got.unreadable is not None
    stats = await queue.stats()
    assert stats.counts["pending"] == 2
    assert (await read(db, "bad") or {})["priority"] == "high"  # reading changes nothing


async def test_a_document_with_an_unknown_status_is_listed_and_never_claimed(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("odd")
    await db["tasks"].update_one({"_id": "odd"}, {"$set": {"status": 7}})

    assert await queue.claim("w") is None
    task = await queue.get("odd")
    assert task is not None and task.unreadable == "field 'status' holds an int (7)"
    assert (await read(db, "odd") or {})["status"] == 7


@pytest.mark.parametrize(
    "forged",
    [
        {"lease_token": {"$ne": None}},
        {"worker_id": {"$exists": True}},
        {"id": {"$gt": ""}},
        {"revision": {"$ne": "x"}},
        {"id": ["t1", "t2"]},
    ],
    ids=["token", "worker", "id", "revision", "array-id"],
)
async def test_a_hand_built_task_with_fields_of_the_wrong_type_settles_nothing(
    db: Any, clock: ManualClock, forged: dict[str, Any]
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t1")
    held = await queue.claim("holder")
    assert held is not None
    before = await read(db, "t1")
    fake = dataclasses.replace(held, **forged)

    for call in (queue.heartbeat, queue.complete, queue.fail, queue.release_for_retry):
        with pytest.raises(InvalidInput) as refused:
            await call(fake)
        assert refused.value.field == "task"
    with pytest.raises(InvalidInput):
        await queue.heartbeat_many([fake])
    assert await read(db, "t1") == before


@pytest.mark.parametrize("batch_size", [1, 10])
async def test_a_task_another_program_inserted_with_an_object_id_runs_as_any_other(
    db: Any, clock: ManualClock, batch_size: int
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("g1")
    inserted = await db["tasks"].insert_one({
        "status": "pending", "lease_until": clock.now(), "attempts": 0, "priority": 0,
        "payload": {"n": 1},
    })  # fmt: skip

    ran = await _run_all(queue, batch_size=batch_size)

    assert sorted(ran) == sorted(["g1", str(inserted.inserted_id)])
    stored = await read(db, inserted.inserted_id)
    assert stored is not None and (stored["status"], stored["attempts"]) == ("done", 1)
    assert (await read(db, "g1") or {})["status"] == "done"


@pytest.mark.parametrize("due", [None, "soon", "missing"])
async def test_a_pending_task_whose_due_time_is_no_date_is_set_aside_by_a_drained_run(
    db: Any, clock: ManualClock, due: Any
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("bad")
    await queue.put("later", delay=600)
    spoil = {"$unset": {"lease_until": ""}} if due == "missing" else {"$set": {"lease_until": due}}
    await db["tasks"].update_one({"_id": "bad"}, spoil)
    ran: list[str] = []

    async def handler(task: Task) -> None:
        ran.append(str(task.id))

    summary = await in_background(
        clock, queue.run(handler, stop_when_drained=True), started=lambda: napping(queue),
        advance=600,
    )  # fmt: skip

    assert ran == ["later"] and summary.completed == 1
    bad = await read(db, "bad")
    assert bad is not None and bad["status"] == "failed"
    assert "field 'lease_until' holds" in bad["error"]
    assert (await queue.get("bad")) is not None


async def test_an_expired_last_attempt_whose_priority_is_no_number_is_buried_naming_it(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The claim took it but could not set it aside (its write failed): its lease ends on its
    last attempt, and the burial names the field, not a crash."""
    queue = await new_queue(db, clock, max_attempts=1)
    await queue.put("bad")
    assert await queue.claim("w") is not None
    await db["tasks"].update_one({"_id": "bad"}, {"$set": {"priority": float("nan")}})
    clock.advance(LEASE_TTL + 1)
    caplog.set_level(logging.WARNING, "mongoq")

    assert (await queue.reclaim_expired()).failed == 1

    bad = await read(db, "bad")
    assert bad is not None and bad["status"] == "failed"
    assert "field 'priority' holds no number" in bad["error"]
    assert set_asides(caplog) == [("tasks", "bad", "priority", "failed")]
