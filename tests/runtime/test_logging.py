"""Every primitive logs a failed attempt the same way (`mongoq.runtime.report`): one record per
event, INFO when the item will be retried, WARNING when it is given up, with the same structured
fields, and the stored state they describe."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

import pytest

from mongoq import OutboxDispatcher, PermanentError, _driver
from mongoq.runtime import loop
from mongoq.testing import ManualClock
from tests.support.group_helpers import dead, messages, new_transport
from tests.support.helpers import new_queue, read, utc
from tests.support.outbox_helpers import deliveries, event, new_outbox

FIELDS = (
    "mongoq_primitive", "mongoq_queue", "mongoq_item", "mongoq_attempt", "mongoq_outcome",
    "mongoq_next_due", "mongoq_worker", "mongoq_error",
)  # fmt: skip


def reports(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if hasattr(r, "mongoq_outcome")]


def fields(record: logging.LogRecord) -> dict[str, Any]:
    return {name: getattr(record, name) for name in FIELDS}


async def boom(item: Any, *context: Any) -> None:
    raise ValueError("boom")


async def test_a_task_retried_is_info_and_failed_is_warning(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="mongoq")
    queue = await new_queue(db, clock, max_attempts=2)
    await queue.put("t", {"n": 1})

    await queue.run(boom, stop_when_empty=True, worker_id="w1")
    doc = await read(db, "t")
    assert doc is not None and doc["status"] == "pending"
    due = utc(doc["lease_until"])
    clock.set(due)
    await queue.run(boom, stop_when_empty=True, worker_id="w2")

    doc = await read(db, "t")
    assert doc is not None and (doc["status"], doc["attempts"]) == ("failed", 2)
    assert doc["error"].endswith("ValueError: boom")
    first, second = reports(caplog)
    assert (first.name, first.levelno, second.levelno) == (
        "mongoq.tasks",
        logging.INFO,
        logging.WARNING,
    )
    logged_due = datetime.fromisoformat(first.mongoq_next_due)
    assert abs(logged_due - due) < timedelta(milliseconds=1)  # stored to the millisecond
    assert fields(first) == {
        "mongoq_primitive": "tasks", "mongoq_queue": queue.name, "mongoq_item": "t",
        "mongoq_attempt": 1, "mongoq_outcome": "retried",
        "mongoq_next_due": first.mongoq_next_due, "mongoq_worker": "w1",
        "mongoq_error": "ValueError: boom",
    }  # fmt: skip
    assert fields(second) == {**fields(first), "mongoq_attempt": 2, "mongoq_outcome": "failed",
                              "mongoq_next_due": None, "mongoq_worker": "w2"}  # fmt: skip
    assert first.exc_info is None  # a retry is one line
    assert second.exc_info is not None and second.exc_info[0] is ValueError
    assert "failed after attempt 2: ValueError: boom" in second.getMessage()


async def test_a_message_nacked_is_info_and_dead_lettered_is_warning(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="mongoq")
    transport = await new_transport(db, clock)
    seq = await transport.publish("g", {"n": 1})

    async def permanent(lease: Any) -> None:
        raise PermanentError("bad message")

    await transport.run(boom, stop_when_empty=True, worker_id="w1", retry_delay=10)
    clock.advance(10)
    await transport.run(permanent, stop_when_empty=True, worker_id="w2")

    assert await messages(db) == {}
    assert list(await dead(db)) == [seq]
    nacked, buried = reports(caplog)
    assert (nacked.name, nacked.levelno, buried.levelno) == (
        "mongoq.groups",
        logging.INFO,
        logging.WARNING,
    )
    assert fields(nacked)["mongoq_next_due"] is not None
    assert {k: v for k, v in fields(nacked).items() if k != "mongoq_next_due"} == {
        "mongoq_primitive": "groups", "mongoq_queue": transport.prefix,
        "mongoq_item": f"g/{seq}", "mongoq_attempt": 1, "mongoq_outcome": "retried",
        "mongoq_worker": "w1", "mongoq_error": "ValueError: boom",
    }  # fmt: skip
    assert fields(buried) == {
        **fields(nacked), "mongoq_attempt": 2, "mongoq_outcome": "dead", "mongoq_next_due": None,
        "mongoq_worker": "w2", "mongoq_error": "PermanentError: bad message",
    }  # fmt: skip


async def test_a_message_out_of_deliveries_is_dead_lettered_with_a_warning(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="mongoq")
    transport = await new_transport(db, clock, max_deliveries=1)
    seq = await transport.publish("g", {"n": 1})

    await transport.run(boom, stop_when_empty=True, worker_id="w1", retry_delay=10)
    clock.advance(10)
    await transport.run(boom, stop_when_empty=True, worker_id="w2")  # buries it instead

    assert await messages(db) == {}
    assert list(await dead(db)) == [seq]
    nacked, buried = reports(caplog)
    assert (nacked.levelno, fields(nacked)["mongoq_outcome"]) == (logging.INFO, "retried")
    assert buried.levelno == logging.WARNING
    assert {k: fields(buried)[k] for k in ("mongoq_item", "mongoq_attempt", "mongoq_outcome")} == {
        "mongoq_item": f"g/{seq}",
        "mongoq_attempt": 1,
        "mongoq_outcome": "dead",
    }
    assert fields(buried)["mongoq_error"].endswith("ValueError: boom")


async def test_a_delivery_rescheduled_is_info_and_buried_is_warning(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="mongoq")
    outbox = await new_outbox(db, clock, subscriptions={"*": ["h"]})
    await outbox.publish([event(1)], session=None)
    dispatcher = OutboxDispatcher(
        outbox, {"h": boom}, worker_id="w", max_attempts=2, backoff=lambda attempt: 10
    )

    await dispatcher.run(stop_when_empty=True)
    clock.advance(10)
    await dispatcher.run(stop_when_empty=True)

    [stored] = await deliveries(db)
    assert (stored["status"], stored["attempts"]) == ("dead", 2)
    retried, buried = reports(caplog)
    assert (retried.name, retried.levelno, buried.levelno) == (
        "mongoq.outbox",
        logging.INFO,
        logging.WARNING,
    )
    assert fields(retried) == {
        "mongoq_primitive": "outbox", "mongoq_queue": outbox.prefix,
        "mongoq_item": f"{event(1).id}/h", "mongoq_attempt": 1, "mongoq_outcome": "retried",
        "mongoq_next_due": fields(retried)["mongoq_next_due"], "mongoq_worker": "w",
        "mongoq_error": "ValueError: boom",
    }  # fmt: skip
    assert fields(retried)["mongoq_next_due"] is not None
    assert fields(buried) == {**fields(retried), "mongoq_attempt": 2, "mongoq_outcome": "buried",
                              "mongoq_next_due": None}  # fmt: skip


async def test_a_worker_on_the_embedded_backend_says_once_that_it_is_in_process(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loop, "_EMBEDDED_NOTED", set())
    queue = await new_queue(db, clock)
    outbox = await new_outbox(db, clock, subscriptions={"*": ["h"]})

    async def nothing(item: Any, *context: Any) -> None:
        return None

    with caplog.at_level(logging.WARNING, logger="mongoq.worker"):
        await queue.run(nothing, stop_when_empty=True)
        await queue.run(nothing, stop_when_empty=True)
        await OutboxDispatcher(outbox, {"h": nothing}, worker_id="w").run(stop_when_empty=True)

    notes = [r for r in caplog.records if getattr(r, "mongoq_backend", None) == "embedded"]
    embedded = _driver.backend_of(db) is _driver.Backend.MEMORY
    assert len(notes) == (1 if embedded else 0)
    if embedded:
        assert f"tasks:{queue.name} runs on the embedded in-memory backend" in notes[0].message
        assert "workers in other processes do not see it" in notes[0].message
