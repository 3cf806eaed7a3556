"""The task queue's operator calls: listings with a stable cursor, bulk requeue of failed tasks,
purge of finished ones, and retention by partial TTL indexes."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from mongoq import AsyncTaskQueue, InvalidInput, Task, _driver
from mongoq.testing import ManualClock
from tests.support.group_helpers import new_transport
from tests.support.helpers import claim_one, every_page, new_queue, read, read_all, utc

STATES = ("pending", "processing", "done", "failed", "tombstone")


async def one_task_in_each_state(queue: AsyncTaskQueue, clock: ManualClock) -> None:
    """Tasks named after the state they end in (two of each), changed a second apart."""
    for n in range(2):
        for state in STATES:
            await queue.put(f"{state}-{n}", {"n": n})
            clock.advance(1)
    for n in range(2):
        for state in ("processing", "done", "failed"):
            task = await claim_one(queue, expect=None)
            while task.id != f"{state}-{n}":  # claims in put order; give others back
                assert await queue.release_not_an_attempt(task, delay=3600)
                task = await claim_one(queue, expect=None)
            if state == "done":
                assert await queue.complete(task, "ok")
            elif state == "failed":
                assert await queue.fail(task, "broken")
            clock.advance(1)
        assert await queue.remove(f"tombstone-{n}")
    for n in range(2):  # the pending ones given back above: due again now
        await queue.put(f"pending-{n}", {"n": n}, revision="again")


@pytest.fixture
async def seeded(db: Any, clock: ManualClock) -> AsyncTaskQueue:
    """A queue with two tasks in each state (see `one_task_in_each_state`)."""
    queue = await new_queue(db, clock)
    await one_task_in_each_state(queue, clock)
    return queue


async def list_all(queue: AsyncTaskQueue, status: Any = None, limit: int = 3) -> list[Task]:
    return await every_page(
        lambda after: queue.list_tasks(status, limit=limit, after=after), "tasks", limit
    )


def in_list_order(docs: list[dict[str, Any]]) -> list[Any]:
    """Ids in the listing's order: updated_at, then id, numbers before strings (as BSON)."""
    return [
        d["_id"]
        for d in sorted(docs, key=lambda d: (d["updated_at"], isinstance(d["_id"], str), d["_id"]))
    ]


async def test_pages_with_equal_sort_keys_list_every_task_once_in_a_stable_order(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    ids: list[Any] = [*range(7), "a", "b", "c", 10, "d", 3_000_000_000]
    for task_id in ids:  # all at one instant: only the id orders them
        await queue.put(task_id, None)

    for limit in (1, 2, 3, 5, 13, 100):
        listed = [task.id for task in await list_all(queue, limit=limit)]
        assert listed == [0, 1, 2, 3, 4, 5, 6, 10, 3_000_000_000, "a", "b", "c", "d"]
    docs = await read_all(db)
    assert in_list_order(list(docs.values())) == [t.id for t in await list_all(queue)]


async def test_each_status_lists_exactly_the_tasks_the_database_holds_in_it(
    db: Any, seeded: AsyncTaskQueue
) -> None:
    queue = seeded
    docs = list((await read_all(db)).values())

    for state in STATES:
        expected = in_list_order([d for d in docs if d["status"] == state])
        listed = await list_all(queue, state, limit=1)
        assert [task.id for task in listed] == expected, state
        assert {task.status for task in listed} <= {state}
        assert len(expected) == 2
    assert [t.id for t in await list_all(queue, limit=4)] == in_list_order(docs)
    failed = await queue.list_tasks("failed")
    assert [(t.error, t.attempts) for t in failed.tasks] == [("broken", 1), ("broken", 1)]


@pytest.mark.parametrize(
    "start",
    [
        datetime(2039, 4, 19, 16, 9, 14, 68000, tzinfo=UTC),
        datetime(1969, 7, 20, 20, 17, tzinfo=UTC),
    ],
    ids=["after-2038", "before-1970"],
)
async def test_pages_continue_at_any_instant_the_clock_shows(db: Any, start: datetime) -> None:
    """The cursor's milliseconds are whole numbers of the instant (no float rounding: past
    2038 a float is off by one for some instants, and a page then repeats forever)."""
    clock = ManualClock(start)
    queue = await new_queue(db, clock)
    for task_id in ("a", "b", "c"):  # one instant: the id orders them
        await queue.put(task_id, None)
    listed = [task.id for task in await list_all(queue, limit=1)]
    assert listed == ["a", "b", "c"]


async def test_a_task_changed_between_pages_moves_to_the_end(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock)
    for task_id in ("a", "b", "c"):
        await queue.put(task_id, None)
        clock.advance(1)
    first = await queue.list_tasks(limit=1)
    assert [t.id for t in first.tasks] == ["a"]
    await queue.put("a", {"changed": True}, revision=2)  # now the most recently changed

    page = await queue.list_tasks(limit=5, after=first.next)
    rest = [t.id for t in page.tasks]
    assert rest == ["b", "c", "a"] and page.next is None


#: Bad arguments of `list_tasks` and `list_groups` (tests/groups/test_listing.py), and the
#: field each error must name.
BAD_LISTINGS = [
    ("tasks", {"status": "finished"}, "status"),
    ("tasks", {"after": "yesterday"}, "after"),
    ("tasks", {"after": "12:x:id"}, "after"),
    ("tasks", {"after": "12:i:not-a-number"}, "after"),
    ("tasks", {"after": "²:i:1"}, "after"),  # a digit to str.isdigit, not to int()
    ("tasks", {"after": "99999999999999999:i:1"}, "after"),  # past year 9999
    ("tasks", {"after": "1:i:1\nx"}, "after"),
    ("groups", {"state": "stuck"}, "state"),
    ("groups", {"after": "x:1"}, "after"),
    ("groups", {"after": "i:one"}, "after"),
    *((kind, {"limit": limit}, "limit") for kind in ("tasks", "groups") for limit in (0, 1001)),
    *((kind, {"after": 12}, "after") for kind in ("tasks", "groups")),
]


@pytest.mark.parametrize(("kind", "arguments", "field"), BAD_LISTINGS)
async def test_a_listing_with_bad_arguments_names_the_field(
    db: Any, clock: ManualClock, kind: str, arguments: dict[str, Any], field: str
) -> None:
    listing = (
        (await new_queue(db, clock)).list_tasks
        if kind == "tasks"
        else (await new_transport(db, clock)).list_groups
    )
    with pytest.raises(InvalidInput) as caught:
        await listing(**arguments)
    assert caught.value.field == field


async def test_requeue_failed_puts_failed_tasks_back_with_fresh_attempts(
    db: Any, clock: ManualClock, seeded: AsyncTaskQueue
) -> None:
    queue = seeded
    before = await read_all(db)

    assert await queue.requeue_failed(["failed-0", "done-0", "missing"]) == 1
    assert await queue.requeue_failed() == 1  # the other one
    assert await queue.requeue_failed() == 0

    after = await read_all(db)
    for n in range(2):
        doc = after[f"failed-{n}"]
        assert (doc["status"], doc["attempts"], utc(doc["lease_until"])) == (
            "pending",
            0,
            clock.now(),
        )
    untouched = {k: v for k, v in after.items() if not k.startswith("failed")}
    assert untouched == {k: v for k, v in before.items() if not k.startswith("failed")}
    with pytest.raises(InvalidInput, match=r"^task_ids\[0\]: "):
        await queue.requeue_failed([{"$gt": ""}])


async def test_purge_deletes_finished_tasks_older_than_asked_and_nothing_else(
    db: Any, clock: ManualClock, seeded: AsyncTaskQueue
) -> None:
    queue = seeded
    docs = await read_all(db)
    done_times = sorted(utc(docs[f"done-{n}"]["updated_at"]) for n in range(2))
    age_of_first = clock.now() - done_times[0]

    # Older than the second done task, younger than the first: only the first goes.
    assert await queue.purge("done", older_than=age_of_first.total_seconds() - 0.5) == 1
    assert await queue.purge("failed", older_than=3600) == 0
    assert await queue.purge("tombstone", older_than=0) == 1  # the other changed just now
    clock.advance(1)
    assert await queue.purge("tombstone", older_than=0) == 1

    left = await read_all(db)
    assert set(docs) - set(left) == {"done-0", "tombstone-0", "tombstone-1"}
    for status in ("pending", "processing"):
        with pytest.raises(
            InvalidInput, match=r"^status: must be one of done, failed, cancelled, tombstone"
        ):
            await queue.purge(status, older_than=0)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=r"^older_than: "):
        await queue.purge("done", older_than=-1)
    assert await read_all(db) == left


