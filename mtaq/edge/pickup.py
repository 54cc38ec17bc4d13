"""The daemon's pick-up of the maildrop (Postfix's pickup(8)): local submissions become ordinary envelopes.

``mtaq sendmail`` writes each message durably into ``SPOOL/maildrop`` (:mod:`mtaq.storage.maildrop`), whether
or not the daemon runs. One process picks the maildrop up (worker 0 of several): once at start, after
recovery, then every :data:`POLL_S` seconds and at once when ``SPOOL/pickup.fifo`` is written to. Each file
becomes an envelope through :meth:`Queue.receive`, as SMTP mail does (durable before it counts), with a
``Received: (from USER@localhost) by HOST (mtaq) id QID; DATE`` line naming the file's owner, and a DKIM
signature when the From: domain has a key. The file is unlinked only after its envelope is durable, and
the directory fsync'd after.

What must always hold (kill -9 or power cut at any point: nothing lost, nothing queued twice):

* a file is removed only after its envelope is durable; a file whose envelope may not be durable stays;
* every envelope names its file (``EnvelopeRecord.maildrop``). Recovery collects the names in the working
  suffix, and the pick-up at start removes a file so named instead of queueing it again;
* the working suffix still holds that envelope: :attr:`Pickup.lock` is held from before the envelopes are
  appended until the unlinks are fsync'd, and the daemon's checkpoint takes its positions under the same
  lock. A checkpoint therefore either begins its working suffix at or before the envelope, or was taken
  after the file's removal was durable (docs/log_format.md, "What recovery trusts");
* files are hostile input (:func:`mtaq.storage.maildrop.read_message`): a file that does not check out,
  or whose envelope mtaq would refuse over SMTP, is moved aside to ``SPOOL/corrupt/maildrop`` and reported
  (``maildrop_corrupt``), never dropped silently nor queued garbled.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import email.utils
import os
import pwd
import re
import time
from typing import Any

from mtaq.core.errors import StorageError, StorageFatal
from mtaq.core.records import EnvelopeRecord
from mtaq.edge.canonical import Canonical
from mtaq.edge.data import text_problem
from mtaq.edge.dkim import Origin, Signer, header_section
from mtaq.edge.milter import MilterDiscarded, MilterRefused, MilterSettings, filter_local
from mtaq.edge.policy import address_problem
from mtaq.queue.store import Queue, new_queue_id
from mtaq.storage import maildrop as md
from mtaq.testing import killpoints

__all__ = ["BATCH_BYTES_MAX", "BATCH_FILES_MAX", "POLL_S", "STALE_TEMP_S", "Pickup", "local_received_header"]

POLL_S = 1.0  # seconds between two looks at the maildrop when nothing wakes the pick-up
WAKE_MIN_S = 0.1  # seconds at least between two scans woken through the fifo
UNMOVABLE_MAX = 10_000  # unmovable maildrop entries remembered (beyond: forgotten, reported again)
STALE_TEMP_S = 3600.0  # a ``.NAME.tmp`` file this old was left by a sendmail that died: moved aside
BATCH_FILES_MAX = 100  # files queued together (one commit round, one directory fsync)
BATCH_BYTES_MAX = 32 << 20  # message bytes held in memory for one batch
_NEWLINE = re.compile(rb"\r\n|\r|\n")
_NOT_IN_COMMENT = re.compile(r"[^!-~]|[()\\]")


def local_received_header(user: str, hostname: str, queue_id: str, when_ts: float) -> bytes:
    """``Received: (from USER@localhost)`` / ``by HOST (mtaq) id QID; DATE`` with its CRLF (RFC 5322 §3.6.7;
    Postfix's pickup writes ``(from userid N)``). ``user`` and ``hostname`` are reduced to printable ASCII
    without ``()\\``."""
    date = email.utils.format_datetime(dt.datetime.fromtimestamp(int(when_ts), dt.UTC))
    u = _NOT_IN_COMMENT.sub("?", user[:64]) or "unknown"
    h = _NOT_IN_COMMENT.sub("?", hostname[:255]) or "localhost"
    return f"Received: (from {u}@localhost)\r\n\tby {h} (mtaq) id {queue_id}; {date}\r\n".encode("ascii")


def _read_checked(directory: str, name: str, body_bytes_max: int) -> md.Dropped:
    """:func:`mtaq.storage.maildrop.read_message`, and the listener's checks of the text (review finding B8:
    a file written past ``mtaq sendmail``, which makes its text fit, with a NUL or a line over 998 octets; a
    bare CR or LF is made CRLF, as ever): DropError with the reason, so that it is set aside as an SMTP client's would be refused."""
    msg = md.read_message(directory, name, body_bytes_max=body_bytes_max)
    problem = text_problem(_NEWLINE.sub(b"\r\n", msg.body))  # bare CR/LF are made CRLF (_receive), not refused
    if problem is not None:
        raise md.DropError(f"message text: {problem}")
    return msg


