"""OutboxDispatcher under faults: a claim answered after its lanes' lease ended starts nothing,
a cancelled `run_once` still completes what finished, a claim that fails is retried (a
driver error is not an empty outbox), and a stop that comes before `run` is not lost, nor
carried past the run it came during. The documents are read back; time moves only through the
manual clock.
"""

from __future__ import annotations

from typing import Any

import anyio

from mongoq.outbox import DeliveryContext, Event, OutboxRunSummary
from mongoq.testing import FaultInjector, ManualClock, Operation, instrument
from tests.support.helpers import in_background, napping, nth, wait_for
from tests.support.outbox_helpers import (
    ONLY_H,
    PREFIX,
    another,
    deliveries,
    dispatcher,
    event,
    lanes,
    new_outbox,
)


def lane_write(op: Operation) -> bool:
    """The claim's write of its lanes (taking a lane, listing what it hands out)."""
    return op.collection == f"{PREFIX}lanes" and op.name == "bulk_write"


async def test_a_claim_answered_after_its_lease_ended_starts_no_handler(
    odb: Any, clock: ManualClock
) -> None:
    """A's claim writes its lane at T (lease to T+30) and is answered at T+35; B took the lane
    over at T+31 and holds the delivery. A starts nothing, leaves B's claim as it is, and
    counts the delivery once (lost: B's claim changed its generation)."""
    faults = FaultInjector()
    outbox_a = await new_outbox(instrument(odb, faults), clock, subscriptions=ONLY_H)
    outbox_b = another(odb, clock, ONLY_H)
    await outbox_b.publish(event(1), session=None)
    started: list[str] = []

    async def handler(received: Event, context: DeliveryContext) -> None:
        started.append(context.delivery.worker_id)

    a = dispatcher(outbox_a, {"h": handler}, worker_id="A")
    held = faults.pause_after("bulk_write", match=lane_write)
    summaries: list[OutboxRunSummary] = []
    async with anyio.create_task_group() as group:

        async def run_a() -> None:
            summaries.append(await a.run_once())

        group.start_soon(run_a)
        await wait_for(held.reached.is_set, "A's lane write to be applied")
        clock.advance(31)
        taken = await outbox_b.claim("B", ["h"], limit=1)
        assert [d.event.id for d in taken] == ["e1"]
        clock.advance(4)
        held.release()
        await wait_for(lambda: bool(summaries), "A's run_once to return")

    assert started == []
    (stored,) = await deliveries(odb)
    assert stored["claims"] == taken[0].generation  # B's claim, untouched by A
    held_by = {doc["owner"] for doc in (await lanes(odb)).values() if doc.get("owner")}
    assert held_by == {"B"}
    assert (summaries[0].claimed, summaries[0].lost, summaries[0].released) == (1, 1, 0)


async def test_a_cancelled_run_once_completes_what_finished_before_it_returns(
    odb: Any, clock: ManualClock
) -> None:
    """e1's handler finishes and its completion is on its way (held); e2's finishes too and
    waits for the next completion; then `run_once` is cancelled. Both are completed before it
    returns, and its summary accounts for both."""
    faults = FaultInjector()
    outbox = await new_outbox(instrument(odb, faults), clock, subscriptions=ONLY_H)
    await outbox.publish([event(1), event(2)], session=None)
    finished: list[str] = []
    second = anyio.Event()

    async def handler(received: Event, context: DeliveryContext) -> None:
        if received.id == "e2":
            await second.wait()
        finished.append(received.id)

    d = dispatcher(outbox, {"h": handler}, concurrency=2)
    completing = faults.pause_before("delete_many")
    summaries: list[OutboxRunSummary] = []
    async with anyio.create_task_group() as group:

        async def run() -> None:
            summaries.append(await d.run_once())

        group.start_soon(run)
        await wait_for(completing.reached.is_set, "e1's completion to be sent")
        second.set()
        await wait_for(lambda: finished == ["e1", "e2"], "e2's handler to finish")
        group.cancel_scope.cancel()
        completing.release()

    assert await deliveries(odb) == []  # both completed
    assert d.summary.claimed == 2 and d.summary.completed == 2


