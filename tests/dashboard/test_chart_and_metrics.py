"""The dashboard's chart (axes, values and a stated window, drawn on the server), its "oldest
waiting" (never ``0s`` while work is due), ``/metrics`` (Prometheus text, or a plain 404
without the extra) and the import that names the missing ``dashboard`` extra."""

from __future__ import annotations

import importlib
import re
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from mongoq import AsyncTaskQueue, MongoqError, NewTask
from mongoq.dashboard.chart import nice_ticks, render, time_ticks, window_label
from mongoq.dashboard.samples import Point
from mongoq.outbox import AsyncOutbox, Event
from mongoq.testing import ManualClock
from tests.support.dashboard_helpers import app_of, client, seed

T0 = datetime(2026, 3, 1, 10, 0, tzinfo=UTC)
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def texts(svg: str, css: str) -> list[str]:
    return re.findall(rf'<text class="{css}"[^>]*>([^<]*)</text>', svg)


def test_value_ticks_are_round_and_time_ticks_fall_on_round_minutes() -> None:
    assert nice_ticks(0) == [0, 1]
    assert nice_ticks(401) == [0, 100, 200, 300, 400, 500]
    assert nice_ticks(3) == [0, 1, 2, 3]  # whole items: no 0.5
    assert nice_ticks(0.4) == [0, 0.1, 0.2, 0.3, 0.4]
    ticks = time_ticks(T0 - timedelta(minutes=30), T0, 6)
    assert [t.strftime("%H:%M") for t in ticks] == [
        "09:30", "09:35", "09:40", "09:45", "09:50", "09:55", "10:00",
    ]  # fmt: skip
    ragged = time_ticks(T0 - timedelta(seconds=333), T0 - timedelta(seconds=7), 4)
    assert [t.strftime("%H:%M:%S") for t in ragged] == ["09:56:00", "09:58:00"]
    assert (window_label(1800), window_label(360), window_label(45)) == (
        "last 30 min", "last 6 min", "last 45 s",
    )  # fmt: skip


def test_the_chart_has_labelled_axes_a_window_and_the_latest_values() -> None:
    points = [
        Point(T0 - timedelta(minutes=20), 400, None),
        Point(T0 - timedelta(minutes=10), 250, 15.0),
        Point(T0, 40, 21.0),
    ]
    svg = render("tasks:emails", "emails", points, now=T0, window=1800, size="large")

    assert 'data-key="tasks:emails"' in svg and 'data-size="large"' in svg
    assert texts(svg, "tick backlog") == ["0", "100", "200", "300", "400"]
    assert texts(svg, "tick rate") == ["0", "5", "10", "15", "20", "25"]
    assert "09:30" in texts(svg, "tick time") and "10:00" in texts(svg, "tick time")
    assert "last 30 min (UTC)" in svg
    assert "latest: backlog 40, 21 finished/min" in svg
    assert svg.count('<polyline class="backlog"') == 1
    assert svg.count('<polyline class="rate"') == 1  # from the second sample: the first has none
    assert "collecting samples" not in svg


def test_a_chart_with_fewer_than_two_samples_shows_them_and_says_it_is_collecting() -> None:
    empty = render("groups:orders", "orders", [], now=T0, window=1800)
    one = render("groups:orders", "orders", [Point(T0, 7, None)], now=T0, window=1800)
    outside = render("groups:orders", "orders", [Point(T0 - timedelta(hours=1), 7, None)],
                     now=T0, window=1800)  # fmt: skip

    assert "collecting samples (0 of 2)" in empty and "<polyline" not in empty
    assert "collecting samples (1 of 2)" in one
    assert '<circle class="backlog"' in one and "latest: backlog 7" in one
    assert "collecting samples (0 of 2)" in outside  # older than the window: not shown
    assert '<text class="tick time"' in empty  # the axes are there all the same


def test_what_a_chart_shows_is_escaped() -> None:
    svg = render('tasks:"><script>x</script>', '"><script>x</script>', [], now=T0, window=60)
    assert "<script>" not in svg


