"""Model-based test: the queue on a crash file system, checked against a plain model after every recovery.

Hypothesis drives the real :class:`Queue` and the real recovery on :class:`CrashFileSystem`, which loses,
garbles or half-keeps every write that was never fsync'd and forgets directory changes never fsync'd.
The model is a few dicts: which messages were acknowledged (their ``receive`` returned, i.e. the 250),
which recipients have a durable final outcome, and the bytes of every body. After each crash and recovery
the log itself is read and checked:

* I1: every acknowledged recipient without a durable final outcome is in exactly one live envelope;
* I2: no recipient whose durable DELIVERY said delivered (or failed) is in a live envelope again;
* I3: every live envelope's data is the body that was sent, byte for byte, or (only for a message that was
  never acknowledged) unreadable; it is never a different or cut-off body;
* I4: a recipient flagged "outcome unknown" never had a durable final outcome.

* the restart positions are right: every live envelope is at or after its runner's recovered position and
  not in that runner's garbage set (else a runner would never offer it again: mail stuck forever).

Checkpoints and reclamation are rules too (the daemon's ``checkpoint`` step: restart positions, fsync,
write the checkpoint, delete wholly-garbage segments), on 4 KiB segments so that segments roll and are
reclaimed often. Injected EIO/ENOSPC have their own named tests (test_edge_storage_failure, test_fsync_eio).
"""

from __future__ import annotations

import asyncio
import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mtaq.core.checkpoint import Checkpoint
from mtaq.core.errors import CorruptRecord
from mtaq.core.records import EnvelopeRecord, Outcome, Pos, StartRecord
from mtaq.core.state import RetryPolicy
from mtaq.queue.recovery import recover
from mtaq.queue.store import Queue
from mtaq.storage.checkpoint import write_checkpoint
from mtaq.storage.log import Log, scan_log
from mtaq.testing.crashfs import CrashFileSystem

SPOOL = "/spool"
LOG_DIR = "/spool/log"
NEVER = (("NOTIFY", "NEVER"),)  # no DSNs: the model tracks only the messages it sends


