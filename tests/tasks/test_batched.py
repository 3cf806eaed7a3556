"""AsyncTaskQueue's batched forms: `claim_many`, `complete_many`, `heartbeat_many` and
`run(..., batch_size=N)`.

The batched forms must cost a small fixed number of commands whatever the batch size, and keep
every guarantee of the single forms: claim order, one holder per task under every interleaving
of two claimers' commands, settles fenced on the claim (a batch that lost some leases completes
only the ones it holds and says which), the revision race, and recovery after a command failed
before it applied or applied with its reply lost. Assertions read the stored documents.

What the batch slot of `run(batch_size=N)` promises whatever the primitive (lost items never
started nor settled, every item counted once, a cancellation settling what it holds) is tested
once against a fake holder in tests/runtime/test_batch.py; here, the task queue's side of it:
which fenced commands it sends, what they write to the tasks, and the counts `run` reports.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from pymongo.errors import AutoReconnect, NetworkTimeout

from mongoq import (
    AsyncTaskQueue,
    InvalidInput,
    NewTask,
    PermanentError,
    ReclaimResult,
    Task,
    TaskRunSummary,
)
from mongoq._validation import MAX_BATCH
from mongoq.runtime.loop import WORKER_STOPPED
from mongoq.testing import (
    CommandCounter,
    FaultInjector,
    Hook,
    ManualClock,
    Operation,
    instrument,
)
from tests.support.helpers import (
    LEASE_TTL,
    Actors,
    Bookkeeping,
    InFlight,
    claim_one,
    encoded,
    later,
    new_queue,
    nth,
    race,
    read,
    read_all,
    unexpected_errors,
    wait_for,
)

HEARTBEAT = LEASE_TTL / 3


def ids(tasks: list[Task]) -> list[Any]:
    return [task.id for task in tasks]


async def put_in_order(
    queue: AsyncTaskQueue, clock: ManualClock, names: list[str], **fields: Any
) -> None:
    """Put `names` due a millisecond apart (`fields` as in `NewTask`), then advance the clock
    past them all: their claim order is `names` on every backend (tasks due at the same
    instant tie, and backends break ties differently)."""
    await queue.put_many(
        [NewTask(name, delay=index / 1000, **fields) for index, name in enumerate(names)]
    )
    clock.advance(1)


async def put_ids(queue: AsyncTaskQueue, clock: ManualClock, count: int) -> list[str]:
    """`count` tasks, ``{"n": id}`` as payload, in claim order."""
    names = [f"t{i:03}" for i in range(count)]
    await queue.put_many(
        [NewTask(name, {"n": name}, delay=index / 1000) for index, name in enumerate(names)]
    )
    clock.advance(1)
    return names


async def drain_batched(
    queue: AsyncTaskQueue, n: int = 10, worker: str = "rescuer", result: Any = "rescued"
) -> list[Task]:
    """Claim and complete in batches until nothing is due; every completion must take effect."""
    delivered: list[Task] = []
    for _ in range(1000):
        batch = await queue.claim_many(n, worker)
        if not batch:
            return delivered
        delivered.extend(batch)
        assert await queue.complete_many(batch, [result] * len(batch)) == [True] * len(batch)
    raise AssertionError("drain did not end")


async def counted_queue(
    db: Any, clock: ManualClock, *hooks: Hook, record: bool = False, **options: Any
) -> tuple[AsyncTaskQueue, CommandCounter]:
    """A queue on `db` (`options` as for `new_queue`) whose commands go through `hooks`, then a
    counter returned with it (which keeps the commands too, with `record`)."""
    counter = CommandCounter()
    counter.record = record
    return await new_queue(instrument(db, *hooks, counter), clock, **options), counter


async def faulty_queue(
    db: Any, clock: ManualClock, **options: Any
) -> tuple[AsyncTaskQueue, FaultInjector]:
    """A queue on `db` (`options` as for `new_queue`) whose commands a fault injector can fail."""
    faults = FaultInjector()
    return await new_queue(instrument(db, faults), clock, **options), faults


#: Where an injected fault strikes a command: before it applied, or after (its reply lost).
WHEN = pytest.mark.parametrize("when", ["before", "after"])


def inject(faults: FaultInjector, when: str, name: str, **rule: Any) -> type[Exception]:
    """Fail the next `name` command (`rule` as for `FaultInjector.fail_before`) `when` it says:
    "before" it applied or "after". The error its caller then sees."""
    if when == "before":
        faults.fail_before(name, **rule)
        return AutoReconnect
    faults.fail_after(name, **rule)
    return NetworkTimeout


async def put_and_claim(
    queue: AsyncTaskQueue, clock: ManualClock, count: int, worker: str = "w"
) -> list[Task]:
    """`count` tasks put as by `put_ids`, all claimed by `worker` in one batch."""
    await put_ids(queue, clock, count)
    batch = await queue.claim_many(count, worker)
    assert len(batch) == count
    return batch


async def snapshot(db: Any) -> dict[Any, bytes]:
    """Every stored task, byte for byte, by id."""
    return {key: encoded(doc) for key, doc in (await read_all(db)).items()}


async def assert_unchanged(db: Any, stored: dict[Any, bytes]) -> None:
    """The tasks of `stored` (by id) are stored byte for byte as they were."""
    for task_id, before in stored.items():
        assert encoded(await read(db, task_id)) == before, task_id


def assert_held(doc: dict[str, Any] | None, task: Task) -> None:
    """The stored task is processing under `task`'s claim, exactly as the claim returned it."""
    assert doc is not None
    assert doc["status"] == "processing"
    assert (doc["worker_id"], doc["lease_token"]) == (task.worker_id, task.lease_token)
    assert (doc["attempts"], doc["lease_until"]) == (task.attempts, task.lease_until)


# ---------------------------------------------------------------------------- command counts


@pytest.mark.parametrize("n", [1, 7, 50])
async def test_claim_many_costs_two_commands_whatever_n(
    db: Any, clock: ManualClock, n: int
) -> None:
    queue, counter = await counted_queue(db, clock)
    names = await put_ids(queue, clock, 60)
    clock.advance(1)
    counter.reset()

    batch = await queue.claim_many(n, "w")

    # The candidates and the claim; no read-back: the claim took every candidate.
    assert counter.total == 2, counter.counts
    assert counter.counts == {"tasks.find": 1, "tasks.update_many": 1}
    assert ids(batch) == names[:n]
    (token,) = {task.lease_token for task in batch}  # one claim token for the whole batch
    assert token is not None
    docs = await read_all(db)
    for task in batch:
        assert (task.status, task.attempts, task.worker_id) == ("processing", 1, "w")
        assert task.lease_until == later(clock, LEASE_TTL)
        assert task.payload == {"n": task.id}
        assert_held(docs[task.id], task)
        assert docs[task.id]["updated_at"] == clock.now()
    for name in names[n:]:
        assert (docs[name]["status"], docs[name]["attempts"]) == ("pending", 0)
        assert docs[name]["lease_token"] is None


