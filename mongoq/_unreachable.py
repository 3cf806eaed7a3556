"""Failing fast, and clearly, without a server: the first call through a client `connect`
made waits at most `connect`'s `timeout` for the server (`reach`: a ``ping`` under
``pymongo.timeout``), while later calls keep the driver's server selection timeout (30 s by
default), long enough to ride out a replica set's election. The driver's
`ServerSelectionTimeoutError` (a message of 500 characters and more, with the whole topology in
it) becomes one `ServerUnavailable` line naming the hosts, why each failed and the seconds
waited. The class decorator applies both to every public call of a primitive. Owns no
collections.

The hosts and the reason are read from the driver's message, which is the same for PyMongo and
Motor (Motor runs PyMongo's topology). Credentials never appear in it: the topology holds hosts
and ports only; any URI-shaped text is masked all the same.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import anyio
import pymongo
from pymongo.errors import ServerSelectionTimeoutError

from mongoq._text import mask_uri_credentials
from mongoq.errors import ServerUnavailable

__all__ = ["expect_first_contact", "names_unreachable_server", "reach", "server_unavailable"]

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C", bound=type)

_SERVER = re.compile(r"ServerDescription \('([^']+)', (\d+)\)")
_WAITED = re.compile(r", Timeout: ([\d.]+)s")
# "host:port: [Errno 111] Connect call failed ('host', port) (configured timeouts: ...)"
_HOST_REASON = re.compile(r"(?:^|,)\s*[^\s,]+:\d+: (.*?) \(configured timeouts:[^)]*\)")
_ERRNO = re.compile(r"\[Errno (\d+)\] .*")
_NOISE = re.compile(r"\[Errno -?\d+\] |\s*\('[^']*', \d+\)")


def server_unavailable(
    error: ServerSelectionTimeoutError, *, waited: float | None = None
) -> ServerUnavailable:
    """`error` as one line: ``cannot reach the MongoDB server at HOSTS (WHY; gave up after
    N s)`` where no host answered, ``no suitable MongoDB server at HOSTS (WHY; ...)`` where
    some did (no primary, no member matching the read preference). The driver's error labels
    (``TransientTransactionError``, which ``with_transaction`` retries on) are kept."""
    if isinstance(error, ServerUnavailable):
        return error
    text = str(error)
    hosts = tuple(dict.fromkeys(_address(host, port) for host, port in _SERVER.findall(text)))
    found = _WAITED.search(text)
    if waited is None and found:
        waited = float(found.group(1))
    head = text.split(", Timeout:")[0]
    reasons = [_said(reason) for reason in _HOST_REASON.findall(head)]
    reason = ", ".join(dict.fromkeys(r for r in reasons if r)) or head.strip()
    reason = mask_uri_credentials(reason) or "no server answered"
    where = ", ".join(hosts) or "the URI's hosts"
    after = "" if waited is None else f"; gave up after {waited:g} s"
    reason = reason[:1].lower() + reason[1:]
    what = "cannot reach the MongoDB server" if reasons else "no suitable MongoDB server"
    unavailable = ServerUnavailable(
        f"{what} at {where} ({reason}{after})", hosts=hosts, waited=waited, driver_error=error
    )
    for label in getattr(error, "_error_labels", ()):
        unavailable._add_error_label(label)
    return unavailable


def _address(host: str, port: str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 in brackets


def _said(reason: str) -> str:
    """A socket error in the operating system's words (``Connection refused``), else the
    driver's, without its ``[Errno N]`` and address."""
    numbered = _ERRNO.fullmatch(reason)
    if numbered is not None and int(numbered.group(1)) > 0:
        return os.strerror(int(numbered.group(1)))
    return _NOISE.sub("", reason).strip()


@dataclass
class _FirstContact:
    seconds: float
    lock: anyio.Lock | None = None  # made in the loop of the first call


#: The clients `connect` made whose server no call has reached yet, with `connect`'s timeout.
_NOT_REACHED: weakref.WeakKeyDictionary[Any, _FirstContact] = weakref.WeakKeyDictionary()


def expect_first_contact(client: Any, seconds: float) -> None:
    """Have the first call through `client` wait at most `seconds` for its server."""
    _NOT_REACHED[client] = _FirstContact(seconds)


async def reach(db: Any) -> bool:
    """Before the first call through a client `connect` made: a ``ping`` given `seconds` in all
    (``pymongo.timeout``, which bounds server selection too), `ServerUnavailable` when no server
    answers. Concurrent first calls share one ping; once one answered, no call pings again.
    True when this call waited for that first ping (the server answered it just now)."""
    if not _NOT_REACHED:
        return False
    client = getattr(db, "client", None)
    contact = _NOT_REACHED.get(client) if client is not None else None
    if contact is None:
        return False
    if contact.lock is None:
        contact.lock = anyio.Lock()
    async with contact.lock:
        if client not in _NOT_REACHED:
            return True  # another first call reached it meanwhile
        try:
            with pymongo.timeout(contact.seconds):
                await db.command("ping")
        except ServerSelectionTimeoutError as error:
            raise server_unavailable(error, waited=contact.seconds) from None
        _NOT_REACHED.pop(client, None)
        return True


def _unavailable(error: BaseException, kwargs: dict[str, Any]) -> ServerUnavailable | None:
    """`error` as `ServerUnavailable` when it says no server could be selected (alone, or as
    every leaf of an exception group a task group raised), else None. Inside a transaction it
    is transient (labelled for ``with_transaction``'s retry), as the driver labels its own."""
    if isinstance(error, BaseExceptionGroup):
        selection, rest = error.split(ServerSelectionTimeoutError)
        if rest is not None or selection is None:
            return None
        error = selection.exceptions[0]
        while isinstance(error, BaseExceptionGroup):
            error = error.exceptions[0]
    if not isinstance(error, ServerSelectionTimeoutError):
        return None
    unavailable = server_unavailable(error)
    session = kwargs.get("session")
    if session is not None and getattr(session, "in_transaction", False):
        unavailable._add_error_label("TransientTransactionError")
    return unavailable


def _naming(method: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    @functools.wraps(method)
    async def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            await reach(getattr(args[0], "db", None))
            return await method(*args, **kwargs)
        except (ServerSelectionTimeoutError, BaseExceptionGroup) as error:
            unavailable = _unavailable(error, kwargs)
            if unavailable is None or unavailable is error:
                raise
            # From None: the driver's message is the 500 characters this error replaces.
            raise unavailable from None

    call.__mongoq_names_unreachable__ = True  # type: ignore[attr-defined]
    return call


def names_unreachable_server(cls: C) -> C:
    """Class decorator: every public coroutine method `cls` defines first `reach`es the
    server of its ``self.db`` (once per client), and raises `ServerUnavailable` where the
    driver would raise its `ServerSelectionTimeoutError`. Wrapped in place, so that the class's
    own order of methods (which `mongoq_sync` mirrors) stays."""
    for name, member in list(vars(cls).items()):
        if name.startswith("_") or not inspect.iscoroutinefunction(member):
            continue
        if getattr(member, "__mongoq_names_unreachable__", False):
            continue
        setattr(cls, name, _naming(member))
    return cls
