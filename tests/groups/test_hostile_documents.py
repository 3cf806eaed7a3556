"""Hostile data (DESIGN.md, "Hostile data"; issue 34): a message, a lock or the sequence counter
written by hand, by another program or by a bad restore, that a claim, a settle, a listing or a
publish cannot use, is set aside at its first encounter. A message becomes a dead letter whose
error names the field and what it holds; a lock is repaired from what its group's messages say
(or dropped when they are gone); a counter is repaired when its value survives in another type,
else publish refuses with `UnreadableDocument`; each with one WARNING naming the collection, the
item and the field. `run()` never raises for it, the other groups (and the group's next
messages) are delivered in the same run, nothing stays leased, and `stats()` and `list_groups`
keep working (an unusable document is listed, marked `unreadable`).

Every test corrupts a stored document, runs, then reads the collections back.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import replace
from typing import Any

import anyio
import pytest

from mongoq import AsyncGroupTransport, GroupLease, NewMessage, UnreadableDocument, _driver, cli
from mongoq.testing import CommandCounter, ManualClock, instrument
from tests.support.group_helpers import (
    EPOCH,
    PREFIX,
    VISIBILITY,
    assert_lock,
    claim_one,
    counter_value,
    dead,
    drain,
    lock,
    locks,
    messages,
    new_transport,
    race,
    snapshot,
)
from tests.support.helpers import Actors, Trace, rejects, set_asides

MESSAGES, LOCKS, COUNTERS, DEAD = (f"{PREFIX}_{kind}" for kind in
                                   ("messages", "locks", "counters", "dead"))  # fmt: skip
BATCHES = pytest.mark.parametrize("batch_size", [1, 4])


@pytest.fixture(autouse=True)
def _warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mongoq")


async def published(db: Any, clock: ManualClock, **options: Any) -> AsyncGroupTransport:
    """A transport with "bad" = [b1 (seq 1), b2 (seq 2)], "good" = [g1 (3)], "other" = [o1 (4)]:
    the group the tests corrupt is the first one a claim takes."""
    transport = await new_transport(db, clock, **options)
    for group, event in (("bad", "b1"), ("bad", "b2"), ("good", "g1"), ("other", "o1")):
        await transport.publish(group, event)
    return transport


async def run(transport: AsyncGroupTransport, **options: Any) -> dict[Any, list[Any]]:
    """Run until nothing is claimable (bounded: a stall fails the test); the events handled, by
    group, in order."""
    handled: dict[Any, list[Any]] = defaultdict(list)

    async def handler(lease: GroupLease) -> None:
        handled[lease.group_id].append(lease.event)

    with anyio.fail_after(20):
        await transport.run(handler, stop_when_empty=True, **options)
    return dict(handled)


# ----------------------------------------------------------------------------------- messages

BAD_DELIVERIES = {
    "a string": ("x", "a string ('x')"),
    "a document": ({"n": 1}, "a document ({'n': 1})"),
    "an array": ([1], "an array ([1])"),
}


@BATCHES
@pytest.mark.parametrize("shape", list(BAD_DELIVERIES))
async def test_a_message_whose_deliveries_is_no_number_is_dead_lettered_and_nothing_waits(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, shape: str, batch_size: int
) -> None:
    transport = await published(db, clock)
    value, found = BAD_DELIVERIES[shape]
    await db[MESSAGES].update_one({"_id": 1}, {"$set": {"deliveries": value}})

    handled = await run(transport, batch_size=batch_size)

    # The run went on: the other groups, and the next message of the bad group, in one run.
    assert handled == {"bad": ["b2"], "good": ["g1"], "other": ["o1"]}
    assert await messages(db) == {}
    assert await locks(db) == {}  # every group drained: nothing stays leased
    letter = (await dead(db))[1]
    assert (letter["group_id"], letter["event"], letter["deliveries"]) == ("bad", "b1", 0)
    assert letter["error"] == (
        f"unreadable group message: field 'deliveries' holds {found}; set aside"
    )
    assert set_asides(caplog) == [(MESSAGES, "bad/1", "deliveries", "dead")]
    (listed,) = await transport.dead_letters()
    assert (listed.seq, listed.deliveries, listed.unreadable) == (1, 0, None)


@BATCHES
async def test_only_what_a_claim_cannot_use_is_set_aside(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, batch_size: int
) -> None:
    """A message whose priority, publish time and last error are of the wrong type is still
    delivered (no claim needs them), in the same batch as a head that is set aside, and beside
    a lock repaired by its claim: nothing is dead-lettered for a field that did not matter."""
    transport = await published(db, clock)
    await db[MESSAGES].update_one({"_id": 1}, {"$set": {"deliveries": "x"}})
    await db[MESSAGES].update_one(
        {"_id": 3}, {"$set": {"priority": "high", "published_at": "now", "last_error": {"a": 1}}}
    )
    await db[LOCKS].update_one({"_id": "good"}, {"$set": {"version": "v"}})

    handled = await run(transport, batch_size=batch_size)

    assert handled == {"bad": ["b2"], "good": ["g1"], "other": ["o1"]}
    assert list(await dead(db)) == [1]
    assert sorted(set_asides(caplog)) == [
        (LOCKS, "good", "version", "repaired"), (MESSAGES, "bad/1", "deliveries", "dead"),
    ]  # fmt: skip
    assert (await messages(db), await locks(db)) == ({}, {})


@BATCHES
@pytest.mark.parametrize("missing", [True, False], ids=["missing", "null"])
async def test_a_message_without_a_delivery_count_is_delivered_as_never_delivered(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, missing: bool,
    batch_size: int,
) -> None:  # fmt: skip
    transport = await published(db, clock)
    change = {"$unset": {"deliveries": 1}} if missing else {"$set": {"deliveries": None}}
    await db[MESSAGES].update_one({"_id": 1}, change)

    handled = await run(transport, batch_size=batch_size)

    assert handled == {"bad": ["b1", "b2"], "good": ["g1"], "other": ["o1"]}
    assert (await messages(db), await locks(db), await dead(db)) == ({}, {}, {})
    assert set_asides(caplog) == []


@BATCHES
async def test_a_burial_mark_that_is_no_document_is_finished_as_a_dead_letter(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, batch_size: int
) -> None:
    transport = await published(db, clock)
    await db[MESSAGES].update_one({"_id": 1}, {"$set": {"dead": "yes"}})

    handled = await run(transport, batch_size=batch_size)

    assert handled == {"bad": ["b2"], "good": ["g1"], "other": ["o1"]}
    letter = (await dead(db))[1]
    assert letter["error"] == (
        "unreadable group message: field 'dead' holds a string ('yes'); set aside"
    )
    assert (await messages(db), await locks(db)) == ({}, {})
    assert set_asides(caplog) == [(MESSAGES, "bad/1", "dead", "dead")]


@BATCHES
async def test_a_message_whose_seq_is_no_number_is_dead_lettered(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, batch_size: int
) -> None:
    """A message inserted by hand with a string id: it sorts after the group's numbered ones."""
    transport = await published(db, clock)
    await db[MESSAGES].insert_one({**(await messages(db))[2], "_id": "b3", "event": "b3"})

    handled = await run(transport, batch_size=batch_size)

    assert handled == {"bad": ["b1", "b2"], "good": ["g1"], "other": ["o1"]}
    assert (await dead(db))["b3"]["error"] == (
        "unreadable group message: field '_id' holds a string ('b3'); set aside"
    )
    assert (await messages(db), await locks(db)) == ({}, {})
    assert set_asides(caplog) == [(MESSAGES, "bad/b3", "_id", "dead")]


