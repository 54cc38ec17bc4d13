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


def test_ab_steps_runs_both_trees_side_by_side_and_refuses_a_tree_it_would_not_import(tmp_path):
    """bench/ab_steps.py: a tiny A/B of the checkout against itself gives figures for both sides; a tree
    without an mtaq package of its own is refused before anything starts (exit 2), since its daemon would
    import another tree's code (stop 57: stop 56's A/Bs compared one tree with itself)."""
    out = _bench("bench/ab_steps.py", "--old", ROOT, "--new", ROOT, "--sessions", "40", "--rounds", "1")
    [rnd] = out["rounds"]
    assert {"old", "new"} == set(rnd) and all(rnd[s]["msg_per_s"] > 0 for s in ("old", "new"))
    r = subprocess.run([sys.executable, "bench/ab_steps.py", "--old", str(tmp_path), "--new", ROOT, "--sessions", "40"],
                       cwd=ROOT, capture_output=True, timeout=120)
    assert 2 == r.returncode and b"would import mtaq from" in r.stderr, r.stderr


def test_ab_source_gives_both_sides_figures_with_every_message_delivered_and_alternates_the_start(tmp_path):
    """bench/ab_source.py: two rounds of the checkout against itself under smtp-source; each side of each
    round reports its rates and CPU (every message delivered, or the script exits non-zero), the rounds start
the two sides in turn, and it refuses
    a tree it would not import, as ab_steps.py does."""
    out = _bench("bench/ab_source.py", "--old", ROOT, "--new", ROOT, "--workers", "1", "--sessions", "2",
                 "--messages", "60", "--rounds", "2", timeout_s=300)
    assert ["old", "new"] == [rnd["first"] for rnd in out["rounds"]]
    for rnd in out["rounds"]:
        assert all(rnd[s]["e2e_msg_per_s"] > 0 and rnd[s]["cpu_ms_per_msg"] > 0 for s in ("old", "new"))
    r = subprocess.run([sys.executable, "bench/ab_source.py", "--old", str(tmp_path), "--new", ROOT, "--rounds", "1"],
                       cwd=ROOT, capture_output=True, timeout=120)
    assert 2 == r.returncode and b"would import mtaq from" in r.stderr, r.stderr


def test_fsync_round_times_the_three_ways(tmp_path):
    out = _bench("bench/fsync_round.py", "--rounds", "20", "--runs", "1", "--dir", str(tmp_path))
    [run] = out["runs"]
    assert {"inline", "executor", "syncthread"} == set(run) and all(v > 0 for v in run.values())
