"""Issue 32 item 5: what clients and remote servers wrote never becomes HTML or Markdown in the report.

A quoted local part such as ``"<script>alert(1)</script>"@evil.test`` is a valid address at MAIL and RCPT, and
a reply text is whatever the next hop sent; report.md carried both raw, so a CommonMark renderer ran the script.
Here report.md is rendered by a real CommonMark renderer (markdown-it-py, with GFM tables) and report.html is
parsed as a browser would: no element but the report's own, and each hostile string shown as its text.
"""

from __future__ import annotations

import datetime as dt
import smtplib
import subprocess
import sys
from html.parser import HTMLParser

import pytest

pytest.importorskip("markdown_it")
pytest.importorskip("matplotlib")

import markdown_it

from mtaq.analytics.report import write_report
from mtaq.analytics.tables import AGE_BUCKETS_MIN, Result, bucket_labels
from mtaq.testing.procs import read_events, start_daemon, start_sink, wait_for

SCRIPT_SENDER = '"<script>alert(1)</script>"@evil.test'
SCRIPT_RCPT = '"<script>alert(2)</script>"@evil.test'
HOSTILE = [
    SCRIPT_SENDER,
    "550 5.1.1 <img src=x onerror=alert(3)> | [click](javascript:alert(4)) ![i](http://evil.test/x.png) `code` "
    "*em* _u_ ~~s~~ &lt;script&gt; \\<b>",
    "a\x1bb\r\nc\u202ed <http://evil.test/auto> <!-- c --> <?php x ?>",
]
# The elements report.md's own Markdown makes (markdown-it: headings, paragraphs, emphasis, tables).
MD_TAGS = {"h1", "h2", "p", "em", "code", "table", "thead", "tbody", "tr", "th", "td"}
HTML_TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "table", "thead", "tbody", "tr",
             "th", "td", "div", "figure", "img", "figcaption", "em"}


