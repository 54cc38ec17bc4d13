"""The benchmarks still run (they are no tests of speed: they print figures, and these checks assert only
that a tiny run completes with every message accounted for). Run as root, as the tests are, a bench that
starts ``mtaq serve`` on a spool in a 0700 temporary directory must let the daemon's mail_owner reach it:
start_time.py and compare_postfix.py did not (every probe was reset, found at stop 42)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from milterkit import converse

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


def _noop_milter(mode: str) -> tuple[subprocess.Popen[str], str]:
    """bench/noop_milter.c, built by compare_postfix.py's noop_milter_binary, listening on a free port."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import compare_postfix
    finally:
        sys.path.pop(0)
    port = compare_postfix.free_port()
    proc = subprocess.Popen([compare_postfix.noop_milter_binary(), "--port", str(port), "--mode", mode],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    assert f"noop_milter: listening on 127.0.0.1:{port}\n" == proc.stdout.readline()
    return proc, f"inet:127.0.0.1:{port}"


def test_the_c_noop_milter_asks_for_every_stage_or_only_the_end_of_message_and_counts_at_sigterm():
    """bench/noop_milter.c (libmilter) negotiates as noop_milter.py does: in mode full no stage is left
    out, in mode eom every stage but the end of message (SMFIP_NOCONNECT .. SMFIP_NODATA); it accepts at
    the end of message and, on SIGTERM, prints the connections and messages it served."""
    skip_all_but_eom = 0x1 | 0x2 | 0x4 | 0x8 | 0x10 | 0x20 | 0x40 | 0x100 | 0x200
    filters = {mode: _noop_milter(mode) for mode in ("full", "eom")}
    seen = {}
    try:
        for mode, (_proc, address) in filters.items():
            out = [converse(address, headers=[("Subject", "x")], body=b"hello\r\n") for _ in range(2)]
            seen[mode] = [(o.stage, o.verdict[0], o.protocol & skip_all_but_eom) for o in out]
    finally:
        for proc, _address in filters.values():
            proc.terminate()  # both at once: libmilter notices the stop within 5 s (its listener's poll)
    for mode, (proc, _address) in filters.items():
        tail, _ = proc.communicate(timeout=30)
        seen[mode] = (seen.get(mode), tail, proc.returncode)
    assert {
        "full": ([("eom", "a", 0)] * 2, "noop_milter: connections=2 messages=2\n", 0),
        "eom": ([("eom", "a", skip_all_but_eom)] * 2, "noop_milter: connections=2 messages=2\n", 0),
    } == seen


def test_compare_postfix_puts_the_c_milter_in_front_and_it_sees_every_message(tmp_path):
    """--milter full (the C filter by default): every message the sink got went through the filter."""
    out = _bench("bench/compare_postfix.py", "--only", "mtaq", "--milter", "full", "--messages", "60", "--sessions",
                 "2", "--pairs", "1", "--workdir", str(tmp_path))
    [run] = out["mtaq"]["runs"]
    milter = out["milter"]
    assert (True, run["messages"], "c", run["messages"]) == (
        out["ok"], run["sink_count"], milter["impl"], milter["messages"])