async def test_a_stop_before_run_makes_it_return_at_once_and_the_next_run_starts_afresh(
    odb: Any, clock: ManualClock
) -> None:
    """`stop()` called before `run()` (its loop not running yet) is not lost: that run claims
    nothing and returns. The run after it dispatches as usual."""
    outbox = await new_outbox(odb, clock, subscriptions=ONLY_H)
    await outbox.publish(event(1), session=None)
    ran: list[str] = []

    async def handler(received: Event, context: DeliveryContext) -> None:
        ran.append(received.id)

    d = dispatcher(outbox, {"h": handler})
    d.stop()
    with anyio.fail_after(10):
        first = await d.run(stop_when_empty=True)
    assert (first.claimed, ran, len(await deliveries(odb))) == (0, [], 1)
    with anyio.fail_after(10):
        second = await d.run(stop_when_empty=True)
    assert (second.completed, ran, await deliveries(odb)) == (1, ["e1"], [])


async def test_a_claim_that_fails_is_retried_after_a_nap_not_taken_for_an_empty_outbox(
    odb: Any, clock: ManualClock
) -> None:
    """The first claim's scan fails (an election): `run(stop_when_empty=True)` naps
    `poll_interval` and claims again, and e1 runs, rather than returning as if nothing were
    there."""
    faults = FaultInjector()
    outbox = await new_outbox(instrument(odb, faults), clock, subscriptions=ONLY_H)
    await outbox.publish(event(1), session=None)
    faults.fail_before("find", collection=f"{PREFIX}deliveries", match=nth(0))
    ran: list[str] = []

    async def handler(received: Event, context: DeliveryContext) -> None:
        ran.append(received.id)

    d = dispatcher(outbox, {"h": handler}, poll_interval=5)
    summary = await in_background(
        clock, d.run(stop_when_empty=True), advance=5, started=lambda: napping(d)
    )
    assert (summary.claimed, summary.completed, ran) == (1, 1, ["e1"])
    assert await deliveries(odb) == []


async def test_a_stop_while_a_run_hands_its_lanes_back_does_not_stop_the_next_run(
    odb: Any, clock: ManualClock
) -> None:
    """`stop()` comes while the run hands its lanes back (after its loop ended): it was for
    that run, which is returning. The next run dispatches e2."""
    faults = FaultInjector()
    outbox = await new_outbox(instrument(odb, faults), clock, subscriptions=ONLY_H)
    await outbox.publish(event(1), session=None)
    seen: list[str] = []

    async def handler(received: Event, context: DeliveryContext) -> None:
        seen.append(received.id)

    d = dispatcher(outbox, {"h": handler})
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(d.run)  # only stop() ends it
            await wait_for(lambda: seen == ["e1"] and napping(d), "e1 to run, then a nap")
            # The clock stands still: the next read of the lanes is the hand-back's.
            pause = faults.pause_before("find", collection=f"{PREFIX}lanes")
            d.stop()
            await pause.reached.wait()  # relinquish reads the lanes it holds
            d.stop()
            pause.release()
    await outbox.publish(event(2), session=None)
    with anyio.fail_after(10):
        second = await d.run(stop_when_empty=True)
    assert (second.completed, seen) == (2, ["e1", "e2"])  # the dispatcher's totals
    assert await deliveries(odb) == []


async def test_a_settle_without_an_answer_is_counted_unknown_once(
    odb: Any, clock: ManualClock
) -> None:
    """e1's completion is applied and its reply lost; e2's reschedule fails before it applies.
    Each delivery claimed is counted once: e1 and e2 ``unknown`` (neither the dispatcher nor
    anyone else can tell what became of them), and the database says what did."""
    faults = FaultInjector()
    outbox = await new_outbox(instrument(odb, faults), clock, subscriptions=ONLY_H)
    await outbox.publish([event(1), event(2)], session=None)

    async def handler(received: Event, context: DeliveryContext) -> None:
        if received.id == "e2":
            raise RuntimeError("e2 fails")

    faults.fail_after("delete_many")  # the completion of e1 applies; its reply is lost
    faults.fail_before("update_one", collection=f"{PREFIX}deliveries")  # e2's reschedule
    d = dispatcher(outbox, {"h": handler}, concurrency=2)
    summary = await d.run_once()

    assert summary == OutboxRunSummary(claimed=2, unknown=2)
    assert [doc["event_id"] for doc in await deliveries(odb)] == ["e2"]  # e1 completed
