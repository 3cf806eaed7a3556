"""The dashboard's HTTP side, through httpx against the ASGI app: what the pages and the JSON
show (read back from a seeded database), and that an action changes the database exactly
when it is allowed, carries the token and comes from the dashboard's own page."""

from __future__ import annotations

import logging
from datetime import timedelta
from html import escape
from typing import Any

import pytest

from mongoq import AsyncTaskQueue, InvalidInput, NewTask
from mongoq.dashboard import create_app
from mongoq.outbox import Event
from mongoq.registry import unregister
from mongoq.testing import ManualClock
from tests.support.dashboard_helpers import HOSTILE_ERROR, TOKEN, app_of, client, seed


async def task_status(db: Any, task_id: Any) -> str:
    doc = await db["emails"].find_one({"_id": task_id})
    assert doc is not None
    return str(doc["status"])


# ---------------------------------------------------------------------------------- pages


async def test_the_overview_shows_every_registered_primitive_with_its_counts(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)
    await db["not_mongoq"].insert_one({"_id": 1})  # a collection nobody registered
    async with client(app_of(db, clock)) as http:
        page = await http.get("/")
        data = (await http.get("/api/overview")).json()

    assert page.status_code == 200
    for name in ('href="/tasks/emails"', 'href="/groups/orders"', 'href="/outbox/shop_"'):
        assert name in page.text
    assert "not_mongoq" not in page.text
    by_key = {p["key"]: p for p in data["primitives"]}
    assert list(by_key) == ["tasks:emails", "groups:orders", "outbox:shop_"]
    tasks = by_key["tasks:emails"]
    assert tasks["counts"] | {} == {
        "pending": 1, "processing": 1, "done": 1, "failed": 2, "cancelled": 0, "tombstone": 0,
        "due": 1, "expired": 0,
    }  # fmt: skip
    assert (tasks["backlog"], tasks["oldest_age"]) == (1, 90.0)
    assert by_key["groups:orders"]["counts"]["dead"] == 1
    assert by_key["groups:orders"]["counts"]["parked"] == 1
    assert by_key["outbox:shop_"]["counts"]["dead"] == 1
    assert 'data-count="tasks:emails:failed">2<' in page.text


async def test_a_task_queues_page_lists_its_failed_tasks_with_their_error_escaped(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)
    async with client(app_of(db, clock, allow_actions=True)) as http:
        page = await http.get("/tasks/emails")

    assert page.status_code == 200
    failed = page.text.split("<h2>Failed tasks</h2>")[1].split("</section>")[0]
    assert "bounce-2" in failed and "ValueError: no such template" in failed
    assert "<script>alert" not in page.text  # the stored error is shown, never run
    assert escape(HOSTILE_ERROR) in failed
    assert "1m30s" in failed  # failed 90 s ago on the queue's clock
    assert "/confirm/tasks/emails/requeue?id=bounce-2&amp;id_type=str" in failed
    assert "/confirm/tasks/emails/requeue?id=7&amp;id_type=int" in failed  # an integer id
    running = page.text.split("<h2>Running and pending tasks</h2>")[1]
    assert "report-4" in running and "digest-3" in running and "welcome-1" not in running


async def test_the_due_tasks_of_a_function_no_running_worker_knows_are_shown_escaped(
    db: Any, clock: ManualClock
) -> None:
    seeded = await seed(db, clock)  # "digest-3" is a plain task, due
    hostile = "send_<b>emial</b>"
    for task_id in ("t-1", "t-2"):
        await seeded.queue.put(task_id, function=hostile)
    async with client(app_of(db, clock)) as http:
        quiet = await http.get("/tasks/emails")
    assert 'class="warning"' not in quiet.text  # no worker running: none to compare with

    await seeded.queue._presence.announce("w-1", ["send_email"], 60)
    async with client(app_of(db, clock)) as http:
        page = await http.get("/tasks/emails")
        overview = await http.get("/")
        data = (await http.get("/api/overview")).json()

    counts = page.text.split("<h2>")[0]  # above the sections: beside the counts
    assert f"waiting for unknown function <code>{escape(hostile)}</code>: <b>2</b>" in counts
    assert "waiting without a function (plain tasks: no Jobs worker runs them): <b>1</b>" in counts
    assert hostile not in page.text and hostile not in overview.text  # escaped, never markup
    row = overview.text.split('href="/tasks/emails"')[1].split("</tr>")[0]
    assert row.count('<span class="warning"') == 2 and escape(hostile) in row
    by_key = {p["key"]: p for p in data["primitives"]}
    assert by_key["tasks:emails"]["unknown_functions"] == {hostile: 2, "": 1}
    assert by_key["groups:orders"]["unknown_functions"] == {}