async def test_a_dead_letter_keeps_only_readable_numbers_and_the_listing_reads_any(
    db: Any, clock: ManualClock
) -> None:
    """A message whose priority is no number is buried with priority 0 (its dead letter must
    read back); a dead letter edited by hand is listed, marked unreadable."""
    transport = await published(db, clock, max_deliveries=1)
    await db[MESSAGES].update_one({"_id": 1}, {"$set": {"priority": "high"}})
    lease = await claim_one(transport, group="bad")
    assert await transport.dead_letter(lease, "no")
    await db[DEAD].insert_one({"_id": 99, "group_id": "x", "priority": "x", "deliveries": "y"})

    letters = {letter.seq: letter for letter in await transport.dead_letters()}

    assert (letters[1].priority, letters[1].unreadable) == (0, None)
    assert (await dead(db))[1]["priority"] == 0
    assert (letters[99].priority, letters[99].deliveries) == (0, 0)
    assert letters[99].unreadable == "field 'priority' holds a string ('x')"
    assert await transport.redrive() == 2  # published again with a readable priority
    assert {doc["event"] for doc in (await messages(db)).values()} >= {"b1", None}


async def test_an_orphan_whose_priority_is_no_number_is_readied_at_priority_0(
    db: Any, clock: ManualClock
) -> None:
    transport = await published(db, clock)
    await db[LOCKS].delete_one({"_id": "bad"})
    await db[MESSAGES].update_many({"group_id": "bad"}, {"$set": {"priority": "x"}})
    clock.advance(31)

    assert await transport.recover_orphans() == 1

    readied = await lock(db, "bad")
    assert readied is not None and readied["priority"] == 0
    assert (await run(transport))["bad"] == ["b1", "b2"]


