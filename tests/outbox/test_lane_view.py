"""The lane view's split (which lanes a claim holds, may take, or must take over first) is kept
between claims and placed again lane by lane as the view changes: whatever the order of
updates and clock readings, it answers what a split computed afresh answers."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from mongoq.outbox.lanes import NEVER, Lane, LaneView
from mongoq.outbox.models import Entry

START = datetime(2026, 1, 1, tzinfo=UTC)
HANDLERS = ("a", "b")


def afresh(
    view: LaneView, owner: str, instance: str, now: datetime, handlers: frozenset[str]
) -> tuple[set[int], set[int], set[int], set[int]]:
    """The split by its definition, lane by lane."""
    held, free, stale, others = set(), set(), set(), set()
    for lane_id, lane in view.lanes.items():
        mine = lane.held_by(owner, instance)
        if lane.handler not in handlers:
            if mine:
                others.add(lane_id)
        elif mine:
            held.add(lane_id)
        elif lane.owner is None or lane.lease_until <= now:
            (stale if lane.in_flight or lane.lost else free).add(lane_id)
    return held, free, stale, others


def a_lane(rng: random.Random, lane_id: int, now: datetime) -> Lane:
    owner = rng.choice([None, "A", "B"])
    lease = now + timedelta(seconds=rng.uniform(-5, 30)) if owner else NEVER
    listed = [Entry(f"d{lane_id}", 1, HANDLERS[lane_id // 8], None)] if rng.random() < 0.2 else []
    return Lane(lane_id, owner, "i" if owner else None, lease, 1, 0, HANDLERS[lane_id // 8],
                lane_id % 8, in_flight=listed)  # fmt: skip


@pytest.mark.parametrize("seed", range(20))
def test_the_kept_split_answers_what_a_fresh_split_answers(seed: int) -> None:
    rng = random.Random(seed)
    view = LaneView()
    now = START
    view.update([a_lane(rng, i, now) for i in range(16)])
    for _ in range(200):
        step = rng.random()
        if step < 0.4:
            view.update([a_lane(rng, rng.randrange(16), now)])
        elif step < 0.7:
            now += timedelta(seconds=rng.uniform(0, 8))
        owner = rng.choice(["A", "B"])
        handlers = frozenset(rng.sample(HANDLERS, rng.choice([1, 2])))
        held, free, stale, others = view.split(owner, "i", now, handlers)
        got = (set(held), set(free), {lane.id for lane in stale}, set(others))
        assert got == afresh(view, owner, "i", now, handlers)
