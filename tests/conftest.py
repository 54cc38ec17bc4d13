"""Shared fixtures: a real sink and a real daemon as subprocesses, in a temporary directory."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from mtaq.testing.filters import Filter, OpenDkim, Rspamd, start_opendkim, start_rspamd, start_rspamd_distribution
from mtaq.testing.procs import Proc, mail_owner_ready, read_events, start_daemon, start_sink

_OWN_TEMPROOT = ""


def pytest_configure(config) -> None:
    """Run as root, each session gets its own temporary root (``PYTEST_DEBUG_TEMPROOT``, mode 0711): pytest
    makes ``pytest-of-root`` 0700 again at every session's start, which shut out the daemons (mail_owner) of
    another session running beside it (their spools are in it). Removed at the end when every test passed."""
    global _OWN_TEMPROOT
    if os.geteuid() == 0 and "PYTEST_DEBUG_TEMPROOT" not in os.environ:
        _OWN_TEMPROOT = tempfile.mkdtemp(prefix="mt")  # short: unix socket paths under it stay below 108 bytes
        os.chmod(_OWN_TEMPROOT, 0o711)
        os.environ["PYTEST_DEBUG_TEMPROOT"] = _OWN_TEMPROOT


def pytest_sessionfinish(session, exitstatus) -> None:
    if _OWN_TEMPROOT and exitstatus == 0:
        shutil.rmtree(_OWN_TEMPROOT, ignore_errors=True)


@pytest.fixture(autouse=True)
def _mail_owner_reaches_tmp_path(request) -> None:
    """The tests run as root, so every daemon switches to mail_owner (mtaq.daemon.privileges): it must reach
    its spool in the test's 0700 temporary directory (and the Python it runs on)."""
    if "tmp_path" in request.fixturenames:
        mail_owner_ready(str(request.getfixturevalue("tmp_path")))


class Relay:
    """A sink and a daemon relaying to it; kills both at the end."""

    def __init__(self, tmp, sink_args=(), config: str = "") -> None:
        self.tmp = tmp
        self.maildir = str(tmp / "maildir")
        self.spool = str(tmp / "spool")
        self.config = None
        if config:
            self.config = str(tmp / "mtaq.toml")
            (tmp / "mtaq.toml").write_text(config)
        self.sink = start_sink(self.maildir, str(tmp / "sink.log"), extra=list(sink_args))
        try:
            self.daemon: Proc = self.start()
        except BaseException:
            self.sink.kill9()  # the daemon did not start: the fixture never sees this relay to close it
            raise

    def start(self, port: int | None = None) -> Proc:
        self.daemon = start_daemon(self.spool, self.sink.port, str(self.tmp / "daemon.log"), port=port, config=self.config)
        return self.daemon

    def restart(self) -> Proc:
        self.daemon.kill9()
        return self.start(port=self.daemon.port)

    def events(self, name: str | None = None) -> list[dict]:
        return [e for e in read_events(self.daemon.log_path) if name is None or e.get("event") == name]

    def wait_for(self, pred, timeout_s: float = 20.0, what: str = "condition"):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            v = pred()
            if v:
                return v
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def close(self) -> None:
        self.daemon.kill9()
        self.sink.kill9()


@pytest.fixture
def relay_factory(tmp_path) -> Iterator:
    made: list[Relay] = []

    def make(sink_args=(), config: str = "") -> Relay:
        r = Relay(tmp_path, sink_args, config)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.fixture(scope="session")
def spark():
    """One SparkSession (local[2], UTC) for the whole test session: starting one costs 6-9 s."""
    pytest.importorskip("pyspark")
    from mtaq.analytics.job import spark_session, stop_session

    s = spark_session("local[2]", [("spark.ui.enabled", "false")], app="mtaq tests")
    from mtaq.analytics.datasource import register

    register(s)  # spark.read.format("mtaq") (the job itself runs its tasks as an RDD, without it)
    yield s
    stop_session(s)


@pytest.fixture
def ipv6_port_taken() -> Iterator[int]:
    """A port on ``::1`` that a listening socket of the test holds (so binding it fails with EADDRINUSE);
    skips the test where the machine has no IPv6 loopback."""
    import socket

    with socket.socket(socket.AF_INET6) as taken:
        try:
            taken.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback")
        taken.listen()
        yield taken.getsockname()[1]


class Filters:
    """Real milters for a test (mtaq.testing.filters): each started in its own directory under the test's
    tmp_path, all stopped (SIGTERM, then SIGKILL) at the end of the test."""

    def __init__(self, tmp) -> None:
        self.tmp = tmp
        self.started: list[Filter] = []

    def rspamd(self, **kw) -> Rspamd:
        """:func:`mtaq.testing.filters.start_rspamd` (its milter address: ``.address``, inet:127.0.0.1:PORT)."""
        f = start_rspamd(str(self.tmp / f"rspamd{len(self.started)}"), **kw)
        self.started.append(f)
        return f

    def rspamd_distribution(self, local_d, **kw) -> Rspamd:
        """:func:`mtaq.testing.filters.start_rspamd_distribution`: /etc/rspamd with ``local_d`` as local.d."""
        f = start_rspamd_distribution(str(self.tmp / f"rspamd{len(self.started)}"), local_d, **kw)
        self.started.append(f)
        return f

    def opendkim(self, **kw) -> OpenDkim:
        """:func:`mtaq.testing.filters.start_opendkim` (``.address``; ``.dns_txt``/``.zone_line``: its public key)."""
        f = start_opendkim(str(self.tmp / f"opendkim{len(self.started)}"), **kw)
        self.started.append(f)
        return f

    def stop(self) -> None:
        for f in self.started:
            f.stop()


@pytest.fixture
def filters(tmp_path) -> Iterator[Filters]:
    """Start real milters with options: ``filters.rspamd(reject=...)``, ``filters.opendkim(internal_hosts=())``."""
    made = Filters(tmp_path)
    yield made
    made.stop()


@pytest.fixture
def rspamd_milter(filters) -> Rspamd:
    """rspamd's proxy worker in milter mode (self-scan, no network, no Redis) on inet:127.0.0.1:PORT."""
    return filters.rspamd()


@pytest.fixture
def opendkim_milter(filters) -> OpenDkim:
    """OpenDKIM signing example.test (selector mtaq) for 127.0.0.1 and authenticated clients."""
    return filters.opendkim()