# -------------------------------------------------------------------------------------- locks

BAD_PRIORITIES = {
    "a string": ("2", "a string ('2')"),
    "a word": ("x", "a string ('x')"),
    "null": (None, "null"),
    "missing": (..., "nothing"),
    "out of range": (7, "an int (7)"),
    "a fraction": (1.5, "a float (1.5)"),
    "a bool": (True, "a bool (True)"),
}


def corruption(field: str, value: Any) -> dict[str, Any]:
    return {"$unset": {field: 1}} if value is ... else {"$set": {field: value}}


@BATCHES
@pytest.mark.parametrize("shape", list(BAD_PRIORITIES))
async def test_a_lock_whose_priority_no_claim_asks_for_is_repaired_and_its_group_delivered(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, shape: str, batch_size: int
) -> None:
    transport = await published(db, clock)
    value, found = BAD_PRIORITIES[shape]
    await db[LOCKS].update_one({"_id": "bad"}, corruption("priority", value))

    first = await run(transport, batch_size=batch_size)

    # The other groups went first; the run's housekeeping (or the claim that read it) repaired
    # the lock from its head: the group's priority is its messages' (0), claimable now.
    assert first.get("good") == ["g1"] and first.get("other") == ["o1"]
    repaired = await lock(db, "bad")
    if repaired is not None:  # else the claim that read it repaired it and drained the group
        assert repaired["priority"] == 0 and repaired["token"] is None
    assert set_asides(caplog) == [(LOCKS, "bad", "priority", "repaired")]
    last = await run(transport, batch_size=batch_size)
    assert first.get("bad", []) + last.get("bad", []) == ["b1", "b2"]
    assert (await messages(db), await locks(db)) == ({}, {})
    assert any(found in r.getMessage() for r in caplog.records if hasattr(r, "mongoq_field"))


BAD_DUE_TIMES = {
    "a string": ("now", "a string ('now')"),
    "null": (None, "null"),
    "missing": (..., "nothing"),
    "a number (the epoch, as the seed's layout writes it)": (0.0, "a float (0.0)"),
    "a document": ({"at": 1}, "a document ({'at': 1})"),
}


