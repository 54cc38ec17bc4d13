"""The analytics job through Spark Connect (issue 38, item 2): ``mtaq analyze --remote sc://HOST:PORT``.

A real Spark Connect server (``spark-submit --class org.apache.spark.sql.connect.service.SparkConnectServer``,
PySpark's own jar, ``local[2]`` behind it) runs as its own JVM process on a loopback port, and the job is run
against it as an administrator would: the ``mtaq analyze`` command with ``--remote``. The server's Python
workers run without the site-packages' ``.pth`` files, so ``mtaq`` is not importable there from this
checkout's editable install: the tasks can only run from the modules the client ships (``addArtifacts``).
Every table and the totals equal a local run's. Nothing is faked; only the machine is one.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyspark.sql.connect.client", reason="the spark-connect extra (grpcio, pandas)")

from test_analytics_cluster import _events, _spark_env, _tables  # tests/ is on sys.path (rootdir mode prepend)
from test_analytics_incremental import write_log

TOKEN = "mtaq-test-token"  # the server's pre-shared key (spark.connect.authenticate.token), as the README says
START_S = 180.0  # the server's JVM and its first Python worker on a loaded 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ConnectServer:
    """A Spark Connect server on 127.0.0.1 (its own JVM, ``local[2]``) whose Python workers see no ``.pth``."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.log = base / "server.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # Python workers started with -S (no site module: no .pth files, so no editable mtaq), the
        # site-packages on PYTHONPATH for pyarrow and PySpark's dependencies.
        wrapper = self.base / "python-no-pth"
        site = sysconfig.get_paths()["purelib"]
        wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="$PYTHONPATH:{site}" exec {sys.executable} -S "$@"\n')
        wrapper.chmod(0o755)
        env = {**_spark_env(), "PYSPARK_PYTHON": str(wrapper)}
        env.pop("PYTHONPATH", None)
        submit = os.path.join(os.path.dirname(sys.executable), "spark-submit")
        for _ in range(3):  # a free port can be taken between the probe and the bind: try another
            self.port = _free_port()
            with open(self.log, "wb") as f:
                self.proc = subprocess.Popen(
                    [submit, "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
                     "--master", "local[2]", "--conf", f"spark.connect.grpc.binding.port={self.port}",
                     "--conf", "spark.connect.grpc.binding.address=127.0.0.1", "--conf", "spark.ui.enabled=false",
                     "--conf", f"spark.connect.authenticate.token={TOKEN}",
                     "--driver-memory", "1g", "spark-internal"],
                    stdout=f, stderr=subprocess.STDOUT, env=env, cwd=self.base, start_new_session=True)
            deadline = time.monotonic() + START_S
            while time.monotonic() < deadline and self.proc.poll() is None:
                if re.search(r"Spark Connect server started at: 127\.0\.0\.1:\d+", self.log.read_text(errors="replace")):
                    return
                time.sleep(0.2)
            self.stop()
        raise AssertionError(f"the Spark Connect server did not start:\n{self.log.read_text()[-3000:]}")

    @property
    def url(self) -> str:
        """The server with its token (a plain channel: PySpark sends a token without TLS only to localhost)."""
        return f"sc://localhost:{self.port}/;token={TOKEN}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory) -> Iterator[ConnectServer]:
    s = ConnectServer(tmp_path_factory.mktemp("connect"))
    try:
        s.start()
        yield s
    finally:
        s.stop()


def _env() -> dict[str, str]:
    """This environment with the mtaq under test first on PYTHONPATH (the subprocesses run elsewhere)."""
    import mtaq

    return {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(mtaq.__file__)))}


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mtaq.cli", "analyze", *args], capture_output=True, text=True,
                          timeout=540, cwd=cwd, env=_env())


