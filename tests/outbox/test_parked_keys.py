"""The parked keys (issue 14): a parked delivery carries one field for its (handler, key), the
``parked_key`` that unparking's distinct scan groups on. Each test reads the stored deliveries
back; the plan itself
(a DISTINCT_SCAN) is checked on a real server in test_plans.py.
"""

from __future__ import annotations

from typing import Any

from mongoq.outbox import Event
from mongoq.testing import ManualClock
from tests.support.outbox_helpers import deliveries, delivery_of, new_outbox, ran

#: Handlers whose names sort around each other: "h1" < "h1a" < "h2" (NUL sorts first).
HANDLERS = {"t": ["h1", "h1a", "h2"]}


async def park_followers(odb: Any, clock: ManualClock, keys: list[str]) -> Any:
    """Each key's head runs on X and is rescheduled an hour; X's next claim parks the rest."""
    outbox = await new_outbox(odb, clock, subscriptions=HANDLERS)
    await outbox.publish(
        [Event(f"{k}-{n}", "t", key=k) for k in keys for n in (1, 2)], session=None
    )
    heads = await outbox.claim("X", limit=20)
    assert ran(heads) == sorted((f"{k}-1", 1) for k in keys for _ in HANDLERS["t"])
    for head in heads:
        assert await outbox.reschedule(head, delay=3600, error="down")
    assert await outbox.claim("X") == []
    return outbox


async def test_a_parked_delivery_carries_its_handler_and_key_in_one_field(
    odb: Any, clock: ManualClock
) -> None:
    await park_followers(odb, clock, ["k", "k\x01"])
    parked = {
        (d["handler"], d["key"]): d["parked_key"]
        for d in await deliveries(odb)
        if d.get("lane") == "parked"
    }
    assert parked == {
        (handler, key): f"{handler}\x00{key}" for handler in HANDLERS["t"] for key in ("k", "k\x01")
    }
    # The field's order is the (handler, key) order, which unparking's cursor goes by.
    assert sorted(parked.values()) == [parked[pair] for pair in sorted(parked)]


async def test_unparking_a_handler_set_moves_back_the_heads_of_its_keys_once_they_are_first(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await park_followers(odb, clock, ["a", "b"])
    clock.advance(3600)
    # h1's heads finish; a claim for h1 unparks h1's followers (and may move back no other
    # handler's: theirs still wait behind their heads).
    for head in await outbox.claim("X", ["h1"], limit=5):
        assert await outbox.complete(head)
    followers = await outbox.claim("X", ["h1"], limit=5)
    assert ran(followers) == [("a-2", 1), ("b-2", 1)]
    for handler in ("h1a", "h2"):
        for key in ("a", "b"):
            doc = await delivery_of(odb, f"{key}-2", handler)
            assert doc is not None and doc["lane"] == "parked", (handler, key)
