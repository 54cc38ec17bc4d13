"""Messages by state, and the parked envelopes (held or delayed) that no runner reads (pure: no I/O).

A message's state is the state of its latest live envelope, or ``active`` while an attempt (or an admin
action) is under way::

    incoming   envelope of runner 0 never attempted (new mail, or a retry due at once)
    deferred   envelope of a retry runner (attempted before, waiting for its interval)
    delayed    parked, due at not_before_ts (RFC 4865 FUTURERELEASE)
    held       parked until an administrator releases it (Postfix's hold queue)
    active     START appended, not yet concluded

:class:`QueueCounts` follows every transition with the envelope in hand (receive, START, conclusion), so a
count by state costs nothing to read (Apache James ADR 31: getSize must not browse the queue). Checkpoints
carry the counts as of their head; recovery replays what came after.

:class:`Parked` keeps the positions of parked envelopes in memory (``queue_id``, due time or None for
held). Parked envelopes are taken out of the runners' FIFOs so that a message delayed for a day never
blocks new mail (the head-of-line blocking of JAMES-4192); in exchange, their positions bound reclamation
and are written into every checkpoint.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from mtaq.core.records import PARKED, EnvelopeRecord, FinishRecord, Pos, Record, StartRecord

__all__ = ["ADMIN_ACTIONS", "ADMIN_BOUNCE", "COPY_FORWARD", "RECOVERY_END", "STATES", "Parked", "QueueCounts", "admin_conclusion", "state_of"]

STATES = ("incoming", "active", "deferred", "delayed", "held")


def state_of(env: EnvelopeRecord) -> str:
    """The state of a message whose live envelope is ``env`` (not ``active``: that is a START's doing)."""
    if env.runner == PARKED:
        return "held" if env.held else "delayed"
    return "incoming" if env.runner == 0 else "deferred"


@dataclass
class QueueCounts:
    """Messages by state (see the module docstring). Counts never go below zero."""

    by_state: Counter[str] = field(default_factory=Counter)

    def added(self, env: EnvelopeRecord) -> None:
        """A new message (or a DSN) was queued with envelope ``env``."""
        self.by_state[state_of(env)] += 1

    def started(self, env: EnvelopeRecord) -> None:
        """An attempt (or admin action) started on ``env``."""
        self._dec(state_of(env))
        self.by_state["active"] += 1

    def concluded(self, replacement: EnvelopeRecord | None) -> None:
        """An attempt ended: with a replacement envelope, or with none (FINISH: the message is gone)."""
        self._dec("active")
        if replacement is not None:
            self.by_state[state_of(replacement)] += 1

    def replay(self, rec: Record, envelope_at: Callable[[Pos], EnvelopeRecord | None]) -> None:
        """Apply a record read back from the log (recovery, offline size): the same transitions as above.
        ``envelope_at`` finds the envelope a START names (None if unreadable: that START is not counted)."""
        if isinstance(rec, EnvelopeRecord):
            if rec.replaces is None:
                self.added(rec)
            else:
                self.concluded(rec)
        elif isinstance(rec, StartRecord):
            env = envelope_at(rec.envelope)
            if env is not None:
                self.started(env)
        elif isinstance(rec, FinishRecord):
            self.concluded(None)

    def _dec(self, state: str) -> None:
        if self.by_state[state] > 0:
            self.by_state[state] -= 1

    def total(self) -> int:
        """Messages in the queue, whatever their state."""
        return sum(self.by_state[s] for s in STATES)

    def as_dict(self) -> dict[str, int]:
        """``{"incoming": n, "active": n, "deferred": n, "delayed": n, "held": n, "total": n}``."""
        out = {s: self.by_state[s] for s in STATES}
        out["total"] = self.total()
        return out

    def snapshot(self) -> tuple[tuple[str, int], ...]:
        """For the checkpoint."""
        return tuple((s, self.by_state[s]) for s in STATES)

    @classmethod
    def restore(cls, pairs: tuple[tuple[str, int], ...]) -> QueueCounts:
        return cls(Counter({s: n for s, n in pairs if s in STATES}))


@dataclass
class Parked:
    """Parked envelopes by position: ``pos -> (queue_id, due)``; ``due`` is None for held mail."""

    entries: dict[Pos, tuple[str, float | None]] = field(default_factory=dict)

    def add(self, pos: Pos, env: EnvelopeRecord) -> None:
        assert env.runner == PARKED
        self.entries[pos] = (env.queue_id, None if env.held else env.not_before_ts)

    def remove(self, pos: Pos) -> bool:
        """Forget ``pos``; True if it was parked."""
        return self.entries.pop(pos, None) is not None

    def __contains__(self, pos: object) -> bool:
        return pos in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def due(self, now: float) -> list[Pos]:
        """Delayed envelopes due at ``now`` (UTC seconds), earliest first."""
        out = [(d, p) for p, (_q, d) in self.entries.items() if d is not None and d <= now]
        return [p for _d, p in sorted(out)]

    def next_due(self) -> float | None:
        """The earliest due time of a delayed envelope, or None."""
        return min((d for _q, d in self.entries.values() if d is not None), default=None)

    def earliest(self) -> Pos | None:
        """The earliest parked position (bounds reclamation), or None."""
        return min(self.entries, default=None)


ADMIN_ACTIONS = ("delete", "hold", "release", "flush", "bounce", "delay")
# Not an administrator's: the daemon's own copy of a parked (held or delayed) envelope to the log's end,
# unchanged but for its generation, so that mail parked for days never pins old segments (seed 001: data
# copied forward). Written like an admin action (START with admin="copy", then the replacement).
COPY_FORWARD = "copy"
# Not an administrator's either: recovery's own ending of an envelope that is no message of its own (a
# replacement or DSN it distrusts, docs/log_format.md "What recovery trusts"): START with admin="end", then
# FINISH, never an attempt. A crash between the two is completed with the FINISH (issue 31, explorer V9:
# taken for a delivery attempt, the orphan was bounced or retried beside the message it came from).
RECOVERY_END = "end"


def admin_conclusion(
    env: EnvelopeRecord, start_pos: Pos, action: str, now_ts: float, release_ts: float | None = None
) -> EnvelopeRecord | FinishRecord:
    """The record that concludes an administrator's action on ``env`` (started at ``start_pos``).

    ``delete``: FINISH (the message is gone, no DSN; Postfix ``postsuper -d``); so is :data:`RECOVERY_END`. ``hold``: a replacement
    that is parked and held (``postsuper -h``). ``release``: a replacement for the new-mail runner, due now
    (``postsuper -H``). ``flush``: the same for deferred or delayed mail (``postqueue -i``). ``delay``: a
    replacement parked until ``release_ts`` (UTC seconds; the admin API's delayed delivery). ``copy``
    (:data:`COPY_FORWARD`): the same parked envelope, one generation later. ``bounce`` is
    concluded like a delivery attempt whose recipients all failed (see :data:`ADMIN_BOUNCE`), by the caller.
    The replacement keeps the DATA reference; the caller copies the data forward. Raises ValueError for
    an unknown action.
    """
    if action in ("delete", RECOVERY_END):
        return FinishRecord(queue_id=env.queue_id, start=start_pos, ts=now_ts)
    if action == COPY_FORWARD:
        return msgspec.structs.replace(env, generation=env.generation + 1, replaces=start_pos)
    if action == "delay":
        if release_ts is None:
            raise ValueError("delay needs a release time")
        return msgspec.structs.replace(
            env, generation=env.generation + 1, not_before_ts=release_ts, replaces=start_pos, runner=PARKED, held=False
        )
    if action not in ("hold", "release", "flush"):
        raise ValueError(f"unknown admin action {action!r}")
    hold = action == "hold"
    return msgspec.structs.replace(
        env,
        generation=env.generation + 1,
        not_before_ts=env.not_before_ts if hold else now_ts,
        replaces=start_pos,
        runner=PARKED if hold else 0,
        held=hold,
    )


# How ``bounce`` ends every recipient: RFC 3463 X.4.7 "delivery time expired", permanent (Postfix
# ``postsuper -e``/``-f``: the message is returned to the sender as expired).
ADMIN_BOUNCE = (554, "5.4.7", "message expired by the administrator")