def test_mtaq_analyze_remote_equals_a_local_run(spark, connect_server, tmp_path):
    """``mtaq analyze --remote sc://127.0.0.1:PORT`` (relative --segments, --events): every table and the totals
    equal those of the same job on a local session, and the server's Python workers ran its tasks from the
    modules the client shipped."""
    from mtaq.analytics.job import Options, analyze

    spool = tmp_path / "spool"
    write_log(str(spool), {})  # 40 messages over 7 segments of 4 KiB (sealed and the live one)
    _events(tmp_path / "mtaq.log")
    events = [str(tmp_path / "mtaq.log.1.gz"), str(tmp_path / "mtaq.log")]
    local = analyze(spark, Options(paths=[str(spool)], out=str(tmp_path / "local"), top=5, partition_bytes=5000,
                                   plots=False, events=events))

    p = _cli("--remote", connect_server.url, "--segments", "spool", "--out", str(tmp_path / "remote"),
             "--events", *events, "--json", "--quiet", "--top", "5", "--partition-bytes", "5000", "--no-plots",
             cwd=tmp_path)
    assert 0 == p.returncode, p.stderr[-3000:]
    totals = json.loads(p.stdout.strip().splitlines()[-1])
    assert {k: local.totals[k] for k in totals} == totals
    assert (40, 2, 7) == (totals["received"], totals["rejected"], totals["segments"])
    want = _tables(tmp_path / "local" / "tables")
    got = _tables(tmp_path / "remote" / "tables")
    assert {"outcomes", "messages", "senders", "recipients", "totals", "rejections"} <= set(want)
    assert sorted(want) == sorted(got)
    assert {} == {t: "differs" for t in want if want[t] != got[t]}
    assert (tmp_path / "remote" / "report.md").read_text().count("\n") > 20
    assert "Warning" not in p.stderr, p.stderr  # e.g. PySpark's about a pandas it does not support
    # the tasks ran in the server's Python workers, which cannot import this checkout's mtaq: only the shipped one
    assert re.search(r"Finished task \d+\.\d+ in stage", connect_server.log.read_text(errors="replace"))
    no_pth = subprocess.run([str(connect_server.base / "python-no-pth"), "-c", "import pyarrow, mtaq"],
                            capture_output=True, text=True, cwd="/", env={"PATH": os.environ["PATH"]})
    assert "No module named 'mtaq'" in no_pth.stderr, no_pth.stderr


def test_the_spark_paths_of_the_job_through_connect_equal_a_local_run(spark, connect_server, tmp_path):
    """With every message merged by Spark (no task closes one, no driver merge) and the senders and
    recipients added up by Spark, the Spark Connect forms of the tasks (mapInArrow) give the tables and totals
    of the local run's RDD forms."""
    from mtaq.analytics.job import Options, analyze

    spool = tmp_path / "spool"
    write_log(str(spool), {})
    kw = {"top": 5, "partition_bytes": 5000, "plots": False, "close_messages": False, "driver_merge_rows": 0,
          "driver_table_rows": 0}
    local = analyze(spark, Options(paths=[str(spool)], out=str(tmp_path / "local"), **kw))
    script = (
        "import json, sys\n"
        "from mtaq.analytics.job import Options, analyze\n"
        "from mtaq.analytics.session import spark_session, stop_session\n"
        f"s = spark_session(remote={connect_server.url!r})\n"
        "notes = []\n"
        f"r = analyze(s, Options(paths=[{str(spool)!r}], out={str(tmp_path / 'remote')!r}, progress=notes.append, **{kw!r}))\n"
        "stop_session(s)\n"
        "print(json.dumps({'totals': r.totals, 'notes': notes}, default=str))\n"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=540, cwd=tmp_path,
                       env=_env())
    assert 0 == p.returncode, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert any("merged by Spark" in n for n in got["notes"]), got["notes"]
    assert any("by Spark" in n and "senders" in n for n in got["notes"]), got["notes"]
    assert json.loads(json.dumps(local.totals, default=str)) == got["totals"]
    want = _tables(tmp_path / "local" / "tables")
    assert {} == {t: "differs" for t, rows in _tables(tmp_path / "remote" / "tables").items() if want.get(t) != rows}
    assert sorted(want) == sorted(_tables(tmp_path / "remote" / "tables"))


def test_an_ipv6_literal_url_reaches_the_server(tmp_path):
    """sc://[::1]:PORT: the brackets are PySpark's, not the host's (nothing listens there: the refusal is the
    connection's, not a name lookup's)."""
    spool = tmp_path / "spool"
    write_log(str(spool), {})
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]
    p = _cli("--remote", f"sc://[::1]:{port}", "--segments", str(spool), "--out", str(tmp_path / "o"), "--quiet",
             cwd=tmp_path)
    assert 2 == p.returncode, p.stderr
    assert "Connection refused" in p.stderr, p.stderr


@pytest.mark.parametrize(("url", "said"), [
    ("http://127.0.0.1:15002", "expected a Spark Connect URL sc://HOST:PORT"),
    ("sc://127.0.0.1:x", "--remote sc://127.0.0.1:x: "),
    ("sc://", "--remote sc://: "),
])
def test_a_bad_remote_url_is_one_line_and_exit_2(tmp_path, url, said):
    spool = tmp_path / "spool"
    write_log(str(spool), {})
    p = _cli("--remote", url, "--segments", str(spool), "--out", str(tmp_path / "o"), "--no-plots", "--quiet",
             cwd=tmp_path)
    assert (2, 1) == (p.returncode, len(p.stderr.strip().splitlines())), p.stderr
    assert p.stderr.startswith(f"mtaq: {said}" if said.startswith("--") else "mtaq: --remote: " + said), p.stderr
    assert not (tmp_path / "o").exists()


