"""What the outbox's calls cost in commands, and that what they no longer send was not needed.

A claim that takes all it asked for trusts its instance's lane view (`LaneView`) and reads no
lane document: the scan, the events of its picks and the lane write. These tests count the
commands of each call, then show that what the view does not know yet is learnt in time: a
lane another instance handed back (the next claim that comes up short reads the lanes again),
a requeue on another instance (the listing write fails and the claim tries again), a settle
through another `AsyncOutbox` object (counted as running until the view is read again, never
handed out twice). A publish without a transaction is two commands for new events: handlers are
listed on an event when their delivery finishes, and the crash windows that opens are covered.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

import anyio
import pytest
from pymongo.errors import PyMongoError

from mongoq import _driver
from mongoq.outbox import AsyncOutbox, Event, PublishResult, schema
from mongoq.outbox.claim import VIEW_TTL
from mongoq.outbox.schema import PUBLISH_GRACE
from mongoq.testing import CommandCounter, FaultInjector, ManualClock, instrument, settle
from tests.support.outbox_helpers import (
    PREFIX,
    another,
    attempts,
    bury_head,
    deliveries,
    delivery_of,
    drain,
    events,
    faulty_outbox,
    keys_in_distinct_lanes,
    lane_docs,
    new_outbox,
    order,
    paid,
    ran,
)


async def counted(db: Any, clock: ManualClock) -> tuple[AsyncOutbox, CommandCounter]:
    counter = CommandCounter()
    outbox = await new_outbox(instrument(db, counter), clock)
    counter.reset()
    return outbox, counter


def names(counter: CommandCounter) -> Counter[str]:
    """The commands counted since the last reset, without the collection prefix."""
    return Counter({name.removeprefix(PREFIX): n for name, n in counter.counts.items()})


# ---------------------------------------------------------------------------- what a call costs


async def test_a_claim_that_takes_all_it_asks_for_reads_no_lane_document(
    odb: Any, clock: ManualClock
) -> None:
    outbox, counter = await counted(odb, clock)
    await outbox.publish([paid(f"u{n}") for n in range(5)], session=None)
    assert names(counter) == {"events.bulk_write": 1, "deliveries.insert_many": 1}
    counter.reset()
    first = await outbox.claim("A", limit=1)  # the first claim reads the lanes
    assert names(counter)["lanes.find"] == 1
    assert await outbox.complete(first[0])
    for _ in range(3):
        counter.reset()
        [delivery] = await outbox.claim("A", limit=1)
        assert names(counter) == {"deliveries.find": 1, "events.find": 1, "lanes.bulk_write": 1}
        counter.reset()
        assert await outbox.complete(delivery)
        assert names(counter) == {"events.bulk_write": 1, "deliveries.delete_one": 1}
    # What the lanes say is what the view said: one lane held, listing the last one handed out.
    held = [lane for lane in (await lane_docs(odb)).values() if lane["owner"] == "A"]
    assert [len(lane["in_flight"]) for lane in held] == [1]


async def test_a_keyed_claim_looks_up_every_key_of_a_wave_in_one_query(
    odb: Any, clock: ManualClock
) -> None:
    outbox, counter = await counted(odb, clock)
    keys = [f"k{n}" for n in range(20)]
    await outbox.publish([paid(f"{k}-{n}", k) for n in (1, 2) for k in keys], session=None)
    counter.reset()
    first = await outbox.claim("A", limit=20)
    assert sorted(d.event.id for d in first) == sorted(f"{k}-1" for k in keys)
    assert names(counter)["deliveries.find"] == 2  # the scan, then what comes before each head
    # The seconds of each key wait behind the heads that run: looked up again, none handed out.
    counter.reset()
    assert await outbox.claim("A", limit=20) == []
    assert await outbox.complete_many(first) == [True] * 20
    assert sorted(d.event.id for d in await outbox.claim("A", limit=20)) == sorted(
        f"{k}-2" for k in keys
    )


# ------------------------------------------------------------------- what the view learns in time


async def test_a_lane_another_instance_hands_back_is_claimed_by_the_next_short_claim(
    odb: Any, clock: ManualClock
) -> None:
    a = await new_outbox(odb, clock)
    b = another(odb, clock)
    k1, k2 = keys_in_distinct_lanes(2)
    await a.publish([paid("x", k1), paid("y", k2), paid("z", k2)], session=None)
    [x] = await a.claim("A", limit=1)  # A's view: every other lane free
    [y] = await b.claim("B", limit=1)  # B takes k2's lane
    assert (x.event.id, y.event.id) == ("x", "y")
    assert await a.claim("A", limit=1) == []  # k2's lane is B's: short, A reads the lanes
    assert await b.complete(y)
    # A claim of B's for mail hands back B's stats lane of k2 (it runs nothing any more).
    assert await b.claim("B", ["mail"]) == []
    assert (await lane_docs(odb))[y.lane_id]["owner"] is None
    assert ran(await a.claim("A", limit=1)) == [("z", 1)]  # seen at once: A came up short


async def test_a_requeue_on_another_instance_fails_the_listing_of_a_cached_lane(
    odb: Any, clock: ManualClock
) -> None:
    """A's view trusts k's lane as A left it (A's last claim filled). e1 is requeued by another
    instance: A's take of k's lane is fenced on the lane's requeue count, fails, and the claim
    tries once more from the lanes as they are; e1 runs before e2, nothing is charged."""
    counter = CommandCounter()
    a = await new_outbox(instrument(odb, counter), clock)
    await bury_head(a)  # e1 dead; e2 and e3 wait
    await a.publish(order(5), session=None)
    mail = await a.claim("A", ["mail"], limit=1)  # fills: the view is trusted
    assert ran(mail) == [("e5", 1)]
    assert await another(odb, clock).requeue("e1", "stats") is True
    counter.reset()
    got = await a.claim("A", ["stats"], limit=1)
    assert ran(got) == [("e1", 1)]
    calls = names(counter)
    assert (calls["lanes.bulk_write"], calls["lanes.find"]) == (2, 2)  # failed, read, again
    assert attempts(await deliveries(odb))["e2"] == (0, 0)
    assert await a.complete_many([*got, *mail]) == [True, True]
    rest = [d.event.id for d in await drain(a, "A")]
    assert sorted(rest) == ["e2", "e3", "e5"] and rest.index("e2") < rest.index("e3")


async def test_a_settle_through_another_object_counts_as_running_until_the_view_is_read(
    odb: Any, clock: ManualClock
) -> None:
    """x (key k) was claimed through `a` and completed through `b` (another object): `a` still
    counts it as running, so k's next waits, until `a` reads the lanes again (a second later,
    or at a claim that comes up short). Nothing runs twice meanwhile."""
    a = await new_outbox(odb, clock)
    b = another(odb, clock)
    [k] = keys_in_distinct_lanes(1)
    await a.publish([paid("x", k), paid("x2", k), paid("u1"), paid("u2")], session=None)
    [x] = await a.claim("A", limit=1)
    assert await b.complete(x)
    assert ran(await a.claim("A", limit=1)) == [("u1", 1)]  # x2 waits: x counts as running
    clock.advance(VIEW_TTL)
    got = await a.claim("A", limit=2)  # the view is read again: x is gone, x2 is k's head
    assert sorted(d.event.id for d in got) == ["u2", "x2"]


# ------------------------------------------------------------------- publish without a transaction


async def test_a_publish_costs_two_commands_and_a_replay_three(
    odb: Any, clock: ManualClock
) -> None:
    outbox, counter = await counted(odb, clock)
    assert await outbox.publish([order(1), order(2)], session=None) == PublishResult(2, 4)
    assert names(counter) == {"events.bulk_write": 1, "deliveries.insert_many": 1}
    counter.reset()
    assert await outbox.publish([order(1), order(3)], session=None) == PublishResult(1, 2)
    # The upserts, e1's read (a replay), the deliveries (e1's already there), e3's and a
    # second look at e1 (none: nothing of e1 was written held, so nothing to release).
    assert names(counter) == {
        "events.bulk_write": 1, "events.find": 1, "deliveries.insert_many": 1,
    }  # fmt: skip
    assert {e: doc["handlers"] for e, doc in (await events(odb)).items()} == {
        "e1": [],
        "e2": [],
        "e3": [],
    }


@pytest.mark.parametrize("when", ["before", "after"])
async def test_a_completion_that_failed_after_listing_its_handler_runs_again_not_twice(
    odb: Any, clock: ManualClock, when: str
) -> None:
    """The completion lists the handler on its event, then its deletion fails (lost, or
    applied with the reply lost). Lost: the delivery is still there and runs again; a replay
    meanwhile adds nothing (listed, and its delivery there). Applied: done, and a replay does
    not bring it back."""
    outbox, faults = await faulty_outbox(odb, clock)
    await outbox.publish(paid("e1"), session=None)
    [e1] = await outbox.claim("A")
    (faults.fail_before if when == "before" else faults.fail_after)(
        "delete_one", collection=f"{PREFIX}deliveries"
    )
    with pytest.raises(PyMongoError):
        await outbox.complete(e1)
    assert (await events(odb))["e1"]["handlers"] == ["stats"]
    assert await outbox.publish(paid("e1"), session=None) == PublishResult(0, 0)
    left = await delivery_of(odb, "e1", "stats")
    if when == "before":
        assert left is not None
        assert ran(await outbox.claim("A")) == [("e1", 1)]  # freed by the next claim, again
    else:
        assert left is None
        assert await outbox.claim("A") == []


async def test_a_purged_dead_letter_is_not_brought_back_by_a_replay(
    odb: Any, clock: ManualClock
) -> None:
    """e1's stats delivery dies and is purged; its mail delivery completed, so the event stays
    as the deduplication record of its id. A replay creates neither again: the burial listed
    stats on the event, as the completion listed mail."""
    outbox = await new_outbox(odb, clock)
    await outbox.publish(order(1), session=None)
    batch = {d.handler: d for d in await outbox.claim("A", limit=2)}
    assert await outbox.bury(batch["stats"], error="poison")
    assert await outbox.complete(batch["mail"])
    clock.advance(60)
    result = await outbox.purge(dead_before=clock.now())
    assert (result.dead_deliveries, result.events) == (1, 0)
    assert sorted((await events(odb))["e1"]["handlers"]) == ["mail", "stats"]
    assert await outbox.publish(order(1), session=None) == PublishResult(0, 0)
    assert await deliveries(odb) == []


# ------------------------------------------------------- a replay or a purge racing the publish


async def during(
    faults: Any, command: str, collection: str, publish: Any, meanwhile: Any, nth: int = 0
) -> Any:
    """Run `publish` until it reaches its `nth` `command` on `collection`, run `meanwhile`, go
    on."""
    seen = {"calls": -1}

    def match(op: Any) -> bool:
        seen["calls"] += 1
        return seen["calls"] == nth

    pause = faults.pause_before(command, collection=f"{PREFIX}{collection}", match=match)
    result: dict[str, Any] = {}

    async def run() -> None:
        result["publish"] = await publish()

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        await pause.reached.wait()
        await meanwhile()
        pause.release()
    return result["publish"]


async def test_a_replay_racing_the_completion_of_its_delivery_runs_nothing_again(
    odb: Any, clock: ManualClock
) -> None:
    """The replay read e1 before its delivery completed (the handler not listed yet) and writes
    its delivery after: written held, then dropped once the replay sees the handler listed."""
    outbox, faults = await faulty_outbox(odb, clock)
    await outbox.publish(paid("e1"), session=None)
    [e1] = await outbox.claim("A")

    async def complete() -> None:
        assert await outbox.complete(e1)

    replay = await during(
        faults, "insert_many", "deliveries", lambda: outbox.publish(paid("e1"), session=None),
        complete,
    )  # fmt: skip
    assert replay == PublishResult(0, 0)
    assert await deliveries(odb) == []
    assert await outbox.claim("A") == []


@pytest.mark.parametrize("replay", [False, True], ids=["new", "replayed"])
async def test_a_purge_between_a_publishs_writes_leaves_no_delivery_without_its_event(
    odb: Any, clock: ManualClock, replay: bool
) -> None:
    """New: a purge between the event and its deliveries leaves the young event alone (stored
    since less than `PUBLISH_GRACE`, whatever its ``created_at``): its delivery runs. Replayed:
    the replay touched the completed event before the purge ran, so the purge leaves it, as the
    deduplication record it is: nothing runs again."""
    outbox, faults = await faulty_outbox(odb, clock)
    event = Event("e1", "order.paid", created_at=clock.now() - timedelta(days=1))
    if replay:
        await outbox.publish(event, session=None)
        [first] = await outbox.claim("A")
        assert await outbox.complete(first)
        clock.advance(PUBLISH_GRACE)

    async def purge() -> None:
        await outbox.purge(dead_before=clock.now(), completed_before=clock.now())

    command, collection = ("find", "events") if replay else ("insert_many", "deliveries")
    await during(faults, command, collection, lambda: outbox.publish(event, session=None), purge)
    assert "e1" in await events(odb)
    assert ran(await outbox.claim("B")) == ([] if replay else [("e1", 1)])


# ------------------------------------------------------------- the view under concurrent claims


class HoldReplies:
    """A hook holding the replies of chosen commands (served already) until released."""

    def __init__(self) -> None:
        self.rules: list[tuple[Any, anyio.Event, anyio.Event]] = []

    def hold(self, match: Any) -> tuple[anyio.Event, anyio.Event]:
        reached, go = anyio.Event(), anyio.Event()
        self.rules.append((match, reached, go))
        return reached, go

    async def before(self, op: Any) -> None:
        return None

    async def after(self, op: Any, error: BaseException | None) -> None:
        for rule in self.rules:
            match, reached, go = rule
            if match(op):
                self.rules.remove(rule)
                reached.set()
                await go.wait()
                return


def lane_read(view: bool) -> Any:
    """A claim's read of its lane view (`view`: the whole collection, or its handlers' lanes),
    else a read-back of some lanes by ``_id``."""

    def match(op: Any) -> bool:
        if not (op.collection == f"{PREFIX}lanes" and op.name == "find"):
            return False
        if view:
            return bool(op.filter == schema.lanes_all() or "$or" in op.filter)
        return bool("_id" in op.filter and "$in" in op.filter["_id"])

    return match


async def test_an_old_lane_read_landing_late_never_hides_an_own_write_from_the_view(
    odb: Any, clock: ManualClock
) -> None:
    """Owners A, B and C on one instance. B's read of h1's lanes is served before A takes h1's
    lane of k1 for x, and its reply lands after A's read-back and C's newer read. The view keeps
    A's write: A's next claim does not hand x out again, and x's one claim completes."""
    holds = HoldReplies()
    subscriptions = {"t1": ["h1"], "t2": ["h2"]}
    outbox = await new_outbox(instrument(odb, holds), clock, subscriptions=subscriptions,
                              lease_ttl=0.5)  # fmt: skip
    other = AsyncOutbox(odb, PREFIX, subscriptions=subscriptions, clock=clock, lease_ttl=0.5)
    k1, k2 = keys_in_distinct_lanes(2)
    await outbox.publish(Event("a2", "t2", key=k2), session=None)
    [a2] = await outbox.claim("A", limit=1)  # A holds k2's lane
    assert await outbox.complete(a2)
    await outbox.publish([Event("x", "t1", key=k1), Event("y", "t2", key=k2)], session=None)
    clock.advance(0.6)  # A's lease on k2's lane lapsed: another instance takes it
    assert ran(await other.claim("Z", ["h2"], limit=1)) == [("y", 1)]

    got: dict[str, list[Any]] = {}

    async def claim(name: str, owner: str, **options: Any) -> None:
        got[name] = await outbox.claim(owner, **options)

    with anyio.fail_after(10):  # a hang guard: a read the holds never meet fails the test
        async with anyio.create_task_group() as group:
            old_read, release_old = holds.hold(lane_read(view=True))
            group.start_soon(lambda: claim("B", "B", handlers=["h1"], limit=1))
            await old_read.wait()
            read_back, release_back = holds.hold(lane_read(view=False))
            group.start_soon(
                lambda: claim("A", "A", limit=1)
            )  # takes k1's lane; k2's hand-back fails
            await read_back.wait()
            new_read, release_new = holds.hold(lane_read(view=True))
            group.start_soon(lambda: claim("C", "C", handlers=["h1"], limit=1))
            await new_read.wait()
            for release in (release_old, release_back, release_new):
                release.set()
                await settle()
    assert ran(got["A"]) == [("x", 1)]
    assert await outbox.claim("A", limit=1) == []
    assert await outbox.complete(got["A"][0])


