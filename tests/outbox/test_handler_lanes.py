"""Each handler's lanes are its own (issue 14): dispatchers of disjoint handlers never wait for
each other, a handler's lanes are given once (one slot a handler, numbered in one document),
and a set-up cut short is finished by the next one.

Every test reads the lane, slot and delivery documents back.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from pymongo.errors import AutoReconnect

from mongoq.outbox import DeliveryContext, Event, OutboxRunSummary, lane_of
from mongoq.testing import CommandCounter, FaultInjector, ManualClock, instrument
from tests.support.outbox_helpers import (
    PREFIX,
    SUBSCRIPTIONS,
    another,
    deliveries,
    delivery_of,
    dispatcher,
    lane_docs,
    lane_ids_of,
    new_outbox,
    order,
    paid,
    pairs,
)


async def slots(db: Any) -> dict[str, Any] | None:
    doc: dict[str, Any] | None = await db[f"{PREFIX}lanes"].find_one({"_id": "slots"})
    return doc


def by_handler(stored: dict[int, dict[str, Any]]) -> dict[str, list[int]]:
    """Each handler's lane numbers, as stored."""
    numbers: dict[str, list[int]] = {}
    for lane_id in sorted(stored):
        numbers.setdefault(stored[lane_id]["handler"], []).append(stored[lane_id]["n"])
    return numbers


async def test_dispatchers_of_disjoint_handlers_progress_side_by_side_in_one_lane(
    odb: Any, clock: ManualClock
) -> None:
    """A mail dispatcher runs e1 of key k and holds mail's lane of k; a stats dispatcher of
    another process drains every stats delivery of k meanwhile, in order (one lane for all
    handlers made it wait for mail's lane)."""
    a = await new_outbox(odb, clock)
    b = another(odb, clock)
    await a.publish([order(n, "k") for n in (1, 2, 3)], session=None)
    started, release = anyio.Event(), anyio.Event()
    ran: list[tuple[str, str]] = []

    async def mail(event: Event, context: DeliveryContext) -> None:
        ran.append(("mail", event.id))
        started.set()
        await release.wait()

    async def stats(event: Event, context: DeliveryContext) -> None:
        ran.append(("stats", event.id))
        await anyio.lowlevel.checkpoint()

    number = lane_of("k")
    mail_lane = await lane_ids_of(odb, "mail") + number
    stats_lane = await lane_ids_of(odb, "stats") + number
    with anyio.fail_after(10):  # a hang guard only: time moves by the manual clock
        async with anyio.create_task_group() as group:
            mailer = dispatcher(a, {"mail": mail}, worker_id="mailer", concurrency=1)
            group.start_soon(partial(mailer.run, stop_when_empty=True))
            await started.wait()
            counted = dispatcher(b, {"stats": stats}, worker_id="counter", concurrency=1)
            summary = await counted.run(stop_when_empty=True)
            assert summary == OutboxRunSummary(claimed=3, completed=3)
            assert ran == [("mail", "e1"), ("stats", "e1"), ("stats", "e2"), ("stats", "e3")]
            stored = await lane_docs(odb)
            assert stored[mail_lane]["owner"] == "mailer"  # running e1 all along
            assert [e["d"] for e in stored[mail_lane]["in_flight"]] == [
                (await delivery_of(odb, "e1", "mail") or {}).get("_id")
            ]
            assert stored[stats_lane]["owner"] is None  # handed back, drained
            release.set()
    assert [r for r in ran if r[0] == "mail"] == [("mail", "e1"), ("mail", "e2"), ("mail", "e3")]
    assert await deliveries(odb) == []


