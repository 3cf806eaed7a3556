"""Naming an unreachable server: the driver's `ServerSelectionTimeoutError` (a message of
500 characters and more, with the whole topology in it) as one `ServerUnavailable` line that
names the hosts, why each failed and the seconds waited; and the class decorator that makes
every public call of a primitive raise it. Owns no collections.

The hosts and the reason are read from the driver's message, which is the same for PyMongo and
Motor (Motor runs PyMongo's topology). Credentials never appear in it: the topology holds hosts
and ports only; any URI-shaped text is masked all the same.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from pymongo.errors import ServerSelectionTimeoutError

from mongoq.errors import ServerUnavailable

__all__ = ["names_unreachable_server", "server_unavailable"]

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C", bound=type)

_SERVER = re.compile(r"ServerDescription \('([^']+)', (\d+)\)")
_WAITED = re.compile(r", Timeout: ([\d.]+)s")
# "host:port: [Errno 111] Connect call failed ('host', port) (configured timeouts: ...)"
_HOST_REASON = re.compile(r"(?:^|,)\s*[^\s,]+:\d+: (.*?) \(configured timeouts:[^)]*\)")
_ERRNO = re.compile(r"\[Errno (\d+)\] .*")
_NOISE = re.compile(r"\[Errno -?\d+\] |\s*\('[^']*', \d+\)")
_USERINFO = re.compile(r"(mongodb(?:\+srv)?://)[^@/\s]+@")


def server_unavailable(error: ServerSelectionTimeoutError) -> ServerUnavailable:
    """`error` as one line: ``cannot reach the MongoDB server at HOSTS (WHY; gave up after
    N s)``."""
    if isinstance(error, ServerUnavailable):
        return error
    text = str(error)
    hosts = tuple(dict.fromkeys(f"{host}:{port}" for host, port in _SERVER.findall(text)))
    found = _WAITED.search(text)
    waited = float(found.group(1)) if found else None
    head = text.split(", Timeout:")[0]
    reasons = [_said(reason) for reason in _HOST_REASON.findall(head)]
    reason = ", ".join(dict.fromkeys(r for r in reasons if r)) or head.strip()
    reason = _USERINFO.sub(r"\1***@", reason) or "no server answered"
    where = ", ".join(hosts) or "the URI's hosts"
    after = "" if waited is None else f"; gave up after {waited:g} s"
    reason = reason[:1].lower() + reason[1:]
    message = f"cannot reach the MongoDB server at {where} ({reason}{after})"
    return ServerUnavailable(message, hosts=hosts, waited=waited, driver_error=error)


def _said(reason: str) -> str:
    """A socket error in the operating system's words (``Connection refused``), else the
    driver's, without its ``[Errno N]`` and address."""
    numbered = _ERRNO.fullmatch(reason)
    if numbered is not None and int(numbered.group(1)) > 0:
        return os.strerror(int(numbered.group(1)))
    return _NOISE.sub("", reason).strip()


def _naming(method: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    @functools.wraps(method)
    async def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(*args, **kwargs)
        except ServerSelectionTimeoutError as error:
            if isinstance(error, ServerUnavailable):
                raise
            # From None: the driver's message is the 500 characters this error replaces.
            raise server_unavailable(error) from None

    call.__mongoq_names_unreachable__ = True  # type: ignore[attr-defined]
    return call


def names_unreachable_server(cls: C) -> C:
    """Class decorator: every public coroutine method `cls` defines raises `ServerUnavailable`
    where the driver would raise its `ServerSelectionTimeoutError`. Wrapped in place, so that
    the class's own order of methods (which `mongoq_sync` mirrors) stays."""
    for name, member in list(vars(cls).items()):
        if name.startswith("_") or not inspect.iscoroutinefunction(member):
            continue
        if getattr(member, "__mongoq_names_unreachable__", False):
            continue
        setattr(cls, name, _naming(member))
    return cls
