"""When a run loop may start a handler: the lease rule every loop and the facade share.

A handler starts only while its holder knows the lease is live. A lease, from a claim or a
renewal, is dated from a clock reading taken before the request was sent (the server dates it
no earlier), never from when the reply came: a reply held up in the network would otherwise
stretch the lease past what the database holds, and another worker may take the item over in
between. A renewal whose outcome is unknown (a driver error) renews nothing. Before a start the
lease must still have a third of its length left (`MARGIN`), so that the handler's first
renewal, a third of a lease later at most, lands before it ends; with less left, the item is
renewed first (fenced on its token, so this works after the lease ended too, as long as nobody
took the item over). An item that cannot be shown live is not started; it is left to the fence
(the holder's later writes match nothing once another worker claimed it). Owns no collections.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

from mongoq import _driver
from mongoq.clock import Clock

__all__ = ["MARGIN", "Liveness", "confirm", "renewed_until", "startable"]

log = logging.getLogger("mongoq.worker")

#: The share of a lease that must be left when a handler starts.
MARGIN = 1 / 3
#: Renewals `confirm` sends before it gives up on a lease whose replies keep coming late.
RENEWALS = 3


class Liveness(enum.Enum):
    """What `confirm` found: the lease is live (start), was found lost (taken over, settled,
    removed: never start, never settle), or could not be shown live before it ended (renewals
    failed or answered late: not started, left to the fence)."""

    LIVE = "live"
    LOST = "lost"
    UNCONFIRMED = "unconfirmed"


def startable(lease_end: datetime, now: datetime, lease: float) -> bool:
    """Whether a handler may start at `now` under a lease that ends at `lease_end` (`lease`
    seconds long): a third of it must be left."""
    return now < lease_end - timedelta(seconds=lease * MARGIN)


def renewed_until(sent: datetime, lease: float) -> datetime:
    """The end of a lease renewed (or claimed) by a request sent at `sent`."""
    return sent + timedelta(seconds=lease)


async def confirm(
    lease_end: datetime,
    *,
    clock: Clock,
    lease: float,
    renew: Callable[[], Awaitable[bool]],
    name: str,
) -> Liveness:
    """Make sure a lease ending at `lease_end` is live enough to start a handler, renewing it
    (`renew()`: True while held, fenced on the holder's token) when less than the margin is
    left. A renewal is tried even once the lease ended: fenced, it succeeds only if nobody took
    the item over, and then dates a fresh lease. A renewal's driver error is an unknown outcome
    and renews nothing: tried again after a ninth of the lease, `RENEWALS` times at most."""
    for _ in range(RENEWALS + 1):
        if startable(lease_end, clock.now(), lease):
            return Liveness.LIVE
        sent = clock.now()
        try:
            held = await renew()
        except _driver.DRIVER_ERRORS as exc:
            log.warning("%s: renewal before the start failed (%s)", name, exc)
            await clock.sleep(lease / 9)
            continue
        if not held:
            return Liveness.LOST
        lease_end = max(lease_end, renewed_until(sent, lease))
    if startable(lease_end, clock.now(), lease):
        return Liveness.LIVE
    log.info("%s: the lease could not be shown live; not started", name)
    return Liveness.UNCONFIRMED
