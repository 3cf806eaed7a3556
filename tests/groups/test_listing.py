"""`list_groups`: ready, in-flight and parked groups with their heads, in a stable id order."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from mongoq import AsyncGroupTransport, GroupInfo
from mongoq.testing import ManualClock
from tests.support.group_helpers import VISIBILITY, locks, messages, new_transport
from tests.support.helpers import every_page, utc


async def list_all(
    transport: AsyncGroupTransport, state: Any = None, limit: int = 2
) -> list[GroupInfo]:
    return await every_page(
        lambda after: transport.list_groups(state, limit=limit, after=after), "groups", limit
    )


async def three_states(transport: AsyncGroupTransport, clock: ManualClock) -> dict[str, Any]:
    """Groups "r1", 7 (ready), "f1", 3 (in flight), "p1" (parked): seqs by group."""
    seqs = {}
    for group in ("p1", "f1", 3, "r1", 7):
        seqs[group] = await transport.publish(group, {"g": group})
        await transport.publish(group, {"g": group, "second": True})
        clock.advance(1)
    parked = await transport.claim("w")  # "p1": published first
    assert parked is not None and parked.group_id == "p1"
    assert await transport.nack(parked, 60, error="boom\nValueError: not now")
    for group in ("f1", 3):
        lease = await transport.claim("w")
        assert lease is not None and lease.group_id == group
    return seqs


async def test_each_state_lists_the_groups_the_locks_hold_in_it(
    db: Any, clock: ManualClock
) -> None:
    transport = await new_transport(db, clock)
    seqs = await three_states(transport, clock)
    now = clock.now()

    by_state = {state: await list_all(transport, state, limit=1) for state in
                ("ready", "in_flight", "parked")}  # fmt: skip

    assert [g.group_id for g in by_state["ready"]] == [7, "r1"]  # numbers first, as BSON
    assert [g.group_id for g in by_state["in_flight"]] == [3, "f1"]
    assert [g.group_id for g in by_state["parked"]] == ["p1"]
    stored = await locks(db)
    for state, groups in by_state.items():
        for group in groups:
            lock = stored[group.group_id]
            assert group.state == state
            assert utc(group.available_at) == utc(lock["available_at"])
            assert group.head_seq == seqs[group.group_id]  # the first message: the head
            head = (await messages(db))[group.head_seq]
            assert group.head_deliveries == head["deliveries"]
            assert group.head_published_at == utc(head["published_at"])
            assert group.head_age == (now - utc(head["published_at"])).total_seconds()
    parked = by_state["parked"][0]
    assert (parked.head_deliveries, parked.head_error) == (1, "boom\nValueError: not now")
    in_flight = {g.group_id: g for g in by_state["in_flight"]}
    assert utc(in_flight["f1"].available_at) == now + timedelta(seconds=VISIBILITY)
    everything = await list_all(transport, limit=3)
    assert [g.group_id for g in everything] == [3, 7, "f1", "p1", "r1"]


async def test_a_parked_group_is_ready_again_once_its_delay_ran_out(
    db: Any, clock: ManualClock
) -> None:
    transport = await new_transport(db, clock)
    await three_states(transport, clock)
    clock.advance(61)

    ready = await list_all(transport, "ready")
    assert [g.group_id for g in ready] == [3, 7, "f1", "p1", "r1"]  # leases ran out too
    assert await list_all(transport, "parked") == []


async def test_a_page_cursor_continues_across_equal_and_mixed_ids(
    db: Any, clock: ManualClock
) -> None:
    transport = await new_transport(db, clock)
    ids: list[Any] = [5, "b", 1, "a", 3_000_000_000, "c", 2]
    for group in ids:
        await transport.publish(group, None)

    for limit in (1, 2, 3, 7, 100):
        listed = [g.group_id for g in await list_all(transport, limit=limit)]
        assert listed == [1, 2, 5, 3_000_000_000, "a", "b", "c"]