def _login_of(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid{uid}"


class Pickup:
    """Picks up ``SPOOL/maildrop`` into ``queue`` (see the module docstring)."""

    def __init__(self, queue: Queue, spool: str, *, hostname: str, body_bytes_max: int, recipients_max: int,
                 signer: Signer | None, log: Any, myorigin: str = "", canonical: Canonical | None = None,
                 milters: MilterSettings | None = None) -> None:
        self.queue = queue
        self.spool = spool
        self.dir = os.path.join(spool, md.MAILDROP_DIR)
        self.hostname = hostname
        self.myorigin = myorigin or hostname  # the domain of a local user's own address (Postfix's myorigin)
        self.body_bytes_max = body_bytes_max
        self.recipients_max = recipients_max
        self.signer = signer
        self.canonical = canonical  # canonical_maps (mtaq.edge.canonical): local mail's envelope and headers
        self.log = log
        self.milters = milters  # non_smtpd_milters (mtaq.edge.milter) and the milter_* settings
        # Held from before a batch's envelopes are appended until their files' unlinks are fsync'd; the
        # daemon's checkpoint reads its positions under it (module docstring).
        self.lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._fifo = -1
        # Entries that could not be moved aside (a local user's directory: renaming it needs write permission
        # on it), by name -> (inode, ctime): reported once, then passed over while they stay as they are
        # (second outside review F5: 2,000 directories made 991 error lines a second).
        self._unmovable: dict[str, tuple[int, int]] = {}
        self.picked_up = 0
        self.set_aside = 0

    # ---------------------------------------------------------------------------------------- the loop
    async def run(self, already_queued: set[str]) -> None:
        """Pick up what is there (files named in ``already_queued``, from recovery, are removed, not queued),
        then again every :data:`POLL_S` seconds or when woken through the fifo. Runs until cancelled."""
        await asyncio.to_thread(md.ensure_maildrop, self.spool)
        try:
            self._fifo = await asyncio.to_thread(md.open_fifo, self.spool)
            asyncio.get_running_loop().add_reader(self._fifo, self._drain)
        except OSError as exc:
            self.log.warning("pickup_fifo_failed", error=str(exc), action=f"maildrop read every {POLL_S} s")
        await self.scan(already_queued)
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            except TimeoutError:
                pass
            self._wake.clear()
            await self.scan(set())
            # A local user writing to the fifo without end (`cat /dev/zero > pickup.fifo`) gets one scan per
            # WAKE_MIN_S, not a busy daemon (issue 32's outside review: 60 % of a core).
            await asyncio.sleep(WAKE_MIN_S)

    def _drain(self) -> None:
        try:
            for _ in range(16):  # at most 64 KiB a wake-up: an endless writer cannot hold the event loop
                if not os.read(self._fifo, 4096):
                    break
        except OSError:
            pass
        self._wake.set()
        # Not read again for WAKE_MIN_S: an endless writer (`cat /dev/zero > pickup.fifo`) costs 64 KiB read per
        # WAKE_MIN_S, not a core (second outside review F6: 46 % of a core while the scans alone were bounded).
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._fifo)
        loop.call_later(WAKE_MIN_S, self._rearm)

    def _rearm(self) -> None:
        if self._fifo >= 0:
            asyncio.get_running_loop().add_reader(self._fifo, self._drain)

    def _unchanged(self, name: str) -> bool:
        """Whether the unmovable entry ``name`` is still the one reported (same inode, same ctime)."""
        try:
            st = os.lstat(os.path.join(self.dir, name))
        except OSError:
            return False
        return (st.st_ino, st.st_ctime_ns) == self._unmovable[name]

    async def scan(self, already_queued: set[str]) -> None:
        """One pass over the maildrop, oldest first."""
        try:
            names = await asyncio.to_thread(md.list_names, self.dir)
        except OSError as exc:
            self.log.error("pickup_failed", error=str(exc), directory=self.dir, action=f"tried again in {POLL_S} s")
            return
        batch: list[md.Dropped] = []
        size = 0
        for name in names:
            if name.startswith("."):
                await self._stale_temp(name)
                continue
            if name in self._unmovable:
                if self._unchanged(name):
                    continue
                del self._unmovable[name]
            if not md.valid_name(name):
                await self._aside(name, "unexpected file name", None)
                continue
            try:
                msg = await asyncio.to_thread(_read_checked, self.dir, name, self.body_bytes_max)
            except md.DropError as exc:
                await self._aside(name, exc.reason, None)
                continue
            except FileNotFoundError:
                continue
            except OSError as exc:
                self.log.error("pickup_read_failed", maildrop=name, error=str(exc), action=f"tried again in {POLL_S} s")
                continue
            if name in already_queued:
                # Its envelope was durable before a crash cut off the unlink: queued once already. Removed
                # durably before any checkpoint can move the working suffix past that envelope.
                async with self.lock:
                    await asyncio.to_thread(md.remove, self.dir, name)
                    await asyncio.to_thread(md.sync_dir, self.dir)
                self.log.warning("maildrop_already_queued", maildrop=name, uid=msg.uid, action="removed")
                continue
            problem = self._envelope_problem(msg)
            if problem:
                await self._aside(name, problem, msg.uid)
                continue
            batch.append(msg)
            size += len(msg.body)
            if len(batch) >= BATCH_FILES_MAX or size >= BATCH_BYTES_MAX:
                if not await self._queue(batch):
                    return
                batch, size = [], 0
        if batch:
            await self._queue(batch)

    def _envelope_problem(self, msg: md.Dropped) -> str:
        """Why the envelope of ``msg`` would be refused over SMTP (the same checks), or ""."""
        if len(msg.recipients) > self.recipients_max:
            return f"{len(msg.recipients)} recipients (recipients_per_message_max {self.recipients_max})"
        p = address_problem(msg.sender, smtputf8=True, null_ok=True)
        if p is not None:
            return f"sender {msg.sender!r}: {p}"
        for r in msg.recipients:
            p = address_problem(r, smtputf8=True)
            if p is not None:
                return f"recipient {r!r}: {p}"
        return ""

    async def _stale_temp(self, name: str) -> None:
        try:
            st = os.lstat(os.path.join(self.dir, name))
        except OSError:
            return
        if time.time() - st.st_mtime > STALE_TEMP_S:
            await self._aside(name, f"temporary file older than {STALE_TEMP_S:.0f} s (its sendmail died)", st.st_uid)

    async def _aside(self, name: str, reason: str, uid: int | None) -> None:
        if uid is None:
            try:
                uid = os.lstat(os.path.join(self.dir, name)).st_uid
            except OSError:
                uid = -1
        try:
            path = await asyncio.to_thread(md.move_aside, self.spool, name)
        except FileNotFoundError:
            return
        except OSError as exc:
            self.log.error("maildrop_corrupt", maildrop=name, uid=uid, reason=reason, moved_to=None,
                           move_error=str(exc), action="passed over while it stays as it is")
            try:
                st = os.lstat(os.path.join(self.dir, name))
            except OSError:
                return
            if len(self._unmovable) >= UNMOVABLE_MAX:
                self._unmovable.clear()
            self._unmovable[name] = (st.st_ino, st.st_ctime_ns)
            return
        self.set_aside += 1
        self.log.error("maildrop_corrupt", maildrop=name, uid=uid, reason=reason, moved_to=path)

    # ------------------------------------------------------------------------------------- queueing
    async def _queue(self, batch: list[md.Dropped]) -> bool:
        """Queue ``batch``, then remove the files whose envelopes are durable. False when the queue refused
        one (a full disk, back-pressure): the rest waits for the next pass."""
        async with self.lock:
            killpoints.hit("pickup.before_receive")
            results = await asyncio.gather(*(self._receive(m) for m in batch), return_exceptions=True)
            # queued, or discarded by a milter (nothing to queue): either way the file goes
            done = [m for m, r in zip(batch, results, strict=True) if isinstance(r, EnvelopeRecord | MilterDiscarded)]
            if done:
                killpoints.hit("pickup.after_receive")  # durable, not yet unlinked
                for m in done:
                    await asyncio.to_thread(md.remove, self.dir, m.name)
                killpoints.hit("pickup.after_unlink")  # unlinked, the directory not yet fsync'd
                # A failed fsync is fatal (GUIDE I6): the exception ends the daemon; recovery re-reads the disk.
                await asyncio.to_thread(md.sync_dir, self.dir)
        ok = True
        for m, r in zip(batch, results, strict=True):
            if isinstance(r, StorageFatal):
                raise r
            if isinstance(r, MilterDiscarded):
                self.log.warning("milter_discard", maildrop=m.name, milter=r.milter, uid=m.uid)
                continue
            if isinstance(r, MilterRefused):
                if r.reply.startswith("4"):  # tempfail or the default action: the file stays, tried again
                    self.log.warning("pickup_deferred", maildrop=m.name, error=r.reply, action="tried again later")
                else:  # Postfix bounces it; here it is set aside, nothing lost (issue 34)
                    await self._aside(m.name, f"refused by a milter: {r.reply}", m.uid)
                continue
            if isinstance(r, BaseException):
                if not isinstance(r, Exception):
                    raise r
                if not isinstance(r, StorageError):
                    # Not the disk: something in this file (a bug its content triggers). Set aside and reported
                    # rather than a crash at every start on the same file.
                    self.log.error("pickup_exception", maildrop=m.name, error=f"{type(r).__name__}: {r}")
                    await self._aside(m.name, f"cannot be queued: {type(r).__name__}", m.uid)
                    continue
                ok = False
                self.log.warning("pickup_deferred", maildrop=m.name, error=str(r), action="tried again later")
        return ok

    async def _receive(self, msg: md.Dropped) -> EnvelopeRecord:
        qid = new_queue_id(self.queue.clock())
        user = _login_of(msg.uid)
        content = _NEWLINE.sub(b"\r\n", msg.body)
        sender, recipients = msg.sender, list(msg.recipients)
        if self.canonical is not None:  # before signing and queueing, as for SMTP (a local client: headers too)
            # MapNesting (a loop in a table) sets the file aside with the reason, like any other exception here.
            sender = self.canonical.sender(sender)
            recipients = [self.canonical.recipient(r) for r in recipients]
            head = header_section(content)
            new_head = self.canonical.head(head) if head else None
            if new_head is not None:
                content = new_head + content[len(head):]
        quarantine = None
        if self.milters is not None and self.milters.non_smtpd_milters:
            content, sender, recipients, quarantine = await filter_local(
                self.milters, content, header_section(content), sender, recipients, qid, self.hostname,
                {"maildrop": msg.name})
        trace = local_received_header(user, self.hostname, qid, self.queue.clock())
        if self.signer:
            # Who may get a signature (issue 32.1): root's mail (cron, the system) as mynetworks mail; any other
            # local user as an authenticated client that owns one address, USER@myorigin (the sender
            # `mtaq sendmail` gives by default; -f is free to anyone, so the envelope sender proves nothing).
            own = f"{user}@{self.myorigin}".lower()
            origin = Origin(client="local", mynetworks=msg.uid == 0, login="" if msg.uid == 0 else (user or str(msg.uid)),
                            mail_from=sender, owns=lambda address: address.lower() == own)
            trace = await self.signer.signature_of(content, origin) + trace
        addresses = (sender, *recipients)
        params = [] if all(a.isascii() for a in addresses) else [("SMTPUTF8", "")]
        env = await self.queue.receive(sender, recipients, trace + content, mail_params=params,
                                       client="local", helo="", queue_id=qid, maildrop=msg.name,
                                       held=quarantine is not None)
        if quarantine is not None:
            self.log.warning("milter_quarantine", queue_id=qid, maildrop=msg.name, reason=quarantine,
                             action="held until released (mtaq queue release)")
        self.picked_up += 1
        self.log.info("picked_up", queue_id=qid, maildrop=msg.name, uid=msg.uid, user=user, sender=msg.sender,
                      nrcpt=len(msg.recipients), size=env.size)
        return env
