"""Blocking databases for the tests of `mongoq_sync` and of the integrations that use it."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import mongoq_sync


@contextlib.contextmanager
def blocking_database(uri: str | None) -> Iterator[mongoq_sync.Database]:
    """A blocking database of its own on `uri` (None: the embedded backend), dropped when the
    test is done: on a server, a database per test would otherwise pile up (as `_database` in
    tests/conftest.py drops the async lanes' databases)."""
    name = f"mongoq_sync_test_{uuid.uuid4().hex[:10]}"
    with mongoq_sync.connect(uri, name) as database:
        try:
            yield database
        finally:  # inside the portal, where the client lives, before it closes
            database.call(lambda: database.async_database.client.drop_database(name))
