"""The batch slot (`mongoq.runtime.batch`) against a fake holder, once for every primitive.

The task queue and the group transport adapt it (`mongoq.tasks.batch`, `mongoq.groups.batch`);
their own suites check the adapters' fencing against the database. Here: what the slot itself
promises, whatever the holder does: an item found lost is never started nor settled, an item
starts only while its lease is known to hold, every item is counted exactly once, finished
items are completed together, a cancellation counts the item cut short and gives back the rest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import anyio
import pytest
from pymongo.errors import AutoReconnect

from mongoq.runtime.batch import run_batch
from mongoq.testing import ManualClock, settle

LEASE = 30.0


class FakeHolder:
    done = "completed"

    def __init__(self, clock: ManualClock, *, lost: frozenset[str] = frozenset()) -> None:
        self.clock = clock
        self.until = clock.now() + timedelta(seconds=LEASE)
        self.lost = set(lost)
        self.calls: list[tuple[str, Any]] = []
        self.fail: dict[str, Exception] = {}
        self.gate: dict[str, anyio.Event] = {}
        self.broken_settle = False

    def lease_end(self, item: str) -> datetime:
        return self.until

    async def renew(self, items: Sequence[str]) -> list[bool]:
        self.calls.append(("renew", list(items)))
        return [item not in self.lost for item in items]

    async def renew_one(self, item: str) -> bool:
        self.calls.append(("renew_one", item))
        return item not in self.lost

    async def handle(self, item: str) -> Any:
        self.calls.append(("handle", item))
        if item in self.gate:
            await self.gate[item].wait()
        if item in self.fail:
            raise self.fail[item]
        return f"result {item}"

    async def settle_failure(self, item: str, error: Exception) -> str:
        self.calls.append(("failure", item))
        if self.broken_settle:
            raise AutoReconnect("injected")
        return "retried"

    async def complete(self, items: Sequence[str], results: Sequence[Any]) -> list[bool]:
        self.calls.append(("complete", list(zip(items, results, strict=True))))
        return [item not in self.lost for item in items]

    async def settle_cut_short(self, item: str) -> str:
        self.calls.append(("cut_short", item))
        return "retried"

    async def give_back(self, item: str) -> str:
        self.calls.append(("give_back", item))
        return "released"


def counter() -> tuple[Counter[str], Any]:
    counts: Counter[str] = Counter()

    def count(outcome: str, n: int) -> None:
        counts[outcome] += n

    return counts, count


async def test_finished_items_are_completed_together_and_failures_settled_at_once(
    clock: ManualClock,
) -> None:
    holder = FakeHolder(clock)
    holder.fail["b"] = RuntimeError("b failed")
    counts, count = counter()
    await run_batch(holder, ["a", "b", "c"], clock=clock, lease=LEASE, count=count)
    assert holder.calls == [
        ("handle", "a"),
        ("handle", "b"),
        ("failure", "b"),
        ("handle", "c"),
        ("complete", [("a", "result a"), ("c", "result c")]),
    ]
    assert counts == Counter(completed=2, retried=1)


async def test_a_lease_too_old_is_renewed_before_the_handler_starts_and_a_lost_one_never_runs(
    clock: ManualClock,
) -> None:
    holder = FakeHolder(clock, lost={"b"})
    counts, count = counter()

    async def advance_then_handle(item: str) -> Any:
        clock.set(holder.until)  # the claim's lease has run out by the next item
        return f"result {item}"

    holder.handle = advance_then_handle  # type: ignore[method-assign]
    await run_batch(holder, ["a", "b", "c"], clock=clock, lease=LEASE, count=count)
    assert ("renew_one", "b") in holder.calls and ("renew_one", "c") in holder.calls
    completed = [call for call in holder.calls if call[0] == "complete"]
    assert completed == [("complete", [("a", "result a"), ("c", "result c")])]
    assert not any(call in holder.calls for call in [("failure", "b"), ("give_back", "b")])
    assert counts == Counter(completed=2, lost=1)


async def test_a_renewal_that_finds_an_item_lost_leaves_it_alone(clock: ManualClock) -> None:
    holder = FakeHolder(clock)
    holder.gate["a"] = anyio.Event()
    counts, count = counter()
    async with anyio.create_task_group() as group:
        group.start_soon(
            lambda: run_batch(holder, ["a", "b", "c"], clock=clock, lease=LEASE, count=count)
        )
        await settle()
        holder.lost = {"b"}
        clock.advance(LEASE / 3)  # the keep-alive renews every item still held
        await settle()
        holder.gate["a"].set()
    assert ("renew", ["a", "b", "c"]) in holder.calls
    assert ("handle", "b") not in holder.calls
    assert counts == Counter(completed=2, lost=1)


async def test_a_cancellation_counts_the_item_cut_short_and_gives_back_the_rest(
    clock: ManualClock,
) -> None:
    holder = FakeHolder(clock)
    holder.gate["b"] = anyio.Event()
    counts, count = counter()
    async with anyio.create_task_group() as group:
        group.start_soon(
            lambda: run_batch(holder, ["a", "b", "c"], clock=clock, lease=LEASE, count=count)
        )
        await settle()
        group.cancel_scope.cancel()
    assert holder.calls[-3:] == [
        ("complete", [("a", "result a")]),
        ("cut_short", "b"),
        ("give_back", "c"),
    ]
    assert counts == Counter(completed=1, retried=1, released=1)


async def test_a_settle_that_fails_counts_unknown_and_the_batch_goes_on(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    holder = FakeHolder(clock)
    holder.fail["a"] = RuntimeError("a failed")
    holder.broken_settle = True
    counts, count = counter()
    await run_batch(
        holder, ["a", "b"], clock=clock, lease=LEASE, count=count, describe=lambda i: f"item {i}"
    )
    assert counts == Counter(unknown=1, completed=1)
    assert any(
        r.getMessage() == "settling item a failed; its lease will expire" for r in caplog.records
    )


async def test_an_empty_batch_does_nothing(clock: ManualClock) -> None:
    holder = FakeHolder(clock)
    counts, count = counter()
    await run_batch(holder, [], clock=clock, lease=LEASE, count=count)
    assert holder.calls == [] and not counts
