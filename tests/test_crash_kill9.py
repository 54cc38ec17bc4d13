"""kill -9 of the real daemon while mail arrives loses no acknowledged message (bench/crash.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CRASH = Path(__file__).resolve().parents[1] / "bench" / "crash.py"


@pytest.mark.timeout(180)
def test_acknowledged_mail_survives_three_kill9_during_sending(tmp_path: Path) -> None:
    """600 messages over 10 sessions, the daemon SIGKILLed and restarted 3 times while they arrive.

    Every message that got 2xx after DATA is delivered to the sink (lost == 0), all 3 kills happened,
    some mail was acknowledged, and ``mtaq log verify`` passes on the spool afterwards. Duplicates and
    delivered-but-unacknowledged messages are allowed (in flight at a kill, or resent by the client).
    """
    keep = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(CRASH), "--messages", "600", "--kills", "3", "--concurrency", "10",
         "--seed", "1", "--drain-timeout", "60", "--keep", str(keep)],
        capture_output=True,
        text=True,
        timeout=170,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON line; exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    res = json.loads(lines[-1])
    detail = f"{res}\nstderr:\n{proc.stderr[-4000:]}"
    assert 0 == res["lost"], detail
    assert res["verify_ok"] is True, detail
    assert 3 == res["kills"], detail
    assert res["acknowledged"] > 0, detail
    assert 0 == proc.returncode, detail
