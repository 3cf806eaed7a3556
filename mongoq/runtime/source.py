"""A source of work: what a run loop (`mongoq.runtime.loop.WorkerLoop`) needs from a primitive.

Each primitive's face hands one out: `AsyncTaskQueue.source` (`mongoq.tasks.source`),
`AsyncGroupTransport.source` (`mongoq.groups.source`), and `OutboxDispatcher` is one itself.
A loop runs one or more sources (the task functions' worker: one per queue) with one budget of
slots, and owns everything around them: the slots, the rotation between sources, which source
is taken for empty, the outage backoff, wake-ups, change streams, maintenance services,
signals and the stop. A source owns what is its primitive's own: how to claim, how to process
one claimed item (handler, renewals, settle, counting), what is left, and which maintenance
it needs.

Where what holds work back plugs in (so that none needs a loop of its own):

- an admission check before a claim (a limit, a pause) is the source's `claim`: it claims
  fewer than `limit`, or nothing, and the loop treats the source as empty until a wake-up or
  a poll interval;
- a state that wake-ups refresh (a pause flag, a limit's counters) is a `Service` with a
  `wake_key`, whose round the loop runs at once when the key is notified;
- a hook after a settle (releasing a slot, readying a dependent task) is the end of the
  source's `process`, which the loop awaits before the slot claims again.

Owns no collections.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from mongoq.clock import Clock
from mongoq.runtime import wakeups
from mongoq.runtime.events import Tally
from mongoq.runtime.services import Service

__all__ = ["ChangeFeed", "Source"]


@dataclass(frozen=True)
class ChangeFeed:
    """A change stream that tells a loop its source may have work: `pipeline` over
    `collection` (`mongoq.runtime.changes`). `heard` sees each event first and says whether it
    wakes the loop (None: every event does)."""

    collection: Any
    pipeline: Sequence[Mapping[str, Any]]
    heard: Callable[[Mapping[str, Any]], bool] | None = None


class Source(Protocol):
    """What a `WorkerLoop` runs.

    `claim(limit)` claims up to `limit` items, each for one slot (an item is what `process`
    takes: a task, a batch of tasks, a batch of group leases, a delivery); an empty list says
    nothing is claimable now. A loop of sources that `fills` gives each claim every free slot
    (one command for many items: the outbox's lanes); otherwise each slot claims with a limit
    of one. `process(item)` runs one item to its settle and counts it in `tally`; an error it
    lets escape is logged by the loop, and the item's lease recovers it. `next_due()` is when
    the next item becomes claimable (None: nothing is left at all), read by a loop that stops
    when drained.
    """

    @property
    def name(self) -> str: ...  # "tasks:emails": the run's log and its loop's name

    @property
    def clock(self) -> Clock: ...

    @property
    def tally(self) -> Tally: ...

    @property
    def fills(self) -> bool: ...

    @property
    def wake_key(self) -> wakeups.Key | None: ...

    @property
    def changes(self) -> ChangeFeed | None: ...

    @property
    def services(self) -> Sequence[Service]: ...

    async def claim(self, limit: int) -> Sequence[Any]: ...

    async def process(self, item: Any) -> None: ...

    async def next_due(self) -> datetime | None: ...
