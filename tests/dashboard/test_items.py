"""The dashboard's item pages (one task, one group, one outbox delivery), the links to them
from every list, their 404 for an id that is not there, and what the database holds after an
action taken from one: through httpx against the ASGI app on a seeded database."""

from __future__ import annotations

from html import escape
from typing import Any

from mongoq.outbox import AsyncOutbox, Event
from mongoq.testing import ManualClock
from tests.support.dashboard_helpers import HOSTILE_ERROR, TOKEN, app_of, client, seed


def section(page: str, heading: str) -> str:
    return page.split(f"<h2>{heading}</h2>")[1].split("</section>")[0]


async def test_every_id_in_a_list_links_to_its_page(db: Any, clock: ManualClock) -> None:
    await seed(db, clock)
    async with client(app_of(db, clock)) as http:
        tasks = (await http.get("/tasks/emails")).text
        groups = (await http.get("/groups/orders")).text
        outbox = (await http.get("/outbox/shop_")).text

    assert 'href="/task/emails?id=bounce-2&amp;id_type=str">bounce-2</a>' in tasks
    assert 'href="/task/emails?id=7&amp;id_type=int">7</a>' in tasks  # an integer id stays one
    assert 'href="/task/emails?id=digest-3&amp;id_type=str">digest-3</a>' in tasks
    dead = section(groups, "Dead letters")
    assert 'href="/group/orders?id=o-1&amp;id_type=str">o-1</a>' in dead
    assert 'href="/group/orders?id=o-1&amp;id_type=str#seq-1">1</a>' in dead
    assert 'href="/group/orders?id=o-2&amp;id_type=str">o-2</a>' in groups  # parked
    assert 'href="/delivery/shop_?event_id=e1&amp;handler=stats">e1</a>' in outbox


async def test_a_task_page_shows_its_payload_result_error_attempts_and_timestamps(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)  # welcome-1 done 90 s ago, bounce-2 failed 90 s ago
    async with client(app_of(db, clock, allow_actions=True)) as http:
        done = await http.get("/task/emails?id=welcome-1&id_type=str")
        failed = await http.get("/task/emails?id=bounce-2&id_type=str")
        pending = await http.get("/task/emails?id=digest-3")  # id_type defaults to text
        integer = await http.get("/task/emails?id=7&id_type=int")

    assert done.status_code == 200
    assert "task welcome-1 of emails" in done.text
    assert "&quot;to&quot;: &quot;welcome-1@example.org&quot;" in section(done.text, "Payload")
    assert "&quot;sent&quot;: true" in section(done.text, "Result")
    history = section(done.text, "History")
    assert "put (created)" in history and "(1m30s ago)" in history
    assert "last changed (to done)" in history
    assert '<span class="status done">done</span>' in done.text
    assert "/confirm/" not in done.text  # nothing to do on a done task

    assert escape(HOSTILE_ERROR) in section(failed.text, "Error")
    assert "<script>alert" not in failed.text  # the stored error is shown, never run
    assert "<dt>attempts</dt><dd>1</dd>" in failed.text
    assert "/confirm/tasks/emails/requeue?id=bounce-2&amp;id_type=str" in failed.text
    assert "due at" in section(pending.text, "History")
    assert "/confirm/tasks/emails/cancel?id=digest-3&amp;id_type=str" in pending.text
    assert integer.status_code == 200 and "ValueError: no such template" in integer.text