async def test_retention_creates_partial_ttl_indexes_and_a_queue_without_it_leaves_them(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(
        db, clock, retain_done=3600, retain_failed=7 * 86400, retain_cancelled=86400
    )
    await queue.put("t", None)
    indexes = await db["tasks"].index_information()
    if _driver.backend_of(db) is _driver.Backend.MEMORY:
        # The embedded backend's TTL ignores partial filters: no TTL index at all there.
        assert not {"retain_done", "retain_failed", "retain_cancelled", "tombstone_ttl"} & set(
            indexes
        )
        return
    assert indexes["retain_cancelled"]["expireAfterSeconds"] == 86400
    assert indexes["retain_cancelled"]["partialFilterExpression"] == {"status": "cancelled"}
    assert (indexes["retain_done"]["expireAfterSeconds"], indexes["retain_failed"]
            ["expireAfterSeconds"]) == (3600, 7 * 86400)  # fmt: skip
    assert indexes["retain_done"]["partialFilterExpression"] == {"status": "done"}
    assert indexes["retain_failed"]["partialFilterExpression"] == {"status": "failed"}
    assert list(indexes["retain_done"]["key"]) == [("updated_at", 1)]

    changed = AsyncTaskQueue(db, "tasks", clock=clock, retain_done=60)
    await changed.setup()
    indexes = await db["tasks"].index_information()
    assert indexes["retain_done"]["expireAfterSeconds"] == 60  # changed in place
    # A queue that does not set it (a producer's set-up) leaves the workers' index alone.
    assert indexes["retain_failed"]["expireAfterSeconds"] == 7 * 86400
    await AsyncTaskQueue(db, "tasks", clock=clock).setup()
    after = await db["tasks"].index_information()
    assert (after["retain_done"]["expireAfterSeconds"], after["retain_failed"]
            ["expireAfterSeconds"]) == (60, 7 * 86400)  # fmt: skip
    assert await read(db, "t") is not None


@pytest.mark.parametrize("bad", [0, -5, "1d"])
def test_a_retention_must_be_a_positive_number_of_seconds(bad: Any) -> None:
    from mongoq.testing import memory_database

    for field in ("retain_done", "retain_failed", "retain_cancelled"):
        with pytest.raises(InvalidInput, match=f"^{field}: "):
            AsyncTaskQueue(memory_database(), "tasks", **{field: bad})
