"""Fixtures of the outbox tests (the databases and the clock are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from mongoq.testing import CommandCounter


@pytest.fixture
def counter() -> CommandCounter:
    """Counts (and, with ``record = True``, records) the commands it is instrumented into."""
    return CommandCounter()
