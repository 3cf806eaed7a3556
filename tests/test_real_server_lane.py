"""The real-server lane: the whole suite reruns on ``MONGOQ_TEST_URI`` (PyMongo async and Motor,
or the drivers ``MONGOQ_TEST_DRIVERS`` names).

This test makes the lane visible in every report: skipped, with the reason, when no server is
configured; when one is, it checks that each driver reaches it and that the server is the
deployment the job set up (``MONGOQ_TEST_TOPOLOGY_EXPECT``, a replica set unless it says
``standalone``): a job whose server lacks transactions must not pass by skipping them.
"""

from __future__ import annotations

import pytest

import mongoq
from mongoq import _driver
from tests.conftest import REAL_SERVER_SKIP, TEST_DRIVERS, TEST_URI, TOPOLOGY_EXPECT


@pytest.mark.skipif(not TEST_URI, reason=REAL_SERVER_SKIP)
@pytest.mark.parametrize("driver", TEST_DRIVERS)
async def test_real_server_lane_reaches_the_expected_deployment(driver: str) -> None:
    db = mongoq.connect(TEST_URI, "mongoq_lane_check", driver=driver)
    try:
        hello = await db.command("hello")
        expected = TOPOLOGY_EXPECT or "replica_set"
        assert _driver.topology_from_hello(hello).value == expected
        assert (await _driver.topology(db)).value == expected
        assert await _driver.supports_transactions(db) is (expected != "standalone")
        assert await _driver.server_local_time(db) is not None
    finally:
        await _driver.close(db)
