"""The dashboard's HTML: the overview, one page per primitive (its counts and its failed
work), the confirmation page of an action, and the error page. Everything shown is escaped;
the pages load only the dashboard's own stylesheet and script (``/static``).

Owns no collections.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from mongoq._text import format_age, one_line
from mongoq.dashboard.readings import Summary

__all__ = ["TITLES", "confirm", "error", "link", "overview", "page", "primitive_page"]

#: The widest an error is shown in a table (the whole text is in the cell's title).
ERROR_WIDTH = 120
TITLES = {"tasks": "task queue", "groups": "group transport", "outbox": "outbox"}


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return escape(str(value))


def _since(now: datetime, then: datetime | None) -> str:
    return format_age(None if then is None else max(0.0, (now - then).total_seconds()))


def _error_cell(text: str | None) -> str:
    if not text:
        return "<td>-</td>"
    return f'<td class="error" title="{escape(text)}">{escape(one_line(text, ERROR_WIDTH))}</td>'


def link(primitive: str, name: str) -> str:
    return f"/{primitive}/{quote(name, safe='')}"


def _confirm_link(primitive: str, name: str, verb: str, label: str, **fields: Any) -> str:
    query = urlencode({k: str(v) for k, v in fields.items()})
    href = f"/confirm/{primitive}/{quote(name, safe='')}/{verb}?{query}"
    return f'<a class="action" href="{escape(href)}">{escape(label)}</a>'


def _id_fields(field: str, value: str | int) -> dict[str, Any]:
    """A stored 7 and "7" are different ids: the form says which."""
    return {field: value, f"{field}_type": "int" if isinstance(value, int) else "str"}


def _table(headers: Sequence[str], rows: Iterable[str], empty: str, css: str = "") -> str:
    body = "".join(rows)
    if not body:
        return f'<p class="empty">{escape(empty)}</p>'
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def page(title: str, body: str, *, database: str, actions: bool, note: str | None = None) -> str:
    mode = "actions enabled" if actions else "read-only"
    banner = f'<p class="note" role="status">{escape(note)}</p>' if note else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)} - mongoq</title>
<link rel="stylesheet" href="/static/dashboard.css"></head>
<body><header><a class="brand" href="/">mongoq</a>
<span class="database">database <b>{escape(database)}</b></span>
<span class="mode {"on" if actions else "off"}">{mode}</span></header>
<main>{banner}<h1>{escape(title)}</h1>{body}</main>
<script src="/static/dashboard.js"></script></body></html>"""


def _counts(summary: Summary) -> str:
    if summary.error is not None:
        return f'<span class="error">unreadable: {escape(summary.error)}</span>'
    return " ".join(
        f'<span class="count"><span class="label">{escape(label)}</span> '
        f'<b data-count="{escape(summary.key)}:{escape(label)}">{count}</b></span>'
        for label, count in summary.counts.items()
    )


def overview(summaries: Sequence[Summary]) -> str:
    rows = [
        f'<tr><td>{TITLES[s.primitive]}</td><td><a href="{link(s.primitive, s.name)}">'
        f"{escape(s.name)}</a></td><td>{_counts(s)}</td>"
        f'<td data-age="{escape(s.key)}">{format_age(s.oldest_age)}</td>'
        f'<td><svg class="chart" data-key="{escape(s.key)}" viewBox="0 0 240 48" '
        f'role="img" aria-label="backlog and throughput of {escape(s.name)}"></svg></td></tr>'
        for s in summaries
    ]
    legend = (
        '<p class="legend"><span class="backlog">backlog</span> '
        '<span class="rate">finished per minute</span> (sampled while this page\'s server '
        "runs)</p>"
    )
    return legend + _table(
        ["primitive", "name", "counts", "oldest waiting", "backlog and throughput"],
        rows, "No mongoq primitive is set up in this database: a primitive's setup() "
        "registers it.", "overview",
    )  # fmt: skip


def _summary_block(summary: Summary) -> str:
    age = format_age(summary.oldest_age)
    oldest = f'<span class="count">oldest waiting <b>{age}</b></span>'
    return f'<p class="counts">{_counts(summary)} {oldest}</p>'


def primitive_page(summary: Summary, sections: Sequence[tuple[str, str]]) -> str:
    """A primitive's page: its counts, then `sections` of (heading, HTML)."""
    parts = [_summary_block(summary)]
    parts += [f"<section><h2>{escape(title)}</h2>{html}</section>" for title, html in sections]
    return "".join(parts)


# ------------------------------------------------------------------------------ sections


def _task_rows(
    name: str, tasks: Sequence[Any], actions: bool, verb: str, label: str,
    cells: Callable[[Any], str], marked: bool = False,
) -> list[str]:  # fmt: skip
    """One row a task: its `cells`, then the link to `verb` it (with actions); `marked` rows
    carry the task's id (``data-task``)."""
    rows = []
    for task in tasks:
        act = _confirm_link("tasks", name, verb, label, **_id_fields("id", task.id))
        mark = f' data-task="{escape(str(task.id))}"' if marked else ""
        rows.append(f"<tr{mark}>{cells(task)}<td>{act if actions else ''}</td></tr>")
    return rows


