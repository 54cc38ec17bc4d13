"""The human report of ``mtaq analyze``: ``OUT/report.md`` (Markdown) and PNG plots (matplotlib, Agg).

Input is the :class:`mtaq.analytics.tables.Result` (small tables already collected); nothing here touches
Spark. Sections follow ``pflogsumm``'s order (grand totals, per-day and per-hour traffic, host/domain
summaries, senders and recipients, deferral and bounce detail), then what only the queue's own history
shows: time to deliver, attempts per message, queue shape over time, outcome-unknown recipients, and the
problems found in the segments. Times are UTC.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from mtaq.analytics.tables import AGE_BUCKETS_MIN, DELAY_BUCKETS_S, Result, bucket_labels

__all__ = ["markdown_table", "write_report"]


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}".rstrip("0").rstrip(".") if v != int(v) else str(int(v))
    if hasattr(v, "isoformat"):
        s = str(v.isoformat())
        return s.replace("T", " ").replace("+00:00", "")
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], limit: int | None = None) -> str:
    """A GitHub-flavoured Markdown table of ``rows`` (dicts) with ``columns``, at most ``limit`` rows."""
    if not rows:
        return "_none_\n"
    shown = rows if limit is None else rows[:limit]
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in shown]
    if limit is not None and len(rows) > limit:
        out.append(f"\n_{len(rows) - limit} more rows in the Parquet table_")
    return "\n".join(out) + "\n"


def _plots(out: str, result: Result) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[tuple[str, str]] = []
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
        fig.tight_layout()
        fig.savefig(os.path.join(out, "traffic_hourly.png"), dpi=90)
        plt.close(fig)
        made.append(("traffic_hourly.png", "Traffic per hour"))
    delays = t.get("delays") or []
    if delays:
        order = bucket_labels(DELAY_BUCKETS_S, "s")
        counts = {r["bucket"]: r["delivered"] for r in delays}
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.bar(order, [counts.get(b, 0) for b in order])
        ax.set_title("Time to deliver (delivered recipients)")
        ax.set_ylabel("recipients")
        fig.autofmt_xdate()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "time_to_deliver.png"), dpi=90)
        plt.close(fig)
        made.append(("time_to_deliver.png", "Time to deliver"))
    qshape = t.get("qshape") or []
    if qshape:
        fig, ax = plt.subplots(figsize=(10, 4))
        ax.plot([r["tick"] for r in qshape], [r["messages"] for r in qshape], marker="o")
        ax.set_title("Messages in the queue at each hour (UTC)")
        ax.set_ylabel("messages")
        fig.autofmt_xdate()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "queue_size.png"), dpi=90)
        plt.close(fig)
        made.append(("queue_size.png", "Queue size over time"))
    attempts = t.get("attempts") or []
    if attempts:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([str(r["attempts"]) for r in attempts], [r["messages"] for r in attempts])
        ax.set_title("Delivery attempts per message")
        ax.set_xlabel("attempts")
        ax.set_ylabel("messages")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "attempts.png"), dpi=90)
        plt.close(fig)
        made.append(("attempts.png", "Attempts per message"))
    return made


def write_report(out: str, result: Result, *, top: int = 20, plots: bool = True) -> str:
    """Write ``out/report.md`` (and the PNGs it links); return its path."""
    os.makedirs(out, exist_ok=True)
    tt, t = result.totals, result.tables
    made = _plots(out, result) if plots else []
    ages = bucket_labels(AGE_BUCKETS_MIN, "m")
    window = f"from {tt['since'] or 'the first record'} until {tt['until'] or 'the last record'} (UTC)"
    s: list[str] = [
        "# mtaq delivery report\n",
        f"Segments: {tt['segments']} files, {tt['records']} records, {tt['bytes_read']} bytes; window {window}.\n",
        "## Grand totals\n",
        markdown_table([
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
        ], ["", "count"]),
        f"\nNote: {tt['rejected_note']}\n",
        "\n## Time to deliver (seconds, delivered recipients)\n",
        markdown_table([{k: tt[f"delay_{k}_s"] for k in ("p50", "p90", "p99", "mean", "max")}],
                       ["p50", "p90", "p99", "mean", "max"]),
        "\n## Per-day traffic\n",
        markdown_table(t["daily"], ["day", "received", "delivered", "deferrals", "bounced", "bytes_received", "bytes_delivered"]),
        "\n## Per-hour traffic\n",
        markdown_table(t["hourly"], ["hour", "received", "delivered", "deferrals", "bounced", "bytes_received", "bytes_delivered"]),
        "\n## Recipient domains: delivery\n",
        markdown_table(t["domains"], ["domain", "delivered", "bytes_delivered", "deferrals", "deferred", "bounced",
                                      "delay_mean_s", "delay_max_s", "delay_p50_s", "delay_p90_s", "delay_p99_s"], top),
        "\n## Sender domains: messages received\n",
        markdown_table(t["sender_domains"], ["domain", "messages", "bytes"], top),
        f"\n## Top {top} senders by message count\n",
        markdown_table(t["senders"], ["sender", "messages", "bytes"], top),
        f"\n## Top {top} senders by size\n",
        markdown_table(sorted(t["senders"], key=lambda r: (-(r["bytes"] or 0), r["sender"])), ["sender", "messages", "bytes"], top),
        f"\n## Top {top} recipients by message count\n",
        markdown_table(t["recipients"], ["rcpt_address", "delivered", "bytes"], top),
        f"\n## Top {top} recipients by size\n",
        markdown_table(sorted(t["recipients"], key=lambda r: (-(r["bytes"] or 0), r["rcpt_address"])),
                       ["rcpt_address", "delivered", "bytes"], top),
        "\n## Deferral and bounce reasons (by enhanced status code and remote host)\n",
        markdown_table(t["reasons"], ["status", "enhanced", "relay", "count", "recipients", "messages", "example"], top),
        "\n## Attempts per message\n",
        markdown_table(t["attempts"], ["attempts", "messages"]),
        "\n## Queue shape over time (messages in the queue at each hour, by age)\n",
        markdown_table(t["qshape"], ["tick", "messages", "bytes", *ages], top * 5),
        "\n## Queue shape at the end of the window (recipients pending, by domain and age)\n",
        markdown_table(t["qshape_now"], ["domain", "recipients", *ages], top),
        "\n## Outcome unknown after a crash (delivered again: at-least-once)\n",
        markdown_table(t["unknown"], ["queue_id", "rcpt_address", "generation", "flagged_ts", "last_reply"], top * 5),
        "\n## Problems found in the segments\n",
        markdown_table(t["problems"], ["file", "segment", "offset", "problem_end", "problem_kind", "problem_reason"], top * 5),
    ]
    if made:
        s.append("\n## Plots\n")
        s += [f"![{title}]({name})\n" for name, title in made]
    s.append(f"\nGenerated in {result.seconds:.1f} s. Tables (Parquet): `tables/` next to this file.\n")
    path = os.path.join(out, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(s))
    return path
