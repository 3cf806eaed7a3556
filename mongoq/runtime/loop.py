"""Run loops shared by the primitives: concurrency, idle polling, graceful stop, signals.

A `WorkerLoop` runs `concurrency` slots. Each slot claims one item (or one batch), processes
it, and claims again. When nothing is claimable, one idle slot polls for all of them: it
sleeps `poll_interval` on the primitive's clock and claims again, while the other idle slots
wait; a slot that claims something wakes one waiting slot, which claims too (and wakes the
next if it finds something), so an idle worker sends one claim an interval whatever its
concurrency. With `claim_many` instead, one claimer fills every free slot with one claim and
claims again as soon as a slot frees up (the outbox's dispatcher: its claim hands out many
deliveries from the lanes it leases in one command). A put or publish in the same process
wakes the poller at once (`mongoq.runtime.wakeups`), and on a replica set so does a change
stream's event (`mongoq.runtime.changes`). The primitive's housekeeping (reclaiming expired
leases, readying orphaned groups) runs every `housekeeping_interval`, busy or not, and when a
slot finds nothing to claim unless it ran within that interval. `stop()` is graceful: no slot
claims again, in-flight items finish, `run()` returns. Cancelling `run()` cancels in-flight
items, whose lease handling releases them. With `handle_signals`, the first SIGTERM/SIGINT
stops gracefully and a second one cancels. Owns no collections.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

import anyio
import anyio.lowlevel

from mongoq import _driver
from mongoq._validation import check_seconds, check_worker_id
from mongoq.clock import Clock
from mongoq.errors import MongoqError
from mongoq.runtime import changes, wakeups, watchdog
from mongoq.runtime.outage import Outage

__all__ = [
    "WORKER_STOPPED",
    "WorkerHost",
    "WorkerLoop",
    "default_worker_id",
    "mongoq_errors_unwrapped",
    "note_embedded",
    "require_main_thread",
    "watch_signals",
]

log = logging.getLogger("mongoq.worker")

Item = TypeVar("Item")
T = TypeVar("T")

#: The error recorded for an item whose handler was cancelled: the worker stopped under it
#: (a cancelled `run`, a second signal), not a failure of the item's own.
WORKER_STOPPED = "worker stopped: the handler was cancelled before it finished"


def default_worker_id() -> str:
    """``hostname:pid:uuid8``: the host and process a worker runs in, unique per start."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Stoppable(Protocol):
    """A run loop that can be asked to stop gracefully (`WorkerLoop`, `OutboxDispatcher`)."""

    @property
    def stopping(self) -> bool: ...

    def stop(self) -> None: ...


def require_main_thread() -> None:
    """Signals reach only the main thread: `handle_signals` is refused elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        raise MongoqError(
            "handle_signals needs the main thread (signals reach only it); elsewhere, call "
            "stop() to stop gracefully, or cancel run()"
        )


async def watch_signals(loop: Stoppable, scope: anyio.CancelScope, name: str) -> None:
    """The first SIGTERM/SIGINT stops `loop` gracefully; a second one cancels `scope`."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if loop.stopping:
                log.warning("%s: second signal %d, cancelling in-flight work", name, signum)
                scope.cancel()
                return
            log.info("%s: signal %d, stopping gracefully", name, signum)
            loop.stop()