async def test_claim_many_with_nothing_due_costs_one_command_and_writes_nothing(
    db: Any, clock: ManualClock
) -> None:
    queue, counter = await counted_queue(db, clock)
    await queue.put("later", delay=60)
    before = await read(db, "later")
    counter.reset()

    assert await queue.claim_many(10, "w") == []

    assert counter.counts == {"tasks.find": 1}
    assert encoded(await read(db, "later")) == encoded(before)


async def test_complete_many_costs_one_command_when_every_task_is_held(
    db: Any, clock: ManualClock
) -> None:
    queue, counter = await counted_queue(db, clock)
    batch = await put_and_claim(queue, clock, 20)
    clock.advance(7)
    counter.reset()

    done = await queue.complete_many(batch, [{"r": task.id} for task in batch])

    assert done == [True] * 20
    assert counter.counts == {"tasks.bulk_write": 1}
    for task in batch:
        doc = await read(db, task.id)
        assert doc is not None
        assert (doc["status"], doc["attempts"], doc["result"]) == ("done", 1, {"r": task.id})
        assert (doc["lease_until"], doc["updated_at"]) == (None, clock.now())
        assert doc["lease_token"] == task.lease_token  # the claim that completed it


async def test_heartbeat_many_costs_one_command_and_extends_every_lease(
    db: Any, clock: ManualClock
) -> None:
    """Every lease still held: one update, and no read to tell which."""
    queue, counter = await counted_queue(db, clock)
    batch = await put_and_claim(queue, clock, 5)
    clock.advance(HEARTBEAT)
    counter.reset()

    assert await queue.heartbeat_many(batch) == [True] * 5

    assert counter.counts == {"tasks.update_many": 1}
    for doc in (await read_all(db)).values():
        assert (doc["status"], doc["lease_until"]) == ("processing", later(clock, LEASE_TTL))
        assert doc["updated_at"] == clock.now()


@pytest.mark.parametrize("call", ["complete_many", "heartbeat_many"])
async def test_an_empty_batch_costs_nothing_and_one_over_the_limit_is_refused_before_any_command(
    db: Any, clock: ManualClock, call: str
) -> None:
    """An empty batch sends nothing. MAX_BATCH + 1 tasks (the same claimed task repeated: the
    size alone is refused) raise InvalidInput naming the argument, and nothing is sent;
    MAX_BATCH itself is accepted."""
    queue, counter = await counted_queue(db, clock)
    (task,) = await put_and_claim(queue, clock, 1)
    before = await snapshot(db)
    method = getattr(queue, call)
    counter.reset()

    assert await method([]) == []
    with pytest.raises(
        InvalidInput, match=f"^tasks: at most {MAX_BATCH} per call, got {MAX_BATCH + 1}$"
    ):
        await method([task] * (MAX_BATCH + 1))

    assert counter.total == 0
    assert await snapshot(db) == before
    clock.advance(1)
    assert await method([task] * MAX_BATCH) == [True] * MAX_BATCH
    doc = await read(db, task.id)
    assert doc is not None and doc["updated_at"] == clock.now()


async def test_a_batched_lifecycle_costs_at_most_a_tenth_of_a_command_per_task(
    db: Any, clock: ManualClock
) -> None:
    queue, counter = await counted_queue(db, clock)
    counter.reset()

    names = await put_ids(queue, clock, 100)
    batch = await queue.claim_many(100, "w")
    done = await queue.complete_many(batch, [task.id for task in batch])

    assert done == [True] * 100
    assert counter.total / 100 <= 0.1, counter.counts
    assert counter.total == 4  # put_many 1, claim_many 2, complete_many 1
    docs = await read_all(db)
    assert sorted(docs) == names
    assert all((doc["status"], doc["result"]) == ("done", key) for key, doc in docs.items())


# ------------------------------------------------------------------------------------ order


async def test_claim_many_returns_tasks_in_claim_order(db: Any, clock: ManualClock) -> None:
    """Priority first, then the task due longest; a task not due yet is not taken. The batch is
    the order successive single claims take on the same tasks."""
    queues = [await new_queue(db, clock, name=name) for name in ("batched", "single")]
    for queue in queues:
        await queue.put("old", priority=0)
        await queue.put("half-second", priority=0, delay=0.5)
        await queue.put("not-yet", priority=9, delay=60)
    clock.advance(1)
    for queue in queues:
        await queue.put("new", priority=0)
        await queue.put("urgent", priority=5)
        await queue.put("low", priority=-1)
        await queue.put("medium", priority=1)
    batched, single = queues

    batch = await batched.claim_many(10, "w")

    expected = ["urgent", "medium", "old", "half-second", "new", "low"]
    assert ids(batch) == expected
    singles = [await single.claim("w") for _ in expected]
    assert [task.id for task in singles if task is not None] == expected
    assert await single.claim("w") is None
    docs = await read_all(db, "batched")
    assert (docs["not-yet"]["status"], docs["not-yet"]["attempts"]) == ("pending", 0)
    assert {docs[name]["status"] for name in expected} == {"processing"}