async def test_the_group_and_outbox_pages_show_dead_letters_parked_groups_and_dead_deliveries(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)
    async with client(app_of(db, clock, allow_actions=True)) as http:
        groups = await http.get("/groups/orders")
        outbox = await http.get("/outbox/shop_")

    dead = groups.text.split("<h2>Dead letters</h2>")[1].split("</section>")[0]
    assert "o-1" in dead and "PermanentError: card declined" in dead
    assert "/confirm/groups/orders/redrive?seq=" in dead
    parked = groups.text.split("<h2>Parked groups")[1]
    assert "o-2" in parked and "TimeoutError: payment service" in parked
    deliveries = outbox.text.split("<h2>Dead deliveries</h2>")[1]
    assert "e1" in deliveries and "KeyError: &#x27;amount&#x27;" in deliveries
    assert "/confirm/outbox/shop_/requeue?event_id=e1&amp;handler=stats" in deliveries


async def test_a_primitive_that_is_not_registered_has_no_page_and_no_actions(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)
    await unregister(db, "tasks", "emails")
    async with client(app_of(db, clock, allow_actions=True)) as http:
        assert (await http.get("/tasks/emails")).status_code == 404
        assert (await http.get("/tasks/nowhere")).status_code == 404
        assert (await http.get("/elsewhere/emails")).status_code == 404
        form = {"id": "bounce-2", "token": TOKEN}
        assert (await http.post("/actions/tasks/emails/requeue", data=form)).status_code == 404
    assert await task_status(db, "bounce-2") == "failed"