async def test_the_pages_show_the_chart_of_the_samples_taken_mid_run(
    db: Any, clock: ManualClock
) -> None:
    seeded = await seed(db, clock)
    app = app_of(db, clock)
    sampler = app.state.dashboard.sampler
    sampler.clock = clock
    async with client(app) as http:
        before = (await http.get("/")).text
        await sampler.sample()
        clock.advance(60)
        await seeded.queue.put_many(NewTask(f"n-{n}") for n in range(5))
        await sampler.sample()  # the run goes on: two samples, no finished task yet
        overview = (await http.get("/")).text
        page = (await http.get("/tasks/emails")).text
        fresh = await http.get("/api/chart", params={"key": "tasks:emails", "size": "small"})
        unknown = await http.get("/api/chart", params={"key": "tasks:nowhere"})

    assert "collecting samples (0 of 2)" in before
    chart = overview.split('data-key="tasks:emails"')[1].split("</svg>")[0]
    assert "collecting samples" not in chart and '<polyline class="backlog"' in chart
    assert "latest: backlog 6" in chart  # digest-3 and the five new ones
    assert "last 30 min (UTC)" in chart
    assert 'data-size="large"' in page.split("<h2>")[0]
    assert fresh.status_code == 200 and fresh.headers["content-type"].startswith("image/svg+xml")
    assert fresh.text.startswith('<svg class="chart" data-key="tasks:emails"')
    assert unknown.status_code == 404


async def test_oldest_waiting_never_reads_0s_while_work_is_due(db: Any, clock: ManualClock) -> None:
    queue = AsyncTaskQueue(db, "jobs", clock=clock)
    await queue.setup()
    await queue.put_many(NewTask(f"j-{n}") for n in range(40))  # due now, 0.0 s old
    outbox = AsyncOutbox(db, "ob_", clock=clock, subscriptions={"t": ["h"]})
    await outbox.setup()
    await outbox.publish(Event(id="e", type="t"), session=None)
    [delivery] = await outbox.claim("w")
    await outbox.reschedule(delivery, delay=120)  # pending, but due only in 2 min
    async with client(app_of(db, clock)) as http:
        data = (await http.get("/api/overview")).json()
        overview = (await http.get("/")).text
        page = (await http.get("/tasks/jobs")).text
        clock.advance(75)
        later = (await http.get("/tasks/jobs")).text

    by_key = {p["key"]: p for p in data["primitives"]}
    assert by_key["tasks:jobs"]["counts"]["due"] == 40
    assert by_key["tasks:jobs"]["oldest_age"] == 0.0
    assert '<td data-age="tasks:jobs">&lt;1s</td>' in overview
    assert '<b data-age="tasks:jobs">&lt;1s</b>' in page
    assert '<b data-age="tasks:jobs">1m15s</b>' in later
    # Nothing of the outbox is due yet: no age at all, rather than a "0s" that says it waits.
    assert by_key["outbox:ob_"]["counts"]["pending"] == 1
    assert by_key["outbox:ob_"]["oldest_age"] is None
    assert '<td data-age="outbox:ob_">-</td>' in overview


async def test_metrics_serves_the_registered_primitives_stats_for_prometheus(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)
    async with client(app_of(db, clock)) as http:
        response = await http.get("/metrics")
        openmetrics = await http.get("/metrics", headers={"accept": OPENMETRICS})

    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.rstrip().endswith("# EOF")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    text = response.text
    assert 'mongoq_tasks{queue="emails",status="failed"} 2.0' in text
    assert 'mongoq_tasks_oldest_due_age_seconds{queue="emails"} 90.0' in text
    assert 'mongoq_group_dead_letters{queue="orders"} 1.0' in text
    assert 'mongoq_outbox_deliveries{queue="shop_",state="dead"} 1.0' in text
    for primitive, name in (("tasks", "emails"), ("groups", "orders"), ("outbox", "shop_")):
        assert f'mongoq_up{{primitive="{primitive}",queue="{name}"}} 1.0' in text


async def test_an_address_that_is_no_page_is_a_404_that_names_no_primitive(
    db: Any, clock: ManualClock
) -> None:
    async with client(app_of(db, clock)) as http:
        for path in ("/nothing/", "/metrics/", "/tasks/"):
            response = await http.get(path)
            assert response.status_code == 404, path
            assert "no such page" in response.text and "primitive" not in response.text


async def test_without_the_metrics_extra_metrics_is_a_plain_404(
    db: Any, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in sys.modules if n.split(".")[0] == "prometheus_client"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.delitem(sys.modules, "mongoq.metrics", raising=False)
    async with client(app_of(db, clock)) as http:
        response = await http.get("/metrics")

    assert response.status_code == 404
    assert response.headers["content-type"].startswith("text/plain")
    assert "'metrics' extra" in response.text and "primitive" not in response.text


def test_without_starlette_the_import_names_the_dashboard_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "starlette", None)
    monkeypatch.delitem(sys.modules, "mongoq.dashboard")

    with pytest.raises(
        MongoqError,
        match=r"mongoq\.dashboard needs the 'dashboard' extra: "
        r"pip install 'mongoq-queue\[dashboard\]' \(missing: starlette\)",
    ):
        importlib.import_module("mongoq.dashboard")
