"""`KeepAlive`, the renewal of a lease while its holder works: told to renew now (a cancel of
the item heard in this process), it renews at once, and once more when the news came while a
renewal sent before it was in flight."""

from __future__ import annotations

from datetime import timedelta

import anyio

from mongoq.runtime.keepalive import KeepAlive
from mongoq.testing import ManualClock
from tests.support.helpers import wait_for


async def test_a_renewal_told_to_renew_while_one_is_in_flight_renews_once_more() -> None:
    """`renew_now` during a renewal sent before the news: that renewal says nothing of it, so
    one more follows at once (else the news waits a whole interval)."""
    clock = ManualClock()
    gate, calls = anyio.Event(), []
    keepalive: KeepAlive | None = None

    async def renew() -> bool:
        calls.append(clock.now())
        if len(calls) == 1:
            assert keepalive is not None
            keepalive.renew_now()  # the news arrives while this renewal is in flight
            await gate.wait()
        return True

    keepalive = KeepAlive(clock=clock, interval=60, renew=renew, first_at=clock.now(), name="x")
    async with keepalive:
        await wait_for(lambda: len(calls) == 1, "the first renewal")
        gate.set()
        await wait_for(lambda: len(calls) == 2, "a second renewal at once")
    assert calls[1] - calls[0] < timedelta(seconds=60)