@contextlib.contextmanager
def mongoq_errors_unwrapped() -> Iterator[None]:
    """A run loop's task groups wrap what their tasks raise in exception groups. When all of it
    is mongoq's own errors (`IndexesMissing` from every slot at once), the caller gets the
    first of them as itself, so ``except IndexesMissing`` works on ``run()``."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if leaves and all(isinstance(leaf, MongoqError) for leaf in leaves):
            raise leaves[0] from group
        raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            yield from _leaves(error)
        else:
            yield error


class WorkerLoop(Generic[Item]):
    """Claim-process slots over a claim function and a process function."""

    def __init__(
        self,
        *,
        claim: Callable[[], Awaitable[Item | None]] | None = None,
        claim_many: Callable[[int], Awaitable[list[Item]]] | None = None,
        process: Callable[[Item], Awaitable[None]],
        clock: Clock,
        concurrency: int = 1,
        poll_interval: float = 1.0,
        stop_when_empty: bool = False,
        housekeeping: Callable[[], Awaitable[Any]] | None = None,
        housekeeping_interval: float = 60.0,
        name: str = "worker",
        next_due: Callable[[], Awaitable[datetime | None]] | None = None,
        wake_key: wakeups.Key | None = None,
        background: Sequence[Callable[[], Coroutine[Any, Any, Any]]] = (),
        changes: tuple[Any, Sequence[Mapping[str, Any]]] | None = None,
        on_change: Callable[[Mapping[str, Any]], bool] | None = None,
        give_up_after: float | None = None,
    ) -> None:
        if (claim is None) == (claim_many is None):
            raise ValueError("a WorkerLoop claims with one of claim and claim_many")
        self._claim = claim
        self._claim_many = claim_many
        self._ended = 0  # items processed, ever (`claim_many`: a slot freed up)
        self._next_due = next_due
        self._process = process
        self._clock = clock
        self._concurrency = concurrency
        self._poll_interval = poll_interval
        self._stop_when_empty = stop_when_empty
        self._housekeeping = housekeeping
        self._housekeeping_interval = housekeeping_interval
        self._housekept_at: datetime | None = None
        self.name = name
        self._outage = Outage(
            name, clock, poll_interval=poll_interval, give_up_after=give_up_after,
            on_back=self._cut_naps,
        )  # fmt: skip
        self._stopping = False
        self._naps: set[anyio.CancelScope] = set()
        self._scope: anyio.CancelScope | None = None
        self._group: anyio.abc.TaskGroup | None = None  # while running: for the drain timer
        self._drain: float | None = None  # a stop's grace, once one was given
        self.in_flight = 0
        self._wake_key = wake_key
        self._background = tuple(background)  # run beside the slots, cancelled after them
        self._changes = changes  # (collection, pipeline): a change stream's events wake it
        self._on_change = on_change  # hears each event first; it wakes the loop if this says so
        self._wakes = 0  # wake-ups so far: one that came while a slot claimed is not missed
        self._poller: int | None = None  # the idle slot that polls for all of them
        self._waiting: list[anyio.Event] = []  # the other idle slots, oldest first

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def idle(self) -> bool:
        """Nothing in flight, and every slot naps on the clock or waits for another slot's
        poll (with `claim_many`: the claimer naps): only the clock or a wake-up moves it."""
        if self.in_flight:
            return False
        if self._claim_many is not None:
            return bool(self._naps)
        return len(self._naps) + len(self._waiting) == self._concurrency

    def stop(self, grace: float | None = None) -> None:
        """Graceful stop: claim nothing more, let in-flight items finish; with `grace`, those
        still running `grace` seconds (of the clock) later are cancelled, as `cancel` does."""
        if not self._stopping:
            log.info("%s: stopping after %d in-flight item(s)", self.name, self.in_flight)
        self._stopping = True
        self._cut_naps()
        for waiting in self._waiting:
            waiting.set()
        if grace is not None and self._drain is None:
            self._drain = grace
            if self._group is not None:
                self._group.start_soon(self._drain_after, grace)

    async def _drain_after(self, grace: float) -> None:
        await self._clock.sleep(grace)
        if self.in_flight:
            log.warning("%s: %d item(s) still running %g s after the stop; cancelling them",
                        self.name, self.in_flight, grace)  # fmt: skip
        self.cancel()

    def wake(self) -> None:
        """Something may be claimable now (a put or publish of this process): the poller
        claims at once (or, with no idle slot polling, one waiting slot does)."""
        self._wakes += 1
        if self._naps:
            self._cut_naps()
        elif self._poller is None:  # (a poller that is claiming claims again: `_wakes`)
            self._wake_one()

    def _wake_one(self) -> bool:
        """Wake the longest-waiting idle slot; False when none waits."""
        while self._waiting:
            waiting = self._waiting.pop(0)
            if not waiting.is_set():
                waiting.set()
                return True
        return False

    async def run(self, *, handle_signals: bool = False) -> None:
        if handle_signals:
            require_main_thread()
        with mongoq_errors_unwrapped():
            await self._run(handle_signals)

    def cancel(self) -> None:
        """Hard stop: cancel the in-flight items (their lease handling releases them, recorded
        as "worker stopped"); `run()` then returns. What a second signal does."""
        self.stop()
        if self._scope is not None:
            self._scope.cancel()

    async def _run(self, handle_signals: bool) -> None:
        async with anyio.create_task_group() as group:
            self._scope, self._group = group.cancel_scope, group
            if self._drain is not None:  # stopped with a grace before it ran
                group.start_soon(self._drain_after, self._drain)
            if handle_signals:
                group.start_soon(watch_signals, self, group.cancel_scope, self.name)
            if self._housekeeping is not None:
                group.start_soon(self._housekeep)
            for task in self._background:
                group.start_soon(task)
            if self._changes is not None:
                collection, pipeline = self._changes
                group.start_soon(partial(
                    changes.watch, collection, pipeline, self._changed, clock=self._clock,
                    retry=self._poll_interval, name=self.name,
                ))  # fmt: skip
            listening = (
                wakeups.listen(self._wake_key, self.wake)
                if self._wake_key is not None
                else contextlib.nullcontext()
            )
            with listening:
                async with anyio.create_task_group() as slots:
                    if self._claim_many is not None:
                        await self._fill_slots(slots)
                    else:
                        for number in range(self._concurrency):
                            slots.start_soon(self._slot, number)
            group.cancel_scope.cancel()  # the signal watcher, once every slot has returned

    def _changed(self, event: Mapping[str, Any]) -> None:
        if self._on_change is None or self._on_change(event):
            self.wake()

    async def _housekeep(self) -> None:
        while True:
            await self._clock.sleep(self._housekeeping_interval)
            await self._run_housekeeping()

    async def _run_housekeeping(self, *, unless_recent: bool = False) -> None:
        if self._housekeeping is None:
            return
        now = self._clock.now()
        if (
            unless_recent
            and self._housekept_at is not None
            and ((now - self._housekept_at).total_seconds() < self._housekeeping_interval)
        ):
            return
        self._housekept_at = now
        try:
            await self._housekeeping()
        except _driver.DRIVER_ERRORS as exc:
            self._outage.failed(exc, "housekeeping", now)  # tried again at its next turn
        else:
            self._outage.succeeded(now)

    async def _nap(self, until: datetime | None = None, *, seconds: float | None = None) -> None:
        """Sleep `seconds` (default `poll_interval`), or until `until` if that comes first;
        `stop()` wakes it."""
        with anyio.CancelScope() as scope:
            self._naps.add(scope)
            try:
                if not self._stopping:
                    length = self._poll_interval if seconds is None else seconds
                    wake = self._clock.now() + timedelta(seconds=length)
                    await self._clock.sleep_until(wake if until is None else min(until, wake))
            finally:
                self._naps.discard(scope)

    async def _drained(self, wakes: int) -> bool:
        """With `next_due`: True (and the loop stops) when nothing is left at all; otherwise
        sleeps until the next item is due (or `poll_interval`), and says False. No sleep when
        a wake-up came since `wakes` (counted before the claim)."""
        assert self._next_due is not None
        started = self._clock.now()
        try:
            due = await self._next_due()
        except _driver.DRIVER_ERRORS as exc:
            delay = self._outage.failed(exc, "reading what is left", started)
            due = self._clock.now() + timedelta(seconds=delay)
        else:
            self._outage.succeeded(started)
        if due is None and self.in_flight == 0:
            self.stop()  # wakes the other slots' naps: they find the same
            return True
        if self._wakes != wakes:
            return False  # woken while claiming or reading: claim again at once
        if due is None or due <= self._clock.now():
            # Another slot's item may still come back (a retry), or the claim found nothing
            # due although something is: another worker took it, it is below this worker's
            # priority, or it waits for housekeeping. Poll, never spin.
            await self._nap()
            return False
        await self._nap(due)
        return False

    async def _idle(self, number: int) -> None:
        """Slot `number` found nothing: the poller (the first idle slot) sleeps
        `poll_interval` and claims again; any other waits until a slot claims something, a
        wake-up, or `stop()`."""
        if self._poller is None or self._poller == number:
            self._poller = number
            await self._nap()
            return
        waiting = anyio.Event()
        self._waiting.append(waiting)
        try:
            if not self._stopping:
                await waiting.wait()
        finally:
            with contextlib.suppress(ValueError):
                self._waiting.remove(waiting)

    def _cut_naps(self) -> None:
        """End every nap now: the slots (or the claimer) claim again."""
        for nap in list(self._naps):
            nap.cancel()

    def _leave_idle(self, number: int) -> None:
        """Slot `number` claimed something: it no longer polls, and one idle slot claims too
        (more may be due): a waiting one, or else the poller, cut short in its nap."""
        if self._poller == number:
            self._poller = None
        if not self._wake_one():
            self._cut_naps()

    async def _slot(self, number: int) -> None:
        while not self._stopping:
            await anyio.lowlevel.checkpoint_if_cancelled()  # the shield below would hide it
            wakes = self._wakes
            assert self._claim is not None
            claimed, item = await self._shielded(self._claim)
            if not claimed:
                continue
            if item is None:
                await self._run_housekeeping(unless_recent=True)
                if self._stop_when_empty:
                    return
                if self._next_due is not None:
                    if await self._drained(wakes):
                        return
                elif self._wakes == wakes:  # else woken while claiming: claim again at once
                    await self._idle(number)
                continue
            self._leave_idle(number)
            self.in_flight += 1
            await self._process_item(item)

    async def _process_item(self, item: Item) -> None:
        """Process `item` (counted in flight by the caller); its slot is free again after."""
        try:
            await self._process(item)
        except Exception:
            # The primitive's process function settles its own item; anything that still
            # escapes is logged rather than allowed to end the slot (the lease recovers it).
            log.exception("%s: unexpected error while processing", self.name)
        finally:
            self.in_flight -= 1

    async def _shielded(self, claim: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
        """Run `claim`, shielded: a claim applied on the server but cancelled before its reply
        is read would hold what it claimed, unseen, for a whole lease. Once it is back, the
        cancellation reaches the processing, whose lease handling releases it. A driver error
        is noted (`Outage`: logged once while the server is lost, backed off, given up on
        after `give_up_after`) and napped on: (False, None)."""
        started = self._clock.now()
        try:
            with anyio.CancelScope(shield=True):
                result = await claim()
        except _driver.DRIVER_ERRORS as exc:
            await self._nap(seconds=self._outage.failed(exc, "claim", started))
            return False, None
        self._outage.succeeded(started)
        return True, result

    async def _fill_slots(self, slots: anyio.abc.TaskGroup) -> None:
        """`claim_many` mode: claim for every free slot at once, start each item in a slot of
        its own, and claim again when an item ended, a wake-up came, or the nap is over."""
        assert self._claim_many is not None
        while not self._stopping:
            await anyio.lowlevel.checkpoint_if_cancelled()  # the shield below would hide it
            free = self._concurrency - self.in_flight
            ended, wakes = self._ended, self._wakes
            items: list[Item] | None = []
            if free > 0:
                claimed, items = await self._shielded(partial(self._claim_many, free))
                if not claimed:
                    continue
            for item in items or ():
                self.in_flight += 1
                slots.start_soon(self._process_one, item)
            if items or self._ended != ended or (free > 0 and self._wakes != wakes):
                # Claimed, or an item ended or a wake-up came while the claim ran (it found no
                # nap, and the claim may have read the state from before it): claim again.
                continue
            if self.in_flight == 0:
                if self._stop_when_empty:
                    return
                if self._next_due is not None:
                    if await self._drained(wakes):
                        return
                    continue
            await self._nap()

    async def _process_one(self, item: Item) -> None:
        """Process an item `_fill_slots` claimed, then have the claimer claim for its slot."""
        try:
            await self._process_item(item)
        finally:
            self._ended += 1
            self._cut_naps()


_EMBEDDED_NOTED: set[int] = set()


def note_embedded(db: Any, name: str) -> None:
    """Say once per process, when a worker starts on the embedded backend, that its data lives
    in this process: a worker started in another process sees an empty database of its own and
    would poll it forever without a word."""
    if _driver.backend_of(db) is not _driver.Backend.MEMORY or os.getpid() in _EMBEDDED_NOTED:
        return
    _EMBEDDED_NOTED.add(os.getpid())
    log.warning(
        "%s runs on the embedded in-memory backend: its data lives in this process only, and "
        "workers in other processes do not see it (connect with a mongodb:// URI to share "
        "work)", name, extra={"mongoq_backend": "embedded"},
    )  # fmt: skip


class WorkerHost:
    """Base of a primitive that runs `WorkerLoop`s: keeps them for `stop()`, and names the
    worker when the caller does not (``hostname:pid:uuid8``, renewed in a forked child)."""

    db: Any

    def __init__(self) -> None:
        self._loops: set[WorkerLoop[Any]] = set()
        self._stop_pending = False
        self._stop_grace: float | None = None
        self._identity = (os.getpid(), default_worker_id())

    def _worker(self, worker_id: str | None) -> str:
        if worker_id is not None:
            return check_worker_id("worker_id", worker_id)
        if self._identity[0] != os.getpid():
            self._identity = (os.getpid(), default_worker_id())
        return self._identity[1]

    async def _run_loop(
        self, loop: WorkerLoop[Any], *, handle_signals: bool, lease: float | None = None
    ) -> None:
        """Run `loop` until it returns, watched for a blocked event loop (`watchdog`) past a
        third of `lease` (default: this primitive's ``lease_ttl``)."""
        note_embedded(self.db, loop.name)
        self._loops.add(loop)
        if self._stop_pending:
            loop.stop(self._stop_grace)
        shortest = lease if lease is not None else getattr(self, "lease_ttl", None)
        try:
            if shortest is None:
                await loop.run(handle_signals=handle_signals)
            else:
                async with watchdog.watching(shortest / 3, loop.name):
                    await loop.run(handle_signals=handle_signals)
        finally:
            self._loops.discard(loop)
            if not self._loops:
                self._stop_pending = False

    def stop(self, grace: float | None = None) -> None:
        """Ask every `run` loop of this instance to stop gracefully: they claim nothing more,
        let in-flight work finish, and return. With `grace` (seconds of the clock), work still
        running that long after is cancelled, released for retry as "worker stopped" (a
        handler that ignores its cancellation is abandoned 5 s later), so that the stop ends
        within about `grace`. The stop holds until a `run` returns: a `run` that starts
        meanwhile (one called just before, whose loop was not running yet, or one called after
        a stop with none running) returns at once, having claimed nothing."""
        if grace is not None:
            grace = check_seconds("grace", grace)
        self._stop_pending, self._stop_grace = True, grace
        for loop in list(self._loops):
            loop.stop(grace)

    def _cancel_running(self) -> None:
        """Hard-stop every `run` loop of this instance (`mongoq_sync`'s second signal)."""
        for loop in list(self._loops):
            loop.cancel()
