"""AsyncGroupTransport under crashes, lost replies, takeovers and poison messages.

A consumer may die holding a group, a command may fail before it applied or apply and lose its
reply, a publisher may die between its commands. Each test checks the stored state right after
the failure, then that the state recovers within one lease_ttl: every published message is
delivered at least once, in per-group order, and a stale holder changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest
from pymongo.errors import AutoReconnect, NetworkTimeout

from mongoq import AsyncGroupTransport, GroupLease, GroupRunSummary, NewMessage
from mongoq.testing import FaultInjector, ManualClock, Operation, instrument, settle
from tests.support.group_helpers import (
    EPOCH,
    VISIBILITY,
    assert_empty,
    assert_lock,
    assert_message,
    assert_permanent_buried_and_flaky_parked,
    assert_released,
    by_group,
    claim_and_ack,
    claim_one,
    counter_value,
    dead,
    drain,
    eventually,
    failing_handler,
    first_occurrences,
    group_messages,
    lock,
    locks,
    messages,
    new_transport,
    publish_each,
    snapshot,
    unchanged,
)
from tests.support.helpers import later, wait_for


@pytest.fixture
def faults() -> FaultInjector:
    return FaultInjector()


@pytest.fixture
async def transport(db: Any, clock: ManualClock, faults: FaultInjector) -> AsyncGroupTransport:
    return await new_transport(instrument(db, faults), clock)


async def recover(transport: AsyncGroupTransport, clock: ManualClock) -> list[GroupLease]:
    """One lease_ttl later (and after the orphan sweep), deliver everything that is left."""
    clock.advance(VISIBILITY + 0.001)
    await transport.recover_orphans()
    return await drain(transport, clock)


def failing(
    faults: FaultInjector,
    when: str,
    name: str,
    collection: str,
    match: Callable[[Operation], bool] | None = None,
) -> Any:
    """Make the next `name` command on `collection` fail `when` it runs: "before" it applies,
    or "after", its reply lost; `pytest.raises` for the error the caller then sees."""
    inject = faults.fail_before if when == "before" else faults.fail_after
    inject(name, collection=collection, match=match)
    return pytest.raises(AutoReconnect if when == "before" else NetworkTimeout)


def each_failure(commands: Sequence[tuple[str, ...]]) -> pytest.MarkDecorator:
    """Parametrize `failure` over each of `commands` (..., collection, name) failed "before" it
    applies and "after" it applied: the command's fields, then `when`."""
    cases = [(*command, when) for when in ("before", "after") for command in commands]
    return pytest.mark.parametrize("failure", cases, ids=["-".join(case) for case in cases])


# ---------------------------------------------------------------------- a consumer that dies


