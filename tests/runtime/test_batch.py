"""The batch slot (`mongoq.runtime.batch`) against a fake holder, once for every primitive.

The task queue and the group transport adapt it (`mongoq.tasks.batch`, `mongoq.groups.batch`);
their own suites check the adapters' fencing against the database. Here: what the slot itself
promises, whatever the holder does: an item found lost is never started nor settled, an item
starts only while its lease is known to hold, every item is counted exactly once, finished
items are completed together, a cancellation counts the item cut short and gives back the rest,
and a settle under way when the batch is cancelled still applies.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

import anyio
import pytest
from pymongo.errors import AutoReconnect

from mongoq.runtime.batch import run_batch
from mongoq.testing import ManualClock, settle
from tests.support.helpers import wait_for

LEASE = 30.0


class FakeHolder:
    """Records every call the slot makes, and counts what the slot reports. An item in `lost`
    is refused by renewals and completions; `gate` holds an item's handler until set; `fail`
    makes a handler raise; `settling`, when given, holds every failure settle until set."""

    done = "completed"

    def __init__(self, clock: ManualClock, *, lost: frozenset[str] = frozenset()) -> None:
        self.clock = clock
        self.until = clock.now() + timedelta(seconds=LEASE)
        self.lost = set(lost)
        self.calls: list[tuple[str, Any]] = []
        self.counts: Counter[str] = Counter()
        self.fail: dict[str, Exception] = {}
        self.gate: dict[str, anyio.Event] = {}
        self.settling: anyio.Event | None = None
        self.broken_settle = False

    def count(self, outcome: str, n: int) -> None:
        self.counts[outcome] += n

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
        if self.settling is not None:
            await self.settling.wait()
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


async def run(holder: FakeHolder, items: Sequence[str] = "abc", **options: Any) -> None:
    """`run_batch` over `items` (one letter each) with `holder`, counting into it."""
    await run_batch(
        holder, list(items), clock=holder.clock, lease=LEASE, count=holder.count, **options
    )


@asynccontextmanager
async def running(holder: FakeHolder) -> AsyncIterator[anyio.CancelScope]:
    """`run` over a, b and c in the background, let go until it waits (on a gate, a settle);
    yields the scope that cancels it. Leaving the block waits for the batch to end."""
    async with anyio.create_task_group() as group:
        group.start_soon(run, holder)
        await settle()
        yield group.cancel_scope


@pytest.mark.parametrize(
    ("lost", "counts"),
    [
        (frozenset(), Counter(completed=2, retried=1)),
        (frozenset({"c"}), Counter(completed=1, retried=1, lost=1)),
    ],
    ids=["all-held", "one-lost-at-completion"],
)
async def test_finished_items_are_completed_together_and_failures_settled_at_once(
    clock: ManualClock, lost: frozenset[str], counts: Counter[str]
) -> None:
    """One completion for every item finished, even one the holder then says it lost (the
    completion's answer is what counts it)."""
    holder = FakeHolder(clock, lost=lost)
    holder.fail["b"] = RuntimeError("b failed")
    await run(holder)
    assert holder.calls == [
        ("handle", "a"),
        ("handle", "b"),
        ("failure", "b"),
        ("handle", "c"),
        ("complete", [("a", "result a"), ("c", "result c")]),
    ]
    assert holder.counts == counts


async def test_a_lease_too_old_is_renewed_before_the_handler_starts_and_a_lost_one_never_runs(
    clock: ManualClock,
) -> None:
    holder = FakeHolder(clock, lost=frozenset({"b"}))

    async def advance_then_handle(item: str) -> Any:
        clock.set(holder.until)  # the claim's lease has run out by the next item
        return f"result {item}"

    async def unanswered(items: Sequence[str]) -> list[bool]:
        # The batch's own renewal (due long before) renews nothing: each item must be renewed
        # alone before it starts.
        holder.calls.append(("renew", list(items)))
        raise AutoReconnect("injected")

    holder.handle = advance_then_handle  # type: ignore[method-assign]
    holder.renew = unanswered  # type: ignore[method-assign]
    await run(holder)
    assert ("renew_one", "b") in holder.calls and ("renew_one", "c") in holder.calls
    completed = [call for call in holder.calls if call[0] == "complete"]
    assert completed == [("complete", [("a", "result a"), ("c", "result c")])]
    assert not any(call in holder.calls for call in [("failure", "b"), ("give_back", "b")])
    assert holder.counts == Counter(completed=2, lost=1)


@pytest.mark.parametrize(
    ("lost", "outcome"),
    [("b", "returns"), ("a", "returns"), ("a", "raises")],
    ids=["not-started-yet", "under-its-handler-which-returns", "under-its-handler-which-raises"],
)
async def test_a_renewal_that_finds_an_item_lost_leaves_it_alone(
    clock: ManualClock, lost: str, outcome: str
) -> None:
    """While a's handler runs, the keep-alive renews every item and finds one lost: b, not
    started yet, never starts; a is not settled, whether its handler then returns or raises.
    Either way it counts lost once, no lease is re-checked (the others' renewal is recent),
    and the others complete together."""
    holder = FakeHolder(clock)
    holder.gate["a"] = anyio.Event()
    if outcome == "raises":
        holder.fail["a"] = RuntimeError("a failed")
    async with running(holder):
        holder.lost = {lost}
        clock.advance(LEASE / 3)  # the keep-alive renews every item still held
        await settle()
        holder.gate["a"].set()
    rest = [item for item in "abc" if item != lost]
    assert holder.calls == [
        ("handle", "a"),
        ("renew", ["a", "b", "c"]),
        *[("handle", item) for item in rest if item != "a"],
        ("complete", [(item, f"result {item}") for item in rest]),
    ]
    assert holder.counts == Counter(completed=2, lost=1)


async def test_a_cancellation_counts_the_item_cut_short_and_gives_back_the_rest(
    clock: ManualClock,
) -> None:
    holder = FakeHolder(clock)
    holder.gate["b"] = anyio.Event()
    async with running(holder) as batch:
        batch.cancel()
    assert holder.calls[-3:] == [
        ("complete", [("a", "result a")]),
        ("cut_short", "b"),
        ("give_back", "c"),
    ]
    assert holder.counts == Counter(completed=1, retried=1, released=1)


async def test_a_failure_settle_under_way_when_the_batch_is_cancelled_still_applies(
    clock: ManualClock,
) -> None:
    """The cancellation comes while a's failure settle waits on the server: shielded, the
    settle ends and counts; b and c, never started, are given back (no attempt spent on b:
    the cancellation is noticed before its handler starts, not at its first wait)."""
    holder = FakeHolder(clock)
    holder.fail["a"] = RuntimeError("a failed")
    holder.settling = anyio.Event()
    holder.gate["b"] = anyio.Event()  # never set: b's handler would wait for the cancellation
    async with running(holder) as batch:
        assert holder.calls == [("handle", "a"), ("failure", "a")]
        batch.cancel()
        holder.settling.set()
    assert holder.calls == [
        ("handle", "a"),
        ("failure", "a"),
        ("give_back", "b"),
        ("give_back", "c"),
    ]
    assert holder.counts == Counter(retried=1, released=2)


async def test_a_settle_that_fails_counts_unknown_and_the_batch_goes_on(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    holder = FakeHolder(clock)
    holder.fail["a"] = RuntimeError("a failed")
    holder.broken_settle = True
    await run(holder, "ab", describe=lambda i: f"item {i}")
    assert holder.counts == Counter(unknown=1, completed=1)
    assert any(
        r.getMessage() == "settling item a failed; its lease will expire" for r in caplog.records
    )


async def test_an_empty_batch_does_nothing(clock: ManualClock) -> None:
    holder = FakeHolder(clock)
    await run(holder, [])
    assert holder.calls == [] and not holder.counts


class TellingHolder(FakeHolder):
    """A holder that tells what its lost items became (as the task queue's tells a cancel
    from a loss): `became` by item, or a driver error when `broken_tell`."""

    def __init__(self, clock: ManualClock, **options: Any) -> None:
        super().__init__(clock, **options)
        self.became: dict[str, str] = {}
        self.broken_tell = False

    async def lost_outcomes(self, items: Sequence[str]) -> list[str]:
        self.calls.append(("tell", list(items)))
        if self.broken_tell:
            raise AutoReconnect("injected")
        return [self.became.get(item, "lost") for item in items]


@pytest.mark.parametrize("broken", [False, True], ids=["told", "telling-fails"])
async def test_a_renewal_stops_a_lost_items_handler_first_and_counts_it_once(
    clock: ManualClock, broken: bool
) -> None:
    """a is lost under its running handler: the renewal stops the handler before it asks
    what a became, then counts it once, as told (``cancelled``) or, if the holder cannot
    tell, ``lost``; b and c complete."""
    holder = TellingHolder(clock)
    holder.became["a"] = "cancelled"
    holder.broken_tell = broken
    holder.gate["a"] = anyio.Event()  # never set: only the renewal ends a's handler
    with anyio.fail_after(10):  # a handler never stopped fails the test, not the suite
        async with running(holder):
            holder.lost = {"a"}
            clock.advance(LEASE / 3)
            await settle()
    assert ("handle", "b") in holder.calls and ("handle", "c") in holder.calls
    assert holder.counts == Counter(completed=2, **{"lost" if broken else "cancelled": 1})


async def test_a_completion_refused_is_counted_once_even_when_telling_what_it_became_fails(
    clock: ManualClock,
) -> None:
    """The final completion is refused for c, and telling what c became fails: c counts
    ``lost`` once, a and b ``completed``, nothing ``unknown``."""
    holder = TellingHolder(clock, lost=frozenset({"c"}))
    holder.broken_tell = True
    await run(holder)
    assert holder.counts == Counter(completed=2, lost=1)


# ------------------------------------------------- renewals that fail, race or answer late


async def test_a_renewal_before_a_start_that_raises_a_driver_error_is_retried_not_escaped(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The batch's renewals fail and a's handler runs until a third of the claim's lease is
    left: b's own renewal raises `AutoReconnect` once (an unknown outcome, which renews
    nothing), so b waits and renews again, then starts. Nothing escapes the batch, nothing is
    logged as an error, every item is counted once."""
    holder = FakeHolder(clock)
    holder.gate["a"] = anyio.Event()
    failures = {"renew_one": 1}

    async def renew(items: Sequence[str]) -> list[bool]:
        holder.calls.append(("renew", list(items)))
        raise AutoReconnect("injected: the keep-alive's renewal")

    async def renew_one(item: str) -> bool:
        holder.calls.append(("renew_one", item))
        if failures["renew_one"]:
            failures["renew_one"] -= 1
            raise AutoReconnect("injected: the renewal before the start")
        return True

    holder.renew = renew  # type: ignore[method-assign]
    holder.renew_one = renew_one  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING), anyio.fail_after(10):
        async with running(holder):
            clock.advance(LEASE * 2 / 3)  # a third of the claim's lease left
            holder.gate["a"].set()
            await wait_for(lambda: ("renew_one", "b") in holder.calls, "b's renewal")
            assert ("handle", "b") not in holder.calls  # not started on an unknown outcome
            clock.advance(4)  # past the retry, a ninth of the lease later
    assert holder.calls.count(("renew_one", "b")) == 2
    assert ("handle", "b") in holder.calls and ("handle", "c") in holder.calls
    assert holder.counts == Counter(completed=3)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_an_item_the_keep_alive_finds_lost_while_its_own_renewal_is_out_counts_once(
    clock: ManualClock,
) -> None:
    """b's renewal before its start is on its way when the keep-alive's renewal of the batch
    finds b lost (and counts it). When b's own renewal then says lost too, the slot neither
    fails on its bookkeeping nor counts b again."""
    holder = FakeHolder(clock)
    holder.gate["a"] = anyio.Event()
    answer = anyio.Event()
    broken = [True]

    async def renew(items: Sequence[str]) -> list[bool]:
        holder.calls.append(("renew", list(items)))
        if broken[0]:
            raise AutoReconnect("injected")
        return [item not in holder.lost for item in items]

    async def renew_one(item: str) -> bool:
        holder.calls.append(("renew_one", item))
        holder.lost.add(item)
        broken[0] = False
        await answer.wait()
        return False

    holder.renew = renew  # type: ignore[method-assign]
    holder.renew_one = renew_one  # type: ignore[method-assign]
    with anyio.fail_after(10):
        async with running(holder):
            clock.advance(LEASE * 2 / 3)
            holder.gate["a"].set()
            await wait_for(lambda: ("renew_one", "b") in holder.calls, "b's renewal")
            clock.advance(4)  # the keep-alive retries, and finds b lost
            await wait_for(lambda: holder.counts["lost"] == 1, "b counted lost")
            answer.set()
    assert ("handle", "b") not in holder.calls
    assert holder.counts == Counter(completed=2, lost=1)


async def test_a_renewal_answered_late_dates_the_lease_from_when_it_was_sent(
    clock: ManualClock,
) -> None:
    """The keep-alive's renewal is sent at a third of the lease and answered a full lease
    later. The lease it gave runs from when it was sent, so it has ended by then: b is
    renewed on its own before it starts (the slot does not take the reply's time for the
    renewal's)."""
    holder = FakeHolder(clock)
    holder.gate["a"] = anyio.Event()
    answer = anyio.Event()

    async def renew(items: Sequence[str]) -> list[bool]:
        holder.calls.append(("renew", list(items)))
        await answer.wait()
        return [True] * len(items)

    holder.renew = renew  # type: ignore[method-assign]
    with anyio.fail_after(10):
        async with running(holder):
            clock.advance(LEASE / 3)
            await wait_for(lambda: ("renew", ["a", "b", "c"]) in holder.calls, "the renewal")
            clock.advance(LEASE)  # the renewal's lease ran from then to here
            answer.set()
            await settle()
            holder.gate["a"].set()
    assert ("renew_one", "b") in holder.calls
    assert holder.counts == Counter(completed=3)
