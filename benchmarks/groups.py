"""Group-transport benchmarks: the lifecycle (publish, claim, ack) and claim cost against the
number of groups.

Targets: at most 5 commands per message unbatched, at most 3.2 with
``publish_many`` batches of 100; commands per claim constant from 10 to 100,000 groups. Issue
#14: at most 6 unbatched, 0.08 batched with 100 groups due. As for
the task queue, times on the embedded backend measure mongomock's full scans.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.harness import Result, counted_database
from mongoq import AsyncGroupTransport, NewMessage
from mongoq.testing import ManualClock


async def _transport(db: object, clock: ManualClock) -> AsyncGroupTransport:
    transport = AsyncGroupTransport(db, "bench", clock=clock)
    await transport.setup()
    return transport


async def _drain(transport: AsyncGroupTransport, clock: ManualClock) -> int:
    acked = 0
    while (lease := await transport.claim("bench")) is not None:
        await transport.ack(lease)
        clock.advance(0.001)  # acks in distinct milliseconds, as on a live system
        acked += 1
    return acked


def _messages(count: int, groups: int) -> list[NewMessage]:
    return [NewMessage(f"g{number % groups}", {"n": number}) for number in range(count)]


async def _publish_in_batches(
    transport: AsyncGroupTransport, messages: list[NewMessage], size: int = 100
) -> None:
    for start in range(0, len(messages), size):
        await transport.publish_many(messages[start : start + size])


async def lifecycle_single(uri: str | None, count: int, groups: int) -> Result:
    async with counted_database(uri) as bench:
        clock = ManualClock()
        transport = await _transport(bench.db, clock)
        bench.start()
        for message in _messages(count, groups):
            await transport.publish(message.group_id, message.event)
        assert await _drain(transport, clock) == count
        return bench.stop(f"groups: publish + claim + ack ({count // groups}/group)", count)


async def lifecycle_publish_many(uri: str | None, count: int, groups: int) -> Result:
    async with counted_database(uri) as bench:
        clock = ManualClock()
        transport = await _transport(bench.db, clock)
        bench.start()
        await _publish_in_batches(transport, _messages(count, groups))
        assert await _drain(transport, clock) == count
        return bench.stop(
            f"groups: publish_many(100) + claim + ack ({count // groups}/group)", count
        )


async def lifecycle_batched(uri: str | None, count: int, groups: int) -> Result:
    """publish_many, claim_many and ack_many in batches of 100."""
    async with counted_database(uri) as bench:
        clock = ManualClock()
        transport = await _transport(bench.db, clock)
        bench.start()
        await _publish_in_batches(transport, _messages(count, groups))
        acked = 0
        while leases := await transport.claim_many(100, "bench"):
            acked += sum(await transport.ack_many(leases))
            clock.advance(0.001)
        assert acked == count
        return bench.stop(
            f"groups: publish/claim/ack_many(100) ({count // groups}/group, {groups} groups)",
            count,
        )


async def claim_cost(uri: str | None, groups: int, claims: int = 20) -> Result:
    async with counted_database(uri) as bench:
        clock = ManualClock()
        transport = await _transport(bench.db, clock)
        messages = _messages(groups * 2, groups)
        for start in range(0, len(messages), 1000):
            await transport.publish_many(messages[start : start + 1000])
        claims = min(claims, groups)
        bench.start()
        for _ in range(claims):
            lease = await transport.claim("bench")
            assert lease is not None
            await transport.ack(lease)
        result = bench.stop(f"groups: claim + ack, {groups} groups", claims)
        return await bench.examined(result, lambda: transport.claim("bench"))


def scenarios(
    count: int, groups_list: list[int]
) -> list[tuple[str, Callable[[str | None], object]]]:
    runs: list[tuple[str, Callable[[str | None], object]]] = [
        ("group lifecycle single", lambda uri: lifecycle_single(uri, count, count // 10)),
        (
            "group lifecycle publish_many",
            lambda uri: lifecycle_publish_many(uri, count, count // 10),
        ),
        ("group lifecycle batched", lambda uri: lifecycle_batched(uri, count, count // 10)),
        # The measure: 100 groups due at every claim_many(100).
        ("group lifecycle batched 100", lambda uri: lifecycle_batched(uri, 1000, 100)),
    ]
    for groups in groups_list:
        runs.append(
            (f"group claim cost {groups}", lambda uri, groups=groups: claim_cost(uri, groups))
        )
    return runs
