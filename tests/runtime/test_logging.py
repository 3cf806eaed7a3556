"""Every primitive logs a failed attempt the same way (`mongoq.runtime.report`): one record per
event, INFO when the item will be retried, WARNING when it is given up, with the same structured
fields, and the stored state they describe."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from pathlib import Path
from traceback import extract_tb
from typing import Any

import pytest

import mongoq
from mongoq import HandlerTimeout, OutboxDispatcher, PermanentError, _driver
from mongoq.runtime import loop, report
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
    dispatcher = OutboxDispatcher(outbox, {"h": boom}, max_attempts=2, backoff=lambda attempt: 10)

    await dispatcher.run(worker_id="w", stop_when_empty=True)
    clock.advance(10)
    await dispatcher.run(worker_id="w", stop_when_empty=True)

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
        await OutboxDispatcher(outbox, {"h": nothing}).run(worker_id="w", stop_when_empty=True)

    notes = [r for r in caplog.records if getattr(r, "mongoq_backend", None) == "embedded"]
    embedded = _driver.backend_of(db) is _driver.Backend.MEMORY
    assert len(notes) == (1 if embedded else 0)
    if embedded:
        assert f"tasks:{queue.name} runs on the embedded in-memory backend" in notes[0].message
        assert "workers in other processes do not see it" in notes[0].message


async def permanent(item: Any, *context: Any) -> None:
    raise PermanentError("the address is malformed")


def one_line_without_traceback(record: logging.LogRecord) -> None:
    assert record.exc_info is None and record.exc_text is None
    assert "\n" not in logging.Formatter().format(record)


async def test_a_permanent_error_is_one_warning_line_naming_the_item_and_the_error(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """`PermanentError` is the handler's deliberate verdict, not a fault: the record says which
    item and why, without a traceback (the item's stored error keeps it)."""
    caplog.set_level(logging.DEBUG, logger="mongoq")
    queue = await new_queue(db, clock, max_attempts=5)
    await queue.put("t", {"n": 1})

    await queue.run(permanent, stop_when_empty=True, worker_id="w1")

    doc = await read(db, "t")
    assert doc is not None and (doc["status"], doc["attempts"]) == ("failed", 1)
    assert doc["error"].endswith("PermanentError: the address is malformed")
    [record] = reports(caplog)
    assert (record.levelno, record.mongoq_outcome) == (logging.WARNING, "failed")
    assert record.getMessage() == (
        f"tasks:{queue.name} t failed after attempt 1: PermanentError: the address is malformed"
    )
    one_line_without_traceback(record)


async def test_a_permanent_error_buries_a_message_and_a_delivery_in_one_line(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="mongoq")
    transport = await new_transport(db, clock)
    seq = await transport.publish("g", {"n": 1})
    outbox = await new_outbox(db, clock, subscriptions={"*": ["h"]})
    await outbox.publish([event(1)], session=None)

    await transport.run(permanent, stop_when_empty=True, worker_id="w")
    await OutboxDispatcher(outbox, {"h": permanent}).run(worker_id="w", stop_when_empty=True)

    assert list(await dead(db)) == [seq]
    [stored] = await deliveries(db)
    assert stored["status"] == "dead"
    dead_letter, buried = reports(caplog)
    assert [(r.levelno, r.mongoq_outcome, r.mongoq_item) for r in (dead_letter, buried)] == [
        (logging.WARNING, "dead", f"g/{seq}"), (logging.WARNING, "buried", f"{event(1).id}/h"),
    ]  # fmt: skip
    for record in (dead_letter, buried):
        assert record.getMessage().endswith(": PermanentError: the address is malformed")
        one_line_without_traceback(record)


async def test_an_unexpected_error_given_up_carries_the_handlers_frames_only(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The traceback of a handler's bug starts at the handler: the run loop's frames that
    called it say nothing about the bug."""
    caplog.set_level(logging.DEBUG, logger="mongoq")
    queue = await new_queue(db, clock, max_attempts=1)
    await queue.put("t", {"n": 1})

    async def handler(task: Any) -> None:
        await boom(task)

    await queue.run(handler, stop_when_empty=True, worker_id="w1")

    [record] = reports(caplog)
    assert record.levelno == logging.WARNING and record.exc_info is not None
    assert record.exc_info[1] is not None
    text = logging.Formatter().format(record)
    assert text.endswith("ValueError: boom") and "in handler" in text and "in boom" in text
    library = Path(mongoq.__file__).parent  # (whatever the checkout's folder is named)
    frames = [Path(frame.filename) for frame in extract_tb(record.exc_info[2])]
    assert not [f for f in frames if f.is_relative_to(library)], text
    traceback = record.exc_info[2]
    assert traceback is not None and traceback.tb_frame.f_code is handler.__code__
    doc = await read(db, "t")  # what is stored starts at the handler's frame too
    assert doc is not None and doc["status"] == "failed"
    assert "in handler" in doc["error"] and str(library) not in doc["error"]


def test_a_handler_timeout_given_up_is_one_line_and_an_internal_error_keeps_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A time limit reached is the run loop's verdict (one line); an error raised in mongoq's
    own frames, with no handler frame to start from, keeps its whole traceback."""
    caplog.set_level(logging.DEBUG, logger="mongoq")
    logger = logging.getLogger("mongoq.tasks")
    attempt = report.Attempt("tasks", "q", "t", 3, "w")
    try:
        raise HandlerTimeout("timed out after 30 s")
    except HandlerTimeout as error:
        report.log_attempt_end(logger, attempt, "failed", error)
    try:
        report.error_line(object())  # type: ignore[arg-type]
    except AttributeError as error:  # raised inside mongoq.runtime.report
        assert error.__traceback__ is not None
        internal = error.with_traceback(error.__traceback__.tb_next)  # mongoq's frames only
    report.log_attempt_end(logger, attempt, "failed", internal)
    timed_out, failed = reports(caplog)
    assert timed_out.getMessage() == (
        "tasks:q t failed after attempt 3: HandlerTimeout: timed out after 30 s"
    )
    one_line_without_traceback(timed_out)
    assert failed.exc_info is not None and failed.exc_info[2] is internal.__traceback__
