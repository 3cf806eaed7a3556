"""Deliberate breakages of the library, applied by monkeypatching, that the campaign must catch.

A `Mutant` is a name, what it breaks, and `Patch`es: ``replacing("module.attr", make)`` or
``replacing("module.Class.attr", make)``, where ``make(original)`` returns what stands in for
the original while the mutant is applied. `applied(name)` is the context manager the command
line (``--mutant NAME``) and the tests use; it restores every original on exit. Registering one
more is one call of `mutant`, e.g. for a dispatcher::

    mutant("dispatch-ignores-late-reply", "...", replacing("mongoq.outbox.dispatcher.x", make))

The library's modules are patched where their callers look them up: ``lease.startable`` is
called through its module, the task schema's filters through ``schema.``, a batch's renewal as
a method of `_Batch`.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import anyio

from mongoq.errors import HandlerAbandoned
from mongoq.runtime import handler as supervisor

__all__ = ["MUTANTS", "Mutant", "MutantUnavailable", "Patch", "applied", "mutant", "replacing"]


class MutantUnavailable(LookupError):
    """The code a mutant patches does not exist here (yet)."""


def _resolve(target: str) -> tuple[Any, str]:
    """The object holding the last name of `target`, found from the longest importable
    module prefix (``mongoq.runtime.batch._Batch.renew`` -> the class `_Batch`, ``renew``)."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:-1]:
                owner = getattr(owner, name)
        except AttributeError:
            break
        if hasattr(owner, parts[-1]):
            return owner, parts[-1]
        break
    raise MutantUnavailable(f"{target} does not exist in this version of the library")


@dataclass(frozen=True)
class Patch:
    """`target` replaced by ``make(original)`` while applied."""

    target: str
    make: Callable[[Any], Any]

    def check(self) -> None:
        _resolve(self.target)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        owner, name = _resolve(self.target)
        original = getattr(owner, name)
        setattr(owner, name, self.make(original))
        try:
            yield
        finally:
            setattr(owner, name, original)


@dataclass(frozen=True)
class Mutant:
    name: str
    breaks: str
    patches: tuple[Patch, ...]

    def available(self) -> bool:
        try:
            for patch in self.patches:
                patch.check()
        except MutantUnavailable:
            return False
        return True


MUTANTS: dict[str, Mutant] = {}


def replacing(target: str, make: Callable[[Any], Any]) -> Patch:
    return Patch(target, make)


def mutant(name: str, breaks: str, *patches: Patch) -> Mutant:
    """Register a mutant under `name`."""
    MUTANTS[name] = Mutant(name, breaks, patches)
    return MUTANTS[name]


@contextlib.contextmanager
def applied(name: str | None) -> Iterator[None]:
    """The library with mutant `name` applied (unchanged for None)."""
    if name is None:
        yield
        return
    if name not in MUTANTS:
        raise ValueError(f"no mutant {name!r}; there are: {', '.join(sorted(MUTANTS))}")
    with contextlib.ExitStack() as stack:
        for patch in MUTANTS[name].patches:
            stack.enter_context(patch.applied())
        yield


# ------------------------------------------------------------------------------- the mutants


def _without_token(original: Callable[[Any], dict[str, Any]]) -> Callable[[Any], dict[str, Any]]:
    def unfenced(task: Any) -> dict[str, Any]:
        fence = dict(original(task))
        fence.pop("lease_token", None)
        return fence

    return unfenced


mutant(
    "settle-without-fence",
    "settle without its fence: the task queue's holder writes (settles, and the heartbeat and "
    "requeue that share the fence) no longer filter on the claim's lease_token",
    replacing("mongoq.tasks.schema.task_held", _without_token),
    replacing("mongoq.tasks.schema.task_held_at_revision", _without_token),
)


def _renew_dated_from_reply(original: Any) -> Any:
    """`_Batch.renew` as the fixed library has it, but the confirmed lease end dated from the
    clock after the reply instead of from before the request."""

    async def renew(self: Any) -> bool | None:
        if not self.unsettled:
            return None
        renewing = list(self.unsettled)
        held = await self.holder.renew(renewing)
        gone = [
            item
            for item, ok in zip(renewing, held, strict=True)
            if not ok and item in self.unsettled
        ]
        for item in gone:
            self.unsettled.remove(item)
            if self.running is not None and self.running[0] is item:
                self.running[1].cancel()
        await self._count_lost(gone)
        if any(held):
            now: datetime = self.clock.now()  # the mutation: after the reply
            self.confirmed = now + timedelta(seconds=self.lease)
        return any(held)

    return renew


mutant(
    "lease-from-reply",
    "lease dated from the reply: a batch's renewal confirms a lease counted from when its reply "
    "came, not from before its request",
    replacing("mongoq.runtime.batch._Batch.renew", _renew_dated_from_reply),
    # Only meaningful where the fix exists: the lease rule's module marks it.
    replacing("mongoq.runtime.lease.renewed_until", lambda original: original),
)


def _always(original: Any) -> Any:
    def startable(lease_end: datetime, now: datetime, lease: float) -> bool:
        return True

    return startable


mutant(
    "ignores-late-reply",
    "ignores a late reply: every loop starts a handler whatever its lease has left "
    "(lease.startable always says True)",
    replacing("mongoq.runtime.lease.startable", _always),
)


def _sets_nothing_aside(original: Any) -> Any:
    async def set_aside_nothing(*args: Any, **kwargs: Any) -> bool:
        return False

    return set_aside_nothing


mutant(
    "claim-retries-refused-document",
    "a claim retries a refused document: the task queue's claims set nothing aside (a document "
    "the server refused, or one they cannot read, stays as it is and is met again by every "
    "claim: quarantine.set_aside_first, set_aside_candidates and set_aside do nothing)",
    replacing("mongoq.tasks.quarantine.set_aside_first", _sets_nothing_aside),
    replacing("mongoq.tasks.quarantine.set_aside_candidates", _sets_nothing_aside),
    replacing("mongoq.tasks.quarantine.set_aside", _sets_nothing_aside),
)


def _keeps_the_abandoned(original: Any) -> Any:
    """`handler._cancel` as the library has it, but an abandonment in word only: the WARNING
    says the handler was abandoned, then the supervisor waits for it however long it runs,
    renewing its lease all along (its slot stays taken, a stop waits for it)."""

    async def cancel(handler: Any, ended: Any, *args: Any) -> None:
        try:
            await original(handler, ended, *args)
        except HandlerAbandoned:
            with anyio.CancelScope(shield=True):
                await ended.wait()

    return cancel


mutant(
    "renewal-keeps-runaway-lease",
    "renewal keeps a runaway's lease: a handler that swallows its cancellation is said to be "
    "abandoned after its grace, yet still waited for (handler._cancel), so its lease is renewed "
    "for as long as it runs, its slot stays taken, and a stop waits for it",
    replacing("mongoq.runtime.handler._cancel", _keeps_the_abandoned),
)


def _waits_for_the_handler(original: Any) -> Any:
    """`handler._cancel` without its grace: the handler is cancelled once, then waited for
    however long it runs (the supervisor never abandons it, nor says so)."""

    async def cancel(handler: Any, ended: Any, *args: Any) -> None:
        handler.cancel()
        with anyio.CancelScope(shield=True):
            await ended.wait()
        supervisor.running.pop(handler, None)

    return cancel


mutant(
    "runaway-never-abandoned",
    "a runaway is never abandoned: a handler that swallows its cancellation is waited for "
    "without a bound and without a word (handler._cancel has no grace)",
    replacing("mongoq.runtime.handler._cancel", _waits_for_the_handler),
)