async def test_claim_many_takes_the_most_urgent_n_and_leaves_the_rest(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put_many([NewTask(f"p{i}", priority=i % 3, delay=i / 1000) for i in range(9)])
    clock.advance(1)

    first = await queue.claim_many(4, "w")
    second = await queue.claim_many(4, "w")
    third = await queue.claim_many(4, "w")

    assert ids(first) == ["p2", "p5", "p8", "p1"]
    assert ids(second) == ["p4", "p7", "p0", "p3"]
    assert ids(third) == ["p6"]
    assert len({task.lease_token for task in first + second + third}) == 3
    assert await queue.claim_many(4, "w") == []


async def test_claim_many_takes_over_expired_leases_with_attempts_to_spare(
    db: Any, clock: ManualClock
) -> None:
    """An expired lease is taken over like by `claim` (one more attempt); an expired lease on
    the last attempt is not (reclaim_expired buries it); a live lease is left alone."""
    queue = await new_queue(db, clock, max_attempts=2)
    await queue.put("exhausted")
    await claim_one(queue, "A", expect="exhausted")
    clock.advance(LEASE_TTL + 1)
    exhausted = await claim_one(queue, "A", expect="exhausted")  # its second (last) attempt
    await queue.put("crashed")
    clock.advance(0.001)
    await queue.put("live")
    crashed = await claim_one(queue, "A", expect="crashed")
    live = await claim_one(queue, "A", expect="live")
    clock.advance(LEASE_TTL + 1)
    assert await queue.heartbeat(live)

    batch = await queue.claim_many(10, "B")

    assert [(task.id, task.attempts) for task in batch] == [("crashed", 2)]
    assert crashed.lease_token != batch[0].lease_token
    docs = await read_all(db)
    assert_held(docs["crashed"], batch[0])
    assert (docs["exhausted"]["lease_token"], docs["exhausted"]["attempts"]) == (
        exhausted.lease_token,
        2,
    )
    assert (docs["live"]["lease_token"], docs["live"]["worker_id"]) == (live.lease_token, "A")
    assert await queue.reclaim_expired() == ReclaimResult(failed=1, requeued=0)


# ------------------------------------------------------------------------------ exclusivity


async def assert_one_holder_each(
    db: Any, clock: ManualClock, name: str, claimed: dict[str, list[Task]], universe: list[str]
) -> None:
    """No task is in two claimers' batches; each claimed task is stored under its claimer's
    token with one attempt; every other task is still claimable (pending, due)."""
    taken = [task.id for tasks in claimed.values() for task in tasks]
    assert len(taken) == len(set(taken)), f"shared: {taken}"
    docs = await read_all(db, name)
    for worker, tasks in claimed.items():
        for task in tasks:
            assert task.worker_id == worker
            assert_held(docs[task.id], task)
            assert task.attempts == 1
    for task_id in set(universe) - set(taken):
        doc = docs[task_id]
        assert (doc["status"], doc["attempts"], doc["lease_token"]) == ("pending", 0, None)
        assert doc["lease_until"] <= clock.now()


async def test_two_batch_claimers_never_share_a_task_in_any_order(
    db: Any, clock: ManualClock
) -> None:
    """A and B each ask for 2 of 3 tasks; every order of their 3 + 3 commands. A candidate
    the other took in between is simply not returned; nothing is taken twice, and what
    neither took stays claimable."""
    universe = ["t1", "t2", "t3"]

    async def setup(queue: AsyncTaskQueue) -> Actors:
        await put_in_order(queue, clock, universe)
        return {"A": lambda: queue.claim_many(2, "A"), "B": lambda: queue.claim_many(2, "B")}

    async def check(queue: AsyncTaskQueue, results: dict[str, Any]) -> str:
        await assert_one_holder_each(db, clock, queue.name, results, universe)
        for tasks in results.values():  # each batch in claim order
            assert ids(tasks) == sorted(ids(tasks))
        # Whatever is left is claimable at once by a third worker.
        left = await queue.claim_many(10, "C")
        assert sorted(ids(left) + [t.id for ts in results.values() for t in ts]) == universe
        return f"A {''.join(ids(results['A'])) or '-'} / B {''.join(ids(results['B'])) or '-'}"

    outcomes = await race(db, clock, {"A": 3, "B": 3}, setup, check)
    # Whoever claims first gets t1 and t2. The other gets t3 in every order: had it read its
    # candidates before that claim (6 orders of 10), its claim matched nothing and it read
    # again, past them, instead of reporting nothing while t3 was due.
    assert outcomes == {"A t1t2 / B t3": 10, "A t3 / B t1t2": 10}


async def test_a_batch_claimer_and_a_single_claimer_never_share_a_task_in_any_order(
    db: Any, clock: ManualClock
) -> None:
    universe = ["t1", "t2", "t3", "t4"]

    async def setup(queue: AsyncTaskQueue) -> Actors:
        await put_in_order(queue, clock, universe)

        async def single() -> list[Task]:
            task = await queue.claim("S")
            return [] if task is None else [task]

        return {"A": lambda: queue.claim_many(3, "A"), "S": single}

    async def check(queue: AsyncTaskQueue, results: dict[str, Any]) -> str:
        await assert_one_holder_each(db, clock, queue.name, results, universe)
        assert len(results["S"]) == 1  # a single claim always finds a due task here
        return f"A {''.join(ids(results['A']))} / S {results['S'][0].id}"

    outcomes = await race(db, clock, {"A": 3, "S": 1}, setup, check)
    assert sum(outcomes.values()) == 4
    # S first: S takes t1, A the next three. S between A's read and A's claim: S takes t1
    # and A gets only the two others it had read. S after A's claim: S takes t4.
    assert outcomes == {"A t2t3t4 / S t1": 1, "A t2t3 / S t1": 1, "A t1t2t3 / S t4": 2}


#: A's call on its expired batch: the call, the commands it sends, and in how many orders of the
#: race A is told True for all three tasks (B took none) or for one (B took two).
STALE_BATCH_CALLS: dict[
    str, tuple[Callable[[AsyncTaskQueue, list[Task]], Awaitable[list[bool]]], int, dict[str, int]]
] = {
    # B takes t1 and t2 only if both its read and its claim come before A's bulk write.
    "complete_many": (
        lambda queue, stale: queue.complete_many(stale, ["A"] * 3),
        3,
        {"A told True for 3, B took 0": 16, "A told True for 1, B took 2": 4},
    ),
    # B takes two only if its read and its claim both come before A's update (3 orders of 10).
    "heartbeat_many": (
        lambda queue, stale: queue.heartbeat_many(stale),
        2,
        {"A told True for 3, B took 0": 7, "A told True for 1, B took 2": 3},
    ),
}


@pytest.mark.parametrize("call", list(STALE_BATCH_CALLS))
async def test_an_expired_batch_settling_while_a_batch_claimer_takes_over_tells_which(
    db: Any, clock: ManualClock, call: str
) -> None:
    """A's leases on t1..t3 expired; A completes (or heartbeats) them while B claims two. Per
    task, A's answer is True exactly when A's call took effect (the task completed by A, or
    A's lease extended) and B does not hold the task: never both, never neither."""
    settle_stale, commands, expected = STALE_BATCH_CALLS[call]

    async def setup(queue: AsyncTaskQueue) -> Actors:
        await queue.put_many([NewTask(f"t{i}") for i in (1, 2, 3)])
        stale = await queue.claim_many(3, "A")
        clock.advance(LEASE_TTL + 1)

        async def settle() -> tuple[list[Task], list[bool]]:
            return stale, await settle_stale(queue, stale)

        return {"A": settle, "B": lambda: queue.claim_many(2, "B")}

    async def check(queue: AsyncTaskQueue, results: dict[str, Any]) -> str:
        stale, answers = results["A"]
        taken: list[Task] = results["B"]
        docs = await read_all(db, queue.name)
        by_b = {task.id: task for task in taken}
        for task, ok in zip(stale, answers, strict=True):
            doc = docs[task.id]
            if not ok:
                assert task.id in by_b, f"{task.id}: A told False, B does not hold it"
                assert_held(doc, by_b[task.id])
                assert (doc["attempts"], doc["result"]) == (2, None)
                continue
            assert task.id not in by_b
            if call == "complete_many":
                assert (doc["status"], doc["result"], doc["lease_token"]) == (
                    "done",
                    "A",
                    task.lease_token,
                )
            else:
                assert (doc["status"], doc["lease_token"], doc["attempts"]) == (
                    "processing",
                    task.lease_token,
                    1,
                )
                assert doc["lease_until"] == later(clock, LEASE_TTL)
        return f"A told True for {sum(answers)}, B took {len(taken)}"

    outcomes = await race(db, clock, {"A": commands, "B": 3}, setup, check)
    assert outcomes == expected


# ---------------------------------------------------------------------- a batch losing leases


async def lose_two_of_four(
    db: Any, clock: ManualClock
) -> tuple[AsyncTaskQueue, CommandCounter, list[Task], dict[Any, bytes]]:
    """A claims t1..t4; its leases expire; B takes two of them over and completes one.
    Returns the queue, its command counter (reset once all that is done), A's batch and the
    stored bytes of the two stolen tasks."""
    queue, counter = await counted_queue(db, clock)
    await put_in_order(queue, clock, ["t1", "t2", "t3", "t4"])
    batch = await queue.claim_many(4, "A")
    assert ids(batch) == ["t1", "t2", "t3", "t4"]
    clock.advance(LEASE_TTL + 1)
    thief = await queue.claim_many(2, "B")  # A's four leases ended together: any two
    assert len(thief) == 2 and {task.attempts for task in thief} == {2}
    assert await queue.complete(thief[0], "B's result")
    clock.advance(1)
    stolen = {task.id: encoded(await read(db, task.id)) for task in thief}
    counter.reset()
    return queue, counter, batch, stolen


async def test_a_batch_that_lost_some_leases_completes_only_the_ones_it_holds(
    db: Any, clock: ManualClock
) -> None:
    queue, counter, batch, stolen = await lose_two_of_four(db, clock)

    done = await queue.complete_many(batch, ["A1", "A2", "A3", "A4"])

    assert done == [task.id not in stolen for task in batch]
    # The bulk write, a read to tell which took effect, one fenced requeue (matching nothing).
    assert counter.total <= 3, counter.counts
    await assert_unchanged(db, stolen)
    for task, result in zip(batch, ["A1", "A2", "A3", "A4"], strict=True):
        if task.id in stolen:
            continue
        doc = await read(db, task.id)
        assert doc is not None
        assert (doc["status"], doc["result"], doc["attempts"]) == ("done", result, 1)
        assert (doc["lease_token"], doc["updated_at"]) == (task.lease_token, clock.now())
    statuses = sorted([(await read(db, task_id) or {})["status"] for task_id in stolen])
    assert statuses == ["done", "processing"]  # B's completion, and B's task in flight


async def test_heartbeat_many_tells_which_leases_are_held_and_extends_only_those(
    db: Any, clock: ManualClock
) -> None:
    """Some leases lost: the update, then one read to tell which tasks are still held."""
    queue, counter, batch, stolen = await lose_two_of_four(db, clock)

    assert await queue.heartbeat_many(batch) == [task.id not in stolen for task in batch]

    assert counter.counts == {"tasks.update_many": 1, "tasks.find": 1}
    await assert_unchanged(db, stolen)
    for task in batch:
        if task.id in stolen:
            continue
        doc = await read(db, task.id)
        assert doc is not None
        assert (doc["status"], doc["lease_token"]) == ("processing", task.lease_token)
        assert (doc["lease_until"], doc["updated_at"]) == (later(clock, LEASE_TTL), clock.now())
    assert await queue.claim_many(10, "C") == []  # the renewed leases hold again


async def test_a_batch_whose_tasks_were_all_taken_changes_nothing(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put_many([NewTask("t1"), NewTask("t2"), NewTask("t3")])
    batch = await queue.claim_many(3, "A")
    assert await queue.remove("t3")
    clock.advance(LEASE_TTL + 1)
    assert sorted(ids(await queue.claim_many(3, "B"))) == ["t1", "t2"]
    before = await snapshot(db)

    assert await queue.heartbeat_many(batch) == [False, False, False]
    assert await queue.complete_many(batch) == [False, False, False]

    assert await snapshot(db) == before


# ---------------------------------------------------------------------------- revision race


async def test_a_task_re_put_with_a_new_revision_in_the_batch_goes_back_to_pending(
    db: Any, clock: ManualClock
) -> None:
    """The holder's completion is for the revision it claimed: the re-put task goes back to
    pending with fresh attempts for its new revision (never done for the old one), and the
    rest of the batch completes."""
    queue = await new_queue(db, clock)
    await put_in_order(queue, clock, ["t1", "t2", "t3"], payload={"v": 1}, revision="r1")
    batch = await queue.claim_many(3, "A")
    assert await queue.put("t2", {"v": 2}, revision="r2") == "updated"
    clock.advance(5)

    done = await queue.complete_many(batch, ["old t1", "old t2", "old t3"])

    assert done == [True, False, True]
    t2 = await read(db, "t2")
    assert t2 is not None
    assert (t2["status"], t2["attempts"], t2["revision"], t2["payload"]) == (
        "pending",
        0,
        "r2",
        {"v": 2},
    )
    assert (t2["lease_until"], t2["worker_id"], t2["lease_token"]) == (clock.now(), None, None)
    assert t2["result"] is None
    for task_id in ("t1", "t3"):
        doc = await read(db, task_id)
        assert doc is not None and (doc["status"], doc["result"]) == ("done", f"old {task_id}")
    again = await queue.claim_many(3, "A")
    assert [(task.id, task.revision, task.attempts, task.payload) for task in again] == [
        ("t2", "r2", 1, {"v": 2})
    ]


# -------------------------------------------------------------------------------- faults


#: claim_many's commands when nobody else claims: the candidates, the conditional claim (its
#: read-back, only under contention, has a test of its own below)
CLAIM_MANY = {
    "select": ("find", lambda op: "lease_token" not in op.filter),
    "claim": ("update_many", None),
}


@WHEN
@pytest.mark.parametrize("command", list(CLAIM_MANY))
async def test_a_claim_many_that_failed_on_any_command_is_recoverable(
    db: Any, clock: ManualClock, command: str, when: str
) -> None:
    queue, faults = await faulty_queue(db, clock)
    names = await put_ids(queue, clock, 5)
    before = await snapshot(db)
    name, match = CLAIM_MANY[command]
    error = inject(faults, when, name, collection="tasks", match=match)

    with pytest.raises(error):
        await queue.claim_many(3, "A")

    applied = command == "claim" and when == "after"
    docs = await read_all(db)
    if not applied:
        assert await snapshot(db) == before
    else:
        # A holds three tasks without knowing it: nobody takes them before the lease ends.
        orphaned = names[:3]
        for task_id in orphaned:
            doc = docs[task_id]
            assert (doc["status"], doc["attempts"], doc["worker_id"]) == ("processing", 1, "A")
            assert doc["lease_until"] == later(clock, LEASE_TTL)
        others = await queue.claim_many(10, "B")
        assert ids(others) == names[3:]
        assert await queue.complete_many(others, ["rescued"] * 2) == [True, True]
        clock.advance(LEASE_TTL)
        assert await queue.claim_many(10, "B") == []
        clock.advance(0.001)

    rescued = await drain_batched(queue)

    expected = names if not applied else names[:3]
    assert sorted(ids(rescued)) == expected
    docs = await read_all(db)
    for task_id in names:
        doc = docs[task_id]
        assert doc["status"] == "done", task_id
        orphaned_here = applied and task_id in names[:3]
        assert doc["attempts"] == (2 if orphaned_here else 1), task_id


async def test_a_put_between_a_batch_read_and_its_claim_is_not_lost(
    db: Any, clock: ManualClock
) -> None:
    """A new revision of t000 is put while A's batch is between its read and its claim: the
    claim takes it all the same (still due), and A, reading nothing back, holds it as read,
    at the old revision. A's completion of it then misses (fenced on the revision) and t000 is
    pending again at the new revision: the new revision runs, the old result is not kept."""
    queue, faults = await faulty_queue(db, clock)
    names = await put_ids(queue, clock, 3)
    paused = faults.pause_before("update_many", collection="tasks")
    batches: list[list[Task]] = []

    async def batch() -> None:
        batches.append(await queue.claim_many(3, "A"))

    async with anyio.create_task_group() as group:
        group.start_soon(batch)
        await wait_for(paused.reached.is_set, "A's claim")
        assert await queue.put(names[0], {"v": 2}, revision="r2") == "updated"
        paused.release()

    (held,) = batches
    assert ids(held) == names
    assert (held[0].revision, held[0].payload) == (None, {"n": names[0]})  # as read
    assert await queue.complete_many(held, ["old"] * 3) == [False, True, True]
    doc = await read(db, names[0])
    assert doc is not None
    assert (doc["status"], doc["revision"], doc["payload"], doc["result"]) == (
        "pending", "r2", {"v": 2}, None,
    )  # fmt: skip
    again = await queue.claim_many(3, "B")
    assert [(t.id, t.revision, t.payload) for t in again] == [(names[0], "r2", {"v": 2})]


@WHEN
async def test_a_contended_claim_many_whose_read_back_failed_is_recoverable(
    db: Any, clock: ManualClock, when: str
) -> None:
    """B claims t1 while A's batch is between its read and its claim: A takes t2 and t3 only,
    so it reads back what it took, and that read fails. A holds t2 and t3 without knowing it:
    nobody takes them before their lease ends; then every task is done, once each."""
    queue, faults = await faulty_queue(db, clock)
    names = await put_ids(queue, clock, 5)
    paused = faults.pause_before("update_many", collection="tasks")
    error = inject(
        faults, when, "find", collection="tasks", match=lambda op: "lease_token" in op.filter
    )

    async def batch() -> None:
        with pytest.raises(error):
            await queue.claim_many(3, "A")

    async with anyio.create_task_group() as group:
        group.start_soon(batch)
        await wait_for(paused.reached.is_set, "A's claim")
        rival = await queue.claim("B")
        assert rival is not None and rival.id == names[0]
        paused.release()

    docs = await read_all(db)
    assert (docs[names[0]]["status"], docs[names[0]]["worker_id"]) == ("processing", "B")
    for task_id in names[1:3]:
        doc = docs[task_id]
        assert (doc["status"], doc["attempts"], doc["worker_id"]) == ("processing", 1, "A")
    assert await queue.complete(rival, "by B")
    others = await queue.claim_many(10, "C")
    assert ids(others) == names[3:]
    assert await queue.complete_many(others, ["by C"] * 2) == [True, True]
    clock.advance(LEASE_TTL + 0.001)
    rescued = await drain_batched(queue)
    assert sorted(ids(rescued)) == names[1:3]
    docs = await read_all(db)
    assert {t: (docs[t]["status"], docs[t]["attempts"]) for t in names} == {
        names[0]: ("done", 1), names[1]: ("done", 2), names[2]: ("done", 2),
        names[3]: ("done", 1), names[4]: ("done", 1),
    }  # fmt: skip


@WHEN
async def test_a_complete_many_that_failed_is_recoverable(
    db: Any, clock: ManualClock, when: str
) -> None:
    queue, faults = await faulty_queue(db, clock)
    names = await put_ids(queue, clock, 4)
    batch = await queue.claim_many(4, "A")
    before = await snapshot(db)
    clock.advance(5)
    error = inject(faults, when, "bulk_write")

    with pytest.raises(error):
        await queue.complete_many(batch, ["A"] * 4)

    docs = await read_all(db)
    if when == "before":
        assert await snapshot(db) == before
        clock.advance(LEASE_TTL)
        rescued = await drain_batched(queue)
        assert sorted(ids(rescued)) == names
        assert all(task.attempts == 2 for task in rescued)
        docs = await read_all(db)
        assert all((doc["status"], doc["result"]) == ("done", "rescued") for doc in docs.values())
        return
    assert all((doc["status"], doc["result"]) == ("done", "A") for doc in docs.values())
    stored = await snapshot(db)
    # Sent again, the completion tells that this claim completed them, and writes nothing.
    assert await queue.complete_many(batch, ["A"] * 4) == [True] * 4
    assert await snapshot(db) == stored
    clock.advance(LEASE_TTL + 1)
    assert await queue.claim_many(10, "B") == []


#: complete_many's commands when a task of the batch changed revision (fresh matchers per test:
#: `nth` counts)
COMPLETE_MANY_RACED: dict[str, tuple[str, Callable[[], Callable[[Operation], bool] | None]]] = {
    "complete": ("bulk_write", lambda: nth(0)),
    "which": ("find", lambda: None),
    "requeue": ("bulk_write", lambda: nth(1)),
}


@WHEN
@pytest.mark.parametrize("command", list(COMPLETE_MANY_RACED))
async def test_a_complete_many_racing_a_revision_that_failed_on_any_command_is_recoverable(
    db: Any, clock: ManualClock, command: str, when: str
) -> None:
    """Whichever command failed, t1 and t3 end done once, and t2's new revision runs with
    fresh attempts: at once if the requeue applied, after the lease (a take-over) if not."""
    queue, faults = await faulty_queue(db, clock)
    await put_in_order(queue, clock, ["t1", "t2", "t3"], payload={"v": 1}, revision="r1")
    batch = await queue.claim_many(3, "A")
    assert await queue.put("t2", {"v": 2}, revision="r2") == "updated"
    clock.advance(5)
    name, matcher = COMPLETE_MANY_RACED[command]
    error = inject(faults, when, name, match=matcher())

    with pytest.raises(error):
        await queue.complete_many(batch, ["A"] * 3)

    completed = not (command == "complete" and when == "before")
    requeued = command == "requeue" and when == "after"
    docs = await read_all(db)
    for task_id in ("t1", "t3"):
        assert docs[task_id]["status"] == ("done" if completed else "processing")
    t2 = docs["t2"]
    assert (t2["revision"], t2["attempts"], t2["result"]) == ("r2", 0, None)
    assert t2["status"] == ("pending" if requeued else "processing")
    if not requeued:
        assert await queue.claim_many(10, "B") == []
        clock.advance(LEASE_TTL + 0.001)

    rescued = await drain_batched(queue)

    expected = ["t2"] if completed else ["t1", "t2", "t3"]
    assert sorted(ids(rescued)) == expected
    by_id = {task.id: task for task in rescued}
    assert (by_id["t2"].revision, by_id["t2"].attempts, by_id["t2"].payload) == ("r2", 1, {"v": 2})
    docs = await read_all(db)
    assert {key: doc["status"] for key, doc in docs.items()} == dict.fromkeys(docs, "done")
    assert docs["t2"]["result"] == "rescued"
    for task_id in ("t1", "t3"):
        assert docs[task_id]["result"] == ("A" if completed else "rescued")


async def test_a_heartbeat_many_whose_reply_was_lost_extended_the_leases(
    db: Any, clock: ManualClock
) -> None:
    queue, faults = await faulty_queue(db, clock)
    batch = await put_and_claim(queue, clock, 3, "A")
    clock.advance(HEARTBEAT)
    faults.fail_after("update_many")

    with pytest.raises(NetworkTimeout):
        await queue.heartbeat_many(batch)

    for doc in (await read_all(db)).values():
        assert doc["lease_until"] == later(clock, LEASE_TTL)
    assert await queue.heartbeat_many(batch) == [True] * 3


# ------------------------------------------------------------------------- run(batch_size=N)


def is_heartbeat_many(op: Operation) -> bool:
    """heartbeat_many's extension: only the lease's end (never back) and updated_at change."""
    return op.name == "update_many" and _extends(op.args[1])


def _extends(update: Any) -> bool:
    if not isinstance(update, dict):  # a pipeline (the reclaim's burial)
        return False
    return set(update.get("$max", {})) == {"lease_until"} and set(update.get("$set", {})) == {
        "updated_at"
    }


def is_heartbeat(op: Operation) -> bool:
    """A single heartbeat: fenced on the lease (not the revision), extends it."""
    return op.name == "update_one" and "revision" not in op.filter and _extends(op.args[1])


def is_reclaim(op: Operation) -> bool:
    return op.name == "update_many" and "attempts" in op.filter


def is_retry(op: Operation) -> bool:
    """release_for_retry's settle: fenced on the revision, back to pending with the error."""
    return op.name == "update_one" and "revision" in op.filter and "error" in op.args[1]["$set"]


async def run_until_empty(queue: AsyncTaskQueue, handler: Any, **options: Any) -> TaskRunSummary:
    options.setdefault("worker_id", "w")
    options.setdefault("schedules", False)  # its ticker's reads: tests/tasks/test_schedules.py
    return await queue.run(handler, stop_when_empty=True, **options)


async def echo(task: Task) -> Any:
    return {"done": task.id}


async def test_run_with_batches_processes_everything_in_fewer_commands(
    db: Any, clock: ManualClock
) -> None:
    queues: dict[str, AsyncTaskQueue] = {}
    counters: dict[str, CommandCounter] = {}
    for kind in ("batched", "single"):
        queues[kind], counters[kind] = await counted_queue(db, clock, name=kind)
        await put_ids(queues[kind], clock, 30)
        counters[kind].reset()

    batched = await run_until_empty(queues["batched"], echo, batch_size=10)
    single = await run_until_empty(queues["single"], echo)

    for summary in (batched, single):
        assert (summary.claimed, summary.completed) == (30, 30)
        assert summary.retried + summary.failed + summary.lost + summary.unknown == 0
    for kind in queues:
        docs = await read_all(db, kind)
        assert len(docs) == 30
        for task_id, doc in docs.items():
            assert (doc["status"], doc["attempts"], doc["result"]) == ("done", 1, {"done": task_id})
    # Batched: per batch of 10 a claim_many (2: nobody else claims) and a complete_many (1);
    # then an empty claim_many (1) and the idle reclaim (2). No single-task command at all.
    assert counters["batched"].counts == {
        "batched.find": 3 * 1 + 1,
        "batched.update_many": 3 + 2,
        "batched.bulk_write": 3,
    }
    assert counters["batched"].total * 4 < counters["single"].total
    assert counters["single"].total >= 2 * 30


async def test_concurrent_batched_slots_never_process_one_task_twice_at_once(
    db: Any, clock: ManualClock
) -> None:
    faults = FaultInjector(yield_between=True)
    queue = await new_queue(instrument(db, faults), clock, backoff_base=1, backoff_cap=1)
    names = [f"t{i:02}" for i in range(48)]
    flaky = set(names[::7])
    await queue.put_many([NewTask(name, priority=i % 3) for i, name in enumerate(names)])
    books = Bookkeeping(flaky)
    summaries: list[TaskRunSummary] = []

    async def worker(worker_id: str) -> None:
        summaries.append(
            await run_until_empty(
                queue, books.handler, worker_id=worker_id, concurrency=3, batch_size=4
            )
        )

    async with anyio.create_task_group() as group:
        group.start_soon(worker, "w1")
        group.start_soon(worker, "w2")
    clock.advance(2)  # past the flaky tasks' backoff (1 to 1.5 s)
    await worker("w3")

    assert books.overlaps == []
    assert books.runs == {name: 2 if name in flaky else 1 for name in names}
    assert sum(s.claimed for s in summaries) == len(names) + len(flaky)
    assert sum(s.completed for s in summaries) == len(names)
    assert sum(s.retried for s in summaries) == len(flaky)
    assert sum(s.lost + s.failed + s.released + s.unknown for s in summaries) == 0
    docs = await read_all(db)
    for name, doc in docs.items():
        attempts = 2 if name in flaky else 1
        assert (doc["status"], doc["attempts"], doc["result"]) == (
            "done",
            attempts,
            {"attempt": attempts},
        ), name


async def test_run_with_batches_retries_and_fails_per_task(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock, max_attempts=2, backoff_base=1, backoff_cap=1)
    names = ["ok", "flaky", "permanent", "always", "unstorable", "ok2"]
    await put_in_order(queue, clock, names)
    runs: list[tuple[Any, int]] = []

    async def handler(task: Task) -> Any:
        runs.append((task.id, task.attempts))
        if task.id == "flaky" and task.attempts == 1:
            raise RuntimeError("transient")
        if task.id == "always":
            raise RuntimeError("never works")
        if task.id == "permanent":
            raise PermanentError("cannot ever work")
        if task.id == "unstorable":
            return object()  # not BSON: the task fails, as with a single task
        return f"result of {task.id}"

    first = await run_until_empty(queue, handler, batch_size=4)

    assert runs == [(name, 1) for name in names]
    assert (first.claimed, first.completed, first.retried, first.failed) == (6, 2, 2, 2)
    assert first.lost + first.released + first.unknown == 0
    docs = await read_all(db)
    assert (docs["permanent"]["status"], docs["permanent"]["attempts"]) == ("failed", 1)
    assert docs["permanent"]["error"].endswith("PermanentError: cannot ever work")
    assert docs["unstorable"]["status"] == "failed"
    assert "InvalidInput" in docs["unstorable"]["error"]
    for name in ("flaky", "always"):
        assert (docs[name]["status"], docs[name]["attempts"]) == ("pending", 1)
        assert later(clock, 1) <= docs[name]["lease_until"] < later(clock, 1.5)
        assert docs[name]["lease_token"] is None
    assert docs["always"]["error"].endswith("RuntimeError: never works")

    clock.advance(2)  # past the backoff
    second = await run_until_empty(queue, handler, batch_size=4)

    assert sorted(runs[6:]) == [("always", 2), ("flaky", 2)]  # their backoffs are jittered
    docs = await read_all(db)
    assert (docs["flaky"]["status"], docs["flaky"]["result"]) == ("done", "result of flaky")
    assert (docs["always"]["status"], docs["always"]["attempts"]) == ("failed", 2)
    assert {docs[name]["status"] for name in ("ok", "ok2")} == {"done"}
    # The last attempt of "always" failed the task: reported as failed, as `run` does for a
    # single task (`release_for_retry` on the last attempt is a `fail`).
    assert (second.claimed, second.completed, second.failed, second.retried) == (2, 1, 1, 0)


async def test_run_with_batches_reports_a_task_lost_mid_batch_and_completes_the_rest(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await put_in_order(queue, clock, ["t1", "t2", "t3"])

    async def handler(task: Task) -> Any:
        if task.id == "t2":  # meanwhile an operator removes t1, already handled
            assert await queue.remove("t1")
        return task.id

    summary = await run_until_empty(queue, handler, batch_size=3)

    assert (summary.claimed, summary.completed, summary.lost) == (3, 2, 1)
    docs = await read_all(db)
    assert (docs["t1"]["status"], docs["t1"]["result"]) == ("tombstone", None)
    assert [(docs[t]["status"], docs[t]["result"]) for t in ("t2", "t3")] == [
        ("done", "t2"),
        ("done", "t3"),
    ]


async def test_a_cancelled_batch_completes_the_finished_and_releases_the_rest(
    db: Any, clock: ManualClock
) -> None:
    """Cancelling `run` mid-batch while the release for retry of t2 (which failed) is on its
    way: the release still applies (an attempt, with backoff and the error), and t1, handled,
    is completed. t3 and t4, never started (the cancellation is noticed before t3's handler
    starts), are released at once without counting an attempt."""
    queue, faults = await faulty_queue(db, clock, backoff_base=10, backoff_cap=10)
    await put_in_order(queue, clock, ["t1", "t2", "t3", "t4"])
    settling = faults.pause_before("update_one", collection="tasks", match=is_retry)
    started: list[Any] = []

    async def handler(task: Task) -> Any:
        started.append(task.id)
        if task.id == "t1":
            clock.advance(3)  # the settles then write a time other than the claim's
            return "done t1"
        await anyio.lowlevel.checkpoint()
        raise RuntimeError(f"{task.id} failed")

    async with anyio.create_task_group() as group:
        group.start_soon(lambda: queue.run(handler, batch_size=4, worker_id="w", schedules=False))
        await wait_for(settling.reached.is_set, "t2's release")
        group.cancel_scope.cancel()
        settling.release()

    assert started == ["t1", "t2"]
    docs = await read_all(db)
    assert (docs["t1"]["status"], docs["t1"]["result"], docs["t1"]["attempts"]) == (
        "done",
        "done t1",
        1,
    )
    t2 = docs["t2"]
    assert (t2["status"], t2["attempts"], t2["lease_token"], t2["worker_id"]) == (
        "pending", 1, None, None,
    )  # fmt: skip
    assert later(clock, 10) <= t2["lease_until"] < later(clock, 15)
    assert t2["error"].endswith("RuntimeError: t2 failed")
    for task_id in ("t3", "t4"):
        doc = docs[task_id]
        assert (doc["status"], doc["attempts"], doc["lease_token"]) == ("pending", 0, None)
        assert doc["lease_until"] == clock.now()
    assert ids(await queue.claim_many(10, "w")) == ["t3", "t4"]
    clock.advance(15)
    retried = await queue.claim_many(10, "w")
    assert [(task.id, task.attempts) for task in retried] == [("t2", 2)]


async def test_a_batch_cancelled_under_a_handler_records_worker_stopped_for_it(
    db: Any, clock: ManualClock
) -> None:
    """The cancellation comes while t2's handler waits: t1, handled, is completed; t2 is cut
    short (an attempt, with backoff, the error "worker stopped"); t3, never started, is
    released at once without counting an attempt."""
    queue = await new_queue(db, clock, backoff_base=10, backoff_cap=10)
    await put_in_order(queue, clock, ["t1", "t2", "t3"])
    started: list[Any] = []

    async def handler(task: Task) -> Any:
        started.append(task.id)
        if task.id == "t2":
            await anyio.sleep_forever()
        return f"done {task.id}"

    async with anyio.create_task_group() as group:
        group.start_soon(lambda: queue.run(handler, batch_size=3, worker_id="w", schedules=False))
        await wait_for(lambda: started == ["t1", "t2"], "t2's handler")
        group.cancel_scope.cancel()

    docs = await read_all(db)
    assert (docs["t1"]["status"], docs["t1"]["result"]) == ("done", "done t1")
    t2 = docs["t2"]
    assert (t2["status"], t2["attempts"], t2["lease_token"], t2["error"]) == (
        "pending", 1, None, WORKER_STOPPED,
    )  # fmt: skip
    assert later(clock, 10) <= t2["lease_until"] < later(clock, 15)
    t3 = docs["t3"]
    assert (t3["status"], t3["attempts"], t3["lease_until"]) == ("pending", 0, clock.now())


async def test_a_batch_longer_than_the_lease_keeps_every_lease_through_heartbeats(
    db: Any, clock: ManualClock
) -> None:
    """Three tasks of 25 s each, one after the other: 75 s, two and a half leases. The batch's
    heartbeat renews every lease (the finished ones too, until they are completed together)
    every 10 s, so another worker never takes any of them over."""
    in_flight = InFlight()
    queue, counter = await counted_queue(db, clock, in_flight, record=True)
    rival = await new_queue(db, clock)  # another process
    await queue.put_many([NewTask(f"t{i}") for i in (1, 2, 3)])
    handled: list[Any] = []
    summaries: list[TaskRunSummary] = []

    async def handler(task: Task) -> Any:
        await clock.sleep(25)
        handled.append(task.id)
        return task.id

    async def worker() -> None:
        summaries.append(await run_until_empty(queue, handler, batch_size=3))

    def napping() -> bool:  # the handler, the heartbeat, the reclaim and the cancels' poll sleep
        return clock.sleepers == 4 and in_flight.count == 0

    start = clock.now()
    async with anyio.create_task_group() as group:
        group.start_soon(worker)
        for step in range(1, 15):  # 70 s in steps of 5 s
            await wait_for(napping, f"the batch to nap at step {step}")
            clock.advance(5)
            await wait_for(napping, f"the batch to nap after step {step}")
            assert await rival.claim_many(10, "rival") == []
            assert await rival.claim("rival") is None
            renewed = start + timedelta(seconds=10 * (step * 5 // 10) + LEASE_TTL)
            docs = await read_all(db)
            for doc in docs.values():
                assert (doc["status"], doc["worker_id"]) == ("processing", "w")
                assert doc["lease_until"] == renewed
            assert len(handled) == step * 5 // 25
        clock.advance(5)  # 75 s: the last task ends, the batch completes

    (summary,) = summaries
    assert (summary.claimed, summary.completed, summary.lost, summary.unknown) == (3, 3, 0, 0)
    docs = await read_all(db)
    assert {(doc["status"], doc["attempts"]) for doc in docs.values()} == {("done", 1)}
    heartbeats = [op for op in counter.operations if is_heartbeat_many(op)]
    assert len(heartbeats) == 7  # at 10, 20, ... 70 s: one command each for the whole batch


# ------------------------------------------------- run(batch_size=N): leases lost mid-batch


@pytest.mark.parametrize("taken_over", [False, True], ids=["still-held", "taken-over"])
async def test_a_batch_past_its_last_renewal_rechecks_each_lease_before_starting_it(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, taken_over: bool
) -> None:
    """The batch stalls in its first handler past the lease the claim granted, its renewal
    held back. Before each later task starts, one heartbeat re-checks its lease: still held
    (nobody took it), the task runs; taken over by another worker, it never starts under the
    lost lease and counts as lost, and the new holder's claim is untouched."""
    faults = FaultInjector()
    queue, counter = await counted_queue(db, clock, faults, record=True)
    rival = await new_queue(db, clock)  # another process
    renewal = faults.pause_before("update_many", collection="tasks", match=is_heartbeat_many)
    # Only the rival takes over here: this worker's own reclaim of expired leases fails.
    faults.fail_before("update_many", collection="tasks", match=is_reclaim, times=100)
    await put_in_order(queue, clock, ["t1", "t2", "t3"])
    started: list[Any] = []
    stolen: list[Task] = []

    async def handler(task: Task) -> Any:
        started.append(task.id)
        if task.id == "t1":
            clock.advance(LEASE_TTL + 1)
            await wait_for(renewal.reached.is_set, "the renewal to be due (and held back)")
            if taken_over:
                stolen.extend(await rival.claim_many(3, "B"))
        return f"done {task.id}"

    with caplog.at_level(logging.WARNING):
        summary = await run_until_empty(queue, handler, batch_size=3)

    rechecks = [op.filter["_id"] for op in counter.operations if is_heartbeat(op)]
    assert rechecks == ["t2", "t3"]  # one heartbeat each, before it would start
    assert not unexpected_errors(caplog)
    docs = await read_all(db)
    if not taken_over:
        assert started == ["t1", "t2", "t3"]
        assert (summary.claimed, summary.completed, summary.lost, summary.unknown) == (3, 3, 0, 0)
        for task_id, doc in docs.items():
            assert (doc["status"], doc["attempts"], doc["result"]) == ("done", 1, f"done {task_id}")
        return
    assert started == ["t1"]  # never t2 or t3 under a lost lease
    assert (summary.claimed, summary.completed, summary.lost, summary.unknown) == (3, 0, 3, 0)
    assert sorted(ids(stolen)) == ["t1", "t2", "t3"]
    for task in stolen:
        assert_held(docs[task.id], task)
        assert (docs[task.id]["attempts"], docs[task.id]["result"]) == (2, None)


@WHEN
async def test_a_failure_settle_that_raised_a_driver_error_counts_unknown_and_the_batch_goes_on(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, when: str
) -> None:
    """t1's handler fails and its release for retry raises a driver error (applied or not):
    counted unknown, logged, and t2 and t3 still run and complete. t1 is released (reply
    lost) or still held until its lease ends; either way it runs again."""
    queue, faults = await faulty_queue(db, clock, backoff_base=1, backoff_cap=1)
    await put_in_order(queue, clock, ["t1", "t2", "t3"])
    inject(faults, when, "update_one", collection="tasks", match=is_retry)

    async def handler(task: Task) -> Any:
        if task.id == "t1" and task.attempts == 1:
            raise RuntimeError("t1 failed")
        return f"done {task.id}"

    with caplog.at_level(logging.WARNING):
        summary = await run_until_empty(queue, handler, batch_size=3)

    assert len(faults.triggered) == 1
    assert (summary.claimed, summary.completed, summary.unknown) == (3, 2, 1)
    assert summary.retried + summary.failed + summary.lost + summary.released == 0
    assert any(
        r.getMessage() == "settling 't1' failed; its lease will expire" for r in caplog.records
    )
    assert not unexpected_errors(caplog)
    docs = await read_all(db)
    assert {docs[t]["status"] for t in ("t2", "t3")} == {"done"}
    t1 = docs["t1"]
    if when == "before":
        assert (t1["status"], t1["attempts"], t1["worker_id"]) == ("processing", 1, "w")
        assert t1["error"] is None
        clock.advance(LEASE_TTL + 0.001)
    else:
        assert (t1["status"], t1["attempts"], t1["lease_token"]) == ("pending", 1, None)
        assert t1["error"].endswith("RuntimeError: t1 failed")
        clock.advance(2)  # past the backoff

    assert [(task.id, task.attempts) for task in await drain_batched(queue)] == [("t1", 2)]
