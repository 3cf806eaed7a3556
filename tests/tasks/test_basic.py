"""AsyncTaskQueue: the producer (put, put_many), claim order, operator calls, stats, indexes."""

from __future__ import annotations

from typing import Any

import pytest

from mongoq import AsyncTaskQueue, NewTask, PutManyResult, ReclaimResult, Task, _driver
from mongoq._indexes import IndexSpec, create_indexes
from mongoq.testing import ManualClock
from tests.support.helpers import (
    LEASE_TTL,
    claim_one,
    counted_queue,
    encoded,
    later,
    new_queue,
    read,
    read_all,
)


@pytest.fixture
async def queue(db: Any, clock: ManualClock) -> AsyncTaskQueue:
    return await new_queue(db, clock)


async def make_done(queue: AsyncTaskQueue, task_id: str) -> None:
    assert await queue.complete(await claim_one(queue, expect=task_id), "ok")


async def make_failed(queue: AsyncTaskQueue, task_id: str) -> None:
    assert await queue.fail(await claim_one(queue, expect=task_id), "broken")


async def claim_ids(queue: AsyncTaskQueue) -> list[Any]:
    """Claim until nothing is due; the ids in claim order."""
    ids = []
    while (task := await queue.claim("w")) is not None:
        ids.append(task.id)
    return ids


# ------------------------------------------------------------------------------------- put