@BATCHES
@pytest.mark.parametrize("shape", list(BAD_DUE_TIMES))
async def test_a_lock_whose_due_time_is_no_date_is_repaired_and_its_group_delivered(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, shape: str, batch_size: int
) -> None:
    transport = await published(db, clock)
    value, found = BAD_DUE_TIMES[shape]
    await db[LOCKS].update_one({"_id": "bad"}, corruption("available_at", value))

    first = await run(transport, batch_size=batch_size)

    assert first == {"good": ["g1"], "other": ["o1"]}
    await assert_lock(db, "bad", available_at=clock.now(), token=None, parked=False, priority=0)
    assert set_asides(caplog) == [(LOCKS, "bad", "available_at", "repaired")]
    assert found in caplog.records[-1].getMessage()
    assert await run(transport, batch_size=batch_size) == {"bad": ["b1", "b2"]}
    assert (await messages(db), await locks(db)) == ({}, {})


async def test_a_repaired_lock_keeps_a_live_holder_s_head_until_its_stamp_ends(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A lock damaged while its group is in flight: the repair makes it claimable when the
    holder's stamp on the head ends, not before (the holder is not taken over)."""
    transport = await published(db, clock)
    held = await claim_one(transport, "A", group="bad")
    await db[LOCKS].update_one({"_id": "bad"}, {"$set": {"available_at": "soon"}})

    await transport.recover_orphans()

    assert (await lock(db, "bad") or {})["available_at"] == held.lease_until
    assert await transport.extend(held) and await transport.ack(held)
    assert set_asides(caplog) == [(LOCKS, "bad", "available_at", "repaired")]


async def test_a_lock_with_nothing_left_to_deliver_is_dropped_by_the_repair(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    transport = await published(db, clock)
    await db[MESSAGES].delete_many({"group_id": "bad"})
    await db[LOCKS].update_one({"_id": "bad"}, {"$set": {"priority": "x"}})

    await transport.recover_orphans()

    assert await lock(db, "bad") is None
    assert set_asides(caplog) == [(LOCKS, "bad", "priority", "dropped")]


@BATCHES
async def test_a_lock_whose_version_is_no_number_is_repaired_by_the_claim_that_reads_it(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, batch_size: int
) -> None:
    transport = await published(db, clock)
    await db[LOCKS].update_one({"_id": "bad"}, {"$set": {"version": "one"}})

    assert await run(transport, batch_size=batch_size) == {
        "bad": ["b1", "b2"], "good": ["g1"], "other": ["o1"],
    }  # fmt: skip
    assert (await messages(db), await locks(db)) == ({}, {})
    assert set_asides(caplog) == [(LOCKS, "bad", "version", "repaired")]


@pytest.mark.parametrize("many", [False, True], ids=["publish", "publish_many"])
async def test_a_publish_into_a_group_whose_lock_version_is_no_number_repairs_it(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, many: bool
) -> None:
    transport = await published(db, clock)
    await db[LOCKS].update_one({"_id": "bad"}, {"$set": {"version": "one"}})

    if many:
        assert await transport.publish_many([NewMessage("bad", "b3"), NewMessage("new", "n1")])
    else:
        assert await transport.publish("bad", "b3") == 5
    repaired = await lock(db, "bad")
    assert repaired is not None and isinstance(repaired["version"], int)
    assert repaired["last_seq"] == 5
    assert set_asides(caplog) == [(LOCKS, "bad", "version", "repaired")]
    handled = await run(transport)
    assert handled["bad"] == ["b1", "b2", "b3"]
    assert (await messages(db), await locks(db)) == ({}, {})


LISTED_FAULTS = {
    "priority": (LOCKS, "bad", {"priority": "x"}, "lock: field 'priority' holds a string ('x')"),
    "available_at": (LOCKS, "bad", {"available_at": "now"},
                     "lock: field 'available_at' holds a string ('now')"),
    "version": (LOCKS, "bad", {"version": {"n": 1}},
                "lock: field 'version' holds a document ({'n': 1})"),
    "deliveries": (MESSAGES, 1, {"deliveries": "x"},
                   "head 1: field 'deliveries' holds a string ('x')"),
}  # fmt: skip


@pytest.mark.parametrize("shape", list(LISTED_FAULTS))
async def test_list_groups_and_stats_show_an_unusable_group_marked_unreadable(
    db: Any, clock: ManualClock, shape: str
) -> None:
    transport = await published(db, clock)
    collection, doc_id, change, text = LISTED_FAULTS[shape]
    await db[collection].update_one({"_id": doc_id}, {"$set": change})

    page = await transport.list_groups()
    stats = await transport.stats()

    listed = {group.group_id: group for group in page.groups}
    assert set(listed) == {"bad", "good", "other"}
    assert listed["bad"].unreadable == text
    assert listed["good"].unreadable is None and listed["other"].unreadable is None
    assert stats.messages == 4
    assert listed["bad"].head_seq == 1


# ------------------------------------------------------------------------------------ counter


async def test_a_counter_whose_value_is_a_number_in_text_is_repaired_without_reusing_a_seq(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    transport = await published(db, clock)  # seqs 1-4 used
    await db[COUNTERS].update_one({"_id": "seq"}, {"$set": {"value": "7"}})

    assert await transport.publish("good", "g2") == 8
    assert await transport.publish_many([NewMessage("good", "g3")]) == [9]
    assert await counter_value(db) == 9
    assert set_asides(caplog) == [(COUNTERS, "seq", "value", "repaired")]


async def test_a_counter_repair_never_goes_below_a_stored_seq(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The text says 2, but seqs up to 4 are stored (and 9 among the dead letters): the next
    seq is 10, never one a stored message or dead letter holds."""
    transport = await published(db, clock)
    await db[DEAD].insert_one({"_id": 9, "group_id": "gone", "event": None, "priority": 0,
                               "deliveries": 1, "error": "e"})  # fmt: skip
    await db[COUNTERS].update_one({"_id": "seq"}, {"$set": {"value": "2"}})

    assert await transport.publish("good", "g2") == 10


@pytest.mark.parametrize("value", ["x", None, {"n": 5}], ids=["a word", "null", "a document"])
@pytest.mark.parametrize("many", [False, True], ids=["publish", "publish_many"])
async def test_a_counter_that_cannot_be_read_is_reported_and_nothing_is_published(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, value: Any, many: bool
) -> None:
    transport = await published(db, clock)
    await db[COUNTERS].update_one({"_id": "seq"}, {"$set": {"value": value}})
    before = await snapshot(db)

    with pytest.raises(UnreadableDocument) as raised:
        if many:
            await transport.publish_many([NewMessage("good", "g2")])
        else:
            await transport.publish("good", "g2")

    assert raised.value.collection == COUNTERS and raised.value.field == "value"
    assert "mq_counters" in str(raised.value) and "'value'" in str(raised.value)
    assert "at least 4" in str(raised.value)  # the largest seq stored: the lowest safe value
    assert await snapshot(db) == before
    assert set_asides(caplog) == [(COUNTERS, "seq", "value", "reported")]


# ---------------------------------------------------------------------- hand-built leases

INJECTIONS: dict[str, Any] = {
    "seq": {"$gt": 0},
    "group_id": {"$ne": None},
    "token": {"$ne": None},
    "group_version": {"$ne": None},
    "worker_id": {"$ne": None},
    "deliveries": "1",
    "priority": "0",
    "lease_until": "later",
    "was_last": "yes",
}


def settles(transport: AsyncGroupTransport, lease: GroupLease) -> list[tuple[str, Any]]:
    """Every settle of `lease`, with the name its error gives the lease."""
    return [
        ("lease", lambda: transport.ack(lease)),
        ("lease", lambda: transport.nack(lease, 0)),
        ("lease", lambda: transport.nack(lease, 5)),
        ("lease", lambda: transport.extend(lease)),
        ("lease", lambda: transport.dead_letter(lease, "no")),
        ("leases[0]", lambda: transport.ack_many([lease])),
        ("leases[0]", lambda: transport.extend_many([lease])),
    ]


@pytest.mark.parametrize("field", list(INJECTIONS))
async def test_a_hand_built_lease_with_a_field_of_the_wrong_type_is_refused_unsent(
    db: Any, clock: ManualClock, field: str
) -> None:
    """Another consumer's lease with a field replaced (an operator such as ``{"$ne": None}``
    as its token would ack or extend whatever the filter then matches): refused, naming the
    field, before any command."""
    counter = CommandCounter()
    transport = await new_transport(instrument(db, counter), clock)
    await transport.publish("held", "h1")
    await transport.publish("held", "h2")
    theirs = await claim_one(transport, "A", group="held")
    forged = replace(theirs, **{field: INJECTIONS[field]})
    before = await snapshot(db)
    counter.reset()

    for name, call in settles(transport, forged):
        with rejects(f"{name}.{field}"):
            await call()

    assert counter.total == 0, counter.counts
    assert await snapshot(db) == before
    assert await transport.ack(theirs)  # the real lease still holds


async def test_a_lease_of_a_group_id_that_is_a_bool_is_refused(db: Any, clock: ManualClock) -> None:
    transport = await new_transport(db, clock)
    await transport.publish(1, "one")
    lease = await claim_one(transport, group=1)
    with rejects("lease.group_id"):
        await transport.ack(replace(lease, group_id=True))
    with rejects("leases[1].seq"):
        await transport.ack_many([lease, replace(lease, seq=True)])
    assert await transport.ack(lease)
    assert await lock(db, 1) is None


async def test_stats_and_a_drained_run_keep_working_over_every_unusable_lock(
    db: Any, clock: ManualClock
) -> None:
    transport = await published(db, clock)
    await db[LOCKS].update_one({"_id": "bad"}, {"$unset": {"available_at": 1}})
    await db[LOCKS].update_one({"_id": "good"}, {"$set": {"priority": "x"}})

    stats = await transport.stats()
    assert stats.messages == 4 and stats.ready == 1  # "other"

    handled: list[Any] = []

    async def handler(lease: GroupLease) -> None:
        handled.append(lease.event)

    async def advance() -> None:  # the drained run naps on the clock between its polls
        while True:
            await anyio.sleep(0.01)
            clock.advance(1)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            group.start_soon(advance)
            await transport.run(handler, stop_when_drained=True)
            group.cancel_scope.cancel()
    assert sorted(handled) == ["b1", "b2", "g1", "o1"]
    assert (await messages(db), await locks(db)) == ({}, {})


async def test_the_cli_lists_an_unusable_group_and_its_dead_letters(
    db: Any, clock: ManualClock, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """``mongoq groups stats / list / dead-letters`` over a lock and a dead letter no claim or
    listing could read before: each answers, the JSON listing says what is unreadable."""
    transport = await published(db, clock)
    await db[LOCKS].update_one({"_id": "bad"}, {"$set": {"priority": "x"}})
    await db[DEAD].insert_one({"_id": 99, "group_id": "x", "priority": "x", "deliveries": "y"})

    async def keep(database: Any) -> None:  # the test's database outlives each command
        return None

    monkeypatch.setattr(_driver, "connect", lambda *args, **kwargs: db)
    monkeypatch.setattr(_driver, "close", keep)
    monkeypatch.setattr(cli, "_fresh_embedded", lambda database: False)
    assert transport.prefix == PREFIX

    for command in (["stats"], ["list"], ["list", "--json"], ["dead-letters", "--json"]):
        capsys.readouterr()
        assert await cli.run(["groups", command[0], PREFIX, *command[1:]]) == 0, command
    listed = capsys.readouterr().out
    capsys.readouterr()
    assert await cli.run(["groups", "list", PREFIX, "--json"]) == 0
    page = json.loads(capsys.readouterr().out)
    unreadable = {group["group_id"]: group["unreadable"] for group in page["groups"]}
    assert unreadable == {
        "bad": "lock: field 'priority' holds a string ('x')", "good": None, "other": None,
    }  # fmt: skip
    assert json.loads(listed)["dead_letters"][0]["unreadable"] == (
        "field 'priority' holds a string ('x')"
    )


# -------------------------------------------------------------------------------- races


async def test_a_sweep_racing_a_publish_into_the_group_it_repairs_never_strands_the_message(
    db: Any, clock: ManualClock
) -> None:
    """The sweep (`recover_orphans`: 5 commands, two more when beaten) finds a lock whose
    priority no claim asks for and whose group has no message left, reads the group's head and
    drops the lock, fenced on the lock as read; a publish into that group (3 commands) races
    it, in every order. The message is never stranded: the sweep sees it and repairs the lock,
    or drops the lock before the publish readies the group (which makes a new one); when the
    publish changed the lock after the sweep read it, the repair or the drop matches nothing (a
    good change is never overwritten) and the sweep reads the lock again and repairs it. Then
    the message is delivered."""

    async def setup(transport: AsyncGroupTransport) -> Actors:
        await db[f"{transport.prefix}_locks"].insert_one({
            "_id": "g", "available_at": EPOCH, "token": None, "priority": "x", "parked": False,
            "version": 1, "last_seq": 1,
        })  # fmt: skip
        return {"S": transport.recover_orphans, "P": lambda: transport.publish("g", "g1")}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        last = [name for who, _, name in trace if who == "S"][-1]
        stored = await lock(db, "g", transport.prefix)
        assert stored is not None  # the message has a lock: nothing stranded
        assert stored["priority"] == 0  # and a claim sees it
        outcome = "repaired" if last == "find_one_and_update" else "dropped, made again"
        delivered = await drain(transport, clock)
        assert [(x.group_id, x.event) for x in delivered] == [("g", "g1")]
        assert await locks(db, transport.prefix) == {}
        return outcome

    seen = await race(db, clock, {"S": 5, "P": 3}, setup, check)

    assert set(seen) == {"repaired", "dropped, made again"}, seen


async def test_a_publish_repairing_a_lock_racing_its_holder_s_ack_never_strands_the_message(
    db: Any, clock: ManualClock
) -> None:
    """A holds g0, its group's last message, when the lock's version is damaged. A publish into
    the group (7 commands: allocate, insert, the refused ready, the lock and head reads, the
    repair, the ready again) races A's ack (3-4 commands) in every order. The repair resets the
    fences and takes the token from A (a lease taken before the damage carries fences nothing
    can check): A's ack still removes its head, but cannot drop the group; g1 is never
    stranded, delivered at once or when A's lease ends."""

    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g0")
        held = await claim_one(transport, "A", group="g")
        assert held.was_last
        await db[f"{transport.prefix}_locks"].update_one({"_id": "g"}, {"$set": {"version": "v"}})
        return {"A": lambda: transport.ack(held), "P": lambda: transport.publish("g", "g1")}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        assert results == {"A": True, "P": 2}
        stored = await lock(db, "g", transport.prefix)
        assert stored is not None and isinstance(stored["version"], int)  # nothing stranded
        now = [(x.group_id, x.event) for x in await drain(transport, clock)]
        clock.advance(VISIBILITY)
        later_on = [(x.group_id, x.event) for x in await drain(transport, clock)]
        assert now + later_on == [("g", "g1")]
        assert await locks(db, transport.prefix) == {}
        return "at once" if now else "after A's lease"

    seen = await race(db, clock, {"A": 4, "P": 7}, setup, check)

    assert set(seen) == {"at once", "after A's lease"}, seen
