"""The queue itself, over the log: what the project exists for (seed 001).

* :mod:`mtaq.queue.store`: :class:`~mtaq.queue.store.Queue`, every change of a message's state (receive,
  start, delivery outcome, conclusion with its DSNs, administrators' actions), appended to the log first,
  then applied to the in-memory working set;
* :mod:`mtaq.queue.runners`: one queue runner per retry interval plus one for new mail, each a cursor over
  the log, and the dispatcher between them and the delivery workers;
* :mod:`mtaq.queue.recovery`: the only start: read the working suffix from the checkpoint, set damage
  aside, conclude interrupted attempts.

May import :mod:`mtaq.core` and :mod:`mtaq.storage` (and the kill-point hook of :mod:`mtaq.testing`);
never the SMTP edge, delivery, administration or the daemon's wiring. Nothing is imported here.
"""