async def test_a_head_finishing_while_its_followers_are_parked_unblocks_them_next_claim(
    odb: Any, clock: ManualClock
) -> None:
    """A claim parks the 40 waiting behind k's running head; the head completes after the claim
    saw it run, before the claim parks its followers. The next claim looks at the parked keys
    although it trusts its view, and hands out k's next."""
    outbox, faults = await faulty_outbox(odb, clock)
    [k] = keys_in_distinct_lanes(1)
    await outbox.publish([paid(f"k{n}", k) for n in range(41)], session=None)
    [head] = await outbox.claim("A", limit=1)
    await outbox.publish(paid("u1"), session=None)

    async def complete() -> None:
        assert await outbox.complete(head)

    async def claim() -> list[Any]:
        return await outbox.claim("A", limit=1)

    parking = during(faults, "bulk_write", "lanes", claim, complete)  # its lane write
    assert ran(await parking) == [("u1", 1)]  # it filled: the next claim trusts the view
    assert sum(d.get("lane") == "parked" for d in await deliveries(odb)) == 40
    assert ran(await outbox.claim("A", limit=1)) == [("k1", 1)]


async def test_a_transactional_publish_inside_a_replays_hold_loses_no_delivery(
    txdb: Any, clock: ManualClock
) -> None:
    """A plain replay adds h2's delivery held; before it reads its event again, a publish in a
    transaction lists h2 (as it lists what it creates; its own upsert found the held delivery).
    Listed is not finished: the replay releases the delivery, and h2 runs."""
    faults = FaultInjector()
    db = instrument(txdb, faults)
    await AsyncOutbox(db, PREFIX, subscriptions={"t": ["a"]}, clock=clock).setup()
    first = AsyncOutbox(db, PREFIX, subscriptions={"t": ["a"]}, clock=clock)
    await first.publish(Event("e1", "t"), session=None)
    grown = {"t": ["a", "h2"]}
    plain = AsyncOutbox(db, PREFIX, subscriptions=grown, clock=clock)
    transactional = AsyncOutbox(txdb, PREFIX, subscriptions=grown, clock=clock)

    async def publish_in_transaction() -> None:
        async def work(session: Any) -> Any:
            return await transactional.publish(Event("e1", "t"), session=session)

        assert await _driver.run_in_transaction(txdb, work) == PublishResult(0, 0)

    replay = await during(
        faults, "find", "events", lambda: plain.publish(Event("e1", "t"), session=None),
        publish_in_transaction, nth=1,  # the replay's second look at its event
    )  # fmt: skip
    assert replay == PublishResult(0, 1)
    assert (await events(txdb))["e1"]["handlers"] == ["a", "h2"]
    assert [d.handler for d in await plain.claim("W", ["h2"])] == ["h2"]


async def test_a_purge_whose_delete_follows_a_replays_release_keeps_the_event(
    odb: Any, clock: ManualClock
) -> None:
    """A first publish stopped between its event and its deliveries; an hour later a purge
    finds e1 unreferenced, and a replay repairs it before the purge's delete lands. The replay
    touched the event (`stored_at`): the delete, which repeats the purge's query, leaves it."""
    outbox, faults = await faulty_outbox(odb, clock)
    faults.fail_before("insert_many", collection=f"{PREFIX}deliveries")
    with pytest.raises(PyMongoError):
        await outbox.publish(paid("e1"), session=None)
    clock.advance(3600)

    async def replay() -> None:
        assert await outbox.publish(paid("e1"), session=None) == PublishResult(0, 1)

    purged = await during(
        faults, "delete_many", "events",
        lambda: outbox.purge(dead_before=clock.now(), completed_before=clock.now()), replay,
    )  # fmt: skip
    assert purged.events == 0
    assert "e1" in await events(odb)
    assert ran(await outbox.claim("W")) == [("e1", 1)]