def test_an_unreachable_server_is_one_line_within_seconds(tmp_path):
    """PySpark's client would retry for minutes: the command says at once that nothing listens."""
    spool = tmp_path / "spool"
    write_log(str(spool), {})
    t0 = time.monotonic()
    p = _cli("--remote", f"sc://127.0.0.1:{_free_port()}", "--segments", str(spool), "--out", str(tmp_path / "o"),
             "--no-plots", "--quiet", cwd=tmp_path)
    assert (2, 1) == (p.returncode, len(p.stderr.strip().splitlines())), p.stderr
    assert "cannot reach the Spark Connect server" in p.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize(("how", "said"), [
    ("no token", "UNAUTHENTICATED: No authentication token provided"),
    ("wrong token", "UNAUTHENTICATED: Invalid authentication token"),
    ("TLS to a plain server", "UNAVAILABLE: "),
    ("a setting the server owns", "--conf spark.driver.memory: "),
])
def test_a_refused_session_is_one_line_and_exit_2(connect_server, tmp_path, how, said):
    """What the server refuses on the session's first requests, or a TLS channel it does not speak (a few
    seconds of retries, not PySpark's ten minutes): one line, exit 2, nothing written."""
    spool = tmp_path / "spool"
    write_log(str(spool), {})
    url = {"no token": f"sc://localhost:{connect_server.port}",
           "wrong token": f"sc://localhost:{connect_server.port}/;token=guess",
           "TLS to a plain server": f"sc://127.0.0.1:{connect_server.port}/;token={TOKEN}"}.get(how, connect_server.url)
    conf = ["--conf", "spark.driver.memory=2g"] if how == "a setting the server owns" else []
    t0 = time.monotonic()
    p = _cli("--remote", url, *conf, "--segments", str(spool), "--out", str(tmp_path / "o"), "--no-plots", "--quiet",
             cwd=tmp_path)
    assert (2, 1) == (p.returncode, len(p.stderr.strip().splitlines())), p.stderr
    shown = url.replace(f"token={TOKEN}", "token=***").replace("token=guess", "token=***")
    assert p.stderr.startswith(f"mtaq: --remote {shown}: {said}"), p.stderr
    assert TOKEN not in p.stderr and "guess" not in p.stderr  # the token is never printed
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "o").exists()


def test_remote_and_master_together_are_refused(tmp_path):
    p = _cli("--remote", "sc://127.0.0.1:1", "--master", "local[1]", "--segments", str(tmp_path), "--out",
             str(tmp_path / "o"), cwd=tmp_path)
    assert 2 == p.returncode
    assert "not allowed with argument" in p.stderr


def test_spark_remote_in_the_environment_is_taken_as_remote(connect_server, tmp_path):
    """PySpark takes SPARK_REMOTE as "run on Spark Connect": so does `mtaq analyze` without --master, as if
    --remote named it (the job runs on the server, the token is never printed). Before, the local session's
    master and SPARK_REMOTE together made PySpark fail with a traceback that printed the URL and its token."""
    spool = tmp_path / "spool"
    write_log(str(spool), {})
    p = subprocess.run([sys.executable, "-m", "mtaq.cli", "analyze", "--segments", "spool", "--out",
                        str(tmp_path / "o"), "--json", "--no-plots"], capture_output=True, text=True, timeout=540,
                       cwd=tmp_path, env={**_env(), "SPARK_REMOTE": connect_server.url})
    assert 0 == p.returncode, p.stderr[-3000:]
    assert f"connecting to Spark Connect at {connect_server.url.replace(TOKEN, '***')}" in p.stderr
    assert TOKEN not in p.stderr + p.stdout
    assert 40 == json.loads(p.stdout.strip().splitlines()[-1])["received"]


@pytest.mark.parametrize(("master", "value", "said"), [
    (["--master", "local[1]"], f"sc://127.0.0.1:1/;token={TOKEN}",
     "mtaq: --master local[1]: SPARK_REMOTE=sc://127.0.0.1:1/;token=*** is set in the environment"),
    ([], "local", "mtaq: SPARK_REMOTE: expected a Spark Connect URL sc://HOST:PORT, got 'local'"),
    ([], f"sc://127.0.0.1:{_free_port()}/;token={TOKEN}", "mtaq: SPARK_REMOTE sc://127.0.0.1:"),
])
def test_spark_remote_in_the_environment_that_cannot_be_used_is_one_line(tmp_path, master, value, said):
    """SPARK_REMOTE beside --master, not a Spark Connect URL, or naming a port where nothing listens: one line,
    exit 2, the token never printed, nothing written."""
    spool = tmp_path / "spool"
    write_log(str(spool), {})
    p = subprocess.run([sys.executable, "-m", "mtaq.cli", "analyze", *master, "--segments", str(spool), "--out",
                        str(tmp_path / "o"), "--no-plots", "--quiet"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env={**_env(), "SPARK_REMOTE": value})
    assert (2, 1) == (p.returncode, len(p.stderr.strip().splitlines())), p.stderr
    assert p.stderr.startswith(said), p.stderr
    assert TOKEN not in p.stderr
    assert not (tmp_path / "o").exists()
