"""The batch slot (`mongoq.runtime.batch`) over clock time, against the fake holder of
`tests.runtime.test_batch`: a batch longer than its lease is kept through renewals to its end,
and an item a renewal found lost is left alone even once the lease it was claimed with has run
out. The adapters' suites check only what their renewals write (`extend_many`, heartbeats).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from functools import partial
from typing import Any

import anyio

from mongoq.runtime.batch import run_batch
from mongoq.testing import ManualClock, settle
from tests.runtime.test_batch import LEASE, FakeHolder


def batch_of_three(holder: FakeHolder) -> Any:
    """`run_batch` over a, b and c with `holder`, counting into it, to start in the background."""
    return partial(
        run_batch, holder, ["a", "b", "c"], clock=holder.clock, lease=LEASE, count=holder.count
    )


async def test_a_batch_longer_than_the_lease_is_renewed_every_third_of_it_until_it_ends(
    clock: ManualClock,
) -> None:
    """Three handlers of 25 s each: 75 s, two and a half leases. Every third of the lease the
    keep-alive renews the three together (a finished item is held until the batch completes
    it), each time well before the lease it extends runs out; so no handler needs its lease
    re-checked, and the three are completed together."""
    holder = FakeHolder(clock)
    start = clock.now()
    renewed_at: list[float] = []

    async def renew(items: Sequence[str]) -> list[bool]:
        renewed_at.append((clock.now() - start).total_seconds())
        return await FakeHolder.renew(holder, items)

    async def handle(item: str) -> Any:
        holder.calls.append(("handle", item))
        await clock.sleep(25)
        return f"result {item}"

    holder.renew = renew  # type: ignore[method-assign]
    holder.handle = handle  # type: ignore[method-assign]
    async with anyio.create_task_group() as group:
        group.start_soon(batch_of_three(holder))
        for _ in range(15):  # 75 s in steps of 5 s
            await settle()
            clock.advance(5)

    assert renewed_at == [10.0 * n for n in range(1, 8)]
    assert [call for call in holder.calls if call[0] == "renew"] == [("renew", ["a", "b", "c"])] * 7
    assert [call for call in holder.calls if call[0] != "renew"] == [
        ("handle", "a"),
        ("handle", "b"),
        ("handle", "c"),
        ("complete", [("a", "result a"), ("b", "result b"), ("c", "result c")]),
    ]
    assert holder.counts == Counter(completed=3)


async def test_an_item_a_renewal_found_lost_is_not_re_checked_even_once_the_lease_ran_out(
    clock: ManualClock,
) -> None:
    """Under a's handler a renewal finds b lost; the next renewal never answers, so when a
    returns the claim's lease has run out and each item left must be re-checked before it
    starts. c is, and runs; b is not even re-checked (it is no longer the batch's), nor
    started, nor settled, and counts lost once."""
    holder = FakeHolder(clock)
    holder.gate["a"] = anyio.Event()
    renewals = 0

    async def renew(items: Sequence[str]) -> list[bool]:
        nonlocal renewals
        renewals += 1
        if renewals > 1:
            await anyio.sleep_forever()  # a server that stopped answering
        return await FakeHolder.renew(holder, items)

    holder.renew = renew  # type: ignore[method-assign]
    async with anyio.create_task_group() as group:
        group.start_soon(batch_of_three(holder))
        await settle()
        holder.lost = {"b"}
        clock.advance(LEASE / 3)  # the first renewal
        await settle()
        clock.set(holder.until)
        await settle()
        holder.gate["a"].set()

    assert holder.calls == [
        ("handle", "a"),
        ("renew", ["a", "b", "c"]),
        ("renew_one", "c"),
        ("handle", "c"),
        ("complete", [("a", "result a"), ("c", "result c")]),
    ]
    assert holder.counts == Counter(completed=2, lost=1)