async def test_a_consumer_that_dies_mid_message_gets_its_head_redelivered_after_visibility(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    await publish_each(transport, "g", "g0", "g1", "g2")
    dying = await claim_one(transport, "A", group="g", event="g0")  # then A dies
    await transport.publish("h", "h0")
    other = await claim_one(transport, "B", group="h")
    clock.advance(1)
    assert await transport.ack(other)

    clock.advance(VISIBILITY - 1.001)
    assert await transport.claim("C") is None  # "h" was dropped; "g" is still A's
    await assert_lock(db, "g", token=dying.token, available_at=dying.lease_until)
    clock.advance(0.001)
    second = await claim_one(transport, "C", group="g", event="g0")  # C dies too
    assert (second.seq, second.deliveries) == (dying.seq, 2)
    await assert_message(db, dying.seq, token=second.token)
    clock.advance(VISIBILITY)
    third = await claim_one(transport, "D", group="g", event="g0")
    assert (third.seq, third.deliveries) == (dying.seq, 3)
    assert await transport.ack(third)

    rest = await drain(transport, clock)

    assert [(lease.event, lease.deliveries) for lease in rest] == [("g1", 1), ("g2", 1)]
    await assert_empty(db)
    assert await dead(db) == {}


STALE_CALLS = {
    "ack": lambda transport, lease: transport.ack(lease),
    "nack": lambda transport, lease: transport.nack(lease),
    "nack-delay": lambda transport, lease: transport.nack(lease, delay=60),
    "nack-error": lambda transport, lease: transport.nack(lease, error=RuntimeError("late")),
    "extend": lambda transport, lease: transport.extend(lease),
    "extend-long": lambda transport, lease: transport.extend(lease, lease_ttl=600),
    "dead_letter": lambda transport, lease: transport.dead_letter(lease, "late"),
}


@pytest.mark.parametrize("stage", ["same-head", "next-head", "parked"])
@pytest.mark.parametrize("call", list(STALE_CALLS))
async def test_a_stale_holder_after_takeover_gets_false_and_changes_nothing(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock, call: str, stage: str
) -> None:
    await publish_each(transport, "g", "g0", "g1")
    stale = await claim_one(transport, "A", group="g", event="g0")
    clock.advance(VISIBILITY + 1)
    new = await claim_one(transport, "B", group="g", event="g0")
    if stage == "next-head":
        assert await transport.ack(new)
        new = await claim_one(transport, "B", group="g", event="g1")
    elif stage == "parked":
        assert await transport.nack(new, delay=60)
    clock.advance(1)

    async with unchanged(db):
        assert await STALE_CALLS[call](transport, stale) is False

    # The new holder is untouched and settles normally.
    assert await transport.ack(new)
    if stage == "next-head":  # g1 was the last message: B's ack dropped the drained group
        await assert_empty(db)
    else:  # g1 waits: the group is released
        assert list(await messages(db)) == [2]
        await assert_released(db, "g", clock.now())


@pytest.mark.parametrize("call", list(STALE_CALLS))
async def test_a_holder_that_released_with_nack_can_no_longer_settle(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock, call: str
) -> None:
    """nack(0) gives the group back: the former holder no longer holds it, so a late settle
    must be refused and change nothing, as after a takeover."""
    await transport.publish("g", "g0")
    lease = await claim_one(transport, "A", group="g")
    assert await transport.nack(lease)
    await assert_lock(db, "g", token=None)

    async with unchanged(db):
        assert await STALE_CALLS[call](transport, lease) is False

    again = await claim_one(transport, "B", group="g", event="g0")
    assert again.deliveries == 2


@pytest.mark.parametrize("extended", [False, True], ids=["holder-in-lease", "holder-extended"])
async def test_a_claimer_stalled_past_its_lease_cannot_restamp_the_new_holders_head(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock, faults: FaultInjector,
    extended: bool,
) -> None:  # fmt: skip
    """A leases the group, then stalls before stamping the head, past the end of its lease. B
    takes the group over and stamps the head. When A's stamp finally runs it finds the head
    held by B's live lease: it changes nothing, A gets nothing, B keeps the group. With
    `extended`, B renewed its lease (and the head's stamp) and A wakes up after B's original
    lease end: the renewed stamp still keeps A out."""
    await publish_each(transport, "g", "g0", "g1")
    pause = faults.pause_before("find_one_and_update", collection="mq_messages")
    claimed: list[GroupLease | None] = []

    async def stalled_claimer() -> None:
        claimed.append(await transport.claim("A"))

    async with anyio.create_task_group() as group:
        group.start_soon(stalled_claimer)
        await wait_for(pause.reached.is_set, "A's head stamp")
        assert (await assert_lock(db, "g"))["token"].startswith("A:")
        await assert_message(db, 1, token=None)  # A has not stamped yet
        clock.advance(VISIBILITY)  # A's lease ends
        taken = await claim_one(transport, "B", group="g", event="g0")
        stamp_until = taken.lease_until
        if extended:
            clock.advance(VISIBILITY - 1)
            assert await transport.extend(taken)
            stamp_until = later(clock, VISIBILITY)
            clock.advance(2)  # past B's original lease end, within the renewed one
            assert clock.now() > taken.lease_until
        else:
            clock.advance(VISIBILITY - 1)  # B's lease is still live
        await assert_message(db, 1, token=taken.token, stamp_until=stamp_until, deliveries=1)
        before = await snapshot(db)
        pause.release()

    assert claimed == [None]
    # A's stamp matched the head but changed nothing: B's token, stamp and delivery count stay.
    assert await snapshot(db) == before
    await assert_lock(db, "g", token=taken.token, available_at=stamp_until)
    assert await transport.claim("C") is None
    assert await transport.ack(taken)
    assert list(await messages(db)) == [2]
    nxt = await claim_and_ack(transport, "A", group="g", event="g1")
    assert nxt.deliveries == 1
    await assert_empty(db)


# ---------------------------------------------------------------------- faults on commands

PUBLISH_COMMANDS = [
    ("mq_counters", "find_one_and_update"),
    ("mq_messages", "insert_one"),
    ("mq_locks", "update_one"),
]


@pytest.mark.parametrize("new_group", [False, True], ids=["existing-group", "new-group"])
@each_failure(PUBLISH_COMMANDS)
async def test_a_publish_that_failed_on_any_command_is_recoverable(
    db: Any,
    transport: AsyncGroupTransport,
    clock: ManualClock,
    faults: FaultInjector,
    failure: tuple[str, str, str],
    new_group: bool,
) -> None:
    """The publisher sees an error and publishes again (at least once): nothing is lost and
    per-group order holds; an event whose message was written the first time comes twice."""
    collection, name, when = failure
    await transport.publish("g", "g0")
    await transport.publish("h", "h0")
    group = "n" if new_group else "g"
    counter_before = await counter_value(db)
    version_before = (await lock(db, group) or {}).get("version")

    with failing(faults, when, name, collection):
        await transport.publish(group, f"{group}1")

    assert len(faults.triggered) == 1
    allocated = not (collection == "mq_counters" and when == "before")
    assert await counter_value(db) == (counter_before or 0) + allocated
    written = collection == "mq_locks" or (collection == "mq_messages" and when == "after")
    assert await group_messages(db) == (
        {"g": ["g0", *(["g1"] if written and not new_group else [])], "h": ["h0"]}
        | ({"n": ["n1"]} if written and new_group else {})
    )
    readied = collection == "mq_locks" and when == "after"
    stored = await lock(db, group)
    if new_group and not readied:
        assert stored is None  # an orphan until the publisher retries or the sweep
    else:
        assert stored is not None
        assert stored["version"] == (version_before or 0) + readied
        assert (stored["available_at"], stored["token"]) == (EPOCH, None)

    await transport.publish(group, f"{group}1")  # the publisher's retry
    await transport.publish(group, f"{group}2")
    delivered = await recover(transport, clock)

    got = by_group(delivered)
    assert first_occurrences(got[group]) == [f"{group}0"] * (not new_group) + [
        f"{group}1",
        f"{group}2",
    ]
    assert got[group].count(f"{group}1") == (2 if written else 1)
    assert first_occurrences(got["h"]) == ["h0"]
    if new_group:
        assert got["g"] == ["g0"]
    await assert_empty(db)


CLAIM_COMMANDS = [("mq_locks", "find_one_and_update"), ("mq_messages", "find_one_and_update")]


@each_failure(CLAIM_COMMANDS)
async def test_a_claim_that_failed_on_any_command_is_recoverable(
    db: Any,
    transport: AsyncGroupTransport,
    clock: ManualClock,
    faults: FaultInjector,
    failure: tuple[str, str, str],
) -> None:
    collection, name, when = failure
    await publish_each(transport, "g", "g0", "g1")
    before = await snapshot(db)

    with failing(faults, when, name, collection):
        await transport.claim("A")

    leased = not (collection == "mq_locks" and when == "before")
    stamped = collection == "mq_messages" and when == "after"
    stored = await assert_lock(db, "g")
    head = await assert_message(db, 1)
    if not leased:
        assert await snapshot(db) == before
    else:
        # A holds the group without knowing it: nobody else gets it until the lease ends.
        assert stored["available_at"] == later(clock, VISIBILITY)
        assert stored["token"] is not None and stored["token"].startswith("A:")
        assert head["deliveries"] == stamped
        assert head["token"] == (stored["token"] if stamped else None)
        assert head["stamp_until"] == (stored["available_at"] if stamped else None)
        assert await transport.claim("B") is None
        clock.advance(VISIBILITY - 0.001)
        assert await transport.claim("B") is None

    delivered = await recover(transport, clock)

    assert [(lease.event, lease.deliveries) for lease in delivered] == [
        ("g0", 1 + stamped),
        ("g1", 1),
    ]
    await assert_empty(db)


#: what waits behind the head, and an ack's command: the ack deletes the head, then releases
#: the group if another message waits or, after checking that none does, drops the drained
#: group (the check is not failed here)
ACK_COMMANDS = [
    ("more-messages", "mq_messages", "delete_one"),
    ("more-messages", "mq_locks", "update_one"),
    ("last-message", "mq_messages", "delete_one"),
    ("last-message", "mq_locks", "delete_one"),
]


@each_failure(ACK_COMMANDS)
async def test_an_ack_that_failed_on_any_command_is_recoverable(
    db: Any,
    transport: AsyncGroupTransport,
    clock: ManualClock,
    faults: FaultInjector,
    failure: tuple[str, str, str, str],
) -> None:
    rest, collection, name, when = failure
    followed = rest == "more-messages"
    await transport.publish("g", "g0")
    if followed:
        await transport.publish("g", "g1")
    lease = await claim_one(transport, "A", group="g", event="g0")
    before = await snapshot(db)
    clock.advance(1)

    with failing(faults, when, name, collection):
        await transport.ack(lease)

    removed = not (collection == "mq_messages" and when == "before")
    let_go = collection == "mq_locks" and when == "after"  # released, or dropped if drained
    if not removed:
        assert await snapshot(db) == before
    assert list(await messages(db)) == [1] * (not removed) + [2] * followed
    stored = await lock(db, "g")
    if let_go and not followed:  # dropped
        assert stored is None
        await assert_empty(db)
        return
    assert stored is not None
    if let_go:  # released
        assert (stored["available_at"], stored["token"]) == (clock.now(), None)
        delivered = await drain(transport, clock)  # no need to wait
    else:
        # The lock stays A's until its lease ends; then a claim redelivers the head or, if it
        # was removed, goes on to g1 or finds the group empty and drops it.
        assert (stored["available_at"], stored["token"]) == (lease.lease_until, lease.token)
        assert await transport.claim("B") is None
        delivered = await recover(transport, clock)

    redelivered = [("g0", 2)] * (not removed)
    assert [(x.event, x.deliveries) for x in delivered] == redelivered + [("g1", 1)] * followed
    await assert_empty(db)


# --------------------------------------------------------------------------------- orphans


async def test_a_publisher_that_dies_before_readying_leaves_an_orphan_the_sweep_readies(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock, faults: FaultInjector
) -> None:
    await transport.publish("g", "g0")
    faults.fail_before("update_one", collection="mq_locks")
    with pytest.raises(AutoReconnect):
        await transport.publish("n", "n0", priority=3)  # the publisher dies here
    await transport.publish("g", "g1")  # an orphan is only a message whose group has no lock
    assert list(await locks(db)) == ["g"]
    assert await group_messages(db) == {"g": ["g0", "g1"], "n": ["n0"]}

    async with unchanged(db):
        clock.advance(VISIBILITY)
        assert await transport.recover_orphans() == 0  # not older than the lease_ttl yet

    clock.advance(0.001)
    assert await transport.recover_orphans() == 1

    assert await lock(db, "n") == {
        "_id": "n",
        "available_at": EPOCH,
        "token": None,
        "priority": 3,
        "parked": False,
        "version": 1,
        "last_seq": 2,
    }
    assert await transport.recover_orphans() == 0
    delivered = await drain(transport, clock)
    assert by_group(delivered) == {"g": ["g0", "g1"], "n": ["n0"]}
    assert next(x for x in delivered if x.group_id == "n").priority == 3
    await assert_empty(db)


async def test_run_readies_orphans_when_idle(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock, faults: FaultInjector
) -> None:
    faults.fail_before("update_one", collection="mq_locks")
    with pytest.raises(AutoReconnect):
        await transport.publish("n", "n0")
    clock.advance(VISIBILITY + 1)
    handled: list[Any] = []

    async def handler(lease: GroupLease) -> None:
        handled.append(lease.event)

    first = await transport.run(handler, stop_when_empty=True)

    assert (first.claimed, handled) == (0, [])  # nothing was claimable: the idle sweep ran
    await assert_lock(db, "n", available_at=EPOCH)
    second = await transport.run(handler, stop_when_empty=True)
    assert (second.claimed, second.acked, handled) == (1, 1, ["n0"])
    await assert_empty(db)


async def test_an_unreadied_message_keeps_its_in_flight_group_from_being_dropped(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock, faults: FaultInjector
) -> None:
    """A publisher dies between writing g1 and readying "g" while "g" is in flight. The
    holder, busy for two minutes (renewing), then acks g0, the last message the group was
    readied with. Dropping the lock now would orphan g1 long after it was published, behind the
    sweep's window; the ack's check before the drop sees g1 and releases the group instead."""
    await transport.publish("g", "g0")
    lease = await claim_one(transport, "A", group="g", event="g0")
    assert lease.was_last
    assert await transport.recover_orphans() == 0  # the sweep's first run
    faults.fail_before("update_one", collection="mq_locks")
    with pytest.raises(AutoReconnect):
        await transport.publish("g", "g1")  # the publisher dies here
    for _ in range(4):  # the handler runs on, its lease renewed; the sweep runs meanwhile
        for _ in range(2):
            clock.advance(VISIBILITY / 2)
            assert await transport.extend(lease)
        assert await transport.recover_orphans() == 0  # g1's group has a lock: no orphan
    assert await transport.ack(lease)
    stored = await assert_released(db, "g", clock.now())
    assert (stored["version"], stored["last_seq"]) == (1, 1)  # g1 never readied it
    assert await group_messages(db) == {"g": ["g1"]}
    delivered = await drain(transport, clock)
    assert [(x.group_id, x.event) for x in delivered] == [("g", "g1")]
    await assert_empty(db)


@pytest.mark.parametrize("batch", [False, True], ids=["publish", "publish_many"])
async def test_a_publish_cancelled_between_its_insert_and_its_ready_still_readies_the_group(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock, faults: FaultInjector,
    batch: bool,
) -> None:  # fmt: skip
    """A caller's timeout cancels the publish after its message was written: the ready runs
    anyway (shielded), so no orphan waits for the sweep."""
    pause = faults.pause_before("bulk_write" if batch else "update_one", collection="mq_locks")
    scope = anyio.CancelScope()

    async def publisher() -> None:
        with scope:
            if batch:
                await transport.publish_many([NewMessage("g", "g0"), NewMessage("h", "h0")])
            else:
                await transport.publish("g", "g0")

    async with anyio.create_task_group() as group:
        group.start_soon(publisher)
        await wait_for(pause.reached.is_set, "the publish to reach its ready")
        assert await locks(db) == {}
        scope.cancel()  # the caller gives up while the ready is pending
        await settle()
        assert await locks(db) == {}
        pause.release()

    assert scope.cancel_called
    expected = {"g": ["g0"], "h": ["h0"]} if batch else {"g": ["g0"]}
    assert await group_messages(db) == expected
    stored = await locks(db)
    assert {g: (doc["available_at"], doc["token"]) for g, doc in stored.items()} == {
        g: (EPOCH, None) for g in expected
    }
    assert by_group(await drain(transport, clock)) == expected
    await assert_empty(db)


# ---------------------------------------------------------------------------- dead letters


async def test_a_poison_message_goes_to_the_dead_letters_with_its_last_error(
    db: Any, clock: ManualClock
) -> None:
    transport = await new_transport(db, clock, max_deliveries=2)
    await publish_each(transport, "g", {"poison": True}, "g1", priority=1)

    first = await claim_one(transport, "A", group="g")
    assert await transport.nack(first, error="boom 1")
    second = await claim_one(transport, "A", group="g", event={"poison": True})
    assert second.deliveries == 2
    assert await transport.nack(second, error=RuntimeError("boom 2"))
    assert (await assert_message(db, 1))["last_error"].endswith("RuntimeError: boom 2")
    clock.advance(3)

    nxt = await claim_one(transport, "A", group="g")  # the head is over the limit: buried

    assert (nxt.seq, nxt.event, nxt.deliveries) == (2, "g1", 1)
    assert list(await messages(db)) == [2]
    (stored,) = (await dead(db)).values()
    assert stored["_id"] == 1
    assert (stored["group_id"], stored["event"], stored["priority"]) == ("g", {"poison": True}, 1)
    assert stored["error"].endswith("RuntimeError: boom 2")
    assert stored["dead_at"] == clock.now()
    assert stored["published_at"] == later(clock, -3)
    # The count includes the claim that found the head over the limit.
    assert stored["deliveries"] == 3
    (letter,) = await transport.dead_letters()
    assert (letter.seq, letter.group_id, letter.event, letter.priority) == (
        1,
        "g",
        {"poison": True},
        1,
    )
    assert letter.error is not None and letter.error.endswith("RuntimeError: boom 2")
    assert (letter.deliveries, letter.dead_at) == (3, clock.now())
    assert await transport.dead_letters(group_id="other") == []

    assert await transport.ack(nxt)
    assert await transport.redrive() == 1

    assert await dead(db) == {}
    assert await group_messages(db) == {"g": [{"poison": True}]}
    (redriven,) = (await messages(db)).values()
    assert (redriven["_id"], redriven["deliveries"], redriven["priority"]) == (3, 0, 1)
    again = await claim_one(transport, "A", group="g", event={"poison": True})
    assert again.deliveries == 1
    assert await transport.ack(again)
    assert await drain(transport, clock) == []
    await assert_empty(db)


async def test_a_consumer_that_keeps_dying_sends_the_head_to_the_dead_letters(
    db: Any, clock: ManualClock
) -> None:
    transport = await new_transport(db, clock, max_deliveries=1)
    await transport.publish("g", "g0")
    await claim_one(transport, "A", group="g", event="g0")  # A dies
    clock.advance(VISIBILITY)

    assert await transport.claim("B") is None  # g0 buried, the group found empty and dropped

    assert await messages(db) == {} and await locks(db) == {}
    (stored,) = (await dead(db)).values()
    assert stored["event"] == "g0"
    assert stored["error"] == "not acked after 1 deliveries"


async def test_redrive_puts_dead_letters_back_at_the_tail_of_their_groups(
    db: Any, clock: ManualClock
) -> None:
    transport = await new_transport(db, clock)
    await publish_each(transport, "g", "g0", "g1")
    lease = await claim_one(transport, "A", group="g", event="g0")
    assert await transport.dead_letter(lease, "bad g0")
    await transport.publish("h", "h0")  # never claimed: before "g", just released
    lease = await claim_one(transport, "A", group="h", event="h0")
    assert await transport.dead_letter(lease, "bad h0")
    await transport.publish("g", "g2")
    assert sorted(await dead(db)) == [1, 3]
    assert (await dead(db))[3]["error"] == "bad h0"

    assert await transport.redrive(group_id="g") == 1

    assert list(await dead(db)) == [3]
    assert await group_messages(db) == {"g": ["g1", "g2", "g0"]}
    assert await transport.redrive([3]) == 1
    assert await transport.redrive() == 0
    assert await dead(db) == {}
    assert by_group(await drain(transport, clock)) == {"g": ["g1", "g2", "g0"], "h": ["h0"]}
    await assert_empty(db)


async def test_dead_letter_moves_the_head_at_once_and_releases_the_group(
    db: Any, clock: ManualClock
) -> None:
    transport = await new_transport(db, clock)
    await publish_each(transport, "g", "g0", "g1", priority=2)
    lease = await claim_one(transport, "A", group="g", event="g0")
    clock.advance(2)

    assert await transport.dead_letter(lease, ValueError("bad input"))

    assert list(await messages(db)) == [2]
    (stored,) = (await dead(db)).values()
    assert (stored["_id"], stored["event"], stored["deliveries"], stored["priority"]) == (
        1,
        "g0",
        1,
        2,
    )
    assert stored["error"].endswith("ValueError: bad input")
    assert stored["dead_at"] == clock.now()
    await assert_released(db, "g", clock.now())
    assert not await transport.dead_letter(lease, "again")
    assert len(await dead(db)) == 1
    (letter,) = await transport.dead_letters(group_id="g")
    assert letter.error is not None and "bad input" in letter.error
    await claim_one(transport, "B", group="g", event="g1")


#: where a burial can stop after its commit point (the mark), and how
BURIAL_STOPS = {
    "mark-reply-lost": ("after", "mq_messages", "find_one_and_update"),
    "before-copy": ("before", "mq_dead", "replace_one"),
    "copy-reply-lost": ("after", "mq_dead", "replace_one"),
    "before-delete": ("before", "mq_messages", "delete_one"),
}


def _is_burial_step(op: Operation) -> bool:
    """A burial's mark filters on ``dead: None`` and its delete on ``dead: {$ne: None}``; the
    head stamp (also a messages.find_one_and_update) does not filter on ``dead``."""
    return isinstance(op.filter, dict) and "dead" in op.filter


@pytest.mark.parametrize("followed", [True, False], ids=["more-messages", "last-message"])
@pytest.mark.parametrize("stop", list(BURIAL_STOPS))
@pytest.mark.parametrize("via", ["dead_letter", "max_deliveries"])
async def test_a_dead_lettering_interrupted_after_the_mark_is_finished_by_the_next_claim(
    db: Any, clock: ManualClock, faults: FaultInjector, via: str, stop: str, followed: bool
) -> None:
    """Once the head is marked, the move is decided: whatever step the burial stopped at, the
    next claimer of the group finishes it. Exactly one dead letter, no live copy, and the group
    goes on with its next message (or is dropped, if there is none)."""
    max_deliveries = 1 if via == "max_deliveries" else None
    transport = await new_transport(instrument(db, faults), clock, max_deliveries=max_deliveries)
    await transport.publish("g", "g0", priority=2)
    if followed:
        await transport.publish("g", "g1", priority=2)
    first = await claim_one(transport, "A", group="g", event="g0")
    when, collection, name = BURIAL_STOPS[stop]
    match = _is_burial_step if collection == "mq_messages" else None
    if via == "dead_letter":
        clock.advance(1)
        marked_at = clock.now()
        error = "bad g0"
        with failing(faults, when, name, collection, match):
            await transport.dead_letter(first, error)
        holder_token, held_until, delivered = first.token, first.lease_until, 1
    else:  # A died; B's claim finds the head over the limit and buries it
        clock.advance(VISIBILITY)
        marked_at = clock.now()
        error = "not acked after 1 deliveries"
        with failing(faults, when, name, collection, match):
            await transport.claim("B")
        holder_token = (await assert_lock(db, "g"))["token"]
        assert holder_token.startswith("B:")
        held_until, delivered = later(clock, VISIBILITY), 2
    assert len(faults.triggered) == 1

    # Stopped after the mark: the head is still there, marked, held by the burier's lease.
    await assert_message(
        db,
        1,
        dead={"error": error, "at": marked_at},
        token=holder_token,
        stamp_until=held_until,
        deliveries=delivered,
    )
    copied = stop in ("copy-reply-lost", "before-delete")
    assert list(await dead(db)) == ([1] if copied else [])
    await assert_lock(db, "g", token=holder_token, available_at=held_until)
    assert await transport.claim("C") is None  # still held: nobody finishes it early
    clock.set(held_until)

    nxt = await transport.claim("C")

    assert list(await messages(db)) == ([2] if followed else [])
    (letter,) = (await dead(db)).values()
    assert (letter["_id"], letter["group_id"], letter["event"], letter["priority"]) == (
        1,
        "g",
        "g0",
        2,
    )
    assert (letter["error"], letter["dead_at"]) == (error, marked_at)
    # The finishing claim stamped the head before it saw the mark: its stamp is counted, as
    # the over-the-limit claim's is.
    assert letter["deliveries"] == delivered + 1
    if followed:
        assert nxt is not None
        assert (nxt.seq, nxt.event, nxt.deliveries) == (2, "g1", 1)
        assert await transport.ack(nxt)
    else:
        assert nxt is None  # the group was found empty after the burial, and dropped
    await assert_empty(db)
    assert list(await dead(db)) == [1]
    (listed,) = await transport.dead_letters(group_id="g")
    assert (listed.seq, listed.error, listed.dead_at) == (1, error, marked_at)


# -------------------------------------------------------------------------------------- run


async def test_run_dead_letters_permanent_errors_and_nacks_the_rest_with_retry_delay(
    db: Any, clock: ManualClock
) -> None:
    transport = await new_transport(db, clock)
    await publish_each(transport, "g", "permanent", "g-ok")
    await publish_each(transport, "h", "flaky", "h-ok")
    handled: list[tuple[Any, int]] = []
    handler = failing_handler(handled)

    first = await transport.run(handler, retry_delay=5, stop_when_empty=True)

    assert (first.claimed, first.acked, first.dead, first.retried, first.lost) == (3, 1, 1, 1, 0)
    assert sorted(handled) == [("flaky", 1), ("g-ok", 1), ("permanent", 1)]
    await assert_permanent_buried_and_flaky_parked(db, clock, retry_delay=5)

    clock.advance(5)
    second = await transport.run(handler, retry_delay=5, stop_when_empty=True)

    assert (second.claimed, second.acked, second.retried) == (2, 2, 0)
    assert handled[3:] == [("flaky", 2), ("h-ok", 1)]
    await assert_empty(db)
    assert list(await dead(db)) == [1]


async def test_a_handler_longer_than_visibility_keeps_its_group_through_extensions(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    await publish_each(transport, "g", "slow", "next")
    rival = await new_transport(db, clock)  # another process
    started = anyio.Event()
    finish = anyio.Event()
    summaries: list[GroupRunSummary] = []

    async def handler(lease: GroupLease) -> None:
        if lease.event == "slow":
            started.set()
            await finish.wait()

    async def worker() -> None:
        summaries.append(await transport.run(handler, worker_id="slow-worker", poll_interval=5))

    async with anyio.create_task_group() as group:
        group.start_soon(worker)
        await wait_for(started.is_set, "the handler to start")
        token = (await assert_lock(db, "g"))["token"]
        assert token.startswith("slow-worker:")
        for _ in range(9):  # 90 s, three times the lease_ttl
            clock.advance(VISIBILITY / 3)
            expected = later(clock, VISIBILITY)

            async def renewed(expected: Any = expected) -> bool:
                return (await lock(db, "g") or {}).get("available_at") == expected

            await eventually(renewed, "the renewal")
            assert await rival.claim("rival") is None
            await assert_lock(db, "g", token=token)
        finish.set()
        await eventually(lambda: _drained(db), "the worker to finish both messages")
        transport.stop()

    (summary,) = summaries
    assert (summary.claimed, summary.acked, summary.lost, summary.unknown) == (2, 2, 0, 0)
    assert await messages(db) == {}


async def _drained(db: Any) -> bool:
    return await messages(db) == {}


@pytest.mark.parametrize("call", ["ack", "ack_many"])
async def test_an_ack_after_a_dead_lettering_that_stopped_after_the_mark_changes_nothing(
    db: Any, clock: ManualClock, faults: FaultInjector, call: str
) -> None:
    """The holder's dead-lettering stopped after the mark (its copy failed); the same lease
    then acks. The head is on its way to the dead letters: the ack must not delete it (it
    would be lost: no dead letter, no message). The next claimer finishes the burial."""
    transport = await new_transport(instrument(db, faults), clock)
    await transport.publish("g", "g0")
    lease = await claim_one(transport, "A", group="g", event="g0")
    with failing(faults, "before", "replace_one", "mq_dead", None):
        await transport.dead_letter(lease, "bad")
    acked = await transport.ack(lease) if call == "ack" else (await transport.ack_many([lease]))[0]

    assert acked is False
    await assert_message(db, 1, dead={"error": "bad", "at": clock.now()}, token=lease.token,
                         stamp_until=lease.lease_until, deliveries=1)  # fmt: skip
    clock.set(lease.lease_until)
    assert await transport.claim("B") is None  # finishes the burial, finds g empty
    assert list(await dead(db)) == [1]
    assert await group_messages(db) == {}


async def test_two_extends_in_flight_that_apply_out_of_order_never_move_the_lease_back(
    db: Any, transport: AsyncGroupTransport, faults: FaultInjector, clock: ManualClock
) -> None:
    """An extend sent at T waits before it applies; one sent at T+5 applies first. When the
    first applies after it, the lock and the head's stamp stay at T+5 plus the lease_ttl."""
    await transport.publish("g", "g0")
    lease = await claim_one(transport)
    held = faults.pause_before("update_one", collection="mq_locks")
    answers: list[bool] = []
    async with anyio.create_task_group() as group:

        async def first() -> None:
            answers.append(await transport.extend(lease))

        group.start_soon(first)
        await wait_for(held.reached.is_set, "the first extend to be on its way")
        clock.advance(5)
        assert await transport.extend(lease)
        held.release()
        await wait_for(lambda: bool(answers), "the first extend's answer")

    assert answers == [True]
    stored = await lock(db, "g")
    head = (await messages(db))[lease.seq]
    assert stored is not None and stored["available_at"] == later(clock, VISIBILITY)
    assert head["stamp_until"] == later(clock, VISIBILITY)