async def test_put_inserts_a_pending_task_due_now(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    assert await queue.put("t1", {"file": "a.mp4"}, revision="r1", priority=3) == "inserted"

    doc = await read(db, "t1")
    assert doc == {
        "_id": "t1",
        "payload": {"file": "a.mp4"},
        "revision": "r1",
        "priority": 3,
        "status": "pending",
        "attempts": 0,
        "lease_until": clock.now(),
        "worker_id": None,
        "lease_token": None,
        "error": None,
        "result": None,
        "created_at": clock.now(),
        "updated_at": clock.now(),
        "function": None,  # a plain task: no task function
    }


@pytest.mark.parametrize(
    ("revision", "replayed_payload"),
    [("r1", {"n": 1}), ("r1", {"n": 2}), (None, {"n": 1}), (None, {"n": 2})],
    ids=["same-revision", "same-revision-other-payload", "no-revision", "no-revision-other"],
)
async def test_replayed_put_is_unchanged_byte_for_byte(
    db: Any,
    queue: AsyncTaskQueue,
    clock: ManualClock,
    revision: str | None,
    replayed_payload: dict[str, int],
) -> None:
    await queue.put("t1", {"n": 1}, revision=revision)
    before = await read(db, "t1")
    clock.advance(60)

    assert await queue.put("t1", replayed_payload, revision=revision) == "unchanged"

    after = await read(db, "t1")
    assert encoded(after) == encoded(before)  # updated_at included
    assert after is not None and after["updated_at"] == later(clock, -60)


@pytest.mark.parametrize("state", ["pending", "done", "failed"])
async def test_put_of_a_new_revision_makes_the_task_pending_again(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock, state: str
) -> None:
    await queue.put("t1", {"v": 1}, revision="r1")
    created = clock.now()
    if state == "done":
        await make_done(queue, "t1")
    elif state == "failed":
        await make_failed(queue, "t1")
    clock.advance(10)

    assert await queue.put("t1", {"v": 2}, revision="r2", priority=7, delay=5) == "updated"

    doc = await read(db, "t1")
    assert doc is not None
    assert doc["status"] == "pending"
    assert doc["attempts"] == 0
    assert (doc["payload"], doc["revision"], doc["priority"]) == ({"v": 2}, "r2", 7)
    assert doc["lease_until"] == later(clock, 5)
    assert doc["error"] is None and doc["result"] is None
    assert doc["worker_id"] is None and doc["lease_token"] is None
    assert doc["created_at"] == created
    assert doc["updated_at"] == clock.now()


async def test_put_of_a_new_revision_while_processing_is_never_done_for_the_old_one(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    await queue.put("t1", {"v": 1}, revision="r1")
    held = await queue.claim("w1")
    assert held is not None and held.revision == "r1"

    assert await queue.put("t1", {"v": 2}, revision="r2") == "updated"
    doc = await read(db, "t1")
    assert doc is not None
    # The task stays with its holder until the holder settles; the payload is the new one.
    assert (doc["status"], doc["lease_token"]) == ("processing", held.lease_token)
    assert (doc["payload"], doc["revision"], doc["attempts"]) == ({"v": 2}, "r2", 0)

    clock.advance(1)
    assert await queue.complete(held, "result of r1") is False

    doc = await read(db, "t1")
    assert doc is not None
    assert doc["status"] == "pending"
    assert doc["attempts"] == 0
    assert (doc["payload"], doc["revision"]) == ({"v": 2}, "r2")
    assert doc["result"] is None
    assert doc["lease_until"] == clock.now()
    assert doc["lease_token"] is None and doc["worker_id"] is None

    again = await queue.claim("w2")
    assert again is not None and (again.payload, again.revision) == ({"v": 2}, "r2")
    assert await queue.complete(again, "result of r2")
    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["status"], doc["result"], doc["attempts"]) == ("done", "result of r2", 1)


async def test_put_of_the_same_revision_while_processing_leaves_the_holder_alone(
    db: Any, queue: AsyncTaskQueue
) -> None:
    await queue.put("t1", {"v": 1}, revision="r1")
    held = await queue.claim("w1")
    assert held is not None
    before = await read(db, "t1")

    assert await queue.put("t1", {"v": 1}, revision="r1") == "unchanged"

    assert encoded(await read(db, "t1")) == encoded(before)
    assert await queue.complete(held, "ok")
    doc = await read(db, "t1")
    assert doc is not None and (doc["status"], doc["result"]) == ("done", "ok")


async def test_dollar_strings_in_values_are_stored_literally(
    db: Any, queue: AsyncTaskQueue
) -> None:
    """Values reach the update pipeline; a string such as "$status" must not read a field."""
    payload = {"path": "$status", "list": ["$attempts", {"x": "$$NOW"}]}
    assert await queue.put("$id", payload, revision="$revision") == "inserted"
    stored = await read(db, "$id")
    assert stored is not None
    assert (stored["payload"], stored["revision"]) == (payload, "$revision")

    assert await queue.put("$id", payload, revision="$revision") == "unchanged"
    assert await queue.put("plain", "$status") == "inserted"

    assert encoded(await read(db, "$id")) == encoded(stored)
    assert (await read(db, "plain") or {})["payload"] == "$status"


# -------------------------------------------------------------------------------- put_many


async def test_put_many_is_one_command_and_idempotent(db: Any, clock: ManualClock) -> None:
    queue, counter = await counted_queue(db, clock)
    batch = [NewTask(f"t{i}", {"i": i}, revision=1, priority=i % 2) for i in range(5)]

    assert await queue.put_many(batch) == PutManyResult(inserted=5, updated=0, unchanged=0)
    assert counter.counts == {"tasks.bulk_write": 1}
    docs = await read_all(db)
    assert sorted(docs) == [f"t{i}" for i in range(5)]
    assert all(doc["status"] == "pending" and doc["attempts"] == 0 for doc in docs.values())
    assert [docs[f"t{i}"]["payload"] for i in range(5)] == [{"i": i} for i in range(5)]
    assert docs["t3"]["priority"] == 1

    counter.reset()
    clock.advance(10)
    again = [
        NewTask("t0", {"i": 0}, revision=1),  # replay
        NewTask("t1", {"i": 1}, revision=1, priority=1),  # replay
        NewTask("t2", {"i": 20}, revision=2),  # new revision
        NewTask("t9", {"i": 9}, delay=30),  # new task
    ]
    assert await queue.put_many(again) == PutManyResult(inserted=1, updated=1, unchanged=2)
    assert counter.counts == {"tasks.bulk_write": 1}

    after = await read_all(db)
    for unchanged in ("t0", "t1", "t3", "t4"):
        assert encoded(after[unchanged]) == encoded(docs[unchanged])
    assert (after["t2"]["payload"], after["t2"]["revision"]) == ({"i": 20}, 2)
    assert after["t2"]["updated_at"] == clock.now()
    assert after["t9"]["lease_until"] == later(clock, 30)


async def test_put_many_of_nothing_sends_no_command(db: Any, clock: ManualClock) -> None:
    queue, counter = await counted_queue(db, clock)

    assert await queue.put_many([]) == PutManyResult(0, 0, 0)

    assert counter.total == 0
    assert await read_all(db) == {}


# ------------------------------------------------------------------------------ claim order


async def test_claim_takes_higher_priority_first_then_the_oldest_due(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    await queue.put("old", priority=0)
    await queue.put("half-second", priority=0, delay=0.5)
    clock.advance(1)
    await queue.put("new", priority=0)
    await queue.put("urgent", priority=5)
    await queue.put("low", priority=-1)
    await queue.put("medium", priority=1)

    assert await claim_ids(queue) == ["urgent", "medium", "old", "half-second", "new", "low"]

    docs = await read_all(db)
    assert {doc["status"] for doc in docs.values()} == {"processing"}
    assert {doc["attempts"] for doc in docs.values()} == {1}


async def test_a_retry_whose_backoff_passed_goes_before_fresh_puts(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock, backoff_base=10, backoff_cap=10)
    await queue.put("retry")
    task = await queue.claim("w")
    assert task is not None
    assert await queue.release_for_retry(task, "transient")
    clock.advance(15)  # the backoff (10 to 15 s) has passed
    await queue.put("fresh")

    assert await claim_ids(queue) == ["retry", "fresh"]
    doc = await read(db, "retry")
    assert doc is not None and (doc["attempts"], doc["error"]) == (2, "transient")


async def test_claim_returns_the_claimed_document(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    await queue.put("t1", ["payload"], revision=4, priority=2)
    clock.advance(3)

    task = await queue.claim("worker-1")

    assert task is not None
    doc = await read(db, "t1")
    assert task == Task.from_document(doc or {})
    assert (task.status, task.attempts, task.worker_id) == ("processing", 1, "worker-1")
    assert (task.payload, task.revision, task.priority) == (["payload"], 4, 2)
    assert task.lease_until == later(clock, LEASE_TTL)
    assert task.lease_token
    assert await queue.claim("worker-2") is None


async def test_delayed_task_is_claimable_only_once_the_clock_reaches_its_due_time(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    await queue.put("later", delay=10)
    due = later(clock, 10)
    doc = await read(db, "later")
    assert doc is not None and doc["lease_until"] == due

    assert await queue.claim("w") is None
    clock.advance(9.999)
    assert await queue.claim("w") is None
    doc = await read(db, "later")
    assert doc is not None and (doc["status"], doc["attempts"]) == ("pending", 0)

    clock.advance(0.001)
    task = await queue.claim("w")
    assert task is not None and task.id == "later"
    doc = await read(db, "later")
    assert doc is not None and (doc["status"], doc["attempts"]) == ("processing", 1)


async def test_claim_on_an_empty_queue_returns_none(db: Any, queue: AsyncTaskQueue) -> None:
    assert await queue.claim("w") is None
    assert await read_all(db) == {}


# ---------------------------------------------------------------------- get, requeue, remove


async def test_get_returns_the_stored_task_or_none(db: Any, queue: AsyncTaskQueue) -> None:
    await queue.put(42, {"k": "v"}, revision="r")

    task = await queue.get(42)

    assert task == Task.from_document(await read(db, 42) or {})
    assert (task.id, task.payload, task.status, task.attempts) == (42, {"k": "v"}, "pending", 0)
    assert await queue.get("missing") is None


async def test_requeue_puts_a_failed_task_back_with_fresh_attempts(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    await queue.put("t1")
    await make_failed(queue, "t1")
    clock.advance(5)

    assert await queue.requeue("t1")

    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["status"], doc["attempts"], doc["lease_until"]) == ("pending", 0, clock.now())
    assert doc["lease_token"] is None and doc["worker_id"] is None
    task = await queue.claim("w")
    assert task is not None and (task.id, task.attempts) == ("t1", 1)


@pytest.mark.parametrize("state", ["pending", "processing", "done", "missing"])
async def test_requeue_changes_nothing_unless_the_task_failed(
    db: Any, queue: AsyncTaskQueue, state: str
) -> None:
    if state != "missing":
        await queue.put("t1")
    if state == "processing":
        assert await queue.claim("w") is not None
    if state == "done":
        await make_done(queue, "t1")
    before = await read_all(db)

    assert await queue.requeue("t1") is False

    assert await read_all(db) == before


async def test_remove_tombstones_a_pending_task_which_is_then_never_claimed(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    await queue.put("t1", revision="r1")
    clock.advance(1)

    assert await queue.remove("t1")

    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["status"], doc["lease_until"], doc["updated_at"]) == (
        "tombstone",
        None,
        clock.now(),
    )
    clock.advance(3600)
    assert await queue.claim("w") is None
    assert await queue.remove("t1") is False  # already a tombstone
    assert (await read(db, "t1") or {})["updated_at"] == later(clock, -3600)


async def test_removing_a_held_task_makes_its_holder_lose(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    await queue.put("t1")
    held = await queue.claim("w")
    assert held is not None
    assert await queue.remove("t1")
    tombstone = await read(db, "t1")

    assert await queue.heartbeat(held) is False
    assert await queue.complete(held, "late") is False
    assert await queue.fail(held, "late") is False

    assert await read(db, "t1") == tombstone
    assert tombstone is not None and tombstone["status"] == "tombstone"
    clock.advance(LEASE_TTL * 2)
    assert await queue.claim("w") is None
    assert await queue.reclaim_expired() == ReclaimResult(failed=0, requeued=0)
    assert await read(db, "t1") == tombstone


async def test_a_put_with_a_new_revision_revives_a_tombstone(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    await queue.put("t1", {"v": 1}, revision="r1")
    await queue.remove("t1")
    tombstone = await read(db, "t1")

    assert await queue.put("t1", {"v": 1}, revision="r1") == "unchanged"
    assert await read(db, "t1") == tombstone

    clock.advance(1)
    assert await queue.put("t1", {"v": 2}, revision="r2") == "updated"
    doc = await read(db, "t1")
    assert doc is not None
    assert (doc["status"], doc["attempts"], doc["payload"]) == ("pending", 0, {"v": 2})
    assert doc["lease_until"] == clock.now()
    task = await queue.claim("w")
    assert task is not None and task.revision == "r2"


# ----------------------------------------------------------------------------------- stats


async def test_stats_counts_each_status_and_the_oldest_due_age(
    db: Any, queue: AsyncTaskQueue, clock: ManualClock
) -> None:
    await queue.put("expired")
    await claim_one(queue, expect="expired")
    clock.advance(LEASE_TTL + 10)  # its lease ran out 10 s ago
    await queue.put("oldest-due")
    clock.advance(15)
    await queue.put("due")
    await queue.put("not-due", delay=60)
    # Distinct priorities put these first, in this order, ahead of the expired lease.
    for priority, task_id in enumerate(["removed", "failed", "done", "live"], start=1):
        await queue.put(task_id, priority=priority)
    await claim_one(queue, expect="live")
    await make_done(queue, "done")
    await make_failed(queue, "failed")
    await claim_one(queue, expect="removed")
    assert await queue.remove("removed")
    await queue.put("cancelled", delay=3600)
    assert await queue.cancel("cancelled")

    stats = await queue.stats()

    docs = await read_all(db)
    assert {task_id: doc["status"] for task_id, doc in docs.items()} == {
        "expired": "processing",
        "live": "processing",
        "done": "done",
        "failed": "failed",
        "removed": "tombstone",
        "cancelled": "cancelled",
        "oldest-due": "pending",
        "due": "pending",
        "not-due": "pending",
    }
    assert stats.counts == {
        "pending": 3,
        "processing": 2,
        "done": 1,
        "failed": 1,
        "cancelled": 1,
        "tombstone": 1,
    }
    assert stats.due == 2
    assert stats.expired == 1
    assert stats.oldest_due_age == 15.0


async def test_stats_of_an_empty_queue(db: Any, queue: AsyncTaskQueue) -> None:
    stats = await queue.stats()

    assert stats.counts == dict.fromkeys(
        ["pending", "processing", "done", "failed", "cancelled", "tombstone"], 0
    )
    assert (stats.due, stats.expired, stats.oldest_due_age) == (0, 0, None)
    assert stats.unknown_functions == {}
    assert await read_all(db) == {}


async def test_stats_costs_the_same_few_commands_whatever_the_queue_size(
    db: Any, clock: ManualClock
) -> None:
    queue, counter = await counted_queue(db, clock)
    await queue.stats()
    empty_cost = counter.total
    await queue.put_many([NewTask(f"t{i}") for i in range(30)])
    for _ in range(10):
        await claim_one(queue)
    counter.reset()

    stats = await queue.stats()

    # A count per status, due, expired, the oldest, the live workers' functions.
    assert counter.total == empty_cost <= 10
    assert stats.counts["pending"] == 20 and stats.counts["processing"] == 10
    docs = await read_all(db)
    assert sum(doc["status"] == "pending" for doc in docs.values()) == 20

    # With a worker live and tasks due, one bounded aggregation more: which wait for others.
    await queue._presence.announce("w1", ["other"], 60)
    counter.reset()
    assert (await queue.stats()).unknown_functions == {"": 20}  # plain tasks: no Jobs runs them
    assert counter.total == empty_cost + 1


# --------------------------------------------------------------------------------- indexes


async def test_setup_creates_the_claim_lease_and_partial_ttl_indexes(
    db: Any, clock: ManualClock
) -> None:
    queue = AsyncTaskQueue(db, "tasks", clock=clock)
    await queue.put("t1")
    before = await read_all(db)
    assert set(await db["tasks"].index_information()) == {"_id_"}

    await queue.setup()
    await queue.setup()  # idempotent

    indexes = await db["tasks"].index_information()
    # The claim's sort, served by one index range (see the module docstring).
    assert list(indexes["claim"]["key"]) == [("priority", -1), ("lease_until", 1)]
    assert list(indexes["status_lease"]["key"]) == [("status", 1), ("lease_until", 1)]
    assert list(indexes["status_updated"]["key"]) == [("status", 1), ("updated_at", 1), ("_id", 1)]
    assert "expireAfterSeconds" not in indexes["claim"]
    assert "expireAfterSeconds" not in indexes["status_lease"]
    # No TTL index is ever bare: a bare one would delete the whole queue.
    ttl_indexes = {name for name, spec in indexes.items() if "expireAfterSeconds" in spec}
    if _driver.backend_of(db) is _driver.Backend.MEMORY:
        # mongomock's TTL ignores partialFilterExpression (and runs on the wall clock), so the
        # library creates no TTL index there rather than a bare one.
        assert set(indexes) == {"_id_", "claim", "status_lease", "status_updated"}
        assert ttl_indexes == set()
    else:
        # No retention set: no retain_done / retain_failed index (tests/tasks/test_operators).
        assert set(indexes) == {"_id_", "claim", "status_lease", "status_updated", "tombstone_ttl"}
        assert ttl_indexes == {"tombstone_ttl"}
        ttl = indexes["tombstone_ttl"]
        assert list(ttl["key"]) == [("updated_at", 1)]
        assert ttl["expireAfterSeconds"] == 30 * 24 * 3600
        assert ttl["partialFilterExpression"] == {"status": "tombstone"}
    # The running workers' presences: every document expires, an hour past its `expires` (a
    # clean-up only; readers filter on `expires` themselves).
    presences = await db["tasks_workers"].index_information()
    assert list(presences["expires"]["key"]) == [("expires", 1)]
    expected = None if _driver.backend_of(db) is _driver.Backend.MEMORY else 3600
    assert presences["expires"].get("expireAfterSeconds") == expected
    assert await read_all(db) == before


async def test_a_ttl_index_without_a_partial_filter_must_say_it_covers_everything(
    db: Any,
) -> None:
    careless = IndexSpec("gone", (("updated_at", 1),), ttl=True)
    with pytest.raises(ValueError, match="partial filter"):
        await create_indexes(db, db["tasks"], (careless,), expiries={"gone": 60})
    assert "gone" not in await db["tasks"].index_information()
