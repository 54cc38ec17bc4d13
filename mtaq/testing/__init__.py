"""Test support shipped with the package (GUIDE §2: fakes and harnesses live beside the code they test).

Real peers (the ``mtaq sink`` next hop, a DNS server, daemons as subprocesses), fault injection (a crash
file system, power cuts, media damage, named kill points) and fixtures (prefilled spools).

May import :mod:`mtaq.core`, :mod:`mtaq.storage`, :mod:`mtaq.queue`, :mod:`mtaq.config` and :mod:`mtaq.logs`.
:mod:`mtaq.testing.killpoints` and :mod:`mtaq.testing.powercut` are hooks that production code calls (off
unless asked by an environment variable); killpoints imports nothing of mtaq. Nothing is imported here.
"""
