"""`call_handler`: one call of a user's handler under the two limits a run loop puts on it, a
time limit on the primitive's clock and the lease. Past the limit the handler is cancelled and
`HandlerTimeout` raised (a failed attempt); when the lease is found lost meanwhile (taken over,
removed), its renewal cancels the handler's guard scope and `LeaseLost` is raised: the work can
no longer be recorded, and another worker may be running it. Owns no collections.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from mongoq.clock import Clock
from mongoq.errors import HandlerTimeout, LeaseLost

__all__ = ["call_handler"]

T = TypeVar("T")


async def call_handler(
    call: Callable[[], Awaitable[T]],
    *,
    clock: Clock,
    limit: float | None = None,
    guard: anyio.CancelScope | None = None,
    timed: Callable[[float], None] | None = None,
) -> T:
    """``await call()``, cancelled after `limit` seconds of `clock` time (`HandlerTimeout`), or
    when `guard` (a scope the lease's renewal cancels once it finds the lease lost) is
    cancelled (`LeaseLost`). The handler's own exceptions come out as they are. `timed` hears
    how long the handler ran, in seconds of `clock` time, however it ended."""
    started = clock.now()
    try:
        return await _limited(call, clock, limit, guard)
    finally:
        if timed is not None:
            timed((clock.now() - started).total_seconds())


async def _limited(
    call: Callable[[], Awaitable[T]],
    clock: Clock,
    limit: float | None,
    guard: anyio.CancelScope | None,
) -> T:
    scope = guard if guard is not None else anyio.CancelScope()
    timed_out = False
    results: list[T] = []
    failure: BaseException | None = None
    with scope:
        if limit is None:
            # No task of its own: the handler runs exactly as if awaited directly.
            results.append(await call())
        else:
            async with anyio.create_task_group() as group:

                async def time_limit() -> None:
                    nonlocal timed_out
                    await clock.sleep(limit)
                    timed_out = True
                    group.cancel_scope.cancel()

                group.start_soon(time_limit)
                try:
                    results.append(await call())
                except anyio.get_cancelled_exc_class():
                    raise  # the group's own (the limit) or the caller's: the group sorts it out
                except BaseException as error:  # raised below, outside the group: not in one
                    failure = error
                group.cancel_scope.cancel()  # the time limit, once the handler is done
    if scope.cancelled_caught:
        raise LeaseLost("the lease was lost while the handler ran; it was cancelled") from failure
    if timed_out:  # even if it returned anyway (a thread, or a cancellation swallowed)
        raise HandlerTimeout(f"timed out after {limit:g} s") from failure
    if failure is not None:
        raise failure
    return results[0]
