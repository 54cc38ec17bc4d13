"""``mtaq sendmail`` and the maildrop (issue 33.2): sendmail(1) options, exit codes, delivery with the daemon up
and down, the pick-up's kill points, and damaged maildrop files.

Real processes: ``mtaq sendmail`` fed on stdin, ``mtaq serve`` and ``mtaq sink`` (mtaq.testing.procs).
"""

from __future__ import annotations

import email.parser
import email.policy
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from mtaq.testing.procs import read_events, start_daemon, start_sink, wait_for

PY = sys.executable


def sendmail(cfg: Path, *args: str, stdin: bytes = b"", prefix: tuple[str, ...] = (), env: dict[str, str] | None = None,
             argv0: list[str] | None = None) -> subprocess.CompletedProcess[bytes]:
    cmd = argv0 if argv0 is not None else [PY, "-m", "mtaq.cli", "sendmail"]
    return subprocess.run([*prefix, *cmd, "-C", str(cfg), *args], input=stdin, capture_output=True, timeout=60,
                          env={**os.environ, **(env or {})}, check=False)


class Host:
    """A sink, a config file, a spool; the daemon started on demand."""

    def __init__(self, tmp: Path, extra: str = "") -> None:
        self.tmp = tmp
        self.spool = tmp / "spool"
        self.maildir = str(tmp / "maildir")
        self.sink = start_sink(self.maildir, str(tmp / "sink.log"), extra=["--defer-rcpt", "^later@", "--defer-count", "1"])
        self.cfg = tmp / "mtaq.toml"
        self.cfg.write_text(f'spool_dir = "{self.spool}"\nmyhostname = "host.test"\ncheckpoint_interval_s = 0.5\n'
                            f'relayhost = "[127.0.0.1]:{self.sink.port}"\n' + extra)
        self.log = str(tmp / "daemon.log")
        self.daemon: Any = None
        self.port: int | None = None

    def start(self, env: dict[str, str] | None = None, **kw: Any) -> None:
        self.daemon = start_daemon(str(self.spool), self.sink.port, self.log, config=str(self.cfg), env=env,
                                   port=self.port, **kw)
        self.port = self.daemon.port

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in read_events(self.log) if e.get("event") == name]

    def messages(self) -> list[Any]:
        parser = email.parser.BytesParser(policy=email.policy.compat32)
        out = []
        for sub in ("new", "cur"):
            d = os.path.join(self.maildir, sub)
            if os.path.isdir(d):
                for n in sorted(os.listdir(d)):
                    with open(os.path.join(d, n), "rb") as f:
                        out.append(parser.parse(f))
        return out

    def wait_messages(self, n: int, timeout_s: float = 30.0) -> list[Any]:
        return wait_for(lambda: (m := self.messages()) and len(m) >= n and m, timeout_s, f"{n} messages in the sink")

    def maildrop(self) -> list[str]:
        d = self.spool / "maildrop"
        return sorted(os.listdir(d)) if d.is_dir() else []

    def close(self) -> None:
        if self.daemon is not None and self.daemon.popen.poll() is None:
            self.daemon.kill9()
        self.sink.kill9()


@pytest.fixture
def host(tmp_path: Path):
    made: list[Host] = []
    # Under /tmp, mode 0755: a local user (nobody) reaches the config file and the spool, as on a host.
    base = Path(tempfile.mkdtemp(prefix="mtaq-sendmail-", dir="/tmp"))
    os.chmod(base, 0o755)

    def make(extra: str = "") -> Host:
        h = Host(base, extra)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()
    shutil.rmtree(base, ignore_errors=True)


MSG = b"To: Ann <ann@example.net>, bob@example.net\nCc: cid@example.net\nBcc: dan@example.net\nSubject: t\n\nhello\n"


