"""Lane documents: who may claim which deliveries.

Collection ``<prefix>lanes`` holds 256 small documents, one per lane (``_id`` 0-255)::

    {_id, owner, instance, lease_until, epoch, rev, in_flight: [entry], lost: [entry]}

with ``entry = {"d": delivery _id, "g": claim generation, "h": handler, "k": key}`` (``k`` left
out for unkeyed deliveries). A worker (``owner``, on one `AsyncOutbox` instance: ``instance``)
holding a lane under a live lease is the only one that claims from it; ``in_flight`` lists what
it claimed, each with the delivery's claim generation at the time. An entry is *running* while
the lane is held and the delivery still exists with that generation: a completion deletes the
delivery, and a retry, release, burial or lost-lease charge moves its generation on, so none of
them has to write the lane. Taking a lane over increments ``epoch`` and moves the previous
owner's ``in_flight`` to ``lost``; `charge_lost` then charges each lost delivery one attempt,
fenced on the generation it was listed with, so charging twice charges once. ``rev`` moves on
with every write to the lane: a takeover pins the ``rev`` it read, so it applies only to the
state it judged free.

One more document, ``{_id: "requeues", value}``, counts `AsyncOutbox.requeue` calls: a claim
that saw it move while it ran checks its keyed picks again.

Every write here is a conditional update of one lane by ``_id`` (no secondary index: the
collection is read whole, 256 documents, once per claim); the filters and updates are in
`mongoq.outbox.schema`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pymongo import UpdateMany, UpdateOne

from mongoq import _driver
from mongoq.clock import stored_instant
from mongoq.outbox import schema
from mongoq.outbox.models import LANES
from mongoq.outbox.schema import REQUEUES

__all__ = ["REQUEUES", "Entry", "Lane", "charge_lost", "read_lanes", "seed_lanes"]

#: A lane nobody ever held: its lease expired long ago.
NEVER = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Entry:
    """One delivery listed by a lane: claimed by the lane's owner at generation `generation`."""

    delivery: Any
    generation: int
    handler: str
    key: str | None

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Entry:
        return cls(doc["d"], int(doc.get("g", 0)), doc.get("h", ""), doc.get("k"))

    @property
    def claim(self) -> tuple[Any, int]:
        """(delivery _id, generation): the claim this entry lists."""
        return self.delivery, self.generation

    def document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"d": self.delivery, "g": self.generation, "h": self.handler}
        if self.key is not None:
            doc["k"] = self.key
        return doc


@dataclass
class Lane:
    """A lane document as read at the start of a claim."""

    id: int
    owner: str | None
    instance: str | None
    lease_until: datetime
    epoch: int
    rev: int = 0
    in_flight: list[Entry] = field(default_factory=list)
    lost: list[Entry] = field(default_factory=list)

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Lane:
        return cls(
            id=int(doc["_id"]),
            owner=doc.get("owner"),
            instance=doc.get("instance"),
            lease_until=stored_instant(doc.get("lease_until")) or NEVER,
            epoch=int(doc.get("epoch", 0)),
            rev=int(doc.get("rev", 0)),
            in_flight=[Entry.from_document(e) for e in doc.get("in_flight") or ()],
            lost=[Entry.from_document(e) for e in doc.get("lost") or ()],
        )

    def held_by(self, owner: str, instance: str) -> bool:
        """Held by this owner on this instance; an expired lease nobody took over is still
        honoured (its next write renews it)."""
        return self.owner == owner and self.instance == instance

    def is_free(self, now: datetime) -> bool:
        return self.owner is None or self.lease_until <= now

    def fence(self, owner: str, instance: str) -> dict[str, Any]:
        """The filter of a write by this lane's holder: it still holds the lane it read."""
        return schema.lane_held(self.id, self.epoch, owner, instance)

    def take_filter(self) -> dict[str, Any]:
        """The filter of a takeover: the lane is exactly as read (judged free then); any write
        in between (a renewal, a hand-back, another take) moves ``rev`` on and the take fails."""
        return schema.lane_as_read(self.id, self.rev)


def lane_document(lane_id: int) -> dict[str, Any]:
    return {
        "_id": lane_id,
        "owner": None,
        "instance": None,
        "lease_until": NEVER,
        "epoch": 0,
        "rev": 0,
        "in_flight": [],
        "lost": [],
    }


async def seed_lanes(db: Any, collection: Any) -> None:
    """Create the lane documents that do not exist yet (idempotent, safe to race)."""
    ops = [
        _driver.update_by_id(
            db, schema.lane_by_id(lane_id), schema.lane_seeding(lane_document(lane_id)), upsert=True
        )
        for lane_id in range(LANES)
    ]
    await collection.bulk_write(ops, ordered=False)


async def read_lanes(collection: Any) -> tuple[list[Lane], int]:
    """Every lane, and the requeue counter."""
    docs = await _driver.find_list(collection, schema.lanes_all())
    lanes = [Lane.from_document(doc) for doc in docs if isinstance(doc["_id"], int)]
    requeues = next((int(d.get("value", 0)) for d in docs if d["_id"] == REQUEUES), 0)
    return lanes, requeues


async def charge_lost(
    db: Any, deliveries: Any, lanes: Any, taken: Sequence[tuple[Lane, int]], now: datetime
) -> None:
    """Charge one attempt to every delivery the previous owners of `taken` (lane, epoch after
    the take) still had running, then clear the lanes' ``lost`` lists.

    The charge is fenced on the generation each delivery was listed with and moves it on, so a
    charge repeated after a failure between the two writes, or a delayed one, charges nothing
    twice; a delivery that finished or was retried meanwhile is not charged at all.
    """
    entries = [entry for lane, _ in taken for entry in lane.lost]
    if entries:
        await deliveries.update_many(
            schema.delivery_claimed(e.claim for e in entries), schema.delivery_charging(now)
        )
    clear: list[UpdateOne | UpdateMany] = [
        _driver.update_by_id(db, schema.lane_at_epoch(lane.id, epoch), schema.lane_clearing_lost())
        for lane, epoch in taken
        if lane.lost
    ]
    if clear:
        await lanes.bulk_write(clear, ordered=False)