async def test_an_id_that_is_not_there_is_a_404_page_that_says_so(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)
    async with client(app_of(db, clock)) as http:
        text_seven = await http.get("/task/emails?id=7&id_type=str")  # 7 is stored as an int
        task = await http.get("/task/emails?id=nowhere")
        group = await http.get("/group/orders?id=o-404")
        delivery = await http.get("/delivery/shop_?event_id=e1&handler=mailer")
        queue = await http.get("/task/elsewhere?id=bounce-2")
        bad = await http.get("/task/emails?id=x&id_type=int")
        missing = await http.get("/delivery/shop_?event_id=e1")

    assert text_seven.status_code == 404
    assert "task &#x27;7&#x27; was not found in task queue &#x27;emails&#x27;" in text_seven.text
    assert task.status_code == 404 and "task &#x27;nowhere&#x27; was not found" in task.text
    assert 'href="/tasks/emails"' in task.text  # the way back
    assert group.status_code == 404 and "group &#x27;o-404&#x27; was not found" in group.text
    assert delivery.status_code == 404
    assert "the delivery of event &#x27;e1&#x27; to &#x27;mailer&#x27; was not found" in (
        delivery.text
    )
    assert queue.status_code == 404 and "no task queue &#x27;elsewhere&#x27;" in queue.text
    assert bad.status_code == 400 and "id: must be a 64-bit integer" in bad.text
    assert missing.status_code == 400 and "handler: is required" in missing.text


async def test_a_group_page_shows_its_lease_its_messages_and_its_dead_letters(
    db: Any, clock: ManualClock
) -> None:
    seeded = await seed(db, clock)  # o-1: a dead letter; o-2: parked by a nack, 300 s
    transport = seeded.transport
    await transport.publish("o-1", {"order": 1, "again": True})
    clock.advance(300)  # o-2's retry is due: claimed below, after o-1 (never claimed since)
    held = [await transport.claim("worker-b"), await transport.claim("worker-b")]
    assert [lease.group_id for lease in held if lease] == ["o-1", "o-2"]
    await transport.publish("o-2", {"order": 2, "line": 2})
    async with client(app_of(db, clock, allow_actions=True)) as http:
        o2 = await http.get("/group/orders?id=o-2&id_type=str")
        o1 = await http.get("/group/orders?id=o-1&id_type=str")

    assert o2.status_code == 200
    assert "in flight: a consumer holds its lease" in o2.text
    assert "lease ends" in o2.text and "(in 30s)" in o2.text  # the default lease_ttl
    messages = section(o2.text, "Messages (the head first)")
    head, second = messages.split('<tr id="seq-')[1:]
    assert head.startswith("2") and "TimeoutError: payment service" in head
    assert "(in 30s)" in head  # the head is held until the lease ends
    assert "<td>2</td>" in head  # its second delivery
    assert "&quot;line&quot;: 2" in second and "<td>0</td>" in second
    assert "No dead letter of this group." in o2.text
    letters = section(o1.text, "Dead letters")
    assert '<tr id="seq-1">' in letters and "PermanentError: card declined" in letters
    assert "/confirm/groups/orders/redrive?seq=1" in letters
    assert "/confirm/groups/orders/redrive?group=o-1&amp;group_type=str" in letters
    assert "&quot;again&quot;: true" in section(o1.text, "Messages (the head first)")
    async with client(app_of(db, clock)) as http:
        await transport.publish("o-new", {"order": 3})
        fresh = await http.get("/group/orders?id=o-new")
    assert "ready: claimable now" in fresh.text
    assert "<dt>claimable since</dt><dd>its first message (never claimed)</dd>" in fresh.text