def test_sendmail_t_delivers_through_the_running_daemon_without_bcc(host) -> None:
    """``sendmail -t``: recipients from To/Cc/Bcc, the Bcc: field removed, From/Date/Message-ID added, and one
    ``Received: (from root@localhost) by host.test (mtaq) id QID`` line naming the invoking user."""
    h = host()
    h.start()
    r = sendmail(h.cfg, "-t", stdin=MSG)
    assert (0, b"") == (r.returncode, r.stderr)
    [m] = h.wait_messages(1)
    assert ["ann@example.net", "bob@example.net", "cid@example.net", "dan@example.net"] == sorted(m.get_all("Delivered-To"))
    assert m["Bcc"] is None
    assert "<root@host.test>" == m["Return-Path"]
    assert m["Date"] and m["Message-ID"] and "root@host.test" in m["From"]
    [picked] = h.events("picked_up")
    received = m.get_all("Received")[0].replace("\r\n", "").replace("\n", "")
    assert received.startswith(f"(from root@localhost)\tby host.test (mtaq) id {picked['queue_id']}; ")
    assert [] == h.maildrop()


def wait_for_maildrop(h) -> None:
    """Wait until the daemon has made SPOOL/maildrop with its mode 1733 (set just after the directory is
    made: waiting for the directory alone races the chmod, seen in a clean-clone run)."""
    md = h.spool / "maildrop"
    wait_for(lambda: md.is_dir() and 0o1733 == md.stat().st_mode & 0o7777, 10, "the maildrop made by the daemon, mode 1733")


def test_sendmail_with_the_daemon_down_is_delivered_after_its_start(host) -> None:
    """With no daemon the message waits, durably, in SPOOL/maildrop (exit 0); the daemon's start picks it up."""
    h = host()
    r = sendmail(h.cfg, "-f", "sender@example.org", "-F", "Sam Sender", "rcpt@example.net",
                 stdin=b"Subject: down\n\nwhile down\n")
    assert (0, b"") == (r.returncode, r.stderr)
    [name] = h.maildrop()
    assert 0o1733 == (h.spool / "maildrop").stat().st_mode & 0o7777
    h.start()
    [m] = h.wait_messages(1)
    assert "<sender@example.org>" == m["Return-Path"]
    assert '"Sam Sender" <sender@example.org>' == m["From"] or "Sam Sender <sender@example.org>" == m["From"]
    assert "while down\n" == m.get_payload().replace("\r\n", "\n")
    assert [name] == [e["maildrop"] for e in h.events("picked_up")]
    wait_for(lambda: h.maildrop() == [], 10, "the maildrop emptied")


def test_a_lone_dot_ends_the_message_unless_i(host) -> None:
    """Without -i a line with a lone '.' ends the input (sendmail(1)); with -i or -oi it is message text."""
    h = host()
    h.start()
    assert 0 == sendmail(h.cfg, "x@example.net", stdin=b"Subject: a\n\nfirst\n.\nlost\n").returncode
    assert 0 == sendmail(h.cfg, "-i", "y@example.net", stdin=b"Subject: b\n\nfirst\n.\nkept\n").returncode
    assert 0 == sendmail(h.cfg, "-oi", "z@example.net", stdin=b"Subject: c\n\nfirst\n.\nkept\n").returncode
    bodies = {m["Subject"]: m.get_payload().replace("\r\n", "\n") for m in h.wait_messages(3)}
    assert {"a": "first\n", "b": "first\n.\nkept\n", "c": "first\n.\nkept\n"} == bodies


