"""The run loop shared by the primitives and the task functions: slots, idle polling, graceful
stop, signals.

A `WorkerLoop` runs `concurrency` slots over one or more sources of work
(`mongoq.runtime.source`: what each primitive's face hands out). Each slot claims one item (a
task, or a batch), processes it, and claims again; a claim tries the sources in turn, starting
at the one after the last claimed from, and tries last those that were found empty within a
poll interval (unless a wake-up of theirs came since). When nothing is claimable, one idle slot
polls for all of them: it sleeps `poll_interval` on the sources' clock and claims again, while
the other idle slots wait; a slot that claims something wakes one waiting slot, which claims
too (and wakes the next if it finds something), so an idle worker sends one claim an interval
whatever its concurrency. Sources that `fill` instead are served by one claimer that fills
every free slot with one claim and claims again as soon as a slot frees up (the outbox's
dispatcher: its claim hands out many deliveries from the lanes it leases in one command). A
put or publish in the same process wakes the poller at once (`mongoq.runtime.wakeups`), and on
a replica set so does a change stream's event (`mongoq.runtime.changes`). The sources'
maintenance services (`mongoq.runtime.services`: reclaiming expired leases, ticking
schedules, renewing lanes...) run beside the slots. `stop()` is graceful: no slot claims
again, in-flight items finish, `run()` returns. Cancelling `run()` cancels in-flight items,
whose lease handling releases them. With `handle_signals`, the first SIGTERM/SIGINT stops
gracefully and a second one cancels. Owns no collections.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any, Protocol

import anyio
import anyio.lowlevel

from mongoq import _driver
from mongoq._validation import (
    check_concurrency,
    check_interval,
    check_seconds,
    check_stop_when,
    check_timeout,
    check_worker_id,
)
from mongoq.errors import MongoqError
from mongoq.runtime import changes, wakeups, watchdog
from mongoq.runtime.outage import Outage
from mongoq.runtime.services import Services
from mongoq.runtime.source import Source

__all__ = [
    "WORKER_STOPPED",
    "RunOptions",
    "WorkerHost",
    "WorkerLoop",
    "default_worker_id",
    "mongoq_errors_unwrapped",
    "note_embedded",
    "require_main_thread",
    "watch_signals",
]

log = logging.getLogger("mongoq.worker")

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


@dataclass(frozen=True)
class RunOptions:
    """What every run takes where it starts (each primitive's `run`, `Jobs.run`), with the
    same names, checks and defaults everywhere: see `checked`."""

    concurrency: int = 1
    poll_interval: float = 1.0
    stop_when_empty: bool = False
    stop_when_drained: bool = False
    give_up_after: float | None = None

    @classmethod
    def checked(
        cls,
        *,
        concurrency: Any,
        poll_interval: Any,
        stop_when_empty: Any,
        stop_when_drained: Any,
        give_up_after: Any,
    ) -> RunOptions:
        """The options, each checked before anything runs (`InvalidInput` naming it)."""
        check_stop_when(stop_when_empty, stop_when_drained)
        return cls(
            check_concurrency(concurrency), check_interval("poll_interval", poll_interval),
            stop_when_empty, stop_when_drained, check_timeout("give_up_after", give_up_after),
        )  # fmt: skip

    def loop(self, sources: Sequence[Source], name: str | None = None) -> WorkerLoop:
        """A run loop over `sources` with these options."""
        return WorkerLoop(
            sources, concurrency=self.concurrency, poll_interval=self.poll_interval,
            stop_when_empty=self.stop_when_empty, stop_when_drained=self.stop_when_drained,
            give_up_after=self.give_up_after, name=name,
        )  # fmt: skip


class WorkerLoop:
    """Claim-process slots over one or more sources of work (`mongoq.runtime.source`)."""

    def __init__(
        self,
        sources: Sequence[Source],
        *,
        concurrency: int = 1,
        poll_interval: float = 1.0,
        stop_when_empty: bool = False,
        stop_when_drained: bool = False,
        give_up_after: float | None = None,
        name: str | None = None,
        once: bool = False,
    ) -> None:
        """`once`: one round of claims (each slot claims once; a filling source, one claim for
        every slot), what it got run to the end, and `run` returns: no change stream, no
        wake-ups, no backoff (a claim that fails claims nothing), the services only while
        items run (the outbox's `run_once`)."""
        if not sources:
            raise ValueError("a WorkerLoop runs at least one source")
        if len({source.fills for source in sources}) != 1:
            raise ValueError("a WorkerLoop's sources all fill its slots, or none does")
        self._sources = list(sources)
        self._fills = sources[0].fills
        self._clock = sources[0].clock
        self._concurrency = concurrency
        self._poll_interval = poll_interval
        self._stop_when_empty = stop_when_empty
        self._drains = stop_when_drained
        self._once = once
        self.name = name if name is not None else sources[0].name
        self._outage = Outage(
            self.name, self._clock, poll_interval=poll_interval, give_up_after=give_up_after,
            on_back=self._cut_naps,
        )  # fmt: skip
        self._services = Services(
            [(s.tally.primitive, s.tally.queue, each) for s in sources for each in s.services],
            clock=self._clock, poll_interval=poll_interval, outage=self._outage, name=self.name,
            quiet=once,
        )  # fmt: skip
        self._turn = 0  # the source the next claim starts at
        # Until when a source is taken for empty: its claim found nothing, and neither a
        # wake-up of it nor a poll interval came since. Tried last, so that a busy source's
        # items are not each charged a claim of an empty one.
        self._empty_until: list[datetime | None] = [None] * len(self._sources)
        self._ended = 0  # items processed, ever (filling: a slot freed up)
        self._stopping = False
        self._naps: set[anyio.CancelScope] = set()
        self._scope: anyio.CancelScope | None = None
        self._group: anyio.abc.TaskGroup | None = None  # while running: for the drain timer
        self._drain: float | None = None  # a stop's grace, once one was given
        self.in_flight = 0
        self._wakes = 0  # wake-ups so far: one that came while a slot claimed is not missed
        self._poller: int | None = None  # the idle slot that polls for all of them
        self._waiting: list[anyio.Event] = []  # the other idle slots, oldest first

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def idle(self) -> bool:
        """Nothing in flight, and every slot naps on the clock or waits for another slot's
        poll (filling: the claimer naps): only the clock or a wake-up moves it."""
        if self.in_flight:
            return False
        if self._fills:
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

    def _woken(self, index: int) -> None:
        """Source `index` may have work (its wake key, its change stream)."""
        self._empty_until[index] = None
        self.wake()

    def _changed(self, index: int, event: Mapping[str, Any]) -> None:
        feed = self._sources[index].changes
        if feed is not None and (feed.heard is None or feed.heard(event)):
            self._woken(index)

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
            try:
                await self._run(handle_signals)
            finally:
                await self._services.close()

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
            for index, source in enumerate(self._sources):
                if source.changes is not None and not self._once:
                    group.start_soon(partial(
                        changes.watch, source.changes.collection, source.changes.pipeline,
                        partial(self._changed, index), clock=self._clock,
                        retry=self._poll_interval, name=source.name,
                    ))  # fmt: skip
            with contextlib.ExitStack() as listening:
                for index, source in enumerate(self._sources):
                    if source.wake_key is not None and not self._once:
                        listening.enter_context(
                            wakeups.listen(source.wake_key, partial(self._woken, index))
                        )
                await self._services.start(group)
                async with anyio.create_task_group() as slots:
                    if self._fills:
                        await self._fill_slots(slots)
                    else:
                        for number in range(self._concurrency):
                            slots.start_soon(self._slot, number)
            group.cancel_scope.cancel()  # the services and watchers, once every slot returned

    def _rotation(self) -> list[int]:
        """The sources in the order a claim tries them: from the one after the last claimed
        from, those taken for empty last."""
        count, now = len(self._sources), self._clock.now()
        rotation = [(self._turn + offset) % count for offset in range(count)]
        self._turn = (rotation[0] + 1) % count  # a slot claiming meanwhile starts at the next
        fresh = [i for i in rotation if (self._empty_until[i] or now) <= now]
        return fresh + [i for i in rotation if i not in fresh]

    async def _claim(self, limit: int) -> list[tuple[int, Any]]:
        """Up to `limit` items over the sources, each with the index of its source."""
        claimed: list[tuple[int, Any]] = []
        for index in self._rotation():
            items = await self._sources[index].claim(limit - len(claimed))
            if items:
                self._turn = (index + 1) % len(self._sources)
                self._empty_until[index] = None
                claimed += [(index, item) for item in items]
                if len(claimed) >= limit:
                    break
            else:
                when = self._clock.now() + timedelta(seconds=self._poll_interval)
                self._empty_until[index] = when
        return claimed

    async def _next_due(self) -> datetime | None:
        dues = [await source.next_due() for source in self._sources]
        return min((due for due in dues if due is not None), default=None)

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
        """Stopping when drained: True (and the loop stops) when nothing is left at all;
        otherwise sleeps until the next item is due (or `poll_interval`), and says False. No
        sleep when a wake-up came since `wakes` (counted before the claim)."""
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
            # priority, or it waits for a maintenance round. Poll, never spin.
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
            claimed, items = await self._shielded(1)
            if self._once:
                if items:
                    self.in_flight += 1
                    await self._process_item(items[0])
                return
            if not claimed:
                continue
            if not items:
                await self._services.idle()
                if self._stop_when_empty:
                    return
                if self._drains:
                    if await self._drained(wakes):
                        return
                elif self._wakes == wakes:  # else woken while claiming: claim again at once
                    await self._idle(number)
                continue
            self._leave_idle(number)
            self.in_flight += 1
            await self._process_item(items[0])

    async def _process_item(self, claimed: tuple[int, Any]) -> None:
        """Process a claimed item (counted in flight by the caller); its slot is free again
        after."""
        index, item = claimed
        try:
            await self._sources[index].process(item)
        except Exception:
            # The source settles its own item; anything that still escapes is logged rather
            # than allowed to end the slot (the lease recovers it).
            log.exception("%s: unexpected error while processing", self.name)
        finally:
            self.in_flight -= 1

    async def _shielded(self, limit: int) -> tuple[bool, list[tuple[int, Any]]]:
        """Claim up to `limit` items, shielded: a claim applied on the server but cancelled
        before its reply is read would hold what it claimed, unseen, for a whole lease. Once
        it is back, the cancellation reaches the processing, whose lease handling releases
        it. A driver error is noted (`Outage`: logged once while the server is lost, backed
        off, given up on after `give_up_after`) and napped on: (False, [])."""
        started = self._clock.now()
        try:
            with anyio.CancelScope(shield=True):
                result = await self._claim(limit)
        except _driver.DRIVER_ERRORS as exc:
            pause = self._outage.failed(exc, "claim", started)
            if not self._once:
                await self._nap(seconds=pause)
            return False, []
        self._outage.succeeded(started)
        return True, result

    async def _fill_slots(self, slots: anyio.abc.TaskGroup) -> None:
        """Filling sources: claim for every free slot at once, start each item in a slot of
        its own, and claim again when an item ended, a wake-up came, or the nap is over."""
        while not self._stopping:
            await anyio.lowlevel.checkpoint_if_cancelled()  # the shield below would hide it
            free = self._concurrency - self.in_flight
            ended, wakes = self._ended, self._wakes
            items: list[tuple[int, Any]] = []
            if free > 0:
                claimed, items = await self._shielded(free)
                if not claimed and not self._once:
                    continue
            for item in items:
                self.in_flight += 1
                slots.start_soon(self._process_one, item)
            if self._once:
                return  # (the slots' group waits for what was claimed)
            if items or self._ended != ended or (free > 0 and self._wakes != wakes):
                # Claimed, or an item ended or a wake-up came while the claim ran (it found no
                # nap, and the claim may have read the state from before it): claim again.
                continue
            if self.in_flight == 0:
                await self._services.idle()
                if self._stop_when_empty:
                    return
                if self._drains:
                    if await self._drained(wakes):
                        return
                    continue
            await self._nap()

    async def _process_one(self, item: tuple[int, Any]) -> None:
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
        self._loops: set[WorkerLoop] = set()
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
        self, loop: WorkerLoop, *, handle_signals: bool, lease: float | None = None
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
