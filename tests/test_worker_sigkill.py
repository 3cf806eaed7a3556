"""``mongoq worker`` processes killed for real: SIGKILL at seeded random moments while a
producer puts work, restarted, and every task judged from the database by the campaign's rules
(``tests/campaign``): nothing lost, no overlap under a live lease, attempts bounded.

The real-server lane only (``MONGOQ_TEST_URI``; skipped with the lane's reason elsewhere): the
embedded backend lives in one process, and these are several. Four workers (batch sizes 1 and
3, three slots each) run the task function of a module the test writes (`APP`); each run of it
records itself in the collection ``runs``, one document per task and claim: the process, the
attempt, its start and end, and the latest lease it saw its task hold, read from the task
document every step while it works. The test puts `TASKS` tasks, kills a ready worker `KILLS`
times (recording each kill in ``kills``), starting a new one in its place each time, waits
until every task has finished, stops the workers with SIGTERM and asserts:

- every task put ended ``done`` or ``failed``, none ``pending`` or ``processing`` or missing;
  1 <= attempts <= max_attempts, and no more recorded runs than attempts;
- a ``done`` task was completed by a run that returned (its stored token is one), with that
  run's result;
- a ``failed`` task used all its attempts, failed because its lease expired on the last one,
  and every process that ran or last claimed it was one the test killed;
- every run started under its own live lease, and no two runs of one task (two claims) held a
  live lease while both ran: a run holds from its start until the first of its end, its
  cancellation, the moment it saw the task held no more, its process's kill, and the latest
  lease it saw;
- and, so that a pass means something: every worker exited 0 after SIGTERM, none logged an
  unexpected error, and at least one run was cut short by a kill.

Instants are compared on the host's system clock, which every process here shares: a worker
stamps with its queue's `ServerClock`, and the offset it records beside each run is taken off
again, so clock estimates of different processes do not pass for overlaps or hide one.

Wall-clock waits are allowed here only because real processes run against a real server; each
waits for a stated condition, with a bound and a message saying what did not happen.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import IO, Any, Literal

import anyio
import anyio.to_thread
import pytest

import mongoq
from mongoq import _driver
from mongoq.clock import stored_instant
from mongoq.tasks.schema import EXPIRED_ON_LAST_ATTEMPT
from tests.conftest import REAL_SERVER_SKIP, RUN_SEED, TEST_DRIVERS, TEST_URI

pytestmark = pytest.mark.skipif(not TEST_URI, reason=REAL_SERVER_SKIP)

#: The worker processes' task functions: ``work(key, steps)`` sleeps `steps` times `STEP`
#: seconds and returns its key; `Recorded` records each run of it in `RUNS` (see the module
#: docstring). Imported by the workers as ``sigkill_app:jobs``, and by the test (the producer).
APP = '''
"""Task functions of tests/test_worker_sigkill.py: each run records itself in `RUNS`."""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any

import anyio
from pymongo import ReadPreference
from pymongo.errors import DuplicateKeyError
from pymongo.write_concern import WriteConcern

import mongoq
from mongoq.clock import stored_instant
from mongoq.jobs import TaskFunction
from mongoq.tasks import Task

QUEUE = "work"
RUNS = "runs"
LEASE_TTL = 4.0
MAX_ATTEMPTS = 3
STEP = 0.1

# Short backoffs: a run that raises (a recording write that failed) is retried within the test.
jobs = mongoq.Jobs(
    lease_ttl=LEASE_TTL, max_attempts=MAX_ATTEMPTS, backoff_base=0.2, backoff_cap=1.0
)


async def _work(key: str, steps: int) -> str:
    await anyio.sleep(steps * STEP)
    return key


class Recorded(TaskFunction[[str, int], str]):
    """`_work`, recording each run: one document per task and claim (its lease token)."""

    async def run(self, task: Task) -> str:
        queue = self.jobs.queue(self.queue)
        runs = self.jobs.db.get_collection(
            RUNS, write_concern=WriteConcern("majority"), read_preference=ReadPreference.PRIMARY
        )
        # A claim of several tasks (batch_size > 1) gives them one token: a run is both.
        run = f"{task.id}/{task.lease_token}"
        started = queue.clock.now()
        held = {"_id": task.id, "status": "processing", "lease_token": task.lease_token}
        doc = await queue.collection.find_one(held, {"lease_until": 1})
        seen = [task.lease_until, stored_instant(doc.get("lease_until")) if doc else None]
        lease = max(s for s in seen if s is not None)
        try:
            await runs.insert_one({
                "_id": run, "task": task.id, "token": task.lease_token, "pid": os.getpid(),
                "worker": task.worker_id, "attempt": task.attempts,
                "offset": getattr(queue.clock, "offset", timedelta(0)).total_seconds(),
                "started": started, "held_at_start": doc is not None, "lease_at_start": lease,
                "lease_seen": lease,
            })  # fmt: skip
        except DuplicateKeyError:  # a second start under one claim: said, for the test
            await runs.update_one({"_id": run}, {"$inc": {"started_again": 1}})
            raise
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._watch, queue, runs, run, held)
                result = await super().run(task)
                group.cancel_scope.cancel()
        except BaseException:  # cancelled (a stop, a lost lease) or failed: said, bounded
            with anyio.move_on_after(2, shield=True), contextlib.suppress(Exception):
                await runs.update_one({"_id": run}, {"$set": {"cut": queue.clock.now()}})
            raise
        await runs.update_one({"_id": run}, {"$set": {"ended": queue.clock.now()}})
        return result

    @staticmethod
    async def _watch(queue: Any, runs: Any, run: str, held: dict[str, Any]) -> None:
        """The latest lease the task is seen held under this run's claim; when it is not."""
        while True:
            await anyio.sleep(STEP)
            doc = await queue.collection.find_one(held, {"lease_until": 1})
            if doc is None:
                await runs.update_one({"_id": run}, {"$min": {"lost": queue.clock.now()}})
                return
            until = stored_instant(doc.get("lease_until"))
            if until is not None:
                await runs.update_one({"_id": run}, {"$max": {"lease_seen": until}})