def test_exit_codes_of_bad_input(host, tmp_path: Path) -> None:
    """sysexits: a bad recipient 67 (EX_NOUSER), a bad sender 65 (EX_DATAERR), no recipient or an unknown
    option 64 (EX_USAGE), a maildrop that cannot be created 73 (EX_CANTCREAT); nothing is written then."""
    h = host()
    assert 67 == sendmail(h.cfg, "bad@exa mple.net", stdin=b"\n").returncode
    assert 67 == sendmail(h.cfg, "-t", stdin=b"To: a@exa..mple.net\n\nx\n").returncode
    assert 67 == sendmail(h.cfg, "-t", stdin=b"To: a@b@c\n\nx\n").returncode
    assert 65 == sendmail(h.cfg, "-f", "a@bad domain", "x@example.net", stdin=b"\n").returncode
    assert 64 == sendmail(h.cfg, stdin=b"Subject: x\n\n").returncode
    assert 64 == sendmail(h.cfg, "-t", stdin=b"Subject: x\n\n").returncode
    assert 64 == sendmail(h.cfg, "-Z", "x@example.net", stdin=b"\n").returncode
    assert [] == h.maildrop()
    # The spool is a file: nothing can be created under it.
    (tmp_path / "afile").write_text("")
    bad = tmp_path / "bad.toml"
    bad.write_text(f'spool_dir = "{tmp_path / "afile" / "spool"}"\n')
    r = sendmail(bad, "x@example.net", stdin=b"\n")
    assert 73 == r.returncode, r.stderr
    # A local user who may not write the spool (it is made by root, mode 0755, with no maildrop yet).
    h.spool.mkdir(mode=0o755)
    r = sendmail(h.cfg, "x@example.net", stdin=b"\n", prefix=("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"))
    assert 73 == r.returncode, r.stderr
    big = tmp_path / "big.toml"
    big.write_text(f'spool_dir = "{h.spool}"\nmessage_size_limit_bytes = 2000\n')
    assert 65 == sendmail(big, "x@example.net", stdin=b"Subject: x\n\n" + b"y" * 3000).returncode


def test_a_local_user_submits_through_the_1733_maildrop(host) -> None:
    """An unprivileged user (nobody) writes into the mode-1733 maildrop made by the daemon; the file is
    theirs, and the Received: line and the default sender name that user."""
    h = host()
    h.start()
    wait_for_maildrop(h)
    os.chmod(h.spool, 0o755)
    r = sendmail(h.cfg, "x@example.net", stdin=b"Subject: n\n\nfrom nobody\n",
                 prefix=("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"), env={"PYTHONDONTWRITEBYTECODE": "1"})
    assert (0, b"") == (r.returncode, r.stderr)
    [m] = h.wait_messages(1)
    assert "<nobody@host.test>" == m["Return-Path"]
    assert m.get_all("Received")[0].startswith("(from nobody@localhost)")
    assert [65534] == [e["uid"] for e in h.events("picked_up")]


def test_a_start_as_root_leaves_waiting_maildrop_files_their_submitters(host) -> None:
    """Started as root, the daemon gives the spool to mail_owner before it switches (issue 32.9), but not the
    files waiting in the maildrop: their owner is the local user the Received: line names. A file a user
    (nobody) dropped while the daemon was down is picked up after a restart as that user's, not mail_owner's."""
    h = host()
    h.start()
    wait_for_maildrop(h)
    os.chmod(h.spool, 0o755)
    h.daemon.kill9()
    r = sendmail(h.cfg, "x@example.net", stdin=b"Subject: n\n\nwhile down\n",
                 prefix=("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"), env={"PYTHONDONTWRITEBYTECODE": "1"})
    assert (0, b"") == (r.returncode, r.stderr)
    [name] = h.maildrop()
    assert 65534 == os.stat(h.spool / "maildrop" / name).st_uid
    h.start()  # as root: the spool given to mail_owner, then the switch
    [m] = h.wait_messages(1)
    assert m.get_all("Received")[0].startswith("(from nobody@localhost)")
    assert [65534] == [e["uid"] for e in h.events("picked_up")]


