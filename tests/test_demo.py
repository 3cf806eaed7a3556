"""The demo's progress: lines from its start and through its first round (which drains most
tasks), driven here by a ticker the test controls instead of the wall clock, so what each line
says is decided by the event loop's order alone; and the ``--batch-size`` it runs with."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import anyio
import pytest

from mongoq import cli, demo
from mongoq.demo import DemoConfig, run_demo

TASKS = 60
DRAINING = re.compile(r"round (\d+) +(\d+) done +(\d+) retried +(\d+) failed +(\d+) to go$")
PUTTING = re.compile(r"put +(\d+) of (\d+)$")


async def _often() -> None:
    """A tick at every turn of the event loop: a line after every step of the work."""
    await anyio.lowlevel.checkpoint()


async def test_progress_comes_while_the_first_round_is_still_draining(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(demo, "PUT_CHUNK", 10)  # several puts, so the ticker sees one midway
    lines: list[str] = []
    config = DemoConfig(tasks=TASKS, workers=2, batch_size=4)
    report = await run_demo(config, lines.append, tick=_often)
    assert report.ok, report.checks

    assert lines[0].startswith(f"putting {TASKS} tasks into {report.queue}")
    first_round_over = next(i for i, line in enumerate(lines) if "round 1  ends at" in line)
    putting = [int(m[1]) for line in lines if (m := PUTTING.search(line))]
    assert putting[-1] == TASKS and any(0 < put < TASKS for put in putting)
    draining = [(i, *map(int, m.groups())) for i, line in enumerate(lines[:first_round_over])
                if (m := DRAINING.search(line))]  # fmt: skip
    # The first line about the draining came before most tasks were done, and others while
    # some but not most were: progress from the start, not once a round is over.
    assert draining and draining[0][2] < TASKS // 2
    assert any(0 < done < TASKS // 2 for _, _, done, *_ in draining)
    done_counts = [done for _, _, done, *_ in draining]
    assert done_counts == sorted(done_counts)
    assert all(done + failed + left == TASKS for _, _, done, _, failed, left in draining)
    said = [line.split(" s  ", 1)[1] for line in lines[1:]]  # without the time each took
    assert all(one != next_one for one, next_one in itertools.pairwise(said))


async def test_a_ticker_or_sink_error_stops_the_demo_and_is_raised_as_itself() -> None:
    def sink(line: str) -> None:
        if " done " in line:  # the ticker's lines only: the demo is midway
            raise BrokenPipeError("stdout closed")

    with pytest.raises(BrokenPipeError, match="stdout closed"):
        await run_demo(DemoConfig(tasks=TASKS, workers=2), sink, tick=_often)


async def test_the_cli_demo_with_json_sends_its_progress_to_stderr(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo, "PROGRESS_INTERVAL", 0)  # a line at every turn of the loop
    assert await cli.run(["demo", "--tasks", "20", "--workers", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ok"] is True  # stdout: the report, nothing else
    assert any(DRAINING.search(line) for line in captured.err.splitlines())


async def test_the_demo_claims_one_task_at_a_time_with_batch_size_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert await cli.run(["demo", "--tasks", "20", "--workers", "2", "--batch-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 workers drain them, a task a claim" in out
    assert out.count("[ok]") == 7 and "[FAILED]" not in out


@pytest.mark.parametrize(("value", "said"), [("0", "at least 1"), ("1001", "at most 1000")])
async def test_the_demo_refuses_a_batch_size_out_of_range_before_writing(
    value: str, said: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the demo ran")

    monkeypatch.setattr(cli, "run_demo", never)
    assert await cli.run(["demo", "--batch-size", value]) == 2
    assert f"argument --batch-size: must be {said}, got {value}" in capsys.readouterr().err
