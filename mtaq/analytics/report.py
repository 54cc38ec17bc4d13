"""The human report of ``mtaq analyze``: ``OUT/report.html`` (one self-contained page: tables and the plots
inline as base64 PNG), ``OUT/report.md`` (Markdown) and the PNG plots beside it (matplotlib, Agg).

Input is the :class:`mtaq.analytics.tables.Result` (small tables already collected); nothing here touches
Spark. Sections follow ``pflogsumm``'s order (grand totals, per-day and per-hour traffic, host/domain
summaries, senders and recipients, deferral and bounce detail), then what only the queue's own history
shows: time to deliver, attempts per message, queue shape over time, outcome-unknown recipients, and the
problems found in the segments. Times are UTC.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from typing import Any

from mtaq.analytics.tables import AGE_BUCKETS_MIN, DELAY_BUCKETS_S, Result, bucket_labels
from mtaq.core.text import escape_text

__all__ = ["html_table", "markdown_table", "markdown_text", "write_report"]


def _cell(v: Any) -> str:
    """A value as text: numbers short, times without ``T`` and ``+00:00``, line breaks as spaces, and every
    other control, format or line-separator character escaped (``\\x1b``, ``\\u202e``: mtaq.core.text)."""
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}".rstrip("0").rstrip(".") if v != int(v) else str(int(v))
    if hasattr(v, "isoformat"):
        s = str(v.isoformat())
        return s.replace("T", " ").replace("+00:00", "")
    return escape_text(str(v).replace("\r\n", " ").replace("\n", " "))


# What a Markdown cell must not carry raw (issue 32 item 5: a quoted local part such as
# "<script>alert(1)</script>"@evil.test is a valid address, and a reply text is the remote's): "<", ">" and "&"
# as character references, which every Markdown renderer passes to HTML as text (CommonMark §6.6 raw HTML,
# autolinks and entities all start with them); the table's "|"; and the other characters that start Markdown
# syntax ("\\", "`", "*", "_", "[", "]", "~", "!") backslash-escaped (CommonMark §2.4), so no cell makes a
# link, image, code span or emphasis.
_MD = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", "|": "\\|", **{c: "\\" + c for c in "\\`*_[]~!"}})


def markdown_text(text: str) -> str:
    """``text`` (any string: an address, a reply) safe in a Markdown table cell: it renders as exactly this
    text, never as HTML or Markdown syntax (see ``_MD``), on one line."""
    return _cell(text).translate(_MD)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], limit: int | None = None) -> str:
    """A GitHub-flavoured Markdown table of ``rows`` (dicts) with ``columns``, at most ``limit`` rows; every
    header and cell through :func:`markdown_text`."""
    if not rows:
        return "_none_\n"
    shown = rows if limit is None else rows[:limit]
    out = ["| " + " | ".join(markdown_text(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(_cell(r.get(c)).translate(_MD) for c in columns) + " |" for r in shown]
    if limit is not None and len(rows) > limit:
        out.append(f"\n_{len(rows) - limit} more rows in the Parquet table_")
    return "\n".join(out) + "\n"


def _figure_png(fig: Any) -> bytes:
    import io

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def _plots(result: Result) -> list[tuple[str, str, bytes]]:
    """The plots as (file name, title, PNG bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[tuple[str, str, bytes]] = []
    t = result.tables
    hourly = t.get("hourly") or []
    if hourly:
        fig, ax = plt.subplots(figsize=(10, 4))
        xs = [r["hour"] for r in hourly]
        for k in ("received", "delivered", "deferrals", "bounced"):
            ax.plot(xs, [r[k] for r in hourly], marker="o", label=k)
        ax.set_title("Traffic per hour (UTC)")
        ax.set_ylabel("count")
        ax.legend()
        fig.autofmt_xdate()
        made.append(("traffic_hourly.png", "Traffic per hour", _figure_png(fig)))
        plt.close(fig)
    delays = t.get("delays") or []
    if delays:
        order = bucket_labels(DELAY_BUCKETS_S, "s")
        counts = {r["bucket"]: r["delivered"] for r in delays}
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.bar(order, [counts.get(b, 0) for b in order])
        ax.set_title("Time to deliver (delivered recipients)")
        ax.set_ylabel("recipients")
        fig.autofmt_xdate()
        made.append(("time_to_deliver.png", "Time to deliver", _figure_png(fig)))
        plt.close(fig)
    qshape = t.get("qshape") or []
    if qshape:
        fig, ax = plt.subplots(figsize=(10, 4))
        ax.plot([r["tick"] for r in qshape], [r["messages"] for r in qshape], marker="o")
        ax.set_title("Messages in the queue at each hour (UTC)")
        ax.set_ylabel("messages")
        fig.autofmt_xdate()
        made.append(("queue_size.png", "Queue size over time", _figure_png(fig)))
        plt.close(fig)
    attempts = t.get("attempts") or []
    if attempts:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([str(r["attempts"]) for r in attempts], [r["messages"] for r in attempts])
        ax.set_title("Delivery attempts per message")
        ax.set_xlabel("attempts")
        ax.set_ylabel("messages")
        made.append(("attempts.png", "Attempts per message", _figure_png(fig)))
        plt.close(fig)
    return made


def _sections(result: Result, top: int) -> tuple[str, list[tuple[str, list[dict[str, Any]], list[str], int | None, str]]]:
    """The report's intro line and sections: (title, rows, columns, row limit, note after the table)."""
    tt, t = result.totals, result.tables
    ages = bucket_labels(AGE_BUCKETS_MIN, "m")
    window = f"from {tt['since'] or 'the first record'} until {tt['until'] or 'the last record'} (UTC)"
    intro = f"Segments: {tt['segments']} files, {tt['records']} records, {tt['bytes_read']} bytes; window {window}."
    grand = [
        {"": "received", "count": tt["received"]},
        {"": "delivered", "count": tt["delivered"]},
        {"": "deferred (recipients)", "count": tt["deferred"]},
        {"": "deferrals", "count": tt["deferrals"]},
        {"": "bounced", "count": tt["bounced"]},
        {"": "of which expired (4.4.7)", "count": tt["expired"]},
        {"": "rejected", "count": tt["rejected"]},
        {"": "DSNs generated", "count": tt["dsn_generated"]},
        {"": "bytes received", "count": tt["bytes_received"]},
        {"": "bytes delivered", "count": tt["bytes_delivered"]},
        {"": "senders", "count": tt["senders"]},
        {"": "sending domains", "count": tt["sending_domains"]},
        {"": "recipients", "count": tt["recipients"]},
        {"": "recipient domains", "count": tt["recipient_domains"]},
        {"": "outcome unknown after a crash", "count": tt["outcome_unknown"]},
        {"": "problems in the segments", "count": tt["problems"]},
    ]
    traffic = ["received", "delivered", "deferrals", "bounced", "bytes_received", "bytes_delivered"]
    return intro, [
        ("Grand totals", grand, ["", "count"], None, f"Note: {tt['rejected_note']}"),
        ("Time to deliver (seconds, delivered recipients)",
         [{k: tt[f"delay_{k}_s"] for k in ("p50", "p90", "p99", "mean", "max")}], ["p50", "p90", "p99", "mean", "max"],
         None, ""),
        ("Per-day traffic", t["daily"], ["day", *traffic], None, ""),
        ("Per-hour traffic", t["hourly"], ["hour", *traffic], None, ""),
        ("Recipient domains: delivery", t["domains"], ["domain", "delivered", "bytes_delivered", "deferrals", "deferred",
                                                       "bounced", "delay_mean_s", "delay_max_s", "delay_p50_s",
                                                       "delay_p90_s", "delay_p99_s"], top, ""),
        ("Sender domains: messages received", t["sender_domains"], ["domain", "messages", "bytes"], top, ""),
        (f"Top {top} senders by message count", t["senders"], ["sender", "messages", "bytes"], top, ""),
        (f"Top {top} senders by size", sorted(t["senders"], key=lambda r: (-(r["bytes"] or 0), r["sender"])),
         ["sender", "messages", "bytes"], top, ""),
        (f"Top {top} recipients by message count", t["recipients"], ["rcpt_address", "delivered", "bytes"], top, ""),
        (f"Top {top} recipients by size", sorted(t["recipients"], key=lambda r: (-(r["bytes"] or 0), r["rcpt_address"])),
         ["rcpt_address", "delivered", "bytes"], top, ""),
        ("Deferral and bounce reasons (by enhanced status code and remote host)", t["reasons"],
         ["status", "enhanced", "relay", "count", "recipients", "messages", "example"], top, ""),
        ("Bounces and deferrals by category", t.get("categories", []),
         ["status", "category", "count", "recipients", "messages", "example"], top, ""),
        ("Attempts per message", t["attempts"], ["attempts", "messages"], None, ""),
        ("Queue shape over time (messages in the queue at each hour, by age)", t["qshape"],
         ["tick", "messages", "bytes", *ages], top * 5, ""),
        ("Queue shape at the end of the window (recipients pending, by domain and age)", t["qshape_now"],
         ["domain", "recipients", *ages], top, ""),
        ("Outcome unknown after a crash (delivered again: at-least-once)", t["unknown"],
         ["queue_id", "rcpt_address", "generation", "flagged_ts", "last_reply"], top * 5, ""),
        ("Problems found in the segments", t["problems"],
         ["file", "segment", "offset", "problem_end", "problem_kind", "problem_reason"], top * 5, ""),
        *([] if "rejection_reasons" not in t else [
            (f"Rejections: top {top} reasons (from the event log)", t["rejection_reasons"],
             ["stage", "code", "enhanced", "reason", "count", "clients", "example"], top, ""),
            (f"Rejections: top {top} clients", t["rejection_clients"],
             ["client", "count", "connect", "mail", "rcpt", "data"], top, ""),
            ("Rejections per hour", t["rejection_hourly"], ["hour", "count", "connect", "mail", "rcpt", "data"],
             None, ""),
        ]),
    ]


def html_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], limit: int | None = None) -> str:
    """An HTML table of ``rows`` with ``columns`` (numbers right-aligned), at most ``limit`` rows."""
    if not rows:
        return "<p><em>none</em></p>\n"
    shown = rows if limit is None else rows[:limit]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for r in shown:
        cells = []
        for c in columns:
            v = r.get(c)
            num = isinstance(v, (int, float)) and not isinstance(v, bool)
            cells.append(f"<td class=\"n\">{html.escape(_cell(v))}</td>" if num else f"<td>{html.escape(_cell(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    more = (f"<p class=\"more\">{len(rows) - limit} more rows in the Parquet table</p>"
            if limit is not None and len(rows) > limit else "")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{more}\n"


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; margin-top: 1.8em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: .5em 0; } th, td { padding: 2px 8px; border: 1px solid #ddd; }
th { background: #f3f3f3; text-align: left; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
tr:nth-child(even) td { background: #fafafa; } .more, .note { color: #666; font-size: .9em; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; }
"""


def write_report(out: str, result: Result, *, top: int = 20, plots: bool = True) -> str:
    """Write ``out/report.md`` (linking PNG files next to it) and ``out/report.html`` (one self-contained
    file: the same tables, the plots inline as base64 PNG); return the path of report.md."""
    import base64

    os.makedirs(out, exist_ok=True)
    made = _plots(result) if plots else []
    for name, _title, png in made:
        with open(os.path.join(out, name), "wb") as f:
            f.write(png)
    intro, sections = _sections(result, top)
    footer = f"Generated in {result.seconds:.1f} s. Tables (Parquet): `tables/` next to this file."
    s: list[str] = ["# mtaq delivery report\n", markdown_text(intro) + "\n"]
    for title, rows, columns, limit, note in sections:
        s += [f"\n## {markdown_text(title)}\n", markdown_table(rows, columns, limit)]
        if note:
            s.append(f"\n{markdown_text(note)}\n")
    if made:
        s.append("\n## Plots\n")
        s += [f"![{title}]({name})\n" for name, title, _png in made]
    s.append(f"\n{footer}\n")
    path = os.path.join(out, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(s))
    h = ["<!DOCTYPE html>", "<html lang=\"en\"><head><meta charset=\"utf-8\">",
         "<title>mtaq delivery report</title>", f"<style>{_CSS}</style></head><body>",
         "<h1>mtaq delivery report</h1>", f"<p>{html.escape(_cell(intro))}</p>"]
    for i, (title, rows, columns, limit, note) in enumerate(sections):
        h += [f"<h2>{html.escape(title)}</h2>", html_table(rows, columns, limit)]
        if note:
            h.append(f"<p class=\"note\">{html.escape(_cell(note))}</p>")
        if i == 1 and made:  # the plots right after the grand totals and the time to deliver
            h.append("<h2>Plots</h2><div class=\"plots\">")
            for _name, ptitle, png in made:
                data = base64.b64encode(png).decode("ascii")
                h.append(f"<figure><img alt=\"{html.escape(ptitle)}\" src=\"data:image/png;base64,{data}\">"
                         f"<figcaption>{html.escape(ptitle)}</figcaption></figure>")
            h.append("</div>")
    h.append(f"<p class=\"note\">{html.escape(footer.replace('`', ''))}</p></body></html>")
    with open(os.path.join(out, "report.html"), "w", encoding="utf-8") as f:
        f.write("\n".join(h) + "\n")
    return path
