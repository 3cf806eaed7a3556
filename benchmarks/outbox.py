"""Outbox benchmarks: the lifecycle (publish, claim, complete) with batches of 1 and 100, and
the claim cost with a backlog waiting behind a blocked key, on the first claim (which parks the
backlog) and after it.

The seed's claims to check: an unkeyed batch claim costs a small fixed number of commands and
writes no delivery document; a batch completion of any size costs a fixed number of commands
(two here: the deletion and the completion time on the events); once a blocked backlog is
parked, a claim no longer scans it. As everywhere, times on the embedded backend measure
mongomock's full scans, not index use.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.harness import Result, counted_database
from mongoq.outbox import AsyncOutbox, Delivery, Event
from mongoq.testing import ManualClock


async def _outbox(db: object, clock: ManualClock) -> AsyncOutbox:
    outbox = AsyncOutbox(db, "bench_", subscriptions={"e": ["h"]}, clock=clock)
    await outbox.setup()
    return outbox


def _events(count: int, keys: int | None) -> list[Event]:
    return [
        Event(f"e{n}", "e", {"n": n}, key=None if keys is None else f"k{n % keys}")
        for n in range(count)
    ]


async def lifecycle(uri: str | None, count: int, batch: int, keys: int | None) -> Result:
    async with counted_database(uri) as bench:
        clock = ManualClock()
        outbox = await _outbox(bench.db, clock)
        events = _events(count, keys)
        bench.start()
        for start in range(0, count, batch):
            await outbox.publish(events[start : start + batch], session=None)
        done = 0
        while claimed := await outbox.claim("bench", limit=batch):
            if batch == 1:
                done += sum([await outbox.complete(delivery) for delivery in claimed])
            else:
                done += sum(await outbox.complete_many(claimed))
            clock.advance(0.001)
        assert done == count, (done, count)
        kind = "unkeyed" if keys is None else f"{keys} keys"
        name = (
            "publish + claim + complete" if batch == 1 else f"publish/claim/complete_many({batch})"
        )
        return bench.stop(f"outbox: {name}, {kind}", count)


async def blocked_key(uri: str | None, backlog: int, claims: int = 20) -> list[Result]:
    """`backlog` deliveries of one key wait behind its head, which the same worker runs (so
    the key's lane is its own and the claim scans it); unkeyed deliveries are due behind them.
    The first claim walks the backlog and parks it; later claims do not see it."""
    async with counted_database(uri) as bench:
        clock = ManualClock()
        outbox = await _outbox(bench.db, clock)
        events = _events(backlog + 1, keys=1) + [
            Event(f"u{n}", "e", {"n": n}) for n in range(claims + 1)
        ]
        for start in range(0, len(events), 1000):
            await outbox.publish(events[start : start + 1000], session=None)
        head = await outbox.claim("bench", limit=1)
        assert head and head[0].event.key == "k0"
        bench.start()
        first = await outbox.claim("bench", limit=1)
        assert first and first[0].event.key is None
        parked = bench.stop(f"outbox: first claim, {backlog} behind a blocked key", 1)
        bench.start()
        for _ in range(claims):
            assert await outbox.claim("bench", limit=1)
        after = bench.stop(f"outbox: claims after parking, {backlog} blocked", claims)
        after = await bench.examined(after, lambda: outbox.claim("bench", limit=1))
        return [parked, after]


async def parked_keys(uri: str | None, keys: int, claims: int = 20) -> list[Result]:
    """`keys` keys, each with a head whose retry is not due for an hour and two deliveries
    parked behind it; unkeyed deliveries are due beside them. Claims after the parking do not
    look at the parked keys; a claim that reads the lanes again (one that came up short) looks
    at them all (`UNPARK_KEYS_PER_CLAIM` a look) in two commands a look."""
    async with counted_database(uri) as bench:
        clock = ManualClock()
        outbox = await _outbox(bench.db, clock)
        events = [Event(f"k{k}-{n}", "e", key=f"k{k}") for k in range(keys) for n in range(3)]
        for start in range(0, len(events), 1000):
            await outbox.publish(events[start : start + 1000], session=None)
        heads: list[Delivery] = []
        while batch := await outbox.claim("bench", limit=1000):
            heads += batch
        for head in heads:
            await outbox.reschedule(head, delay=3600)
        while await outbox.claim("bench", limit=1000):
            pass  # parks the followers: no head is due
        stats = await outbox.stats()
        assert stats.parked == 2 * keys, stats
        await outbox.publish([Event(f"u{n}", "e") for n in range(claims + 1)], session=None)
        assert await outbox.claim("bench", limit=1)  # fills: the next ones trust the view
        bench.start()
        for _ in range(claims):
            for delivery in await outbox.claim("bench", limit=1):
                await outbox.complete(delivery)
        after = bench.stop(f"outbox: claims after parking, {keys} parked keys", claims)
        assert await outbox.claim("bench", limit=2) == []  # nothing left: it comes up short
        bench.start()
        assert await outbox.claim("bench", limit=2) == []  # so this one reads the lanes again
        looked = bench.stop(f"outbox: a claim that looks at {keys} parked keys", 1)
        return [after, looked]


async def disjoint_handlers(uri: str | None, count: int = 200) -> Result:
    """Two services' dispatchers on one outbox, each serving its own handler of every event:
    while A's dispatcher runs all of its handler's deliveries (holding their lanes), B's
    drains its own, in batches of 100. Lanes shared by all handlers left B nothing while A
    held them; per-handler lanes leave B all of its deliveries."""
    async with counted_database(uri) as bench:
        clock = ManualClock()
        outbox = AsyncOutbox(bench.db, "bench_", subscriptions={"e": ["a", "b"]}, clock=clock)
        await outbox.setup()
        await outbox.publish(_events(count, None), session=None)
        running = await outbox.claim("A", ["a"], limit=count)
        assert len(running) == count, len(running)
        bench.start()
        done = 0
        while claimed := await outbox.claim("B", ["b"], limit=100):
            done += sum(await outbox.complete_many(claimed))
        return bench.stop(f"outbox: B drained {done}/{count} while A runs its {count}", done)


async def claim_cpu(uri: str | None, backlog: int = 500, claims: int = 200) -> Result:
    """mongoq's own time per unbatched claim (limit 1, then its completion, not timed), the
    commands left out: a backlog of unkeyed deliveries over every lane, one worker."""
    async with counted_database(uri) as bench:
        clock = ManualClock()
        outbox = await _outbox(bench.db, clock)
        await outbox.publish(_events(backlog, None), session=None)
        for _ in range(5):  # warm: the worker holds its lanes as it would
            for delivery in await outbox.claim("bench", limit=1):
                await outbox.complete(delivery)
        elapsed, own, commands = 0.0, 0.0, 0
        for _ in range(claims):
            bench.start()
            claimed = await outbox.claim("bench", limit=1)
            one = bench.stop("claim", 1, own=True)
            assert claimed and one.own_ms is not None
            elapsed, own, commands = (
                elapsed + one.seconds,
                own + one.own_ms,
                commands + one.commands,
            )
            for delivery in claimed:
                await outbox.complete(delivery)
            clock.advance(0.001)
        return Result(
            "outbox: mongoq's own time per claim(1), unkeyed", bench.backend, claims, elapsed,
            commands, own_ms=own / claims,
        )  # fmt: skip


def scenarios(count: int, blocked: list[int]) -> list[tuple[str, Callable[[str | None], object]]]:
    runs: list[tuple[str, Callable[[str | None], object]]] = [
        ("outbox lifecycle single", lambda uri: lifecycle(uri, count, 1, None)),
        ("outbox lifecycle batched", lambda uri: lifecycle(uri, count, 100, None)),
        ("outbox lifecycle single keyed", lambda uri: lifecycle(uri, count, 1, 50)),
        ("outbox lifecycle batched keyed", lambda uri: lifecycle(uri, count, 100, 50)),
        ("outbox own time per claim", lambda uri: claim_cpu(uri)),
        ("outbox disjoint handlers", lambda uri: disjoint_handlers(uri)),
    ]
    for size in blocked:
        runs.append((f"outbox blocked key {size}", lambda uri, size=size: blocked_key(uri, size)))
    for keys in (100, 1000):
        runs.append((f"outbox parked keys {keys}", lambda uri, keys=keys: parked_keys(uri, keys)))
    return runs