async def test_claimers_of_disjoint_handlers_progress_side_by_side_in_one_lane_number(
    odb: Any, clock: ManualClock
) -> None:
    """Each handler's lanes are its own (issue 14): while A holds mail's lane of k, B claims
    stats's deliveries of the same key, and each key keeps its order per handler."""
    outbox = await new_outbox(odb, clock)
    await outbox.publish([order(1, "k"), order(2, "k")], session=None)
    mail = await outbox.claim("A", ["mail"], limit=5)
    stats = await outbox.claim("B", ["stats"], limit=5)
    assert (pairs(mail), pairs(stats)) == ([("e1", "mail")], [("e1", "stats")])
    assert mail[0].lane_id == stats[0].lane_id == lane_of("k")
    stored_lanes = await lane_docs(odb)
    mail_lane = stored_lanes[await lane_ids_of(odb, "mail") + lane_of("k")]
    stats_lane = stored_lanes[await lane_ids_of(odb, "stats") + lane_of("k")]
    assert (mail_lane["owner"], stats_lane["owner"]) == ("A", "B")
    assert await outbox.claim("B", ["stats"]) == []  # e2 of stats waits behind e1
    assert await outbox.complete(stats[0])
    assert pairs(await outbox.claim("B", ["stats"])) == [("e2", "stats")]  # A still runs e1
    assert await outbox.complete(mail[0])
    assert pairs(await outbox.claim("A", ["mail"])) == [("e2", "mail")]


async def test_a_page_of_another_owners_deliveries_in_one_lane_number_is_read_past(
    odb: Any, clock: ManualClock
) -> None:
    """A holds stats's lane of number n, 40 stats deliveries due there. X claims for every
    handler: mail's lane n is free, so X's scan reads lane number n, and its first page is all
    A's (dropped, never picked); the next page starts after them and finds x1."""
    outbox = await new_outbox(odb, clock)
    number = 9
    ids = [f"u{i}" for i in range(20_000) if lane_of(f"u{i}") == number][:41]
    await outbox.publish([paid(i) for i in ids], session=None)
    assert len(await outbox.claim("A", ["stats"], limit=1)) == 1  # A holds stats's lane n
    clock.advance(1)
    await outbox.publish(order(1), session=None)
    [claimed] = await another(odb, clock).claim("X", limit=1)
    assert claimed.event.id == "e1"
    stored = await lane_docs(odb)
    assert stored[await lane_ids_of(odb, "stats") + number]["owner"] == "A"
    assert stored[await lane_ids_of(odb, claimed.handler) + lane_of("e1")]["owner"] == "X"


async def test_a_claim_does_not_scan_a_handler_whose_every_lane_another_owner_holds(
    odb: Any, clock: ManualClock, counter: CommandCounter
) -> None:
    """A holds all 256 of stats's lanes. X's claims for every handler scan mail's deliveries
    only: stats's, all in A's lanes, would be read and dropped on every claim."""
    outbox = await new_outbox(odb, clock)
    ids: dict[int, str] = {}
    for i in range(100_000):
        ids.setdefault(lane_of(f"s{i}"), f"s{i}")
        if len(ids) == 256:
            break
    await outbox.publish([paid(i) for i in ids.values()], session=None)
    assert len(await outbox.claim("A", ["stats"], limit=256)) == 256
    await outbox.publish(order(1), session=None)
    x = another(instrument(odb, counter), clock)
    counter.record = True
    [claimed] = await x.claim("X", limit=5)
    assert (claimed.event.id, claimed.handler) == ("e1", "mail")
    scans = [
        op.filter for op in counter.operations
        if op.collection == f"{PREFIX}deliveries" and op.name == "find" and "lane" in op.filter
    ]  # fmt: skip
    assert scans and all(f["handler"] == {"$in": ["mail"]} for f in scans), scans
    assert (await lane_docs(odb))[await lane_ids_of(odb, "stats") + lane_of("e1")]["owner"] == "A"


