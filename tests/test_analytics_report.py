"""report.html looked at in a real headless browser (Debian's chromium): a screenshot that is not blank, and no
missing image (every <img> is an inline data: PNG that the browser decoded).

The report is rendered from a Result written here (the report takes the job's results as data), so no Spark
is needed. Skipped when chromium is not installed (``make debs`` installs it).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import subprocess

import pytest

pytest.importorskip("matplotlib")

from mtaq.analytics.report import write_report
from mtaq.analytics.tables import AGE_BUCKETS_MIN, DELAY_BUCKETS_S, Result, bucket_labels

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run"]
# Appended to a copy of the page: after load, count the images the browser could not decode.
CHECK = """<script>window.addEventListener('load', () => {
  const imgs = [...document.images];
  const bad = imgs.filter(i => !(i.complete && i.naturalWidth > 0 && i.src.startsWith('data:image/png;base64,')));
  const p = document.createElement('p'); p.id = 'imgcheck';
  p.textContent = 'images=' + imgs.length + ' broken=' + bad.length; document.body.appendChild(p);
});</script>"""


def result() -> Result:
    h0 = dt.datetime(2025, 3, 1, 0, 0)
    hours = [h0 + dt.timedelta(hours=i) for i in range(30)]
    ages = bucket_labels(AGE_BUCKETS_MIN, "m")
    tables = {
        "hourly": [{"hour": h, "received": 100 + i, "delivered": 120 + 2 * i, "deferrals": i % 7, "bounced": i % 3,
                    "bytes_received": 1000 * i, "bytes_delivered": 1100 * i} for i, h in enumerate(hours)],
        "daily": [{"day": dt.date(2025, 3, 1), "received": 2000, "delivered": 2500, "deferrals": 70, "bounced": 20,
                   "bytes_received": 10**6, "bytes_delivered": 2 * 10**6}],
        "domains": [{"domain": f"d{i}.example", "delivered": 100 - i, "bytes_delivered": 5000, "deferrals": i,
                     "deferred": i, "bounced": 1, "delay_mean_s": 1.5, "delay_max_s": 30.0, "delay_p50_s": 0.2,
                     "delay_p90_s": 2.0, "delay_p99_s": 20.0} for i in range(30)],
        "senders": [{"sender": f"s{i}@a.example", "sender_domain": "a.example", "messages": 50 - i, "bytes": 999 * i}
                    for i in range(30)],
        "sender_domains": [{"domain": "a.example", "messages": 900, "bytes": 10**6}],
        "recipients": [{"rcpt_address": f"u{i}@<b>.example", "rcpt_domain": "b.example", "delivered": 9, "bytes": 77}
                       for i in range(30)],
        "reasons": [{"status": "deferred", "enhanced": "4.2.0", "relay": "mx[192.0.2.25]:25", "count": 70,
                     "recipients": 60, "messages": 50, "example": "451 try later | <again>"}],
        "delays": [{"bucket": b, "delivered": 10 * (i + 1)} for i, b in enumerate(bucket_labels(DELAY_BUCKETS_S, "s"))],
        "attempts": [{"attempts": 1, "messages": 800}, {"attempts": 2, "messages": 100}, {"attempts": 4, "messages": 5}],
        "qshape": [{"tick": h, "messages": 10 + i, "bytes": 100 * i, **{a: i for a in ages}} for i, h in enumerate(hours)],
        "qshape_now": [{"domain": "z.example", "recipients": 3, **{a: 0 for a in ages}}],
        "unknown": [{"queue_id": "Q1", "rcpt_address": "x@w.example", "generation": 1, "flagged_ts": hours[3],
                     "last_reply": ""}],
        "problems": [],
        "segments": [],
    }
    totals = {
        "received": 2000, "delivered": 2500, "deferred": 60, "bounced": 20, "rejected": 0, "deferrals": 70,
        "expired": 2, "dsn_generated": 20, "bytes_received": 10**6, "bytes_delivered": 2 * 10**6, "senders": 30,
        "sending_domains": 1, "recipients": 30, "recipient_domains": 30, "delay_p50_s": 0.2, "delay_p90_s": 2.0,
        "delay_p99_s": 20.0, "delay_mean_s": 1.5, "delay_max_s": 30.0, "outcome_unknown": 1, "problems": 0,
        "segments": 3, "records": 10**6, "bytes_read": 143 * 10**6, "since": None, "until": None,
        "rejected_note": "rejected is 0: the log holds only accepted mail",
    }
    return Result(totals, tables, 12.5)


def test_report_html_is_one_self_contained_file(tmp_path):
    """Tables and every plot are in report.html itself: <img> sources are data: PNGs, nothing else is loaded."""
    write_report(str(tmp_path), result(), top=10)
    page = (tmp_path / "report.html").read_text()
    srcs = re.findall(r'<img[^>]* src="([^"]*)"', page)
    assert 4 == len(srcs)
    assert all(s.startswith("data:image/png;base64,") for s in srcs)
    assert not re.search(r'(?:href|src)="(?!data:)', page)
    assert "<td>u0@&lt;b&gt;.example</td>" in page  # escaped
    assert "20 more rows in the Parquet table" in page
    md = (tmp_path / "report.md").read_text()
    assert "| received | 2000 |" in md and "![Attempts per message](attempts.png)" in md


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make debs)")
def test_report_html_in_headless_chromium(tmp_path):
    """A 1200x2000 screenshot by headless chromium is a PNG with real content (not one flat colour), and in the
    rendered page every image decoded (naturalWidth > 0): no missing image."""
    from PIL import Image

    out = tmp_path / "out"
    write_report(str(out), result(), top=10)
    page = out / "report.html"
    shot = tmp_path / "shot.png"
    assert CHROMIUM is not None
    run = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile1'}", f"--screenshot={shot}",
                          "--window-size=1200,2000", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert 0 == run.returncode, run.stderr[-2000:]
    img = Image.open(shot)
    assert ("PNG", (1200, 2000)) == (img.format, img.size)
    colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # text, table rules and plots, not a blank page
    # Below the grand totals come the plots: drawn in colour (matplotlib's blue), not empty frames.
    rgb = img.convert("RGB")
    assert any(r < 80 and g > 90 and b > 150 for _n, (r, g, b) in colours)
    assert rgb.getpixel((0, 0)) == (255, 255, 255)

    checked = tmp_path / "checked.html"
    checked.write_text(page.read_text().replace("</body>", CHECK + "</body>"))
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile2'}", "--virtual-time-budget=5000",
                          "--dump-dom", checked.as_uri()], capture_output=True, text=True, timeout=120)
    assert 0 == dom.returncode, dom.stderr[-2000:]
    assert re.search(r'id="imgcheck">images=4 broken=0<', dom.stdout), dom.stdout[-1500:]
    assert os.path.getsize(shot) > 20_000
