"""The analytics job on a real Spark standalone cluster (issue 38, item 2).

A master and two workers run as separate JVM processes (``spark-class org.apache.spark.deploy.master.Master``
and ``...deploy.worker.Worker``) on real loopback ports, and the job is submitted exactly as the README's
"On a cluster" section says: ``spark-submit --master spark://127.0.0.1:PORT --deploy-mode client --py-files
mtaq.zip mtaq/analytics/submit.py ...``. Every table it writes equals a local run's, and both workers' executors
ran tasks of it (their own logs say so). Nothing here is faked: the JVMs, ports, executors and Python workers
are Spark's own; only the machine is one.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from test_analytics_incremental import write_log  # tests/ is on sys.path (pytest, rootdir mode prepend)

START_S = 120.0  # a JVM's start on a loaded 2-core machine takes 5-20 s


def _spark_env() -> dict[str, str]:
    import pyspark

    return {**os.environ, "SPARK_HOME": os.path.dirname(pyspark.__file__), "SPARK_LOCAL_IP": "127.0.0.1",
            # no REST submission server: it takes a fixed port (6066), and nothing here uses it
            "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
            "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}


def _wait_for_line(log: Path, proc: subprocess.Popen, pattern: str, what: str, count: int = 1) -> list[str]:
    """Wait until ``log`` holds ``count`` lines matching ``pattern`` (a regex; its first group is returned)."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        found = re.findall(pattern, log.read_text(errors="replace"))
        if len(found) >= count:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"{what}: not seen in {START_S:.0f} s:\n{log.read_text()[-3000:]}")


class Standalone:
    """A Spark standalone master and two one-core workers on loopback, each its own JVM process."""

    def __init__(self, base: Path) -> None:
        self.base, self.procs = base, []
        self.env = _spark_env()
        self.spark_class = shutil.which("spark-class", path=os.path.dirname(sys.executable))
        assert self.spark_class is not None
        self.work = [base / "worker-1", base / "worker-2"]

    def _start(self, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
        log = self.base / f"{name}.log"
        with open(log, "wb") as f:
            p = subprocess.Popen([self.spark_class, *args], stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                 cwd=self.base, start_new_session=True)
        self.procs.append(p)
        return p, log

    def start(self) -> None:
        p, mlog = self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                              "--port", "0", "--webui-port", "0")
        [self.url] = _wait_for_line(mlog, p, r"Starting Spark master at (spark://127\.0\.0\.1:\d+)", "the master")
        for i, work in enumerate(self.work, 1):
            work.mkdir()
            self._start(f"worker-{i}", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--port", "0",
                        "--webui-port", "0", "--cores", "1", "--memory", "1g", "--work-dir", str(work), self.url)
        _wait_for_line(mlog, p, r"Registering worker (127\.0\.0\.1:\d+) with 1 cores", "two workers", count=2)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()