async def test_a_publish_gives_lanes_to_the_handlers_subscribed_to_every_event_type(
    odb: Any, clock: ManualClock
) -> None:
    """A process subscribing "audit" to every type ("*") publishes without a set-up of its
    own: its first publish gives audit its lanes, and the delivery is claimed."""
    await new_outbox(odb, clock)
    wide = another(odb, clock, subscriptions={**SUBSCRIPTIONS, "*": ["audit"]})
    await wide.publish(paid("p1"), session=None)
    assert (await slots(odb) or {}).get("handlers") == ["stats", "mail", "audit"]
    assert len(await lane_docs(odb)) == 768
    [claimed] = await another(odb, clock).claim("Y", ["audit"])
    assert (claimed.event.id, claimed.handler) == ("p1", "audit")


async def test_every_handler_gets_one_slot_of_256_lanes_and_setup_changes_nothing_after(
    odb: Any, clock: ManualClock
) -> None:
    """The first handler set up has lanes 0-255 (an earlier version's lane ids), the next
    256-511; a second set-up, and another instance's, write nothing."""
    await new_outbox(odb, clock)
    stored = await lane_docs(odb)
    assert sorted(stored) == list(range(512))
    assert by_handler(stored) == {"stats": list(range(256)), "mail": list(range(256))}
    assert (await slots(odb) or {}).get("handlers") == ["stats", "mail"]
    before = [await lane_docs(odb), await slots(odb)]
    await another(odb, clock).setup()
    assert [await lane_docs(odb), await slots(odb)] == before


async def test_set_ups_racing_on_a_new_outbox_give_each_handler_one_slot(
    odb: Any, clock: ManualClock
) -> None:
    """Three processes set the outbox up at once, command by command: one slot a handler, no
    number skipped, 256 lanes each."""
    db = instrument(odb, FaultInjector(yield_between=True))
    outboxes = [another(db, clock) for _ in range(3)]
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            for outbox in outboxes:
                group.start_soon(outbox.setup)
    assert sorted((await slots(odb) or {}).get("handlers", [])) == ["mail", "stats"]
    stored = await lane_docs(odb)
    assert sorted(stored) == list(range(512))
    assert {h: len(ns) for h, ns in by_handler(stored).items()} == {"mail": 256, "stats": 256}


async def test_a_set_up_cut_short_while_writing_lanes_is_finished_by_the_next_one(
    odb: Any, clock: ManualClock
) -> None:
    """The connection breaks as the set-up writes the lanes (the slots given already): the
    first publish of another instance writes them. Lanes missing from a slot (a seeding
    stopped half-way) are written by the next set-up."""
    faults = FaultInjector()
    faults.fail_before("insert_many", collection=f"{PREFIX}lanes")
    with pytest.raises(AutoReconnect):
        await another(instrument(odb, faults), clock).setup()
    assert (await slots(odb) or {}).get("handlers") == ["stats", "mail"]
    assert await lane_docs(odb) == {}
    await another(odb, clock).publish(order(1), session=None)
    stored = await lane_docs(odb)
    assert sorted(stored) == list(range(512))
    assert by_handler(stored) == {"stats": list(range(256)), "mail": list(range(256))}

    await odb[f"{PREFIX}lanes"].delete_many({"_id": {"$gte": 300, "$lt": 400}})
    await odb[f"{PREFIX}lanes"].update_one({"_id": 299}, {"$set": {"owner": "A"}})
    await another(odb, clock).setup()
    after = await lane_docs(odb)
    assert sorted(after) == list(range(512))
    assert after[299]["owner"] == "A"  # what was there is left alone
    assert by_handler(after) == by_handler(stored)


