"""Shared fixtures: every test runs on the embedded backend and, when ``MONGOQ_TEST_URI`` names
a replica set, on a real server through PyMongo async and through Motor (the real-server lane).
Without the variable those lanes are skipped with a visible reason: the report header says so
and `test_real_server_lane` is reported as skipped with it.

Shims for embedded-backend bugs belong here, commented; none is needed yet: the library itself
avoids what mongomock gets wrong (see `mongoq._driver`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

import mongoq
from mongoq import _driver
from mongoq.testing import ManualClock, memory_database
from tests.txengine import transactional_database

TEST_URI = os.environ.get("MONGOQ_TEST_URI")
REAL_SERVER_SKIP = "real-server lane: set MONGOQ_TEST_URI to a replica-set URI to run it"


# Without a server the lanes are not generated at all (one skip line per test would bury the
# report); the header and tests/test_real_server_lane.py say so instead.
BACKENDS = ["memory", "pymongo", "motor"] if TEST_URI else ["memory"]


def pytest_report_header() -> str:
    if TEST_URI:
        return "mongoq backends: memory, pymongo and motor on MONGOQ_TEST_URI"
    return f"mongoq backends: memory only ({REAL_SERVER_SKIP})"


@pytest.fixture(params=BACKENDS)
async def db(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A fresh, empty database on each backend."""
    if request.param == "memory":
        yield memory_database()
        return
    assert TEST_URI is not None
    name = f"mongoq_test_{uuid.uuid4().hex[:10]}"
    database = mongoq.connect(TEST_URI, name, driver=request.param)
    try:
        yield database
    finally:
        await database.client.drop_database(name)
        await _driver.close(database)


async def _database(kind: str) -> AsyncIterator[Any]:
    if kind == "memory":
        yield memory_database()
        return
    if kind == "tx":
        yield transactional_database()
        return
    assert TEST_URI is not None
    name = f"mongoq_test_{uuid.uuid4().hex[:10]}"
    database = mongoq.connect(TEST_URI, name, driver=kind)
    try:
        yield database
    finally:
        await database.client.drop_database(name)
        await _driver.close(database)


# The outbox runs with and without transactions: "tx" is the test-only transactional engine
# (tests/txengine.py, mongomock-ng), the embedded backend has none.
@pytest.fixture(params=["memory", "tx", *BACKENDS[1:]])
async def odb(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A fresh database on every backend the outbox supports, transactional or not."""
    async for database in _database(request.param):
        yield database


@pytest.fixture(params=["tx", *BACKENDS[1:]])
async def txdb(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A fresh database with multi-document transactions."""
    async for database in _database(request.param):
        yield database


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()
