"""Who may use the dashboard and how: the hosts it answers to, the token every action needs,
and the checks that keep another site from acting through an operator's browser.

- Every request's ``Host`` must be one of `allowed_hosts` (by default the loopback names):
  a page elsewhere that points its own name at 127.0.0.1 (DNS rebinding) gets 403, and so
  cannot read the dashboard either.
- An action is a POST carrying the token, in the form's ``token`` field or an
  ``Authorization: Bearer`` header, compared in constant time. Another site cannot know it,
  so it cannot forge an action; on top of that a POST whose ``Origin`` is another site's, or
  that the browser marks ``Sec-Fetch-Site: cross-site``, is refused before the token is read.
- Pages may not be framed (clickjacking) and load nothing from elsewhere (a strict
  Content-Security-Policy).

Owns no collections.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from mongoq.errors import InvalidInput

__all__ = ["LOOPBACK", "SECURITY_HEADERS", "Guard", "new_token"]

#: The host names of this machine's loopback interface, which `Guard` answers by default.
LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: The shortest token `Guard` accepts: a configured one must not be guessable.
MIN_TOKEN = 16
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


def new_token() -> str:
    """A fresh random token (22 URL-safe characters, 128 bits)."""
    return secrets.token_urlsafe(16)


_HOST = re.compile(r"(?:\[(?P<ip6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9._-]+))(?::[0-9]{1,5})?")


def _host_name(host: str) -> str | None:
    """``example.org`` of ``example.org:8188``, ``::1`` of ``[::1]:8188``; None for anything
    that is not a host (and optional port) alone (``[::1]evil``, ``a@b``)."""
    match = _HOST.fullmatch(host.strip().lower())
    if match is None:
        return None
    if match.group("ip6"):
        try:  # one spelling of an address: [0:0:0:0:0:0:0:1] is [::1]
            return ipaddress.IPv6Address(match.group("ip6")).compressed
        except ValueError:
            return None
    return str(match.group("name"))


class Guard:
    """The checks of one dashboard: `allowed_hosts` (``"*"`` for any), the `token`."""

    def __init__(self, token: str, allowed_hosts: Iterable[str] | None = None) -> None:
        if not isinstance(token, str) or len(token) < MIN_TOKEN:
            raise InvalidInput("token", f"must be a text of at least {MIN_TOKEN} characters")
        if isinstance(allowed_hosts, str):
            raise InvalidInput("allowed_hosts", "must be a list of host names, not one text")
        hosts = LOOPBACK if allowed_hosts is None else tuple(allowed_hosts)
        if not hosts or not all(isinstance(h, str) and h for h in hosts):
            raise InvalidInput("allowed_hosts", "must be a non-empty list of host names")
        self._token = token.encode()
        self._any_host = "*" in hosts
        # Configured names as written (an IPv6 address with or without brackets).
        self._hosts = {_host_name(h) or _host_name(f"[{h}]") or h.lower() for h in hosts}

    def host_allowed(self, host: str | None) -> bool:
        if self._any_host:
            return True
        name = None if host is None else _host_name(host)
        return name is not None and name in self._hosts

    def cross_site(self, headers: Mapping[str, str], host: str | None) -> bool:
        """Whether a request comes from another site's page, by what the browser says."""
        if headers.get("sec-fetch-site", "") == "cross-site":
            return True
        origin = headers.get("origin")
        if origin is None:
            return False  # not a browser's cross-origin POST (those always carry Origin)
        if origin == "null":
            return True  # a sandboxed frame or a redirect chain: never our own page
        return urlsplit(origin).netloc.lower() != (host or "").lower()

    def token_valid(self, headers: Mapping[str, str], form: Mapping[str, str]) -> bool:
        """The token in the form, or in an ``Authorization: Bearer`` header (either will do:
        a proxy in front may add a bearer token of its own)."""
        given = [form.get("token", "")]
        authorization = headers.get("authorization", "")
        if authorization.lower().startswith("bearer "):
            given.append(authorization[len("bearer ") :].strip())
        return any(g and hmac.compare_digest(g.encode(), self._token) for g in given)
