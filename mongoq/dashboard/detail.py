"""The dashboard's item pages: one task (its payload, result, error, attempts and
timestamps), one group of a group transport (its state and lease, its messages, its dead
letters) and one delivery of an outbox (its document or completion record, its event, the
event's other deliveries), each with the actions that fit its state. Everything shown is
escaped; stored values are shown as JSON, cut at `MAX_SHOWN` characters.

Owns no collections.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from html import escape
from typing import Any

from mongoq._text import plain
from mongoq.dashboard.items import DeliveryView, GroupView
from mongoq.dashboard.pages import (
    ago,
    confirm_link,
    deliveries_table,
    delivery_link,
    error_cell,
    id_fields,
    link,
    show,
    table,
    unreadable_mark,
)
from mongoq.groups.models import NEVER_CLAIMED, DeadLetter
from mongoq.tasks import Task

__all__ = ["MAX_SHOWN", "as_json", "delivery_page", "group_page", "task_page"]

#: The most characters of one stored value (a payload, a result) a page shows.
MAX_SHOWN = 64 * 1024


def as_json(value: Any) -> str:
    """A stored value as indented JSON in a ``<pre>``, escaped, cut at `MAX_SHOWN`."""
    text = json.dumps(plain(value), indent=2, ensure_ascii=False)
    if len(text) > MAX_SHOWN:
        text = text[:MAX_SHOWN] + f"\n... ({len(text) - MAX_SHOWN} more characters not shown)"
    return f'<pre class="value">{escape(text)}</pre>'


def _fields(rows: Sequence[tuple[str, str]]) -> str:
    """A list of labelled values (already HTML)."""
    items = "".join(f"<dt>{escape(label)}</dt><dd>{value}</dd>" for label, value in rows)
    return f'<dl class="fields">{items}</dl>'


def _when(now: datetime, at: datetime | None, future: str = "in", past: str = "ago") -> str:
    """An instant and how far from `now` it is: ``2026-01-01 10:00:00Z (1m30s ago)``."""
    if at is None:
        return "-"
    if at > now:
        return f"{show(at)} ({future} {ago(at, now)})"
    return f"{show(at)} ({ago(now, at)} {past})"


def _section(title: str, html: str, anchor: str = "") -> str:
    ident = f' id="{escape(anchor)}"' if anchor else ""
    return f"<section{ident}><h2>{escape(title)}</h2>{html}</section>"


def _error_block(text: str | None, empty: str) -> str:
    if not text:
        return f'<p class="empty">{escape(empty)}</p>'
    return f'<pre class="value error">{escape(text)}</pre>'


def _back(primitive: str, name: str, label: str) -> str:
    return f'<p class="back"><a href="{link(primitive, name)}">Back to {escape(label)}</a></p>'


# ---------------------------------------------------------------------------------- tasks

#: What a task's ``lease_until`` means in each status.
_LEASE_MEANS = {"pending": "due at", "processing": "lease ends"}


def task_page(queue: str, task: Task, now: datetime, actions: bool) -> str:
    """One task: its state, its history as its document keeps it, its payload, result and
    error; requeue (failed) or cancel (pending, running) when actions are allowed."""
    status = f'<span class="status {escape(task.status)}">{escape(task.status)}</span>'
    state = _fields([
        ("status", status), ("attempts", str(task.attempts)), ("priority", str(task.priority)),
        ("revision", show(task.revision)), ("worker", show(task.worker_id)),
    ])  # fmt: skip
    history = [("put (created)", _when(now, task.created_at)),
               (f"last changed (to {task.status})", _when(now, task.updated_at))]  # fmt: skip
    means = _LEASE_MEANS.get(task.status)
    if means is not None:
        history.append((means, _when(now, task.lease_until)))
    kept = ('<p class="hint">A task keeps its latest state: the attempts count its claims, the '
            "error is the last one recorded (kept after a retry or a requeue).</p>")  # fmt: skip
    act = ""
    if actions and task.status == "failed":
        act = confirm_link("tasks", queue, "requeue", "Requeue", **id_fields("id", task.id))
    elif actions and task.status in ("pending", "processing"):
        act = confirm_link("tasks", queue, "cancel", "Cancel", **id_fields("id", task.id))
    return "".join([
        state, f'<p class="item-actions">{act}</p>' if act else "",
        f"<p>{unreadable_mark(task.unreadable)}</p>" if task.unreadable else "",
        _section("History", _fields(history) + kept),
        _section("Payload", as_json(task.payload)),
        _section("Result", as_json(task.result) if task.status == "done" or task.result
                 is not None else '<p class="empty">No result (the task is not done).</p>'),
        _section("Error", _error_block(task.error, "No error recorded.")),
        _back("tasks", queue, f"task queue {queue}"),
    ])  # fmt: skip


# --------------------------------------------------------------------------------- groups

_STATES = {
    "ready": "ready: claimable now",
    "in_flight": "in flight: a consumer holds its lease",
    "parked": "parked: waiting out a retry delay",
}


def group_page(prefix: str, view: GroupView, actions: bool) -> str:
    """One group: its state and lease, its messages (the head first) and its dead letters."""
    now = view.now
    state = _STATES.get(view.state or "", "no message waits (no lock)")
    when = {"in_flight": "lease ends", "parked": "retried at"}.get(view.state or "",
                                                                 "claimable since")  # fmt: skip
    rows = [("state", escape(state)), ("priority", show(view.priority))]
    if view.available_at is not None and view.state is not None:
        never = view.available_at <= NEVER_CLAIMED  # the epoch: it sorts first
        rows.append((when, "its first message (never claimed)" if never
                     else _when(now, view.available_at)))  # fmt: skip
    if view.unreadable is not None:
        rows.append(("lock", unreadable_mark(view.unreadable)))
    messages = [
        f'<tr id="seq-{escape(str(m.seq))}"><td>{show(m.seq)}{unreadable_mark(m.unreadable)}</td>'
        f"<td>{_when(now, m.published_at)}</td><td>{m.deliveries}</td>"
        f"<td>{_when(now, m.held_until) if m.held_until else '-'}</td>"
        f"{error_cell(m.last_error)}<td>{_inline(m.event)}</td></tr>"
        for m in view.messages
    ]
    more = ('<p class="hint">More messages wait than are shown here (the oldest first).</p>'
            if view.more else "")  # fmt: skip
    return "".join([
        _fields(rows),
        _section("Messages (the head first)", table(
            ["seq", "published", "deliveries", "held until", "last error", "event"], messages,
            "No message of this group waits.") + more),
        _section("Dead letters", _letters(prefix, view.group_id, view.dead, now, actions)),
        _back("groups", prefix, f"group transport {prefix}"),
    ])  # fmt: skip


def _inline(value: Any) -> str:
    """A stored value on one line of a table (the whole of it in the cell's title)."""
    text = json.dumps(plain(value), ensure_ascii=False)
    short = text if len(text) <= 80 else text[:77] + "..."
    return f'<code title="{escape(text[:MAX_SHOWN])}">{escape(short)}</code>'


def _letters(
    prefix: str, group_id: Any, letters: Sequence[DeadLetter], now: datetime, actions: bool
) -> str:
    rows = [
        f'<tr id="seq-{d.seq}"><td>{d.seq}</td><td>{d.deliveries}</td>'
        f"<td>{_when(now, d.published_at)}</td><td>{ago(now, d.dead_at)}</td>"
        f"{error_cell(d.error)}<td>{_inline(d.event)}</td><td>"
        f"{confirm_link('groups', prefix, 'redrive', 'Redrive', seq=d.seq) if actions else ''}"
        "</td></tr>"
        for d in letters
    ]
    shown = table(["seq", "deliveries", "published", "dead for", "error", "event", ""], rows,
                  "No dead letter of this group.")  # fmt: skip
    if actions and letters:
        shown += confirm_link("groups", prefix, "redrive", "Redrive this group's dead letters",
                              **id_fields("group", group_id))  # fmt: skip
    return shown


# --------------------------------------------------------------------------------- outbox


def delivery_page(prefix: str, view: DeliveryView, actions: bool) -> str:
    """One delivery: its state and attempts, its last error, its event, and the event's
    deliveries to other handlers; requeue when it is dead and actions are allowed."""
    now, d = view.now, view.delivery
    rows = [("handler", show(view.handler))]
    if d is None:
        rows.append(("status", "finished (no completion record is kept: completion_history "
                               "is off)"))  # fmt: skip
    else:
        status = "pending, waiting for its key" if d.status == "parked" else d.status
        rows += [
            ("status", f'<span class="status {escape(d.status)}">{escape(status)}</span>'),
            ("attempts", f"{d.attempts} ended"), ("key", show(d.key)),
            ("sequence", show(d.sequence)), ("created", _when(now, d.created_at)),
            ("completed" if d.status == "completed" else "last changed",
             _when(now, d.updated_at)),
        ]  # fmt: skip
        if d.due_at is not None:
            rows.append(("due at", _when(now, d.due_at)))
    act = ""
    if actions and d is not None and d.status == "dead":
        act = confirm_link("outbox", prefix, "requeue", "Requeue", event_id=view.event_id,
                           handler=view.handler)  # fmt: skip
    others = deliveries_table(prefix, view.others, now, actions,
                              "No other handler has a delivery of this event.")  # fmt: skip
    return "".join([
        _fields(rows), f'<p class="item-actions">{act}</p>' if act else "",
        _section("Last error", _error_block(None if d is None else d.last_error,
                                            "No error recorded.")),
        _section("Event", _event(prefix, view, now)),
        _section("Other deliveries of this event", others),
        _back("outbox", prefix, f"outbox {prefix}"),
    ])  # fmt: skip


def _event(prefix: str, view: DeliveryView, now: datetime) -> str:
    if view.event is None:
        return '<p class="empty">The event is no longer stored (purged).</p>'
    event, stored = view.event.event, view.event
    rows = [
        ("id", show(event.id)), ("type", show(event.type)), ("key", show(event.key)),
        ("created", _when(now, event.created_at)),
        ("correlation id", show(event.correlation_id)),
        ("causation id", show(event.causation_id)),
        ("finished for", ", ".join(
            f'<a href="{escape(delivery_link(prefix, event.id, h))}">{escape(h)}</a>'
            for h in stored.finished) or "-"),
    ]  # fmt: skip
    if stored.completed_at is not None:
        rows.append(("every delivery completed", _when(now, stored.completed_at)))
    headers = as_json(event.headers) if event.headers else '<p class="empty">No headers.</p>'
    payload = as_json(event.payload)
    return f"{_fields(rows)}<h3>Payload</h3>{payload}<h3>Headers</h3>{headers}"
