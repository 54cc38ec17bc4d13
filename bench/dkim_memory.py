"""DKIM signing and memory (issue 32.6): the daemon's peak RSS growth while N sessions from mynetworks send
large messages at once, with DKIM signing on (a key for the From: domain) and off (no key).

For each mode: start ``mtaq serve`` (``mtaq.testing.procs.start_daemon``, a sink as the next hop), read its
peak RSS (``VmHWM`` in /proc/PID/status), send ``--messages`` messages of ``--size`` bytes at once from
127.0.0.1 (each its own session, held with ``HOLDFOR=3600`` so that no delivery reads them back), read the
peak RSS again. Prints ONE JSON line::

    {"messages": 20, "size": 9500000, "dkim_on_grown_mib": ..., "dkim_off_grown_mib": ..., "signed": 20}

Run from the project root::

    .venv/bin/python bench/dkim_memory.py --messages 20 --size 9500000
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import smtplib
import subprocess
import sys
import tempfile
from pathlib import Path

from mtaq.testing.procs import peak_rss_kib, start_daemon, start_sink


def _send(port: int, n: int, size: int) -> int:
    line = b"%07d " % n + b"L" * 68 + b"\r\n"
    msg = (b"From: a@example.org\r\nTo: r@example.net\r\nSubject: big %d\r\nMessage-ID: <big-%d@example.org>\r\n\r\n"
           % (n, n)) + line * (size // len(line))
    with smtplib.SMTP("127.0.0.1", port, timeout=300) as s:
        s.ehlo("client.test")
        s.mail("a@example.org", ["HOLDFOR=3600"])
        s.rcpt(f"r{n}@example.net")
        return s.data(msg)[0]


def run(work: Path, dkim: bool, messages: int, size: int) -> tuple[float, int]:
    """(peak RSS growth in MiB, messages queued with a DKIM-Signature)."""
    config = f"message_size_limit_bytes = {size + 1_000_000}\n"
    if dkim:
        key = work / "example.org.pem"
        subprocess.run([sys.executable, "-m", "mtaq.cli", "dkim", "keygen", "example.org", "s1", "--out", str(key)],
                       check=True, capture_output=True)
        config += f'[dkim_keys."example.org"]\nselector = "s1"\nkey_file = "{key}"\n'
    (work / "mtaq.toml").write_text(config)
    sink = start_sink(str(work / "maildir"), str(work / "sink.log"))
    daemon = start_daemon(str(work / "spool"), sink.port, str(work / "daemon.log"), config=str(work / "mtaq.toml"))
    try:
        before = peak_rss_kib(daemon.popen.pid) or 0
        with concurrent.futures.ThreadPoolExecutor(messages) as pool:
            codes = list(pool.map(lambda n: _send(daemon.port, n, size), range(messages)))
        assert codes == [250] * messages, codes
        after = peak_rss_kib(daemon.popen.pid) or 0
    finally:
        daemon.kill9()
        sink.kill9()
    signed = 0
    for seg in sorted((work / "spool").rglob("*.seg")):
        signed += seg.read_bytes().count(b"DKIM-Signature: v=1")
    return (after - before) / 1024, signed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=20)
    p.add_argument("--size", type=int, default=9_500_000)
    a = p.parse_args()
    out: dict[str, object] = {"messages": a.messages, "size": a.size}
    for dkim in (True, False):
        with tempfile.TemporaryDirectory(prefix="mtaq-dkim-mem-") as d:
            grown, signed = run(Path(d), dkim, a.messages, a.size)
        out[f"dkim_{'on' if dkim else 'off'}_grown_mib"] = round(grown, 1)
        if dkim:
            out["signed"] = signed
    print(json.dumps(out))


if __name__ == "__main__":
    main()
