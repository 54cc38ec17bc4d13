"""Named kill points: the daemon SIGKILLs itself at a chosen point (for crash tests; off unless asked).

``MTAQ_KILL_POINT=name`` (and optionally ``MTAQ_KILL_AFTER=N``, default 1) makes the N-th pass through
:func:`hit` with that name kill the process with SIGKILL, as a power cut or ``kill -9`` would at exactly that
moment (the issue's "crash at each named point"; FoundationDB-style buggify, but only a kill). Points:

* ``edge.after_commit``: the message is durable, the 250 is not sent yet;
* ``delivery.after_remote_reply``: the next hop answered, our DELIVERY record is not written yet;
* ``checkpoint.after_tmp``: the new checkpoint is written and fsync'd as a temp file, not yet renamed;
* ``reclaim.after_first_unlink``: one of several garbage segments is unlinked, the directory not fsync'd;
* ``recovery.before_conclude``: recovery has read the working suffix, not yet concluded the attempts;
* ``pickup.before_receive``: maildrop files read and checked, nothing of them appended yet;
* ``pickup.after_receive``: their envelopes are durable, the files not yet unlinked;
* ``pickup.after_unlink``: the files are unlinked, the maildrop directory not yet fsync'd.

Counted points (``COUNTED``), for kills at every step of a sequence rather than at one moment:

* ``log.roll``: a segment was sealed and the next one created, neither fsync'd yet (the sealed one's tail
  is only in the page cache: the next run reads it, and a later power cut can take it);
* ``log.append``: a record was appended to the log (written, not yet fsync'd), any time in the run;
* ``recovery.append``: the same, counted only while recovery runs (:data:`recovering`, set by the daemon
  around :func:`mtaq.queue.recovery.recover`): ``MTAQ_KILL_AFTER=k`` kills recovery right after its k-th
  append (a FINISH, a DSN, a replacement), and not at all if it appends fewer.
"""

from __future__ import annotations

import os
import signal

__all__ = ["COUNTED", "POINTS", "hit"]

POINTS = (
    "edge.after_commit",
    "delivery.after_remote_reply",
    "checkpoint.after_tmp",
    "reclaim.after_first_unlink",
    "recovery.before_conclude",
    "pickup.before_receive",
    "pickup.after_receive",
    "pickup.after_unlink",
)
COUNTED = ("log.append", "log.roll", "recovery.append")
recovering = False  # True while recovery runs (the daemon sets it): log.append counts as recovery.append too
_POINT = os.environ.get("MTAQ_KILL_POINT") or None
_AFTER = int(os.environ.get("MTAQ_KILL_AFTER", "1") or "1")
_count = 0


def hit(name: str) -> None:
    """Kill the process with SIGKILL if ``name`` is the configured point and its count is reached."""
    global _count
    if _POINT is None:
        return
    if name != _POINT and not (recovering and name == "log.append" and _POINT == "recovery.append"):
        return
    _count += 1
    if _count >= _AFTER:
        os.kill(os.getpid(), signal.SIGKILL)
