"""`call_handler`: one call of a user's handler under the limits a run loop puts on it: a time
limit on the primitive's clock, the lease, and the run's own cancellation. Past the limit the
handler is cancelled and `HandlerTimeout` raised (a failed attempt); when the lease is found
lost meanwhile (taken over, removed, cancelled), its renewal cancels the guard scope and
`LeaseLost` is raised: the work can no longer be recorded, and another worker may be running it.

The handler runs in an asyncio task of its own, cancelled once when one of those limits comes.
A handler that ignores its cancellation (a bare ``except:`` around an ``await``, a blocking call
in a thread) is given `GRACE` seconds of the clock to end; then it is abandoned: left running,
`HandlerAbandoned` raised (its item is not settled, its lease no longer renewed, its slot free),
one WARNING names it. A cancel scope around the handler itself would deliver the cancellation
again at every checkpoint, a busy loop of the event loop for as long as the handler ignores it.
The running handlers are known by task (`running`), for the watchdog (`mongoq.runtime.watchdog`).
Owns no collections.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import anyio

from mongoq.clock import Clock
from mongoq.errors import HandlerAbandoned, HandlerTimeout, LeaseLost

__all__ = ["GRACE", "abandoned", "call_handler", "running"]

log = logging.getLogger("mongoq.worker")

T = TypeVar("T")

#: Seconds of the clock a cancelled handler has to end before it is abandoned.
GRACE = 5.0
#: The handlers running now, by their task: what each is (e.g. ``task 't1'``).
running: dict[asyncio.Task[Any], str] = {}
#: Those of them abandoned (`HandlerAbandoned`) and still running: ``asyncio.run`` waits for
#: every task at its end, so a process with one that never ends does not exit by itself.
abandoned: set[asyncio.Task[Any]] = set()
#: The handler task this code runs in, if any: a `call_handler` inside a handler (a task
#: function's own time limit inside its run loop's) nests in the outer one, which then gives
#: the inner one the time to abandon first, and says nothing more (`_nested`).
_supervisor: contextvars.ContextVar[asyncio.Task[Any] | None] = contextvars.ContextVar(
    "mongoq_supervisor", default=None
)
_nested: set[asyncio.Task[Any]] = set()


async def call_handler(
    call: Callable[[], Awaitable[T]],
    *,
    clock: Clock,
    limit: float | None = None,
    guard: anyio.CancelScope | None = None,
    timed: Callable[[float], None] | None = None,
    name: str = "handler",
    grace: float = GRACE,
) -> T:
    """``await call()``, cancelled after `limit` seconds of `clock` time (`HandlerTimeout`), or
    when `guard` (a scope the lease's renewal cancels once it finds the lease lost) is
    cancelled (`LeaseLost`), or when the caller is cancelled (the cancellation goes on); a
    handler that does not end within `grace` seconds of its cancellation is abandoned
    (`HandlerAbandoned`). The handler's own exceptions come out as they are. `timed` hears how
    long the handler ran, in seconds of `clock` time, however it ended (an abandoned one: when
    it ends); `name` names the handler in the log."""
    if limit is None and guard is None:  # nothing to supervise: the caller's own call does it
        return await _timed(call, clock, timed)
    return await _supervised(partial(_timed, call, clock, timed), clock, limit, guard, name, grace)


async def _supervised(
    call: Callable[[], Awaitable[T]],
    clock: Clock,
    limit: float | None,
    guard: anyio.CancelScope | None,
    name: str,
    grace: float,
) -> T:
    outer = _supervisor.get()
    if outer is not None:
        _nested.add(outer)
    ended = anyio.Event()
    handler: asyncio.Task[T] = asyncio.get_running_loop().create_task(_awaited(call))
    handler.add_done_callback(lambda _: ended.set())
    running[handler] = name
    try:
        why = await _stop_reason(ended, clock, limit, guard)
    except BaseException:  # the caller's cancellation: the handler stops first, or is left
        await _cancel(handler, ended, clock, grace, name, "the worker stopped")
        _raise_inner_abandoned(handler)
        if _finished(handler) and anyio.current_effective_deadline() == -math.inf:
            # It finished anyway (a thread cannot be interrupted): its result is recorded,
            # and the run loop's cancel scope delivers the cancellation again at once after.
            return handler.result()
        raise
    if why is None:
        running.pop(handler, None)
        _nested.discard(handler)
        return handler.result()
    await _cancel(handler, ended, clock, grace, name, why)
    _raise_inner_abandoned(handler)
    failure = None if handler.cancelled() else handler.exception()
    if why == _LOST:
        raise LeaseLost("the lease was lost while the handler ran; it was cancelled") from failure
    # Even if it returned anyway (a thread, or a cancellation swallowed).
    raise HandlerTimeout(f"timed out after {limit:g} s") from failure


def _raise_inner_abandoned(handler: asyncio.Task[Any]) -> None:
    """A nested call_handler inside `handler` abandoned its own handler (and said so): that is
    this one's outcome too."""
    _nested.discard(handler)
    if handler.done() and not handler.cancelled():
        failure = handler.exception()
        if isinstance(failure, HandlerAbandoned):
            raise failure


def _finished(handler: asyncio.Task[Any]) -> bool:
    """Whether `handler` ended with a result (neither cancelled nor failed)."""
    return handler.done() and not handler.cancelled() and handler.exception() is None


async def _awaited(call: Callable[[], Awaitable[T]]) -> T:
    _supervisor.set(asyncio.current_task())  # (a call_handler inside it nests)
    return await call()


async def _timed(
    call: Callable[[], Awaitable[T]], clock: Clock, timed: Callable[[float], None] | None
) -> T:
    """``await call()``, `timed` told how long it ran on `clock`: timed from within the task
    that runs it, so that another handler's turn in between is not counted (nor, for one
    abandoned, heard before it ends)."""
    started = clock.now()
    try:
        return await call()
    finally:
        if timed is not None:
            timed((clock.now() - started).total_seconds())


_LOST = "its lease was lost"
_TIMED_OUT = "it ran past its time limit"


async def _stop_reason(
    ended: anyio.Event, clock: Clock, limit: float | None, guard: anyio.CancelScope | None
) -> str | None:
    """Wait for the handler to end; None when it did, else why it must stop: `_TIMED_OUT`, or
    `_LOST` (`guard` cancelled). The caller's cancellation is raised."""
    scope = guard if guard is not None else anyio.CancelScope()
    timed_out = False
    with scope:
        async with anyio.create_task_group() as group:
            if limit is not None:

                async def time_limit() -> None:
                    nonlocal timed_out
                    await clock.sleep(limit)
                    timed_out = True
                    group.cancel_scope.cancel()

                group.start_soon(time_limit)
            await ended.wait()
            group.cancel_scope.cancel()  # the time limit, once the handler is done
    if scope.cancelled_caught:
        return _LOST
    return _TIMED_OUT if timed_out else None


async def _cancel(
    handler: asyncio.Task[Any], ended: anyio.Event, clock: Clock, grace: float, name: str,
    why: str,
) -> None:  # fmt: skip
    """Cancel `handler` once and give it `grace` seconds to end; `HandlerAbandoned` when it
    does not (it runs on, unsupervised)."""
    handler.cancel()
    # A nested supervisor inside gets its own grace first: this one waits twice as long.
    wait = 2 * grace if handler in _nested else grace
    with anyio.CancelScope(shield=True):
        async with anyio.create_task_group() as group:

            async def give_up() -> None:
                await clock.sleep(wait)
                group.cancel_scope.cancel()

            group.start_soon(give_up)
            await ended.wait()
            group.cancel_scope.cancel()
    if handler.done():
        running.pop(handler, None)
        return
    abandoned.add(handler)
    _nested.discard(handler)
    handler.add_done_callback(_when_abandoned_ends(name))
    log.warning(
        "%s: abandoned, still running %g s after it was cancelled (%s): it ignores its "
        "cancellation; its lease is no longer renewed and its slot is free",
        name, grace, why, extra={"mongoq_handler": name, "mongoq_outcome": "lost"},
    )  # fmt: skip
    raise HandlerAbandoned(f"{name} ignored its cancellation ({why}) and was abandoned")


def _when_abandoned_ends(name: str) -> Callable[[asyncio.Task[Any]], None]:
    """What an abandoned handler's task does when it ends at last: forgotten, and its outcome
    read (asyncio would otherwise log "exception was never retrieved")."""

    def ended(task: asyncio.Task[Any]) -> None:
        running.pop(task, None)
        abandoned.discard(task)
        outcome = "cancelled" if task.cancelled() else repr(task.exception())
        log.info("%s: the abandoned handler ended at last (%s)", name, outcome,
                 extra={"mongoq_handler": name})  # fmt: skip

    return ended