class _Quiet:
    def __getattr__(self, name: str):
        return lambda *a, **k: None


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fs = CrashFileSystem()
        self.bodies: dict[str, bytes] = {}
        self.acked: dict[str, set[str]] = {}
        self.done: dict[str, set[str]] = {}  # durable delivered or failed
        self.waiting: dict[str, tuple[Pos, EnvelopeRecord]] = {}
        self.attempts: dict[str, object] = {}
        self.unacked: dict[str, tuple[Pos, EnvelopeRecord]] = {}
        self.n = 0
        self.intervals: tuple[float, ...] = (1.0,)  # retry_intervals_s: changed across restarts (issue 12.3)
        self._open()

    # ------------------------------------------------------------------------------------------ helpers
    def _open(self) -> None:
        self.log, report = Log.open(self.fs, LOG_DIR, segment_bytes_max=4096)
        self.q = Queue(self.log, policy=RetryPolicy(intervals_s=self.intervals), clock=lambda: 1000.0, reporting_mta="mx.test")
        self.q.on_durable = lambda env, pos: self.waiting.__setitem__(env.queue_id, (pos, env))
        self.recovery = asyncio.run(recover(self.q, report, SPOOL, _Quiet()))

    def _body(self) -> bytes:
        self.n += 1
        return b"Subject: m%d\r\n\r\n" % self.n + bytes(random.Random(self.n).randbytes(300 + self.n % 700))

    def _live(self) -> dict[str, list[tuple[Pos, EnvelopeRecord]]]:
        started: set[Pos] = set()
        envs: list[tuple[Pos, EnvelopeRecord]] = []
        for scan in scan_log(self.fs, LOG_DIR, decode=True):
            for pos, rec in scan.records:
                if isinstance(rec, StartRecord):
                    started.add(rec.envelope)
                elif isinstance(rec, EnvelopeRecord):
                    envs.append((pos, rec))
        live: dict[str, list[tuple[Pos, EnvelopeRecord]]] = {}
        for pos, env in envs:
            if pos not in started:
                live.setdefault(env.queue_id, []).append((pos, env))
        return live

    # ------------------------------------------------------------------------------------------ rules
    @rule(nrcpt=st.integers(1, 3))
    def receive(self, nrcpt: int) -> None:
        """A client's message, acknowledged: receive() returned after the covering fsync."""
        body = self._body()
        rcpts = [f"r{i}@example.net" for i in range(nrcpt)]
        env = asyncio.run(self.q.receive("s@example.org", rcpts, body, rcpt_params=[NEVER] * nrcpt))
        self.bodies[env.queue_id] = body
        self.acked[env.queue_id] = set(rcpts)

    @rule()
    def receive_unacknowledged(self) -> None:
        """A message whose client never got its 250 (appended, no commit awaited)."""
        body = self._body()
        env, pos, _lsn = self.q._append_message("s@example.org", ["u@example.net"], body, rcpt_params=[NEVER])
        self.bodies[env.queue_id] = body
        self.unacked[env.queue_id] = (pos, env)  # a runner may see it once some fsync makes it durable

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        qid = data.draw(st.sampled_from(sorted(self.waiting)))
        pos, env = self.waiting.pop(qid)
        self.attempts[qid] = self.q.start(pos, env)

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """The next hop's final replies for some recipients, made durable."""
        qid = data.draw(st.sampled_from(sorted(self.attempts)))
        a = self.attempts[qid]
        todo = [r for r in a.envelope.recipients if r.index not in a.outcomes]  # type: ignore[attr-defined]
        if not todo:
            return
        chosen = data.draw(st.lists(st.sampled_from(todo), min_size=1, unique_by=lambda r: r.index))
        outs = []
        for r in chosen:
            status = data.draw(st.sampled_from(["delivered", "deferred", "failed"]))
            code = {"delivered": 250, "deferred": 451, "failed": 550}[status]
            outs.append(Outcome(r.index, status, code, f"{code // 100}.0.0", "x"))  # type: ignore[arg-type]
        asyncio.run(self.q.record_outcomes(a, "relay", outs))  # type: ignore[arg-type]
        for r, o in zip(chosen, outs, strict=True):
            if o.status != "deferred":
                self.done.setdefault(qid, set()).add(r.address)

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def conclude(self, data: st.DataObject) -> None:
        qid = data.draw(st.sampled_from(sorted(self.attempts)))
        a = self.attempts.pop(qid)

        async def go():  # conclude asks for a commit round (sync_soon): let it finish in this loop
            out = self.q.conclude(a, self.bodies[qid])  # type: ignore[arg-type]
            await self.log.sync()
            return out

        c, pos = asyncio.run(go())
        if isinstance(c.record, EnvelopeRecord):
            self.waiting[qid] = (pos, c.record)

    @rule()
    def checkpoint(self) -> None:
        """What the daemon does every checkpoint_interval_s, with the model as the queue runners."""
        log, n = self.log, self.q.policy.runners
        head = log.end
        # A runner reads only up to the durable end: it cannot have passed a record not yet made durable.
        durable = log.durable_end
        queued = [*self.waiting.values(), *self.unacked.values()]
        positions = tuple(min((p for p, e in queued if min(e.runner, n - 1) == k), default=durable) for k in range(n))
        started = sorted({r.envelope for sc in scan_log(self.fs, LOG_DIR) for _, r in sc.records if isinstance(r, StartRecord)})
        garbage = tuple(tuple(p for p in started if p >= positions[k]) for k in range(n))
        suffix = self.q.working.earliest_start() or head
        cp = Checkpoint(head=head, suffix=suffix, runners=positions, garbage=garbage, written_ts=1000.0)
        asyncio.run(log.sync())
        write_checkpoint(self.fs, SPOOL, cp)
        garbage_end = min((*positions, self.q.working.earliest_envelope() or head, head))
        log.delete_segments_before(garbage_end.segment - 1)

    @rule(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(["random", "drop", "keep"]),
          intervals=st.sampled_from([(1.0,), (1.0, 2.0), (1.0, 2.0, 3.0), (2.0, 1.0)]))
    def crash_and_recover(self, seed: int, mode: str, intervals: tuple[float, ...]) -> None:
        """Power loss (or kill -9 for "keep"), then the only start there is: recovery, possibly with other
        retry intervals (runners merged or split). Then check I1-I4 and that every runner will offer what is
        live and nothing already started."""
        self.fs.crash(random.Random(seed), mode=mode)
        self.intervals = intervals
        self.attempts.clear()
        self.waiting.clear()
        self.unacked.clear()
        self._open()
        live = self._live()
        for qid, rcpts in self.acked.items():
            left = rcpts - self.done.get(qid, set())
            envs = live.get(qid, [])
            if left:  # I1
                assert 1 == len(envs), f"{qid}: {len(envs)} live envelopes for {sorted(left)}"
                assert left <= {r.address for r in envs[0][1].recipients}, f"{qid}: lost {left}"
        res = self.recovery
        recs = [(p, r) for sc in scan_log(self.fs, LOG_DIR) for p, r in sc.records]
        started = {r.envelope for _, r in recs if isinstance(r, StartRecord)}
        for pos, env in recs:  # nothing started is ahead of its runner unless that runner will skip it
            if isinstance(env, EnvelopeRecord) and env.runner >= 0 and pos in started:
                k = min(env.runner, len(res.runners) - 1)
                assert pos < res.runners[k] or pos in res.garbage[k], f"{env.queue_id}: {pos} would be offered again"
        for qid, envs in live.items():
            for pos, env in envs:
                k = min(env.runner, len(res.runners) - 1)
                assert pos >= res.runners[k] and pos not in res.garbage[k], f"{qid}: no runner will offer {pos}"
                addrs = {r.address for r in env.recipients}
                assert not addrs & self.done.get(qid, set()), f"{qid}: done recipients back in the queue"  # I2
                for r in env.recipients:  # I4
                    assert not (r.unknown and r.address in self.done.get(qid, set()))
                try:  # I3
                    body = self.q.read_body(env)
                except CorruptRecord:
                    assert qid not in self.acked, f"{qid}: acknowledged message with unreadable data"
                    self.waiting[qid] = (pos, env)  # a runner offers it too (and the worker ends it)
                    continue
                assert self.bodies[qid] == body, f"{qid}: body differs"
                if qid not in self.acked:  # survived without its 250: it is queued mail now
                    self.acked[qid] = addrs
                self.waiting[qid] = (pos, env)

    @invariant()
    def log_is_usable(self) -> None:
        assert self.log.failed is None


QueueMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestQueueModel = QueueMachine.TestCase


def test_negative_control_fsync_as_a_no_op_is_caught(monkeypatch):
    """The same machine with durability broken (fsync does nothing): it must find acknowledged mail lost.
    A model that cannot fail proves nothing."""
    import pytest
    from hypothesis.stateful import run_state_machine_as_test

    from mtaq.testing import crashfs

    monkeypatch.setattr(crashfs._CrashFile, "fsync", lambda self: None)
    with pytest.raises((AssertionError, ExceptionGroup)) as info:
        run_state_machine_as_test(
            QueueMachine,
            settings=settings(max_examples=200, stateful_step_count=25, deadline=None, database=None,
                              suppress_health_check=[HealthCheck.too_slow]),
        )
    found = info.value.exceptions if isinstance(info.value, ExceptionGroup) else (info.value,)
    assert any(isinstance(e, AssertionError) for e in found)
