"""A task document never passes the server's 16 MiB: payload plus result is checked as a whole.

`put` and `complete` used to check their own value only, so a 9 MiB payload with a 9 MiB result
passed both checks; a server refuses that update (code 17419) and `run()` took the refusal for
"outcome unknown", running the handler again a lease apart until the attempts ran out. Now the
completion is refused before any write with `InvalidInput` naming the field, and `run()` fails
the task at once with that error. Assertions read the stored documents.
"""

from __future__ import annotations

from typing import Any

import pytest
from pymongo.errors import OperationFailure

from mongoq import InvalidInput, NewTask, Task
from mongoq.testing import FaultInjector, ManualClock, instrument
from tests.support.helpers import QUEUE, SIXTEEN_MIB, claim_one, new_queue, read

NINE_MIB = "x" * (9 * 1024 * 1024)


async def test_a_result_that_would_take_the_document_past_16_mib_is_refused_unwritten(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("big", NINE_MIB)
    task = await claim_one(queue)
    before = await read(db, "big")
    with pytest.raises(InvalidInput, match=r"^result: .*16 MiB") as refused:
        await queue.complete(task, NINE_MIB)
    assert refused.value.field == "result"
    assert await read(db, "big") == before  # still held, nothing written
    assert await queue.complete(task, "a reference") is True
    stored = await read(db, "big")
    assert stored is not None
    assert (stored["status"], stored["result"]) == ("done", "a reference")


async def test_complete_many_names_the_result_that_does_not_fit(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put_many([NewTask("small", 1), NewTask("big", NINE_MIB)])
    tasks = await queue.claim_many(2, "w")
    big = [t.id for t in tasks].index("big")
    results: list[Any] = ["ok", "ok"]
    results[big] = NINE_MIB
    with pytest.raises(InvalidInput, match=rf"^results\[{big}\]: "):
        await queue.complete_many(tasks, results)
    stored = {task_id: await read(db, task_id) for task_id in ("small", "big")}
    assert {doc["status"] for doc in stored.values() if doc} == {"processing"}


async def test_payload_and_revision_together_must_fit(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock)
    with pytest.raises(InvalidInput, match=r"^revision: payload and revision encode"):
        await queue.put("t", NINE_MIB, revision=NINE_MIB)
    assert await read(db, "t") is None


@pytest.mark.parametrize("batch_size", [1, 10])
async def test_run_fails_a_task_whose_result_does_not_fit_at_once(
    db: Any, clock: ManualClock, batch_size: int
) -> None:
    queue = await new_queue(db, clock, max_attempts=5)
    await queue.put("big", NINE_MIB)
    runs: list[int] = []

    async def handler(task: Task) -> str:
        runs.append(task.attempts)
        return NINE_MIB

    summary = await queue.run(handler, stop_when_empty=True, batch_size=batch_size)
    clock.advance(3600)  # a retry would be due by now
    await queue.run(handler, stop_when_empty=True, batch_size=batch_size)
    assert runs == [1]  # never a retry loop
    assert summary.failed == 1
    stored = await read(db, "big")
    assert stored is not None
    assert (stored["status"], stored["attempts"], stored["result"]) == ("failed", 1, None)
    assert "16 MiB" in stored["error"]
    assert len(stored["payload"]) == len(NINE_MIB)


async def test_a_server_refusal_of_an_oversized_document_fails_the_task_at_once(
    db: Any, clock: ManualClock
) -> None:
    """Should the estimate ever miss, the server's refusal (code 17419, nothing written) is a
    definite answer: the task fails now instead of waiting for its lease and running again."""
    faults = FaultInjector()
    refusal = OperationFailure("Resulting document after update is larger than 16777216", 17419)
    faults.fail_before(
        "update_one", collection=QUEUE, error=refusal, match=lambda op: "$set" in op.args[1]
    )
    queue = await new_queue(instrument(db, faults), clock)
    await queue.put("t", 1)
    runs: list[int] = []

    async def handler(task: Task) -> str:
        runs.append(task.attempts)
        return "fits, but the server says no"

    summary = await queue.run(handler, stop_when_empty=True)
    assert runs == [1] and summary.failed == 1 and summary.unknown == 0
    stored = await read(db, "t")
    assert stored is not None
    assert stored["status"] == "failed"
    assert "17419" in stored["error"] or "larger than" in stored["error"]


def test_the_limit_is_the_servers() -> None:
    from mongoq._validation import MAX_DOCUMENT_BYTES

    assert MAX_DOCUMENT_BYTES == SIXTEEN_MIB
