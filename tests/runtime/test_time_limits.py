"""The limits a run loop puts on a handler: `handler_timeout` cancels a handler that runs too
long (a failed attempt, "timed out after N s"); a handler whose lease a renewal finds lost is
cancelled and counted lost, and nothing it would have settled is written."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from mongoq import GroupLease, InvalidInput, OutboxDispatcher, Task
from mongoq.testing import ManualClock
from tests.support.group_helpers import (
    PREFIX,
    VISIBILITY,
    assert_lock,
    assert_message,
    new_transport,
)
from tests.support.helpers import LEASE_TTL, in_background, later, new_queue, read
from tests.support.outbox_helpers import PREFIX as PREFIX_OUTBOX
from tests.support.outbox_helpers import deliveries, event, new_outbox

TIMEOUT = 5.0


class Stuck:
    """A handler that blocks until cancelled, and records how each call ended."""

    def __init__(self, stuck: int = 1) -> None:
        self.stuck = stuck
        self.calls: list[Any] = []
        self.cancelled: list[Any] = []

    async def __call__(self, item: Any, *context: Any) -> str:
        self.calls.append(item)
        if len(self.calls) > self.stuck:
            return "ok"
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled.append(item)
            raise
        raise AssertionError("unreachable")


async def nothing() -> None:
    return None


@pytest.mark.parametrize("batch_size", [1, 2])
async def test_a_task_past_its_time_limit_is_cancelled_and_its_attempt_counted(
    db: Any, clock: ManualClock, batch_size: int
) -> None:
    queue = await new_queue(db, clock, backoff_base=60, backoff_cap=60)
    await queue.put("slow", 1)
    await queue.put("quick", 2, delay=1)  # claimed with the slow one only in a batch
    stuck = Stuck()
    run = queue.run(stuck, stop_when_empty=True, handler_timeout=TIMEOUT, batch_size=batch_size)

    summary = await in_background(
        clock, run, started=lambda: stuck.calls, then=nothing, advance=TIMEOUT
    )

    assert [task.id for task in stuck.cancelled] == ["slow"]
    assert (summary.retried, summary.lost) == (1, 0)
    slow = await read(db, "slow")
    assert slow is not None
    assert (slow["status"], slow["attempts"], slow["lease_token"]) == ("pending", 1, None)
    assert slow["error"].endswith("HandlerTimeout: timed out after 5 s")


async def test_a_task_that_always_times_out_ends_failed(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock, max_attempts=1)
    await queue.put("slow", 1)
    stuck = Stuck()

    summary = await in_background(
        clock, queue.run(stuck, stop_when_empty=True, handler_timeout=TIMEOUT),
        started=lambda: stuck.calls, then=nothing, advance=TIMEOUT,
    )  # fmt: skip

    assert (summary.failed, summary.retried) == (1, 0)
    doc = await read(db, "slow")
    assert doc is not None and (doc["status"], doc["attempts"]) == ("failed", 1)
    assert doc["error"].endswith("HandlerTimeout: timed out after 5 s")


async def test_a_handler_that_finishes_in_time_is_not_touched(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t", 1)

    async def quick(task: Task) -> str:
        clock.advance(TIMEOUT - 1)  # under the limit, on the queue's clock
        return "done in time"

    summary = await queue.run(quick, stop_when_empty=True, handler_timeout=TIMEOUT)

    assert summary.completed == 1
    doc = await read(db, "t")
    assert doc is not None and (doc["status"], doc["result"]) == ("done", "done in time")


async def test_a_task_removed_under_its_handler_cancels_it_and_counts_it_lost(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t", 1)
    stuck = Stuck()

    async def remove() -> None:
        assert await queue.remove("t")

    summary = await in_background(
        clock, queue.run(stuck, stop_when_empty=True),
        started=lambda: stuck.calls, then=remove, advance=LEASE_TTL / 3,
    )  # fmt: skip

    assert [task.id for task in stuck.cancelled] == ["t"]
    assert (summary.lost, summary.retried, summary.completed) == (1, 0, 0)
    doc = await read(db, "t")
    assert doc is not None
    assert (doc["status"], doc["attempts"], doc.get("error")) == ("tombstone", 1, None)


@pytest.mark.parametrize("batch_size", [1, 3])
async def test_a_group_taken_over_under_its_handler_cancels_it(
    db: Any, clock: ManualClock, batch_size: int
) -> None:
    transport = await new_transport(db, clock)
    seq = await transport.publish("g", {"n": 1})
    stuck = Stuck()

    async def take_over() -> None:
        locks = db[f"{PREFIX}_locks"]
        taken = await locks.update_one({"_id": "g"}, {"$set": {"token": "another worker"}})
        assert taken.modified_count == 1

    summary = await in_background(
        clock, transport.run(stuck, stop_when_empty=True, batch_size=batch_size),
        started=lambda: stuck.calls, then=take_over, advance=VISIBILITY / 3,
    )  # fmt: skip

    assert [lease.seq for lease in stuck.cancelled] == [seq]
    assert (summary.lost, summary.retried, summary.acked) == (1, 0, 0)
    await assert_message(db, seq, deliveries=1, last_error=None)  # nothing settled by it


async def test_a_group_head_past_its_time_limit_is_nacked_with_the_reason(
    db: Any, clock: ManualClock
) -> None:
    transport = await new_transport(db, clock)
    seq = await transport.publish("g", {"n": 1})
    stuck = Stuck()

    summary = await in_background(
        clock,
        transport.run(stuck, stop_when_empty=True, handler_timeout=TIMEOUT, retry_delay=10),
        started=lambda: stuck.calls, then=nothing, advance=TIMEOUT,
    )  # fmt: skip

    assert (summary.retried, summary.lost) == (1, 0)
    head = await assert_message(db, seq, deliveries=1)
    assert head["last_error"].endswith("HandlerTimeout: timed out after 5 s")
    await assert_lock(db, "g", parked=True, available_at=later(clock, 10))
    assert isinstance(stuck.calls[0], GroupLease)


async def test_a_delivery_past_its_time_limit_is_rescheduled_with_the_reason(
    db: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(db, clock, subscriptions={"*": ["h"]})
    await outbox.publish([event(1)], session=None)
    stuck = Stuck()
    dispatcher = OutboxDispatcher(outbox, {"h": stuck}, backoff=lambda attempt: 60)

    summary = await in_background(
        clock, dispatcher.run(handler_timeout=TIMEOUT, stop_when_empty=True),
        started=lambda: stuck.calls, then=nothing, advance=TIMEOUT,
    )  # fmt: skip

    assert (summary.retried, summary.completed) == (1, 0)
    [stored] = await deliveries(db)
    assert (stored["status"], stored["attempts"]) == ("pending", 1)
    assert stored["last_error"].endswith("HandlerTimeout: timed out after 5 s")


@pytest.mark.parametrize("bad", [0, -1, "5", float("nan")])
async def test_a_time_limit_must_be_a_positive_number_of_seconds(
    db: Any, clock: ManualClock, bad: Any
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t", 1)
    transport = await new_transport(db, clock)
    outbox = await new_outbox(db, clock, subscriptions={"*": ["h"]})
    stuck = Stuck()

    for run in (queue.run, transport.run):
        with pytest.raises(InvalidInput, match=r"^handler_timeout: "):
            await run(stuck, handler_timeout=bad)
    with pytest.raises(InvalidInput, match=r"^handler_timeout: "):
        await OutboxDispatcher(outbox, {"h": stuck}).run(handler_timeout=bad)
    assert stuck.calls == []
    doc = await read(db, "t")
    assert doc is not None and (doc["status"], doc["attempts"]) == ("pending", 0)


async def test_a_dispatcher_whose_lanes_were_all_taken_cancels_its_handlers(
    db: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(db, clock, subscriptions={"*": ["h"]})
    await outbox.publish([event(1)], session=None)
    stuck = Stuck()
    dispatcher = OutboxDispatcher(outbox, {"h": stuck}, backoff=lambda attempt: 60)

    async def take_over() -> None:
        lanes = db[f"{PREFIX_OUTBOX}lanes"]
        taken = await lanes.update_many({"owner": "w"}, {"$set": {"owner": "another worker"}})
        assert taken.modified_count >= 1

    summary = await in_background(
        clock, dispatcher.run(worker_id="w", stop_when_empty=True),
        started=lambda: stuck.calls, then=take_over, advance=outbox.lease_ttl / 3,
    )  # fmt: skip

    assert [e.id for e in stuck.cancelled] == [event(1).id]
    assert (summary.lost, summary.retried, summary.completed) == (1, 0, 0)
    [stored] = await deliveries(db)  # left to the lanes' new holder, untouched
    assert (stored["status"], stored["attempts"], stored.get("last_error")) == ("pending", 0, None)