async def test_a_claim_naming_a_handler_without_lanes_creates_none(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    before = [await lane_docs(odb), await slots(odb)]
    assert await outbox.claim("A", ["nobody"]) == []
    assert await outbox.claim("A", ["nobody", "mail"]) == []
    assert [await lane_docs(odb), await slots(odb)] == before


async def test_a_claim_of_every_handler_finds_the_lanes_another_process_gave_a_handler(
    odb: Any, clock: ManualClock
) -> None:
    """A claims for every handler; another process publishes to a handler nobody had: its
    first publish gives it lanes 512-767, and A's next claim (its last came up short) reads
    them and claims its delivery there."""
    a = await new_outbox(odb, clock)
    assert await a.claim("A") == []
    other = another(odb, clock, subscriptions={**SUBSCRIPTIONS, "audit.due": ["audit"]})
    await other.publish(Event(id="x", type="audit.due"), session=None)
    assert (await slots(odb) or {}).get("handlers") == ["stats", "mail", "audit"]
    [claimed] = await a.claim("A")
    assert (claimed.event.id, claimed.handler) == ("x", "audit")
    assert (await lane_docs(odb))[512 + lane_of("x")]["owner"] == "A"


async def test_an_owner_that_changes_handlers_reads_the_lanes_it_held_of_the_others(
    odb: Any, clock: ManualClock, counter: CommandCounter
) -> None:
    """X claimed for mail, then let its lanes go (`relinquish`). Its claims for stats read
    mail's lane of k again (this instance had it as held): they neither try to hand it back
    on every claim (a write that fails, and the claim run twice) nor leave it out."""
    outbox = await new_outbox(instrument(odb, counter), clock)
    await outbox.publish([order(n, "k") for n in (1, 2)], session=None)
    [mail] = await outbox.claim("X", ["mail"])
    assert await outbox.relinquish("X") == 1
    assert await outbox.complete(mail)
    ran: list[tuple[str, str]] = []
    for _ in range(3):
        counter.reset()
        got = await outbox.claim("X", ["stats"], limit=1)
        ran += pairs(got)
        assert counter.counts.get(f"{PREFIX}lanes.bulk_write", 0) <= 1  # no second round
        assert await outbox.complete_many(got) == [True] * len(got)
    assert ran == [("e1", "stats"), ("e2", "stats")]
    assert (await lane_docs(odb))[await lane_ids_of(odb, "mail") + lane_of("k")]["owner"] is None


async def test_a_lane_write_whose_reply_was_lost_is_read_again_by_a_claim_of_other_handlers(
    odb: Any, clock: ManualClock
) -> None:
    """X's claim for mail wrote mail's lane of k (e1 listed) but its reply was lost. X then
    claims for stats only and keeps renewing its lanes: its next claim reads that lane, frees
    e1 (never handed out, nothing charged) and hands the lane back, so Y claims e1."""
    faults = FaultInjector()
    outbox = await new_outbox(instrument(odb, faults), clock)
    await outbox.publish(order(1, "k"), session=None)
    faults.fail_after("bulk_write", collection=f"{PREFIX}lanes")
    with pytest.raises(AutoReconnect):
        await outbox.claim("X", ["mail"])
    mail_lane = await lane_ids_of(odb, "mail") + lane_of("k")
    assert (await lane_docs(odb))[mail_lane]["owner"] == "X"
    assert pairs(await outbox.claim("X", ["stats"])) == [("e1", "stats")]
    await outbox.extend_lease("X")
    assert (await lane_docs(odb))[mail_lane]["owner"] is None
    [again] = await another(odb, clock).claim("Y", ["mail"])
    assert (again.event.id, again.handler, again.attempt) == ("e1", "mail", 1)


async def test_a_requeue_counts_itself_in_its_handlers_lane(odb: Any, clock: ManualClock) -> None:
    """A dead mail delivery requeued: mail's lane of its number counts it (twice: before and
    after it turns pending), stats's lane of that number does not."""
    outbox = await new_outbox(odb, clock)
    await outbox.publish(order(1, "k"), session=None)
    [mail] = await outbox.claim("A", ["mail"])
    assert await outbox.bury(mail, error="poison")
    assert await outbox.requeue("e1", "mail")
    stored = await lane_docs(odb)
    number = lane_of("k")
    assert stored[await lane_ids_of(odb, "mail") + number]["requeued"] == 2
    assert stored[await lane_ids_of(odb, "stats") + number]["requeued"] == 0
    [again] = await outbox.claim("A", ["mail"])  # A still holds the lane
    assert (again.event.id, again.handler) == ("e1", "mail")