async def test_a_delivery_page_shows_its_attempts_its_error_its_event_and_its_siblings(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)  # e1 to stats: dead, "KeyError: 'amount'"
    outbox = AsyncOutbox(db, "shop_", clock=clock,
                         subscriptions={"order.paid": ["stats", "mailer"]})  # fmt: skip
    await outbox.publish(Event(id="e2", type="order.paid", key="c-7", payload={"total": 5},
                               headers={"source": "checkout"}), session=None)  # fmt: skip
    [stats] = await outbox.claim("w", handlers=["stats"])
    await outbox.reschedule(stats, delay=60, error="TimeoutError: upstream")
    async with client(app_of(db, clock, allow_actions=True)) as http:
        dead = await http.get("/delivery/shop_?event_id=e1&handler=stats")
        retried = await http.get("/delivery/shop_?event_id=e2&handler=stats")

    assert dead.status_code == 200
    assert '<span class="status dead">dead</span>' in dead.text
    assert "KeyError: &#x27;amount&#x27;" in section(dead.text, "Last error")
    assert "/confirm/outbox/shop_/requeue?event_id=e1&amp;handler=stats" in dead.text
    assert "<dt>type</dt><dd>order.paid</dd>" in section(dead.text, "Event")
    assert "<dt>attempts</dt><dd>1 ended</dd>" in retried.text
    assert "TimeoutError: upstream" in section(retried.text, "Last error")
    assert "<dt>due at</dt>" in retried.text and "(in 1m0s)" in retried.text
    event = section(retried.text, "Event")
    assert "&quot;total&quot;: 5" in event and "&quot;source&quot;: &quot;checkout&quot;" in event
    others = section(retried.text, "Other deliveries of this event")
    assert 'href="/delivery/shop_?event_id=e2&amp;handler=mailer">e2</a>' in others
    assert "/confirm/" not in retried.text  # pending: nothing to requeue


async def test_a_completed_delivery_shows_its_completion_record(
    db: Any, clock: ManualClock
) -> None:
    outbox = AsyncOutbox(db, "kept_", clock=clock, subscriptions={"t": ["h", "g"]},
                         completion_history=True)  # fmt: skip
    await outbox.setup()
    await outbox.publish(Event(id="e9", type="t", payload=[1, 2]), session=None)
    [delivery] = await outbox.claim("w", handlers=["h"])
    clock.advance(2)
    assert await outbox.complete(delivery)
    async with client(app_of(db, clock)) as http:
        page = await http.get("/delivery/kept_?event_id=e9&handler=h")

    assert page.status_code == 200
    assert '<span class="status completed">completed</span>' in page.text
    assert "<dt>completed</dt>" in page.text and "(0s ago)" in page.text
    assert "<dt>attempts</dt><dd>1 ended</dd>" in page.text
    assert 'handler=g">e9</a>' in section(page.text, "Other deliveries of this event")


async def test_a_requeue_from_a_task_page_changes_the_task(db: Any, clock: ManualClock) -> None:
    await seed(db, clock)
    async with client(app_of(db, clock, allow_actions=True)) as http:
        page = await http.get("/task/emails?id=7&id_type=int")
        confirm = page.text.split('<a class="action" href="')[1].split('"')[0]
        form = {"id": "7", "id_type": "int", "token": TOKEN}
        assert (await http.get(confirm.replace("&amp;", "&"))).status_code == 200
        done = await http.post("/actions/tasks/emails/requeue", data=form)
        after = await http.get("/task/emails?id=7&id_type=int")

    assert done.status_code == 303
    doc = await db["emails"].find_one({"_id": 7})
    assert (doc["status"], doc["attempts"]) == ("pending", 0)
    assert '<span class="status pending">pending</span>' in after.text


async def test_a_group_and_a_delivery_whose_documents_are_unreadable_are_shown_marked(
    db: Any, clock: ManualClock
) -> None:
    await seed(db, clock)
    await db["orders_locks"].update_one({"_id": "o-2"}, {"$set": {"priority": "high"}})
    await db["orders_messages"].update_many({"group_id": "o-2"}, {"$set": {"deliveries": "x"}})
    await db["shop_events"].update_one({"_id": "e1"}, {"$unset": {"type": ""}})
    async with client(app_of(db, clock)) as http:
        group = await http.get("/group/orders?id=o-2&id_type=str")
        delivery = await http.get("/delivery/shop_?event_id=e1&handler=stats")
        transport = await http.get("/groups/orders")

    assert (group.status_code, delivery.status_code, transport.status_code) == (200, 200, 200)
    assert "unreadable: field &#x27;priority&#x27; holds a string" in group.text
    assert "unreadable: field &#x27;deliveries&#x27; holds a string" in group.text
    assert (await db["shop_events"].find_one({"_id": "e1"}) or {}).get("type") is None