def test_local_users_reach_the_maildrop_and_nothing_else_of_the_spool(host) -> None:
    """The spool holds mail: a local user (nobody) can read no segment, checkpoint or other file of it, nor
    list it (the daemon's umask is 077, as Postfix's 0700 queue directories), yet submits with sendmail
    through the maildrop without any chmod by the administrator (the spool is entered, not listed)."""
    h = host()
    h.start()
    as_nobody = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    r = sendmail(h.cfg, "x@example.net", stdin=b"Subject: n\n\nfrom nobody\n", prefix=as_nobody,
                 env={"PYTHONDONTWRITEBYTECODE": "1"})
    assert (0, b"") == (r.returncode, r.stderr)
    h.wait_messages(1)
    wait_for(lambda: (h.spool / "checkpoint").exists(), 10, "a checkpoint")
    files = [str(p) for p in h.spool.rglob("*") if p.is_file() and "maildrop" not in p.parts]
    assert [] != files
    readable = [f for f in files if subprocess.run([*as_nobody, "cat", f], capture_output=True).returncode == 0]
    assert [] == readable
    assert 0 != subprocess.run([*as_nobody, "ls", str(h.spool)], capture_output=True).returncode


def test_a_local_user_gets_a_dkim_signature_only_for_their_own_address(host, tmp_path: Path) -> None:
    """``-f`` is free to any local user, so the envelope sender proves nothing (issue 32.1, found by the
    outside review): nobody's `-f ceo@example.org` with `From: ceo@example.org` is relayed unsigned
    (`dkim_not_signed`); nobody's own address (nobody@host.test, the default sender) is signed."""
    from test_dkim import keygen

    keys = ""
    for domain in ("example.org", "host.test"):
        key_file, _ = keygen(tmp_path, domain, "s1")
        os.chmod(tmp_path, 0o755)
        os.chmod(key_file, 0o600)
        keys += f'[dkim_keys."{domain}"]\nselector = "s1"\nkey_file = "{key_file}"\n'
    h = host(keys)
    h.start()
    wait_for_maildrop(h)
    as_nobody = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    r = sendmail(h.cfg, "-f", "ceo@example.org", "x@example.net", stdin=b"From: ceo@example.org\nSubject: a\n\nwire\n",
                 prefix=as_nobody, env=env)
    assert (0, b"") == (r.returncode, r.stderr)
    [forged] = h.wait_messages(1)
    r = sendmail(h.cfg, "y@example.net", stdin=b"From: nobody@host.test\nSubject: b\n\nmine\n", prefix=as_nobody, env=env)
    assert (0, b"") == (r.returncode, r.stderr)
    own = next(m for m in h.wait_messages(2) if m["Subject"] == "b")
    assert (None, "s1") == (forged["DKIM-Signature"], dict(
        kv.strip().split("=", 1) for kv in str(own["DKIM-Signature"]).split(";") if "=" in kv)["s"])
    assert ["example.org"] == [e["domain"] for e in h.events("dkim_not_signed")]


def test_bp_lists_and_q_flushes_the_queue(host) -> None:
    """-bp is ``mtaq queue list`` (mailq); -q is ``mtaq queue flush ALL``: deferred mail is tried at once."""
    h = host('retry_intervals_s = [3600]\n')
    h.start()
    assert 0 == sendmail(h.cfg, "later@example.net", stdin=b"Subject: q\n\nlater\n").returncode
    [picked] = wait_for(lambda: h.events("deferred_until"), 30, "the first attempt deferred")[:1]
    r = sendmail(h.cfg, "-bp")
    assert 0 == r.returncode, r.stderr
    assert picked["queue_id"] in r.stdout.decode() and "later@example.net" in r.stdout.decode()
    r = sendmail(h.cfg, "-q")
    assert 0 == r.returncode, r.stderr
    [m] = h.wait_messages(1)
    assert ["later@example.net"] == m.get_all("Delivered-To")