work = Recorded(
    jobs, _work, name="work", queue=QUEUE, timeout=None, retry_on=None, max_attempts=None
)
jobs.functions[work.name] = work
'''

APP_MODULE = "sigkill_app"
TASKS = 200
#: Seconds between two puts: the production lasts about as long as the kills.
PUT_GAP = 0.03
#: One task in `LONG_SHARE` works `LONG_STEPS` steps (more than half a lease: it is renewed);
#: the others 1-8 steps.
LONG_SHARE, LONG_STEPS = 0.1, 25
WORKERS = 4
CONCURRENCY = 3
BATCH_SIZES = (1, 3)
KILLS = 8
#: Seconds between two kills, drawn from the seed.
KILL_GAP = (0.3, 1.0)
#: Seconds a worker may take to start (imports, connection, indexes) until its ready file says so.
READY_WAIT = 60.0
#: Seconds every task may take to finish once the last kill is over and every worker is ready:
#: a lease to expire and a poll to claim again, a few times over, and the work itself.
FINISH_WAIT = 120.0
#: Seconds the workers may take to drain and exit after SIGTERM.
STOP_WAIT = 30.0
POLL = 0.25
#: Instants are stored in milliseconds, truncated: two of them, compared, may be off by 2 ms.
EPSILON = timedelta(milliseconds=2)
FINISHED = ("done", "failed")


def _load_app(path: Path) -> ModuleType:
    """The task functions' module, for the producer, without touching ``sys.modules``."""
    spec = importlib.util.spec_from_file_location(APP_MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Worker:
    """One ``mongoq worker`` process: its slot, ready file and log."""

    slot: int
    process: subprocess.Popen[bytes]
    ready: Path
    log: Path
    output: IO[bytes]

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_ready(self) -> bool:
        """Running, and its ready file (written once it claims) names it."""
        with contextlib.suppress(OSError):
            return self.process.poll() is None and self.ready.read_text().strip() == str(self.pid)
        return False

    def tail(self, lines: int = 15) -> str:
        self.output.flush()
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return f"--- worker {self.pid} (slot {self.slot}), last lines:\n" + "\n".join(text)


@dataclass
class Fleet:
    """The worker processes: one per slot at any time, every one ever started remembered."""

    directory: Path
    env: dict[str, str]
    started: list[Worker] = field(default_factory=list)
    current: dict[int, Worker] = field(default_factory=dict)

    def start(self, slot: int) -> Worker:
        number = len(self.started)
        ready = self.directory / f"ready-{slot}-{number}"
        log = self.directory / f"worker-{slot}-{number}.log"
        output = log.open("wb")
        argv = [
            sys.executable, "-m", "mongoq", "worker", f"{APP_MODULE}:jobs",
            "--concurrency", str(CONCURRENCY),
            "--batch-size", str(BATCH_SIZES[slot % len(BATCH_SIZES)]),
            "--ready-file", str(ready),
        ]  # fmt: skip
        process = subprocess.Popen(
            argv, cwd=self.directory, env=self.env, stdout=output, stderr=subprocess.STDOUT
        )
        worker = Worker(slot, process, ready, log, output)
        self.started.append(worker)
        self.current[slot] = worker
        return worker

    async def until_ready(self, worker: Worker) -> None:
        deadline = time.monotonic() + READY_WAIT
        while not worker.is_ready():
            if worker.process.poll() is not None:
                pytest.fail(f"worker {worker.pid} exited ({worker.process.returncode}) before "
                            f"it was ready\n{worker.tail()}")  # fmt: skip
            if time.monotonic() > deadline:
                pytest.fail(f"worker {worker.pid} wrote no ready file within {READY_WAIT} s\n"
                            f"{worker.tail()}")  # fmt: skip
            await anyio.sleep(0.05)

    async def kill(self, worker: Worker) -> datetime:
        """SIGKILL `worker` and reap it; the system time by which it is gone."""
        worker.process.send_signal(signal.SIGKILL)
        await anyio.to_thread.run_sync(worker.process.wait, 10)
        return datetime.now(UTC)

    def gone(self) -> list[Worker]:
        """The current workers that exited by themselves (none should)."""
        return [w for w in self.current.values() if w.process.poll() is not None]

    async def stop(self) -> dict[int, str]:
        """SIGTERM every current worker (each drains, then exits): how each ended, ``exit 0``
        the only good answer."""
        ended = {w.pid: f"gone before the stop: exit {w.process.returncode}" for w in self.gone()}
        running = [w for w in self.current.values() if w.pid not in ended]
        for worker in running:
            worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT
        for worker in running:
            left = max(0.1, deadline - time.monotonic())
            with contextlib.suppress(subprocess.TimeoutExpired):
                await anyio.to_thread.run_sync(worker.process.wait, left)
            code = worker.process.poll()
            ended[worker.pid] = "still running after SIGTERM" if code is None else f"exit {code}"
        return ended

    def close(self) -> None:
        """Kill whatever still runs (a failed test's workers): nothing outlives the test."""
        for worker in self.started:
            if worker.process.poll() is None:
                worker.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(10)
            worker.output.close()

    def tails(self) -> str:
        return "\n".join(w.tail() for w in self.started if w.log.stat().st_size)


@pytest.fixture
async def server_db() -> Any:
    """A database of its own on ``MONGOQ_TEST_URI``'s server, dropped after the test."""
    assert TEST_URI is not None
    name = f"mongoq_test_{uuid.uuid4().hex[:10]}"
    driver: Literal["pymongo", "motor"] = "motor" if TEST_DRIVERS[:1] == ["motor"] else "pymongo"
    db = mongoq.connect(TEST_URI, name, driver=driver)
    try:
        yield db
    finally:
        await db.client.drop_database(name)
        await _driver.close(db)


@contextlib.contextmanager
def fleet_of(tmp_path: Path, database: str) -> Iterator[Fleet]:
    """Worker processes that find the server through ``MONGOQ_URI`` (not the command line,
    where a password would show in ``ps``) and the module on ``PYTHONPATH``."""
    assert TEST_URI is not None
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {
        **os.environ, "MONGOQ_URI": TEST_URI, "MONGOQ_DATABASE": database,
        "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1",
    }  # fmt: skip
    fleet = Fleet(tmp_path, env)
    try:
        yield fleet
    finally:
        fleet.close()


async def test_workers_killed_with_sigkill_lose_nothing_and_never_overlap(
    server_db: Any, tmp_path: Path
) -> None:
    seed = f"{RUN_SEED}:sigkill"
    (tmp_path / f"{APP_MODULE}.py").write_text(APP.lstrip())
    app = _load_app(tmp_path / f"{APP_MODULE}.py")
    app.jobs.use(server_db)
    await app.jobs.setup()
    queue = app.jobs.queue(app.QUEUE)
    kills = _driver.collection(server_db, "kills")
    with fleet_of(tmp_path, server_db.name) as fleet:
        for slot in range(WORKERS):
            fleet.start(slot)
        for worker in list(fleet.current.values()):
            await fleet.until_ready(worker)
        keys: list[str] = []
        async with anyio.create_task_group() as group:
            group.start_soon(_produce, app, random.Random(f"{seed}:steps"), keys)
            group.start_soon(_chaos, fleet, kills, random.Random(f"{seed}:kills"))
        for worker in list(fleet.current.values()):
            await fleet.until_ready(worker)
        await _until_finished(queue.collection, fleet, seed)
        codes = await fleet.stop()
        logs = fleet.tails()
        tasks = {doc["_id"]: doc for doc in await _driver.find_list(queue.collection, {})}
        runs = await _driver.find_list(_driver.collection(server_db, app.RUNS), {})
        killed = {doc["pid"]: _utc(doc["at"]) for doc in await _driver.find_list(kills, {})}
        unexpected = [
            line for w in fleet.started
            for line in w.log.read_text(errors="replace").splitlines()
            if "unexpected error" in line.lower()
        ]  # fmt: skip
    context = f"seed {seed!r}, {len(killed)} kills, {len(runs)} runs\n{logs}"
    assert set(codes.values()) == {"exit 0"}, f"the workers ended {codes}\n{context}"
    assert not unexpected, "\n".join(unexpected[:10]) + f"\n{context}"
    problems = _outcomes(keys, tasks, runs, killed, app.MAX_ATTEMPTS)
    problems += _overlaps(runs, killed)
    listed = "\n".join(problems[:20])
    assert not problems, f"{len(problems)} problem(s):\n{listed}\n{context}"
    cut = [run for run in runs if run["pid"] in killed and "ended" not in run]
    assert killed and cut, f"no run was cut short by a kill: the test proved nothing\n{context}"


async def _produce(app: ModuleType, rng: random.Random, keys: list[str]) -> None:
    """Put `TASKS` tasks, `PUT_GAP` seconds apart (while the kills go on)."""
    for number in range(TASKS):
        key = f"t{number:03d}"
        steps = LONG_STEPS if rng.random() < LONG_SHARE else rng.randint(1, 8)
        await app.work.options(task_id=key).defer(key, steps)
        keys.append(key)
        await anyio.sleep(PUT_GAP)


async def _chaos(fleet: Fleet, kills: Any, rng: random.Random) -> None:
    """`KILLS` times, after a seeded pause: SIGKILL a ready worker (drawn from the seed among
    the ready ones), record the kill, and start a new worker in its slot."""
    for _ in range(KILLS):
        await anyio.sleep(rng.uniform(*KILL_GAP))
        ready = [fleet.current[slot] for slot in sorted(fleet.current)]
        ready = [worker for worker in ready if worker.is_ready()]
        if not ready:  # every slot is starting: this moment kills nothing
            continue
        victim = rng.choice(ready)
        at = await fleet.kill(victim)
        await kills.insert_one({"pid": victim.pid, "slot": victim.slot, "at": at})
        fleet.start(victim.slot)


async def _until_finished(collection: Any, fleet: Fleet, seed: str) -> None:
    """Wait until every task is done or failed, `FINISH_WAIT` seconds at most."""
    deadline = time.monotonic() + FINISH_WAIT
    while True:
        docs = await _driver.find_list(collection, {}, projection={"status": 1})
        statuses = Counter(doc["status"] for doc in docs)
        if len(docs) == TASKS and set(statuses) <= set(FINISHED):
            return
        if fleet.gone():
            pytest.fail(f"a worker exited by itself (seed {seed!r})\n"
                        + "\n".join(w.tail() for w in fleet.gone()))  # fmt: skip
        if time.monotonic() > deadline:
            left = await _driver.find_list(
                collection, {"status": {"$nin": list(FINISHED)}}, limit=5
            )
            pytest.fail(
                f"not every task finished within {FINISH_WAIT} s after the last kill (seed "
                f"{seed!r}): {len(docs)} of {TASKS} put, {dict(statuses)}; for example "
                f"{left}\n{fleet.tails()}"
            )
        await anyio.sleep(POLL)


def _utc(value: Any) -> datetime:
    instant = stored_instant(value)
    assert instant is not None, f"not an instant: {value!r}"
    return instant


def _system(run: Mapping[str, Any], name: str) -> datetime | None:
    """The run's stamp `name` on the system clock (its `ServerClock` offset taken off)."""
    value = stored_instant(run.get(name))
    return None if value is None else value - timedelta(seconds=run["offset"])


def _pid_of(worker_id: Any) -> int | None:
    """The process of a default worker id, ``hostname:pid:uuid8``."""
    parts = str(worker_id or "").split(":")
    return int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else None


def _outcomes(
    keys: list[str],
    tasks: Mapping[Any, Mapping[str, Any]],
    runs: list[dict[str, Any]],
    killed: Mapping[int, datetime],
    max_attempts: int,
) -> list[str]:
    """Nothing lost, attempts bounded, each end explained (see the module docstring)."""
    problems: list[str] = []
    by_task: dict[Any, list[dict[str, Any]]] = {}
    for run in runs:
        by_task.setdefault(run["task"], []).append(run)
    if sorted(tasks) != sorted(keys):
        problems.append(f"tasks stored {len(tasks)}, put {len(keys)}: lost "
                        f"{sorted(set(keys) - set(tasks))[:10]}")  # fmt: skip
    for key in keys:
        doc, ran = tasks.get(key), by_task.get(key, [])
        if doc is None:
            continue
        said = (f"{key}: {doc['status']} after {doc.get('attempts')} attempt(s), "
                f"{len(ran)} run(s) recorded")  # fmt: skip
        attempts = doc.get("attempts")
        if doc["status"] not in FINISHED:
            problems.append(f"{said}: neither done nor failed")
        if not isinstance(attempts, int) or not 1 <= attempts <= max_attempts:
            problems.append(f"{said}: attempts not within 1..{max_attempts}")
        elif len(ran) > attempts:
            problems.append(f"{said}: more runs than attempts counted")
        if doc["status"] == "done":
            problems += _done_explained(said, key, doc, ran)
        if doc["status"] == "failed":
            problems += _failure_explained(said, doc, ran, killed, max_attempts)
    return problems


def _done_explained(
    said: str, key: str, doc: Mapping[str, Any], ran: list[dict[str, Any]]
) -> list[str]:
    """A done task was completed by a run that returned, with its result."""
    by = {run["token"]: run for run in ran}.get(doc.get("lease_token"))
    if by is None or "ended" not in by:
        return [f"{said}: done by claim {doc.get('lease_token')!r}, no run of which returned"]
    if doc.get("result") != key or _pid_of(doc.get("worker_id")) != by["pid"]:
        return [f"{said}: result {doc.get('result')!r} by {doc.get('worker_id')!r}, but run "
                f"{by['_id']!r} of process {by['pid']} returned {key!r}"]  # fmt: skip
    return []


def _failure_explained(
    said: str,
    doc: Mapping[str, Any],
    ran: list[dict[str, Any]],
    killed: Mapping[int, datetime],
    max_attempts: int,
) -> list[str]:
    """A failed task's attempts were all used up by kills."""
    problems = []
    if doc.get("attempts") != max_attempts or not str(doc.get("error") or "").startswith(
        EXPIRED_ON_LAST_ATTEMPT
    ):
        problems.append(f"{said}: failed with {doc.get('error')!r}, not a lease expired on the "
                        f"last of {max_attempts} attempts")  # fmt: skip
    survivors = sorted({run["pid"] for run in ran} - set(killed))
    last = _pid_of(doc.get("worker_id"))
    if survivors or last not in killed:
        problems.append(f"{said}: failed, but processes {survivors or [last]} that ran or last "
                        f"claimed it were never killed")  # fmt: skip
    return problems


def _held(run: Mapping[str, Any], killed: Mapping[int, datetime]) -> tuple[datetime, datetime]:
    """When `run` ran under a live lease, on the system clock: from its start to the first of
    its end, its cancellation, its seeing the task held no more, its process's kill and the
    latest lease it saw."""
    start, lease = _system(run, "started"), _system(run, "lease_seen")
    assert start is not None and lease is not None, run
    ends = [_system(run, name) for name in ("ended", "cut", "lost")] + [killed.get(run["pid"])]
    return start, min([lease, *(end for end in ends if end is not None)])


def _overlaps(runs: list[dict[str, Any]], killed: Mapping[int, datetime]) -> list[str]:
    """Every run started under its own live lease; no two claims of one task held a live
    lease while both ran."""
    problems: list[str] = []
    by_task: dict[Any, list[tuple[datetime, datetime, dict[str, Any]]]] = {}
    for run in runs:
        start, end = _held(run, killed)
        # Both on the run's own clock: the lease it knew of when it started.
        if not run["held_at_start"] or _utc(run["started"]) >= _utc(run["lease_at_start"]):
            problems.append(f"{run['task']}: run {run['_id']!r} (process {run['pid']}, attempt "
                            f"{run['attempt']}) started without a live lease: {run}")  # fmt: skip
        if run.get("started_again"):
            problems.append(f"{run['task']}: started {1 + run['started_again']} times under "
                            f"one claim: {run}")  # fmt: skip
        by_task.setdefault(run["task"], []).append((start, end, run))
    for task, held in by_task.items():
        held.sort(key=lambda item: item[0])
        for number, (start, end, run) in enumerate(held):
            for other_start, other_end, other in held[number + 1 :]:
                if other_start < end - EPSILON and start < other_end - EPSILON:
                    problems.append(
                        f"{task}: overlap under live leases: run {run['_id']!r} (process "
                        f"{run['pid']}) held {start:%T.%f}-{end:%T.%f}, run {other['_id']!r} "
                        f"(process {other['pid']}) held {other_start:%T.%f}-{other_end:%T.%f}"
                    )
    return problems
