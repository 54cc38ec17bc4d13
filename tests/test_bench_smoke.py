"""The benchmarks still run (they are no tests of speed: they print figures, and these checks assert only
that a tiny run completes with every message accounted for). Run as root, as the tests are, a bench that
starts ``mtaq serve`` on a spool in a 0700 temporary directory must let the daemon's mail_owner reach it:
start_time.py and compare_postfix.py did not (every probe was reset, found at stop 42)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*args: str, timeout_s: float = 120) -> dict:
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, timeout=timeout_s)
    assert 0 == r.returncode, r.stderr.decode(errors="replace")[-2000:]
    return json.loads(r.stdout.decode().strip().splitlines()[-1])


def test_start_time_gets_its_first_250(tmp_path):
    out = _bench("bench/start_time.py", "--queued", "0", "--runs", "1", "--no-cold")
    [res] = out["results"]
    assert 1 == len(res["first_250_s"])


def test_compare_postfix_runs_mtaq_and_the_sink_gets_every_message(tmp_path):
    out = _bench("bench/compare_postfix.py", "--only", "mtaq", "--messages", "100", "--sessions", "2", "--pairs", "1",
                 "--workdir", str(tmp_path))
    [run] = out["mtaq"]["runs"]
    assert (True, run["messages"]) == (out["ok"], run["sink_count"])


def test_deferred_idle_measures_a_restart_that_reads_no_queue(tmp_path):
    """The second start finds the checkpoint the first left: its recovery reads none of the 300 deferred."""
    out = _bench("bench/deferred_idle.py", "--queued", "300", "--idle-s", "1", "--restart", "--workers", "1")
    [res] = out["results"]
    assert [300] == [r["records"] for r in res["first"]["recovery"]]
    assert [0] == [r["records"] for r in res["restart"]["recovery"]]
    assert res["restart"]["rss_mib"] > 0