def test_bs_speaks_smtp_on_stdin_and_stdout(host) -> None:
    """-bs: an SMTP session on stdin/stdout (no daemon needed); the message goes to the maildrop at its 250."""
    h = host()
    session = (b"EHLO me\r\nMAIL FROM:<s@example.org>\r\nRCPT TO:<r@example.net>\r\nRCPT TO:<bad@@x>\r\nDATA\r\n"
               b"Subject: bs\r\n\r\nvia -bs\r\n.\r\n"
               b"MAIL FROM:<s@example.org>\r\nRCPT TO:<r@example.net>\r\nDATA\r\nSubject: nul\r\n\r\na\0b\r\n.\r\n"
               b"QUIT\r\n")
    r = sendmail(h.cfg, "-bs", stdin=session)
    out = r.stdout.decode()
    assert (0, b"") == (r.returncode, r.stderr), out  # no traceback after QUIT (second outside review)
    assert out.startswith("220 ") and "250 2.0.0 Ok: queued as" in out and "221" in out, out
    # a NUL is refused as an SMTP listener refuses it, not queued and set aside later (B8)
    assert "550 5.6.0 Error: message contains NUL characters (smtpd_forbid_nul)" in out, out
    assert 1 == len(h.maildrop())
    h.start()
    [m] = h.wait_messages(1)
    assert ("<s@example.org>", ["r@example.net"]) == (m["Return-Path"], m.get_all("Delivered-To"))


