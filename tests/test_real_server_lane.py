"""The real-server lane: the whole suite reruns on ``MONGOQ_TEST_URI`` (PyMongo async and Motor).

This test makes the lane visible in every report: skipped, with the reason, when no server is
configured; when one is, it checks the server is a replica set (transactions and change streams
need one) and that both drivers reach it.
"""

from __future__ import annotations

import pytest

import mongoq
from mongoq import _driver
from tests.conftest import REAL_SERVER_SKIP, TEST_URI


@pytest.mark.skipif(not TEST_URI, reason=REAL_SERVER_SKIP)
@pytest.mark.parametrize("driver", ["pymongo", "motor"])
async def test_real_server_lane_reaches_a_replica_set(driver: str) -> None:
    db = mongoq.connect(TEST_URI, "mongoq_lane_check", driver=driver)
    try:
        hello = await db.command("hello")
        assert hello.get("setName"), "MONGOQ_TEST_URI must name a replica set"
        assert await _driver.server_local_time(db) is not None
    finally:
        await _driver.close(db)