class Elements(HTMLParser):
    """The start tags of a page (with their attributes), and its text, as a browser's parser sees them."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.other: list[str] = []
        self.text: list[str] = []
        self.feed(page)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, attrs))

    def handle_data(self, data):
        self.text.append(data)

    def handle_comment(self, data):
        self.other.append(f"<!--{data}-->")

    def handle_pi(self, data):
        self.other.append(f"<?{data}>")


def render_md(text: str) -> str:
    """CommonMark with GFM tables; raw HTML passed through, as CommonMark says (html=True)."""
    return markdown_it.MarkdownIt("commonmark", {"html": True}).enable("table").render(text)


def hostile_result() -> Result:
    ages = bucket_labels(AGE_BUCKETS_MIN, "m")
    t0 = dt.datetime(2025, 3, 1, 0, 0)
    tables = {
        "hourly": [], "daily": [], "domains": [], "delays": [], "attempts": [], "qshape": [], "problems": [],
        "segments": [],
        "senders": [{"sender": s, "sender_domain": "evil.test", "messages": 1, "bytes": 10} for s in HOSTILE],
        "sender_domains": [{"domain": s, "messages": 1, "bytes": 1} for s in HOSTILE],
        "recipients": [{"rcpt_address": s, "rcpt_domain": "evil.test", "delivered": 1, "bytes": 2} for s in HOSTILE],
        "reasons": [{"status": "bounced", "enhanced": "5.1.1", "relay": s, "count": 1, "recipients": 1,
                     "messages": 1, "example": s} for s in HOSTILE],
        "qshape_now": [{"domain": s, "recipients": 1, **{a: 0 for a in ages}} for s in HOSTILE],
        "unknown": [{"queue_id": "Q1", "rcpt_address": s, "generation": 1, "flagged_ts": t0, "last_reply": s}
                    for s in HOSTILE],
    }
    totals = {k: 0 for k in (
        "received", "delivered", "deferred", "bounced", "rejected", "deferrals", "expired", "dsn_generated",
        "bytes_received", "bytes_delivered", "senders", "sending_domains", "recipients", "recipient_domains",
        "delay_p50_s", "delay_p90_s", "delay_p99_s", "delay_mean_s", "delay_max_s", "outcome_unknown", "problems",
        "segments", "records", "bytes_read")}
    totals.update(since=None, until=None, rejected_note="rejected is 0: the log holds only accepted mail")
    return Result(totals, tables, 1.0)


def shown(s: str) -> str:
    """How a cell shows ``s``: line breaks as spaces, other controls escaped (mtaq.core.text)."""
    from mtaq.core.text import escape_text

    return escape_text(s.replace("\r\n", " ").replace("\n", " "))


def test_hostile_cells_render_as_their_text_in_report_md_and_report_html(tmp_path):
    """Every cell of every table, in both formats: a CommonMark renderer makes no element but the report's
    own (no script, img, a, HTML comment or processing instruction), and each hostile string is shown as
    exactly its text, pipes included, in each of the 10 cells it is in."""
    write_report(str(tmp_path), hostile_result(), top=10, plots=False)
    md = Elements(render_md((tmp_path / "report.md").read_text()))
    assert set() == {tag for tag, _ in md.tags} - MD_TAGS
    assert [] == md.other
    cells = [t for t in md.text if t.strip()]
    assert {s: 10 for s in map(shown, HOSTILE)} == {s: cells.count(s) for s in map(shown, HOSTILE)}
    page = Elements((tmp_path / "report.html").read_text())
    assert set() == {tag for tag, _ in page.tags} - HTML_TAGS
    assert [] == [a for tag, attrs in page.tags for a in attrs if a[0].startswith("on") or a[0] in ("href", "src")]
    assert [] == page.other
    texts = [t for t in page.text if t.strip()]
    assert {s: 10 for s in map(shown, HOSTILE)} == {s: texts.count(s) for s in map(shown, HOSTILE)}


@pytest.mark.timeout(300)
def test_a_script_sender_and_reply_through_the_daemon_and_mtaq_analyze(tmp_path):
    """End to end: a client sends from ``"<script>alert(1)</script>"@evil.test`` to
    ``"<script>alert(2)</script>"@evil.test``; the next hop (``mtaq sink``) refuses the recipient with a reply
    that quotes it; ``mtaq analyze`` reads the spool. report.md rendered as CommonMark has no script element,
    nor any element but the report's own, and shows the addresses and the reply as text."""
    pytest.importorskip("pyspark")
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"), extra=["--reject-rcpt", "script"])
    try:
        d = start_daemon(str(tmp_path / "spool"), sink.port, str(tmp_path / "daemon.log"))
        try:
            with smtplib.SMTP("127.0.0.1", d.port, timeout=30) as s:
                s.sendmail(SCRIPT_SENDER, [SCRIPT_RCPT], b"Subject: x\r\nMessage-ID: <x@t>\r\n\r\nhi\r\n")
            # Both bounces: the recipient's, and the DSN's to the sender (the sink refuses it too): with only
            # the first awaited, whether the DSN's was logged before the kill was a race.
            wait_for(lambda: len([e for e in read_events(d.log_path) if e.get("event") == "bounced"]) >= 2, 30,
                     "the bounce and the DSN's")
        finally:
            d.kill9()
    finally:
        sink.kill9()
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "mtaq.cli", "analyze", "--segments", str(tmp_path / "spool"), "--out",
                        str(out), "--master", "local[1]", "--no-plots", "--quiet"],
                       capture_output=True, text=True, timeout=280)
    assert 0 == p.returncode, p.stderr[-3000:]
    text = (out / "report.md").read_text()
    md = Elements(render_md(text))
    assert set() == {tag for tag, _ in md.tags} - MD_TAGS
    cells = [t for t in md.text if t.strip()]
    # the example of the reasons and of the bounce categories (one of the two refusals, each quoting its
    # address): the text, once in each table
    replies = [f"<{a}>: Recipient address rejected: User unknown" for a in (SCRIPT_RCPT, SCRIPT_SENDER)]
    assert (2, 2) == (cells.count(SCRIPT_SENDER), sum(cells.count(r) for r in replies))  # top senders: count, size
    page = Elements((out / "report.html").read_text())
    assert "script" not in {tag for tag, _ in page.tags}