def test_a_program_named_sendmail_is_mtaq_sendmail(host, tmp_path: Path) -> None:
    """``ln -s $(which mtaq) /usr/sbin/sendmail``: called as ``sendmail`` the mtaq program is the sendmail command."""
    script = shutil.which("mtaq", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("no mtaq console script next to the interpreter")
    link = tmp_path / "sendmail"
    link.symlink_to(script)
    h = host()
    r = sendmail(h.cfg, "-oi", "-t", stdin=b"To: l@example.net\n\nlinked\n", argv0=[str(link)])
    assert (0, b"") == (r.returncode, r.stderr)
    assert 1 == len(h.maildrop())


@pytest.mark.parametrize("point", ["pickup.before_receive", "pickup.after_receive", "pickup.after_unlink"])
def test_a_kill_in_the_pickup_loses_and_duplicates_nothing(host, point: str) -> None:
    """kill -9 at each point of the pick-up (before the envelope is appended, once it is durable but before the
    file's unlink, after the unlink before the directory fsync), restart: the message is delivered exactly once
    and the maildrop ends empty. After a durable envelope the file left behind is removed, not queued again
    (``maildrop_already_queued``: the envelope names its file)."""
    h = host()
    assert 0 == sendmail(h.cfg, "-t", stdin=b"To: k@example.net\nMessage-ID: <kill@test>\n\nk\n").returncode
    [name] = h.maildrop()
    try:
        h.start({"MTAQ_KILL_POINT": point})
    except RuntimeError:
        pass  # the kill point came before the port was seen listening
    assert -9 == h.daemon.popen.wait(timeout=30) if h.daemon is not None else True
    expect_file = point != "pickup.after_unlink"
    assert ([name] if expect_file else []) == h.maildrop()
    h.start()
    wait_for(lambda: h.maildrop() == [], 10, "the maildrop emptied")
    qids = wait_for(lambda: [e["queue_id"] for e in h.events("queued")] or None, 10, "queued")
    wait_for(lambda: {e.get("queue_id") for e in h.events("removed")} >= set(qids), 30, "every queue entry done")
    msgs = h.messages()
    assert ["<kill@test>"] == [m["Message-ID"] for m in msgs]
    assert [name] == [e["maildrop"] for e in h.events("picked_up")]
    already = [e["maildrop"] for e in h.events("maildrop_already_queued")]
    assert ([name] if point == "pickup.after_receive" else []) == already


def test_damaged_maildrop_files_are_set_aside_and_reported(host) -> None:
    """A file whose content checksum fails, a torn one, a symbolic link and a stray name are moved to
    SPOOL/corrupt/maildrop with a ``maildrop_corrupt`` event each; none is queued; a good one beside them is."""
    h = host()
    for i in range(3):
        assert 0 == sendmail(h.cfg, f"d{i}@example.net", stdin=f"Subject: d{i}\n\nbody {i}\n".encode()).returncode
    flipped, torn, good = h.maildrop()
    d = h.spool / "maildrop"
    data = bytearray((d / flipped).read_bytes())
    data[-3] ^= 0x20
    (d / flipped).write_bytes(bytes(data))
    (d / torn).write_bytes((d / torn).read_bytes()[:-5])
    secret = h.tmp / "secret"
    secret.write_text("not mail")
    link = "0661aaaaaaaaaa.0123456789abcdef"
    os.symlink(secret, d / link)
    (d / "stray").write_text("x")
    h.start()
    [m] = h.wait_messages(1)
    assert "d2" == m["Subject"]
    reports = wait_for(lambda: len(h.events("maildrop_corrupt")) >= 4 and h.events("maildrop_corrupt"), 10, "reports")
    reasons = {e["maildrop"]: e["reason"] for e in reports}
    assert {flipped: "content checksum mismatch", link: "a symbolic link", "stray": "unexpected file name"} == {
        k: v for k, v in reasons.items() if k != torn}
    assert reasons[torn].startswith("torn or padded")
    assert sorted([flipped, torn, link, "stray"]) == sorted(os.listdir(h.spool / "corrupt" / "maildrop"))
    assert [] == h.maildrop()
    assert "not mail" == secret.read_text()
    assert [good] == [e["maildrop"] for e in h.events("picked_up")]


def test_with_two_workers_one_picks_up(host) -> None:
    """workers = 2: only worker 0 reads the maildrop; each message is queued once."""
    h = host()
    h.start(workers=2)
    for i in range(4):
        assert 0 == sendmail(h.cfg, f"w{i}@example.net", stdin=f"Subject: w{i}\n\nx\n".encode()).returncode
    msgs = h.wait_messages(4)
    assert 4 == len({m["Subject"] for m in msgs})
    picked = h.events("picked_up")
    assert 4 == len(picked)
    assert {0} == {e.get("shard") for e in picked}  # every worker's events carry its shard


def test_a_checkpoint_waits_for_the_pickups_unlinks(tmp_path: Path, monkeypatch) -> None:
    """In-process daemon: while a picked-up file's envelope is durable (and even delivered and finished) but
    its unlink not yet fsync'd, a checkpoint does not take its positions: it waits for the pick-up's lock.
    Otherwise its working suffix could start past that envelope, and a crash before the unlink would queue
    the file again (docs/log_format.md, "What recovery trusts", rule 6)."""
    import asyncio
    import threading

    from aiosmtpd.smtp import SMTP

    from mtaq.config import load_config
    from mtaq.daemon.process import Daemon
    from mtaq.storage import maildrop as md
    from mtaq.testing.sink import SinkHandler

    spool = tmp_path / "spool"
    md.write_message(str(spool), "a@example.org", ["b@example.net"], b"Subject: lock\r\n\r\nx\r\n", login="root")
    release = threading.Event()
    real_remove = md.remove

    def blocked_remove(d: str, name: str) -> None:
        release.wait(30)
        real_remove(d, name)

    monkeypatch.setattr(md, "remove", blocked_remove)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sink = SinkHandler(str(tmp_path / "maildir"))
        server = await loop.create_server(lambda: SMTP(sink, hostname="sink", loop=loop), "127.0.0.1", 0)
        cfg = load_config(None, {"spool_dir": str(spool), "listen": "127.0.0.1:0", "stats_interval_s": 0,
                                 "relayhost": f"[127.0.0.1]:{server.sockets[0].getsockname()[1]}",
                                 "checkpoint_interval_s": 3600, "admin_listen": ""})
        d = Daemon(cfg)
        task = asyncio.create_task(d.run())
        try:
            while sink.received < 1 or len(d.queue.working) or not d.runners_settled():
                await asyncio.sleep(0.01)  # delivered and finished, its unlink still held up
            assert d.pickup is not None and d.pickup.lock.locked()
            before = d.checkpoints
            cp = asyncio.create_task(d.checkpoint())
            while not cp.done() and not d.pickup.lock._waiters:  # type: ignore[attr-defined]
                await asyncio.sleep(0.01)
            assert (False, before) == (cp.done(), d.checkpoints)
            release.set()
            await cp
            assert (before + 1, []) == (d.checkpoints, os.listdir(spool / "maildrop"))
        finally:
            release.set()
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            server.close()

    asyncio.run(main())


def test_a_full_disk_is_a_temporary_failure_and_leaves_nothing(host, tmp_path: Path) -> None:
    """A maildrop on a full file system (a 64 KiB tmpfs): exit 75 (EX_TEMPFAIL, try again later), and no
    temporary file is left behind. Skipped where this process may not mount a tmpfs."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        cfg = tmp_path / "small.toml"
        cfg.write_text(f'spool_dir = "{small / "spool"}"\n')
        r = sendmail(cfg, "x@example.net", stdin=b"Subject: big\n\n" + b"z" * 100 * 1024)
        assert 75 == r.returncode, r.stderr
        assert [] == os.listdir(small / "spool" / "maildrop")
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_sendmail_makes_the_text_fit_for_smtp_or_refuses_it(host) -> None:
    """Review finding B8: what ``mtaq sendmail`` takes, an SMTP client could have sent. A line over 998 octets
    (here 2,500 in the body and a 1,200-octet Subject:) is broken by CRLF SPACE every 998 octets, as Postfix's
    smtp_line_length_limit does; a NUL is refused (exit 65, one line) unless smtpd_forbid_nul = "strip";
    a bare CR is refused (65) unless smtp_bare_newline = "normalize"."""
    h = host()
    long_body = b"".join(b"%09d," % i for i in range(250))  # 2,500 octets, no space
    subject = b"S" * 1200
    r = sendmail(h.cfg, "long@example.net", stdin=b"Subject: " + subject + b"\n\n" + long_body + b"\nend\n")
    assert (0, b"") == (r.returncode, r.stderr)
    for stdin, word in ((b"Subject: nul\n\na\0b\n", b"NUL"), (b"Subject: cr\n\na\rb\n", b"bare CR")):
        r = sendmail(h.cfg, "bad@example.net", stdin=stdin)
        assert 65 == r.returncode
        assert 1 == len(r.stderr.splitlines()) and word in r.stderr
    h.start()
    h.wait_messages(1)
    [path] = [os.path.join(h.maildir, "new", n) for n in os.listdir(os.path.join(h.maildir, "new"))]
    raw = open(path, "rb").read()
    assert 998 == max(len(line) for line in raw.split(b"\r\n") if not line.startswith((b"Received", b"\t")))
    unfolded = raw.replace(b"\r\n ", b"")
    assert b"\r\nSubject: " + subject + b"\r\n" in unfolded and b"\r\n\r\n" + long_body + b"\r\nend\r\n" in unfolded
    lenient = host('smtpd_forbid_nul = "strip"\nsmtp_bare_newline = "normalize"\n')
    r = sendmail(lenient.cfg, "-i", "x@example.net", stdin=b"Subject: mended\n\na\0b\rc\n")
    assert (0, b"") == (r.returncode, r.stderr)


def test_maildrop_files_with_text_smtp_would_refuse_are_set_aside(host) -> None:
    """Review finding B8: a file written into the maildrop past ``mtaq sendmail`` (its format is simple; any
    local user may write one) whose text has a line over 998 octets or a NUL is set aside with a
    ``maildrop_corrupt`` event naming the line, as an SMTP client's message would be refused; one with a bare
    LF is queued with CRLF (as before), and a good one beside them too."""
    from mtaq.storage import maildrop as md

    h = host()
    bodies = {"long": b"Subject: long\r\n\r\n" + b"x" * 999 + b"\r\n", "nul": b"Subject: nul\r\n\r\na\0b\r\n",
              "lf": b"Subject: lf\r\n\r\na\nb\r\n", "good": b"Subject: good\r\n\r\nfine\r\n"}
    names = {md.write_message(str(h.spool), "a@example.org", ["b@example.net"], text, login="root"): key
             for key, text in bodies.items()}
    h.start()
    assert ["good", "lf"] == sorted(m["Subject"] for m in h.wait_messages(2))
    reports = wait_for(lambda: len(h.events("maildrop_corrupt")) >= 2 and h.events("maildrop_corrupt"), 10, "reports")
    assert {"long": "message text: line 3 longer than 998 octets (RFC 5321 section 4.5.3.1.6)",
            "nul": "message text: line 3 has a NUL octet"} == {names[e["maildrop"]]: e["reason"] for e in reports}
    wait_for(lambda: h.maildrop() == [], 10, "the maildrop emptied")


NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


def test_a_local_users_directories_in_the_maildrop_are_reported_once(host) -> None:
    """Second outside review F5: a local user makes directories with maildrop names; the daemon cannot move
    them aside (renaming a directory needs write permission on it) and used to try, and log an error, every
    second for each, for ever. Each is now reported once and passed over while it stays as it is; mail
    submitted meanwhile is picked up as usual (each pick-up is a scan that meets the directories again)."""
    from mtaq.storage import maildrop as md

    h = host()
    h.start()
    wait_for_maildrop(h)
    os.chmod(h.spool, 0o755)
    names = [md.new_name() for _ in range(20)]
    made = subprocess.run([*NOBODY, "mkdir", *[str(h.spool / "maildrop" / n) for n in names]], capture_output=True)
    assert 0 == made.returncode, made.stderr
    reports = wait_for(lambda: (r := h.events("maildrop_corrupt")) and len(r) >= 20 and r, 30, "20 reports")
    assert sorted(names) == sorted(e["maildrop"] for e in reports)
    for i in range(3):
        assert 0 == sendmail(h.cfg, f"after{i}@example.net", stdin=f"Subject: after {i}\n\nx\n".encode()).returncode
        h.wait_messages(i + 1)
    assert 20 == len(h.events("maildrop_corrupt"))


def test_an_endless_writer_to_the_fifo_is_read_at_a_bounded_rate(host) -> None:
    """Second outside review F6: a local user writing to SPOOL/pickup.fifo without end kept the daemon at
    46 % of a core (it read as fast as the writer wrote). The pick-up now reads at most 64 KiB per wake-up
    and one wake-up per WAKE_MIN_S (0.1 s): over 2 s the writer gets at most about 21 x 64 KiB plus the
    pipe's buffer through (before: hundreds of MiB)."""
    import threading
    import time

    from mtaq.edge.pickup import WAKE_MIN_S

    h = host()
    h.start()
    fifo = h.spool / "pickup.fifo"
    wait_for(fifo.exists, 10, "the fifo")
    fd = os.open(fifo, os.O_WRONLY)
    written = 0
    stop = threading.Event()

    def write() -> None:
        nonlocal written
        chunk = b"\0" * 65536
        try:
            while not stop.is_set():
                written += os.write(fd, chunk)
        except OSError:  # closed under it
            pass

    started = time.monotonic()
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    time.sleep(2.0)
    elapsed = time.monotonic() - started
    stop.set()
    os.close(fd)  # the blocked write ends with an error or returns; the thread ends either way
    writer.join(10)
    pipe_bytes = 1024 * 1024  # the most a pipe's buffer can hold (fs.pipe-max-size's default)
    assert written <= (elapsed / WAKE_MIN_S + 2) * 65536 + pipe_bytes, written
    assert 0 == sendmail(h.cfg, "still@example.net", stdin=b"Subject: still\n\nx\n").returncode
    h.wait_messages(1)