@pytest.fixture(scope="module")
def standalone(tmp_path_factory) -> Iterator[Standalone]:
    c = Standalone(tmp_path_factory.mktemp("standalone"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def module_zip(path: Path) -> str:
    """dist/mtaq.zip as ``make spark-zip`` makes it (the package's modules and its shipped TOML, written by
    the same function that ships them to a Spark Connect server); returns the directory above ``mtaq/``."""
    from mtaq.analytics.session import package_zip

    package_zip(str(path))
    return os.path.dirname(os.path.dirname(os.path.abspath(__import__("mtaq").__file__)))


def _tables(*dirs: Path) -> dict[str, list[str]]:
    """Every Parquet table under ``dirs`` (name → its rows as sorted reprs), read with pyarrow."""
    import pyarrow.parquet as pq

    got = {}
    for d in dirs:
        for t in sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
            got[t.name] = sorted(repr(r) for r in pq.read_table(t).to_pylist())
    return got


def _events(path: Path) -> None:
    """Two rotated event logs (the older gzip'd) with refusals, as the daemon writes them (JSON lines)."""
    def ev(ts: str, **kw) -> str:
        return json.dumps({"timestamp": ts, "level": "info", **kw}) + "\n"

    with gzip.open(path.with_suffix(".log.1.gz"), "wt") as f:
        f.write(ev("2025-03-02T01:00:00Z", event="smtp_reject", client="192.0.2.7", stage="rcpt", code=554,
                   enhanced="5.7.1", reply="554 5.7.1 <x@far.example>: Relay access denied", sender="s@a.example",
                   recipient="x@far.example"))
    path.write_text(ev("2025-03-02T02:00:00Z", event="connection_refused", client="192.0.2.8",
                       reason="too many connections from your address", code=421))


def test_the_job_on_a_standalone_cluster_equals_a_local_run(spark, standalone, tmp_path):
    """spark-submit --master spark://127.0.0.1:PORT --deploy-mode client --py-files mtaq.zip submit.py: every
    table (the small ones under OUT/tables, the big ones under --parquet-out) and the totals equal those of
    the same job run locally; each worker's executor ran tasks of it."""
    from mtaq.analytics.job import Options, analyze

    spool = tmp_path / "spool"
    write_log(str(spool), {})  # 40 messages over 7 segments of 4 KiB (sealed and the live one)
    assert len(glob.glob(f"{spool}/log/*.seg")) >= 5
    _events(tmp_path / "mtaq.log")
    events = [str(tmp_path / "mtaq.log.1.gz"), str(tmp_path / "mtaq.log")]
    flags = ["--top", "5", "--partition-bytes", "5000", "--no-plots"]

    local = analyze(spark, Options(paths=[str(spool)], out=str(tmp_path / "local"), parquet_out=str(tmp_path / "local-big"),
                                   top=5, partition_bytes=5000, plots=False, events=events))

    pkg = module_zip(tmp_path / "mtaq.zip")
    submit = shutil.which("spark-submit", path=os.path.dirname(sys.executable))
    assert submit is not None
    p = subprocess.run(
        [submit, "--master", standalone.url, "--deploy-mode", "client", "--py-files", str(tmp_path / "mtaq.zip"),
         # wait for both executors before the first task (else the first to register may run them all)
         "--conf", "spark.cores.max=2", "--conf", "spark.scheduler.minRegisteredResourcesRatio=1.0",
         "--conf", "spark.scheduler.maxRegisteredResourcesWaitingTime=600s", "--conf", "spark.ui.enabled=false",
         "--executor-memory", "512m", f"{pkg}/mtaq/analytics/submit.py",
         "--segments", str(spool), "--out", str(tmp_path / "cluster"), "--parquet-out", str(tmp_path / "cluster-big"),
         "--events", *events, "--json", "--quiet", *flags],
        capture_output=True, text=True, timeout=540, cwd=tmp_path, env=standalone.env)
    assert 0 == p.returncode, p.stderr[-3000:]
    totals = json.loads(p.stdout.strip().splitlines()[-1])
    assert {k: local.totals[k] for k in totals if k in local.totals} == {k: v for k, v in totals.items()
                                                                          if k in local.totals}
    assert (40, 2) == (totals["received"], totals["rejected"])

    want = _tables(tmp_path / "local" / "tables", tmp_path / "local-big")
    got = _tables(tmp_path / "cluster" / "tables", tmp_path / "cluster-big")
    assert {"outcomes", "messages", "senders", "recipients", "totals", "rejections"} <= set(want)
    assert sorted(want) == sorted(got)
    assert {} == {t: "differs" for t in want if want[t] != got[t]}
    # the application ran on both workers: each one's executor log names finished tasks
    for work in standalone.work:
        [app] = [d for d in work.iterdir() if d.name.startswith("app-")]
        logs = "".join(f.read_text(errors="replace") for f in app.glob("*/stderr"))
        assert re.search(r"Finished task \d+\.\d+ in stage", logs), f"{work.name} ran no task"
