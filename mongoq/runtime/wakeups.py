"""Same-process wake-ups: a put or a publish wakes this process's run loops that serve it.

A run loop (`mongoq.runtime.loop.WorkerLoop`, `mongoq.outbox.OutboxDispatcher`) listens under
its primitive's `Key` while it runs; a producer's write then `notify`-s that key and the loop
claims at once instead of waiting out its poll. A key names the primitive, the database and
the queue (or prefix), not the client: two clients of one process on different servers with
the same names wake each other's loops for nothing, which costs a claim, never a message.
Writes from another process reach a loop through its poll. Thread-safe: a listener that
registered from another thread's event loop (a `mongoq_sync` portal) is called through that
loop. Owns no collections.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import anyio

from mongoq.clock import Clock

__all__ = ["Key", "key_of", "listen", "notify", "sleep_until_woken"]

#: (primitive, database name, queue name or prefix)
Key = tuple[str, str, str]


def key_of(primitive: str, db: Any, name: str) -> Key:
    """The key a run loop of `primitive` on `db`'s queue (or prefix) `name` listens under."""
    return (primitive, str(getattr(db, "name", "")), name)


@dataclass(eq=False)
class _Listener:
    callback: Callable[[], None]
    loop: asyncio.AbstractEventLoop | None
    thread: int = field(default_factory=threading.get_ident)

    @property
    def gone(self) -> bool:
        """Its event loop is closed: nobody can be woken through it any more."""
        return self.loop is not None and self.loop.is_closed()

    def call(self) -> None:
        if self.thread == threading.get_ident() or self.loop is None:
            self.callback()
            return
        # The loop may close between the check and the call: the producer's write stands.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.callback)


_lock = threading.Lock()
_listeners: dict[Key, set[_Listener]] = {}


@contextlib.contextmanager
def listen(key: Key, callback: Callable[[], None]) -> Iterator[None]:
    """Call `callback` (in the current event loop's thread) on every `notify` of `key` while
    the block runs."""
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    listener = _Listener(callback, loop)
    with _lock:
        _listeners.setdefault(key, set()).add(listener)
    try:
        yield
    finally:
        with _lock:
            listeners = _listeners.get(key)
            if listeners is not None:
                listeners.discard(listener)
                if not listeners:
                    del _listeners[key]


def notify(key: Key) -> None:
    """Wake every run loop of this process listening under `key` (none: nothing happens).
    A listener whose loop has closed (its run never got to leave) is dropped."""
    with _lock:
        listeners = _listeners.get(key, set())
        for listener in [listener for listener in listeners if listener.gone]:
            listeners.discard(listener)
        live = list(listeners)
        if not listeners:
            _listeners.pop(key, None)
    for listener in live:
        listener.call()


def _forget_all() -> None:
    """In a forked child: the parent's run loops are not there."""
    _listeners.clear()


os.register_at_fork(after_in_child=_forget_all)


async def sleep_until_woken(clock: Clock, until: datetime, woken: anyio.Event) -> None:
    """Sleep on `clock` until `until`, or until `woken` is set, whichever comes first."""
    async with anyio.create_task_group() as group:

        async def sleep() -> None:
            await clock.sleep_until(until)
            group.cancel_scope.cancel()

        async def watch() -> None:
            await woken.wait()
            group.cancel_scope.cancel()

        group.start_soon(sleep)
        group.start_soon(watch)
