"""Process wiring: ``mtaq serve``, where every other package is put together.

* :mod:`mtaq.daemon.process`: one daemon process: open the log, listen at once, recover, run the queue
  runners, delivery, checkpoints, reclamation and the admin API;
* :mod:`mtaq.daemon.workers`: several such processes accepting on one port, one spool shard each,
  under a crash-only supervisor; and where the shards of a spool are.

May import any package of mtaq; only :mod:`mtaq.cli` imports it. Nothing is imported here.
"""