async def test_a_primitive_that_cannot_be_read_is_shown_with_its_error_beside_the_others(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    from mongoq.testing import FaultInjector, instrument

    await seed(db, clock)
    faults = FaultInjector()
    faults.fail_before("count_documents", collection="orders_locks", times=100)
    async with client(app_of(instrument(db, faults), clock)) as http:
        data = (await http.get("/api/overview")).json()

    by_key = {p["key"]: p for p in data["primitives"]}
    assert by_key["groups:orders"]["error"] and by_key["groups:orders"]["counts"] == {}
    assert by_key["tasks:emails"]["error"] is None
    assert by_key["tasks:emails"]["counts"]["failed"] == 2
    assert any("could not read groups 'orders'" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------ samples


async def test_the_chart_json_has_the_backlog_and_the_finished_per_minute_of_each_sample(
    db: Any, clock: ManualClock
) -> None:
    seeded = await seed(db, clock)
    app = app_of(db, clock)
    sampler = app.state.dashboard.sampler
    sampler.clock = clock
    await sampler.sample()
    clock.advance(1)  # finished after the first sample, not in its millisecond
    for n in range(6):
        await seeded.queue.put(f"new-{n}")
    for _ in range(7):  # digest-3 and the six new ones
        task = await seeded.queue.claim("w")
        assert task is not None
        await seeded.queue.complete(task)
    clock.advance(29)
    await sampler.sample()
    await seeded.queue.purge("done", 0)  # fewer finished tasks stored: the rate is unmoved
    clock.advance(30)
    await sampler.sample()
    async with client(app) as http:
        samples = (await http.get("/api/samples")).json()

    tasks = samples["series"]["tasks:emails"]
    assert [(p["backlog"], p["per_minute"]) for p in tasks] == [(1, None), (0, 14.0), (0, 0.0)]
    groups = samples["series"]["groups:orders"]
    assert [(p["backlog"], p["per_minute"]) for p in groups] == [(1, None)] * 3  # o-2 waits
    assert samples["interval"] == 10.0


# ----------------------------------------------------------------------------- actions


async def test_a_read_only_dashboard_offers_no_action_and_refuses_every_one(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)
    async with client(app_of(db, clock)) as http:
        page = await http.get("/tasks/emails")
        confirm = await http.get("/confirm/tasks/emails/requeue?id=bounce-2")
        post = await http.post("/actions/tasks/emails/requeue",
                               data={"id": "bounce-2", "token": TOKEN})  # fmt: skip

    assert "/confirm/" not in page.text and "read-only" in page.text
    assert confirm.status_code == 403 and post.status_code == 403
    assert await task_status(db, "bounce-2") == "failed"


async def test_an_action_without_the_token_or_with_a_wrong_one_changes_nothing(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    await seed(db, clock)
    caplog.set_level(logging.INFO, "mongoq.dashboard")
    async with client(app_of(db, clock, allow_actions=True)) as http:
        missing = await http.post("/actions/tasks/emails/requeue", data={"id": "bounce-2"})
        wrong = await http.post("/actions/tasks/emails/requeue",
                                data={"id": "bounce-2", "token": TOKEN[:-1] + "x"})  # fmt: skip
        bearer = await http.post("/actions/tasks/emails/requeue", data={"id": "bounce-2"},
                                 headers={"Authorization": "Bearer nope",
                                          "Accept": "application/json"})  # fmt: skip

    assert [r.status_code for r in (missing, wrong, bearer)] == [403, 403, 403]
    assert bearer.json() == {"error": "a missing or wrong token"}
    assert await task_status(db, "bounce-2") == "failed"
    refused = [r for r in caplog.records if getattr(r, "mongoq_outcome", None) == "refused"]
    assert len(refused) == 3 and all(r.mongoq_action == "requeue" for r in refused)


async def test_requeue_with_the_token_puts_the_failed_task_back_and_says_so(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    await seed(db, clock)
    caplog.set_level(logging.INFO, "mongoq.dashboard")
    async with client(app_of(db, clock, allow_actions=True)) as http:
        confirm = await http.get("/confirm/tasks/emails/requeue?id=bounce-2&id_type=str")
        form = {"id": "bounce-2", "id_type": "str", "token": TOKEN}
        done = await http.post("/actions/tasks/emails/requeue", data=form)
        after = await http.get(done.headers["location"])

    assert "Requeue failed task &#x27;bounce-2&#x27; of queue &#x27;emails&#x27;" in confirm.text
    assert 'name="token"' in confirm.text and 'method="post"' in confirm.text
    assert done.status_code == 303
    assert done.headers["location"] == "/tasks/emails?did=requeue&count=1"
    assert "Requeue: 1 changed." in after.text
    doc = await db["emails"].find_one({"_id": "bounce-2"})
    assert (doc["status"], doc["attempts"]) == ("pending", 0)
    assert await task_status(db, 7) == "failed"  # only the one asked for
    [logged] = [r for r in caplog.records if getattr(r, "mongoq_outcome", None) == "done"]
    assert (logged.mongoq_action, logged.mongoq_queue, logged.mongoq_count) == (
        "requeue", "emails", 1,
    )  # fmt: skip


async def test_a_script_acts_with_a_bearer_token_and_gets_json(db: Any, clock: ManualClock) -> None:
    await seed(db, clock)
    async with client(app_of(db, clock, allow_actions=True), accept="application/json",
                      authorization=f"Bearer {TOKEN}") as http:  # fmt: skip
        done = await http.post("/actions/tasks/emails/requeue", data={"all": "1"})

    assert done.json() == {"action": "requeue", "count": 2, "text": "requeued 2 failed task(s)"}
    assert [await task_status(db, t) for t in ("bounce-2", 7)] == ["pending", "pending"]


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": "https://evil.example"},
        {"origin": "null"},
        {"sec-fetch-site": "cross-site"},
        {"origin": "http://127.0.0.1:3000"},
    ],  # the same machine, another site: another port
)
async def test_an_action_from_another_site_is_refused_even_with_the_token(
    db: Any, clock: ManualClock, headers: dict[str, str]
) -> None:
    await seed(db, clock)
    async with client(app_of(db, clock, allow_actions=True)) as http:
        post = await http.post("/actions/tasks/emails/requeue", headers=headers,
                               data={"id": "bounce-2", "token": TOKEN})  # fmt: skip
        same = await http.post("/actions/tasks/emails/cancel",
                               headers={"origin": "http://127.0.0.1:8188",
                                        "sec-fetch-site": "same-origin"},
                               data={"id": "digest-3", "token": TOKEN})  # fmt: skip

    assert post.status_code == 403
    assert await task_status(db, "bounce-2") == "failed"
    assert same.status_code == 303  # the dashboard's own page may
    assert await task_status(db, "digest-3") == "cancelled"


async def test_a_request_for_another_host_name_is_refused_pages_included(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)
    async with client(app_of(db, clock, allow_actions=True)) as http:
        rebound = await http.get("/api/overview", headers={"host": "evil.example:8188"})
        post = await http.post("/actions/tasks/emails/requeue", headers={"host": "evil.example"},
                               data={"id": "bounce-2", "token": TOKEN})  # fmt: skip
        local = await http.get("/", headers={"host": "localhost:8188"})
        ipv6 = await http.get("/", headers={"host": "[::1]:8188"})

    assert (rebound.status_code, post.status_code) == (403, 403)
    assert rebound.json() == {"error": "this dashboard does not answer that host name"}
    assert rebound.headers["x-frame-options"] == "DENY"
    assert (local.status_code, ipv6.status_code) == (200, 200)
    assert await task_status(db, "bounce-2") == "failed"
    async with client(app_of(db, clock, allowed_hosts=["*"])) as http:
        assert (await http.get("/", headers={"host": "dash.internal"})).status_code == 200
    async with client(app_of(db, clock, allowed_hosts=["0:0:0:0:0:0:0:1"])) as http:
        assert (await http.get("/", headers={"host": "[::1]:8188"})).status_code == 200
        assert (await http.get("/", headers={"host": "[::1]x"})).status_code == 403


async def test_every_response_forbids_framing_and_foreign_content(
    db: Any, clock: ManualClock
) -> None:
    async with client(app_of(db, clock)) as http:
        for path in ("/", "/api/samples", "/static/dashboard.js", "/tasks/none"):
            response = await http.get(path)
            assert response.headers["x-frame-options"] == "DENY"
            policy = response.headers["content-security-policy"]
            assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
        assert (await http.get("/static/other.js")).status_code == 404


@pytest.mark.parametrize(
    ("path", "form", "field"),
    [
        ("/actions/tasks/emails/purge", {"status": "pending", "older_than": "1d"}, "status"),
        ("/actions/tasks/emails/purge", {"status": "done", "older_than": "soon"}, "older_than"),
        ("/actions/tasks/emails/requeue", {"id": "x", "id_type": "int"}, "id"),
        ("/actions/tasks/emails/cancel", {}, "id"),
        ("/actions/groups/orders/redrive", {"seq": "-1"}, "seq"),
        ("/actions/outbox/shop_/requeue", {"event_id": "e1"}, "handler"),
    ],
)
async def test_a_bad_field_is_refused_naming_it_before_anything_is_written(
    db: Any, clock: ManualClock, path: str, form: dict[str, str], field: str
) -> None:
    await seed(db, clock)
    before = {name: await db[name].find({}).to_list(None)
              for name in ("emails", "orders_dead", "shop_deliveries")}  # fmt: skip
    async with client(app_of(db, clock, allow_actions=True)) as http:
        post = await http.post(path, data={**form, "token": TOKEN})
        confirm = await http.get(path.replace("/actions/", "/confirm/"), params=form)

    assert post.status_code == 400 and confirm.status_code == 400
    assert f"{field}:" in post.text and f"{field}:" in confirm.text
    after = {name: await db[name].find({}).to_list(None) for name in before}
    assert after == before


async def test_cancel_purge_redrive_and_the_outbox_actions_change_the_database(
    db: Any, clock: ManualClock
) -> None:
    seeded = await seed(db, clock)
    async with client(app_of(db, clock, allow_actions=True)) as http:

        async def act(path: str, **form: str) -> None:
            response = await http.post(path, data={**form, "token": TOKEN})
            assert response.status_code == 303, response.text

        await act("/actions/tasks/emails/cancel", id="report-4")
        await act("/actions/tasks/emails/purge", status="done", older_than="60")
        [letter] = await seeded.transport.dead_letters()
        await act("/actions/groups/orders/redrive", seq=str(letter.seq))
        await act("/actions/outbox/shop_/requeue", event_id="e1", handler="stats")

    assert await task_status(db, "report-4") == "cancelled"
    assert await db["emails"].find_one({"_id": "welcome-1"}) is None  # done 90 s ago
    assert await db["orders_dead"].count_documents({}) == 0
    messages = await db["orders_messages"].find({"group_id": "o-1"}).to_list(None)
    assert [m["event"] for m in messages] == [{"order": 1}]
    [delivery] = await db["shop_deliveries"].find({"event_id": "e1"}).to_list(None)
    assert delivery.get("status", "pending") == "pending" and delivery["attempts"] == 0

    await seeded.outbox.bury((await seeded.outbox.claim("again"))[0], error="still broken")
    clock.advance(3600)
    async with client(app_of(db, clock, allow_actions=True)) as http:
        purge = await http.post("/actions/outbox/shop_/purge",
                                data={"older_than": "30m", "token": TOKEN})  # fmt: skip
    assert purge.status_code == 303
    assert await db["shop_deliveries"].count_documents({}) == 0


def test_create_app_refuses_bad_options_naming_them() -> None:
    from mongoq.testing import memory_database

    db = memory_database()
    for options, field in (
        ({"token": "short", "allow_actions": True}, "token"),
        ({"allow_actions": "yes"}, "allow_actions"),
        ({"sample_interval": 0}, "sample_interval"),
        ({"allowed_hosts": "localhost"}, "allowed_hosts"),
        ({"allowed_hosts": []}, "allowed_hosts"),
    ):
        with pytest.raises(InvalidInput) as error:
            create_app(db, **options)
        assert error.value.field == field
    assert len(create_app(db).state.dashboard.token) >= 16  # a fresh random one
    create_app(db, token="short")  # read-only: a token guards nothing, so none is checked


async def test_purges_delete_only_what_is_old_enough_and_in_the_status_asked(
    db: Any, clock: ManualClock
) -> None:
    seeded = await seed(db, clock)  # welcome-1 done and bounce-2, 7 failed 90 s ago
    await seeded.queue.put("young")
    task = await seeded.queue.claim("w")
    assert task is not None and task.id == "digest-3"
    await seeded.queue.complete(task)  # done now
    async with client(app_of(db, clock, allow_actions=True)) as http:
        form = {"status": "done", "older_than": "60", "token": TOKEN}
        done = await http.post("/actions/tasks/emails/purge", data=form)
    assert done.status_code == 303
    remaining = {doc["_id"] for doc in await db["emails"].find({}).to_list(None)}
    assert remaining == {"bounce-2", 7, "report-4", "digest-3", "young"}

    await seeded.outbox.publish([Event(id="e2", type="order.paid", key="k2")], session=None)
    [fresh] = await seeded.outbox.claim("w")
    await seeded.outbox.bury(fresh, error="now")  # dead now; e1 dead 90 s ago
    async with client(app_of(db, clock, allow_actions=True)) as http:
        purge = await http.post("/actions/outbox/shop_/purge",
                                data={"older_than": "1m", "token": TOKEN})  # fmt: skip
    assert purge.status_code == 303
    left = await db["shop_deliveries"].find({}).to_list(None)
    assert [d["event_id"] for d in left] == ["e2"]


async def test_a_redrive_of_one_dead_letter_leaves_the_others(db: Any, clock: ManualClock) -> None:
    seeded = await seed(db, clock)
    await seeded.transport.publish("o-3", {"order": 3})
    lease = await seeded.transport.claim("w")
    assert lease is not None and lease.group_id == "o-3"
    await seeded.transport.dead_letter(lease, "also declined")
    first, second = await seeded.transport.dead_letters()
    async with client(app_of(db, clock, allow_actions=True)) as http:
        response = await http.post("/actions/groups/orders/redrive",
                                   data={"seq": str(second.seq), "token": TOKEN})  # fmt: skip
    assert response.status_code == 303
    assert [d.seq for d in await seeded.transport.dead_letters()] == [first.seq]


async def test_ids_are_taken_as_sent_never_stripped(db: Any, clock: ManualClock) -> None:
    queue = AsyncTaskQueue(db, "emails", clock=clock)
    await queue.setup()
    await queue.put(" a")
    await queue.put("a")
    async with client(app_of(db, clock, allow_actions=True)) as http:
        page = await http.get("/tasks/emails")
        response = await http.post("/actions/tasks/emails/cancel",
                                   data={"id": " a", "token": TOKEN})  # fmt: skip
    assert "id=+a&amp;id_type=str" in page.text  # the link keeps the space
    assert response.status_code == 303
    assert (await task_status(db, " a"), await task_status(db, "a")) == ("cancelled", "pending")


async def test_a_name_with_a_slash_has_its_page_and_actions(db: Any, clock: ManualClock) -> None:
    queue = AsyncTaskQueue(db, "team/jobs", clock=clock, max_attempts=1)
    await queue.setup()
    await queue.put("j1")
    task = await queue.claim("w")
    assert task is not None
    await queue.fail(task, "broken")
    async with client(app_of(db, clock, allow_actions=True)) as http:
        overview = await http.get("/")
        page = await http.get("/tasks/team%2Fjobs")
        confirm = await http.get("/confirm/tasks/team%2Fjobs/requeue?id=j1")
        done = await http.post("/actions/tasks/team%2Fjobs/requeue",
                               data={"id": "j1", "token": TOKEN})  # fmt: skip
    assert 'href="/tasks/team%2Fjobs"' in overview.text
    assert page.status_code == 200 and "j1" in page.text
    assert (
        confirm.status_code == 200 and 'action="/actions/tasks/team%2Fjobs/requeue"' in confirm.text
    )
    assert done.status_code == 303 and done.headers["location"].startswith("/tasks/team%2Fjobs?")
    doc = await db["team/jobs"].find_one({"_id": "j1"})
    assert doc["status"] == "pending"


async def test_the_confirmation_page_escapes_what_the_link_carried(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)
    hostile = '"><script>alert(1)</script>'
    async with client(app_of(db, clock, allow_actions=True)) as http:
        page = await http.get("/confirm/tasks/emails/cancel", params={"id": hostile, "x": hostile})
    assert page.status_code == 200
    assert "<script>alert" not in page.text
    assert f'name="x" value="{escape(hostile)}"' in page.text


async def test_an_age_out_of_range_and_an_oversized_form_are_refused(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)
    async with client(app_of(db, clock, allow_actions=True)) as http:
        huge = await http.post("/actions/outbox/shop_/purge",
                               data={"older_than": "1000000d", "token": TOKEN})  # fmt: skip
        large = await http.post("/actions/tasks/emails/requeue",
                                data={"all": "1", "token": TOKEN, "pad": "x" * 20_000})  # fmt: skip
    assert huge.status_code == 400 and "older_than:" in huge.text
    assert large.status_code == 413
    assert await db["shop_deliveries"].count_documents({}) == 1
    assert await task_status(db, "bounce-2") == "failed"


async def test_a_registry_that_cannot_be_read_is_an_error_page_not_a_crash(
    db: Any, clock: ManualClock
) -> None:
    from mongoq.registry import REGISTRY
    from mongoq.testing import FaultInjector, instrument

    await seed(db, clock)
    faults = FaultInjector()
    faults.fail_before("find", collection=REGISTRY, times=100)
    async with client(app_of(instrument(db, faults), clock)) as http:
        page = await http.get("/")
        data = await http.get("/api/overview", headers={"accept": "application/json"})
        script = await http.get("/api/overview")  # what the page's script fetches
    assert page.status_code == 500 and "this page could not be read" in page.text
    assert "mongoq" in page.text  # the dashboard's own page, with its header
    assert "injected" not in page.text  # the detail is in the log, not on the page
    assert data.status_code == 500 and "could not be read" in data.json()["error"]
    assert script.status_code == 500 and "could not be read" in script.json()["error"]


def test_registrations_stay_hashable() -> None:
    from mongoq.registry import Registration

    found = Registration("outbox", "shop_", None, None, "1", {"completion_history": True})
    assert found in {found}


async def test_a_chunked_form_is_read_no_further_than_its_limit(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)
    sent: list[int] = []

    async def chunks() -> Any:
        yield f"all=1&token={TOKEN}&pad=".encode()
        for _ in range(1000):  # 64 MB, if it were all read
            sent.append(1)
            yield b"x" * 65536

    async with client(app_of(db, clock, allow_actions=True)) as http:
        large = await http.post("/actions/tasks/emails/requeue", content=chunks())
    assert large.status_code == 413
    assert len(sent) < 5  # stopped reading past 16 KiB
    assert await task_status(db, "bounce-2") == "failed"
    sent.clear()
    async with client(app_of(db, clock)) as http:  # read-only: refused before any reading
        refused = await http.post("/actions/tasks/emails/requeue", content=chunks())
    assert refused.status_code == 403 and len(sent) == 0


@pytest.mark.parametrize(
    ("path", "form", "field"),
    [
        ("/actions/groups/orders/redrive", {"seq": "²"}, "seq"),
        ("/actions/tasks/emails/requeue", {"id": "+7", "id_type": "int"}, "id"),
        ("/actions/tasks/emails/requeue", {"id": "7_0", "id_type": "int"}, "id"),
        ("/actions/tasks/emails/cancel", {"id": "9" * 19, "id_type": "int"}, "id"),
        ("/actions/groups/orders/redrive", {"seq": "9" * 19}, "seq"),
    ],
)
async def test_an_integer_is_digits_only(
    db: Any, clock: ManualClock, path: str, form: dict[str, str], field: str
) -> None:
    await seed(db, clock)
    async with client(app_of(db, clock, allow_actions=True)) as http:
        response = await http.post(path, data={**form, "token": TOKEN})
    assert response.status_code == 400 and f"{field}: must be" in response.text
    assert await task_status(db, 7) == "failed"


async def test_a_redrive_of_a_group_takes_every_batch_it_needs(
    db: Any, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mongoq.dashboard import actions

    seeded = await seed(db, clock)
    for n in range(3):
        await seeded.transport.publish("o-9", {"n": n})
    buried = 0
    for _ in range(6):  # a claim that meets o-1's emptied group drops it and returns None
        lease = await seeded.transport.claim("w")
        if lease is not None:
            assert lease.group_id == "o-9"
            buried += await seeded.transport.dead_letter(lease, "declined")
    assert buried == 3
    monkeypatch.setattr(actions, "REDRIVE_BATCH", 2)
    async with client(app_of(db, clock, allow_actions=True), accept="application/json") as http:
        group = await http.post("/actions/groups/orders/redrive",
                                data={"group": "o-9", "token": TOKEN})  # fmt: skip
        every = await http.post("/actions/groups/orders/redrive", data={"all": "1", "token": TOKEN})
    assert (group.json()["count"], every.json()["count"]) == (3, 1)  # then o-1's
    assert await db["orders_dead"].count_documents({}) == 0


async def test_after_an_action_the_overview_refresh_reads_afresh(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)
    app = app_of(db, clock, allow_actions=True)
    await app.state.dashboard.sampler.sample()
    async with client(app) as http:
        before = (await http.get("/api/overview")).json()
        await http.post("/actions/tasks/emails/requeue", data={"all": "1", "token": TOKEN})
        after = (await http.get("/api/overview")).json()
    assert before["primitives"][0]["counts"]["failed"] == 2
    assert after["primitives"][0]["counts"]["failed"] == 0


async def test_a_sample_in_the_millisecond_of_the_last_loses_nothing(
    db: Any, clock: ManualClock
) -> None:
    seeded = await seed(db, clock)
    sampler = app_of(db, clock).state.dashboard.sampler
    sampler.clock = clock
    await sampler.sample()
    await seeded.queue.put("one-more")
    for _ in range(2):  # finished in the very millisecond the sample read
        task = await seeded.queue.claim("w")
        assert task is not None
        await seeded.queue.complete(task)
    await sampler.sample()  # the clock has not moved: no window yet
    clock.advance(60)
    await sampler.sample()
    rates = [p["per_minute"] for p in sampler.series()["series"]["tasks:emails"]]
    assert rates == [None, None, 2.0]


async def test_a_finish_stamped_just_before_a_sample_is_counted_by_the_next(
    db: Any, clock: ManualClock
) -> None:
    """A worker whose clock lags the dashboard's (or whose write was on its way) stamps a
    finish before the sample that comes first: the window ends `WINDOW_LAG` behind."""
    await seed(db, clock)  # digest-3 was put 90 s ago: due on either clock
    behind = ManualClock(clock.now() - timedelta(seconds=1))
    worker = AsyncTaskQueue(db, "emails", clock=behind)
    sampler = app_of(db, clock).state.dashboard.sampler
    sampler.clock = clock
    await sampler.sample()
    await worker.put_many(NewTask(f"late-{n}") for n in range(4))
    for _ in range(5):  # digest-3 and the four new ones, stamped 1 s before the sample
        task = await worker.claim("w")
        assert task is not None
        await worker.complete(task)
    clock.advance(60)
    behind.advance(60)
    await sampler.sample()
    rates = [p["per_minute"] for p in sampler.series()["series"]["tasks:emails"]]
    assert rates == [None, 5.0]


async def test_a_task_no_worker_can_use_is_shown_marked_on_the_queue_and_task_pages(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)
    await db["emails"].update_one({"_id": "digest-3"}, {"$set": {"attempts": "x"}})
    async with client(app_of(db, clock)) as http:
        queue_page = await http.get("/tasks/emails")
        task_page = await http.get("/task/emails", params={"id": "digest-3"})
        overview = await http.get("/")

    assert (queue_page.status_code, task_page.status_code, overview.status_code) == (200,) * 3
    mark = "unreadable: field &#x27;attempts&#x27; holds a string (&#x27;x&#x27;)"
    assert mark in queue_page.text and mark in task_page.text


async def test_a_listing_without_payloads_reads_none_and_keeps_the_rest(
    db: Any, clock: ManualClock
) -> None:
    queue = AsyncTaskQueue(db, "big", clock=clock)
    await queue.setup()
    await queue.put("t1", {"blob": "x" * 100_000})

    page = await queue.list_tasks(payloads=False)

    (task,) = page.tasks
    assert (task.id, task.status, task.payload, task.unreadable) == ("t1", "pending", None, None)
    assert (await queue.list_tasks()).tasks[0].payload == {"blob": "x" * 100_000}