def failed_tasks(name: str, tasks: Sequence[Any], now: datetime, actions: bool) -> str:
    rows = _task_rows(name, tasks, actions, "requeue", "Requeue", lambda task: (
        f"<td>{_text(task.id)}</td><td>{task.attempts}</td>"
        f"<td>{_since(now, task.updated_at)}</td>{_error_cell(task.error)}"
    ), marked=True)  # fmt: skip
    table = _table(["task", "attempts", "failed ago", "error", ""], rows, "No failed task.")
    if actions and tasks:
        table += _confirm_link("tasks", name, "requeue", "Requeue every failed task", all=1)
    return table


def open_tasks(name: str, tasks: Sequence[Any], now: datetime, actions: bool) -> str:
    rows = _task_rows(name, tasks, actions, "cancel", "Cancel", lambda task: (
        f"<td>{_text(task.id)}</td><td>{escape(task.status)}</td><td>{task.attempts}</td>"
        f"<td>{_since(now, task.updated_at)}</td><td>{_text(task.worker_id)}</td>"
    ))  # fmt: skip
    return _table(["task", "status", "attempts", "changed ago", "worker", ""], rows,
                  "No pending or running task.")  # fmt: skip


def purge_form(primitive: str, name: str, statuses: Sequence[str]) -> str:
    """A form that leads to the purge's confirmation page (nothing is deleted from here)."""
    href = f"/confirm/{primitive}/{quote(name, safe='')}/purge"
    select = ""
    if statuses:
        options = "".join(f"<option>{escape(s)}</option>" for s in statuses)
        select = f'<label>status <select name="status">{options}</select></label> '
    return (
        f'<form class="purge" method="get" action="{escape(href)}">{select}'
        '<label>older than <input name="older_than" value="7d" size="6"></label> '
        '<button type="submit">Purge...</button></form>'
    )


def dead_letters(name: str, letters: Sequence[Any], now: datetime, actions: bool) -> str:
    rows = []
    for letter in letters:
        act = _confirm_link("groups", name, "redrive", "Redrive", seq=letter.seq)
        rows.append(
            f"<tr><td>{letter.seq}</td><td>{_text(letter.group_id)}</td>"
            f"<td>{letter.deliveries}</td><td>{_since(now, letter.dead_at)}</td>"
            f"{_error_cell(letter.error)}<td>{act if actions else ''}</td></tr>"
        )
    table = _table(["seq", "group", "deliveries", "dead for", "error", ""], rows,
                   "No dead letter.")  # fmt: skip
    if actions and letters:
        table += _confirm_link("groups", name, "redrive", "Redrive every dead letter", all=1)
    return table


def parked_groups(groups: Sequence[Any]) -> str:
    rows = [
        f"<tr><td>{_text(g.group_id)}</td><td>{_text(g.available_at)}</td>"
        f"<td>{_text(g.head_seq)}</td><td>{format_age(g.head_age)}</td>"
        f"<td>{_text(g.head_deliveries)}</td>{_error_cell(g.head_error)}</tr>"
        for g in groups
    ]
    return _table(["group", "retried at", "head", "head age", "deliveries", "error"], rows,
                  "No parked group.")  # fmt: skip


def dead_deliveries(name: str, deliveries: Sequence[Any], now: datetime, actions: bool) -> str:
    rows = []
    for d in deliveries:
        act = _confirm_link("outbox", name, "requeue", "Requeue", event_id=d.event_id,
                            handler=d.handler)  # fmt: skip
        rows.append(
            f"<tr><td>{_text(d.event_id)}</td><td>{_text(d.event_type)}</td>"
            f"<td>{_text(d.handler)}</td><td>{d.attempts}</td><td>{_text(d.key)}</td>"
            f"<td>{_since(now, d.updated_at)}</td>{_error_cell(d.last_error)}"
            f"<td>{act if actions else ''}</td></tr>"
        )
    return _table(["event", "type", "handler", "attempts", "key", "dead for", "error", ""], rows,
                  "No dead delivery.")  # fmt: skip


# ---------------------------------------------------------------------- confirm, error


def confirm(primitive: str, name: str, verb: str, sentence: str, form: Mapping[str, str]) -> str:
    hidden = "".join(
        f'<input type="hidden" name="{escape(k)}" value="{escape(v)}">'
        for k, v in form.items()
        if k != "token"
    )
    action = f"/actions/{primitive}/{quote(name, safe='')}/{verb}"
    return f"""<p class="confirm">{escape(sentence)}</p>
<form method="post" action="{escape(action)}">{hidden}
<label>token <input type="password" name="token" autocomplete="off" required
 placeholder="printed when the dashboard started"></label>
<button type="submit" class="danger">Confirm</button>
<a href="{link(primitive, name)}">Back</a></form>"""


def error(message: str) -> str:
    return f'<p class="error">{escape(message)}</p><p><a href="/">Back to the overview</a></p>'
