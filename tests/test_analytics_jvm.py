"""The driver JVM's class archive (mtaq/analytics/jvm.py): made once, used after, never a damaged one."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("pyspark")

from mtaq.analytics import jvm


def test_plan_creates_uses_and_refuses(tmp_path, monkeypatch):
    """No archive: this run creates it (to a TMP name of its own). One whose size is the size in its name: used,
    with its checksums verified. One of another size (truncated: the JVM would crash mapping it): deleted,
    never passed to the JVM. A TMP left by a killed run over an hour ago: deleted. Off, or a master elsewhere:
    no archive."""
    monkeypatch.setenv(jvm.ARCHIVE_ENV, str(tmp_path))
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    first = jvm.plan("local[2]")
    assert first.state == "creating" and first.tmp is not None and first.final_stem is not None
    assert f"-XX:ArchiveClassesAtExit={first.tmp}" in first.options and os.path.dirname(first.tmp) == str(tmp_path)
    final = f"{first.final_stem}-1000.jsa"
    with open(final, "wb") as f:
        f.write(b"x" * 1000)
    used = jvm.plan("local[2]")
    assert used.state == "used" and f"-XX:SharedArchiveFile={final} -XX:+VerifySharedSpaces" in used.options
    os.truncate(final, 600)
    again = jvm.plan("local[2]")
    assert again.state == "creating" and final not in again.options and not os.path.exists(final)
    stale = f"{first.final_stem}-x.tmp-999999"
    fresh = f"{first.final_stem}-x.tmp-999998"
    for p in (stale, fresh):
        open(p, "wb").close()
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    jvm.plan("local[2]")
    assert not os.path.exists(stale) and os.path.exists(fresh)  # a run may still be writing the fresh one
    monkeypatch.setenv(jvm.ARCHIVE_ENV, "off")
    assert (jvm.plan("local[2]").state, jvm.plan("local[2]").options) == ("off", "-XX:TieredStopAtLevel=1")
    monkeypatch.setenv(jvm.ARCHIVE_ENV, str(tmp_path))
    assert (jvm.plan("spark://h:7077").state, jvm.plan("spark://h:7077").options) == ("off", "")
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1")  # under spark-submit: its JVM runs already
    assert jvm.plan("local[2]").state == "off"


def test_the_first_run_writes_the_archive_and_the_next_uses_it(tmp_path):
    """Two fresh `mtaq analyze` processes on a small log: the first starts its driver without an archive and
    leaves one (size in its name, no TMP left); the second maps it and gives the same totals."""
    from test_analytics_merges import write_log

    spool = str(tmp_path / "spool")
    write_log(spool)
    archive = tmp_path / "archive"
    env = {**os.environ, jvm.ARCHIVE_ENV: str(archive)}

    def run(n: int) -> tuple[str, dict]:
        p = subprocess.run([sys.executable, "-m", "mtaq.cli", "analyze", "--segments", spool, "--out",
                            str(tmp_path / f"out{n}"), "--master", "local[2]", "--json", "--no-plots"],
                           capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        [state] = [line.rsplit("class archive: ", 1)[1].rstrip(")") for line in p.stderr.splitlines()
                   if "Spark started (class archive: " in line]
        return state, json.loads(p.stdout.strip().splitlines()[-1])

    state, first = run(1)
    assert state == "creating"
    [made] = os.listdir(archive)
    assert made.endswith(".jsa") and os.path.getsize(archive / made) == int(made.rsplit("-", 1)[1][:-4]) > 0
    state, second = run(2)
    assert state == "used" and second == first and first["delivered"] > 0
    assert os.listdir(archive) == [made]


def _session_in_a_process(tmp_path, env: dict, script: str) -> subprocess.CompletedProcess:
    """``script`` (after a SparkSession ``s`` made by spark_session on local[1]) in a fresh process."""
    code = ("from mtaq.analytics.job import class_archive, spark_session, stop_session\n"
            "s = spark_session('local[1]', [('spark.ui.enabled', 'false')])\n" + script + "\nstop_session(s)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, cwd=str(tmp_path))


def test_an_archive_directory_with_spaces_and_quotes(tmp_path, monkeypatch):
    """Spark splits spark.driver.extraJavaOptions at whitespace (shell-like quotes): a cache directory with a
    space in its name made the driver JVM fail to start on every run. The paths are quoted: the JVM starts,
    and writes its archive there."""
    import shlex

    archive = tmp_path / "My Cache's dir"
    p = _session_in_a_process(tmp_path, {jvm.ARCHIVE_ENV: str(archive)},
                              "print('STATE', class_archive(s), s.range(3).count())")
    assert p.returncode == 0 and "STATE creating 3" in p.stdout, p.stderr[-3000:]
    [made] = os.listdir(archive)
    assert made.endswith(".jsa")
    monkeypatch.setenv(jvm.ARCHIVE_ENV, str(archive))
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    got = jvm.plan("local[2]")
    assert got.state == "used" and f"-XX:SharedArchiveFile={archive / made}" in shlex.split(got.options)


def test_the_driver_java_options_of_spark_defaults_are_kept(tmp_path):
    """spark.driver.extraJavaOptions from spark-defaults.conf (SPARK_CONF_DIR) still reach the driver JVM: the
    job's own options (C1, the class archive) are set with --conf, which replaces the file's value, so the
    file's value is added after them."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "spark-defaults.conf").write_text("# the admin's\nspark.driver.extraJavaOptions  -Dmtaq.probe=1 \\\n"
                                              "    -Dmtaq.other=two\n")
    p = _session_in_a_process(tmp_path, {"SPARK_CONF_DIR": str(conf), jvm.ARCHIVE_ENV: "off"},
                              "j = s.sparkContext._jvm.System\n"
                              "print('PROBE', j.getProperty('mtaq.probe'), j.getProperty('mtaq.other'))")
    assert p.returncode == 0 and "PROBE 1 two" in p.stdout, p.stderr[-3000:]


def test_spark_defaults_read_as_java_properties(tmp_path, monkeypatch):
    """The properties file as java.util.Properties reads it (separators =, : or blanks; comments; continued
    lines; escapes; the last of a key), values trimmed; --properties-file in PYSPARK_SUBMIT_ARGS instead of
    SPARK_CONF_DIR's spark-defaults.conf; none: {}."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "spark-defaults.conf").write_text(
        "! a comment\n  # another\n\na.b=1\nc.d : two words \ne\\ f\\=g\tthree\\\n    four\nu 4\nu 5\nv \\u0041\\tB\n"
        "x.y")
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf))
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS", raising=False)
    assert jvm.spark_defaults() == {"a.b": "1", "c.d": "two words", "e f=g": "threefour", "u": "5", "v": "A\tB", "x.y": ""}
    other = tmp_path / "other.conf"
    other.write_text("spark.driver.extraJavaOptions -Dp=1\n")
    for args in (f"--properties-file {other} pyspark-shell", f"--properties-file={other} pyspark-shell"):
        monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", args)
        assert jvm.spark_defaults() == {"spark.driver.extraJavaOptions": "-Dp=1"}
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "pyspark-shell")
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path / "none"))
    assert jvm.spark_defaults() == {}


def test_no_archive_made_in_a_directory_this_user_cannot_write(tmp_path, monkeypatch):
    """A directory this user cannot write (a shared or read-only cache): never "creating" (the JVM would build
    the archive at exit, seconds of work, and then fail to write it, on every run), still "used" when an archive
    is there."""
    monkeypatch.setenv(jvm.ARCHIVE_ENV, str(tmp_path))
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(tmp_path) else real(p, mode, **kw))
    assert (jvm.plan("local[2]").state, jvm.plan("local[2]").options) == ("off", "-XX:TieredStopAtLevel=1")
    monkeypatch.setattr(os, "access", real)
    stem = jvm.plan("local[2]").final_stem
    with open(f"{stem}-1000.jsa", "wb") as f:
        f.write(b"x" * 1000)
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(tmp_path) else real(p, mode, **kw))
    assert jvm.plan("local[2]").state == "used"


def test_archives_of_other_installations_do_not_pile_up(tmp_path, monkeypatch):
    """The key changes with every new PySpark install (a new virtualenv: new jar times) or JDK: each left an
    archive of 150-200 MB in the cache for ever. An archive is touched when used; another key's archive unused
    for longer than jvm._UNUSED_S, and another key's TMP older than an hour, are deleted; a recent one (another
    installation in use) is kept."""
    monkeypatch.setenv(jvm.ARCHIVE_ENV, str(tmp_path))
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    stem = jvm.plan("local[2]").final_stem
    mine = f"{stem}-1000.jsa"
    old_other, new_other = tmp_path / "spark-classes-0123456789abcdef-500.jsa", tmp_path / "spark-classes-fedcba9876543210-500.jsa"
    old_tmp, unrelated = tmp_path / "spark-classes-0123456789abcdef-x.tmp-4242", tmp_path / "notes.txt"
    for p in (mine, old_other, new_other, old_tmp, unrelated):
        with open(p, "wb") as f:
            f.write(b"x" * (1000 if p == mine else 500))
    long_ago = time.time() - jvm._UNUSED_S - 3600
    for p in (mine, old_other, old_tmp, unrelated):
        os.utime(p, (long_ago, long_ago))
    got = jvm.plan("local[2]")
    assert got.state == "used" and mine in got.options
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (mine, new_other, unrelated))
    assert time.time() - os.stat(mine).st_mtime < 60  # touched: in use


def test_no_archive_in_a_directory_others_can_write_or_of_another_user(tmp_path, monkeypatch):
    """The JVM checks an archive's checksums, not who wrote it: a directory others may write to (a shared /tmp)
    is not used at all, and an archive there of another owner is neither mapped nor deleted."""
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv(jvm.ARCHIVE_ENV, str(shared))
    assert (jvm.plan("local[2]").state, jvm.plan("local[2]").options) == ("off", "-XX:TieredStopAtLevel=1")
    mine = tmp_path / "mine"
    monkeypatch.setenv(jvm.ARCHIVE_ENV, str(mine))
    made = jvm.plan("local[2]")
    assert made.state == "creating" and (os.stat(mine).st_mode & 0o777) == 0o700
    if os.getuid() != 0:
        return  # giving a file to another user needs root
    planted = f"{made.final_stem}-1000.jsa"
    with open(planted, "wb") as f:
        f.write(b"x" * 1000)
    os.chown(planted, 65534, 65534)
    got = jvm.plan("local[2]")
    assert got.state == "creating" and planted not in got.options and os.path.exists(planted)


def test_stop_session_leaves_the_accumulator_servers_shutdown_to_a_thread_and_it_ends(tmp_path):
    """PySpark's stop shuts its accumulator server down in the caller, which waits for the server's handler
    (it looks once a second): 0.7-1 s of every `mtaq analyze`. stop_session stops the context and hands that
    shutdown to a daemon thread, not the caller's; the server still ends (its socket closed, its thread gone),
    accumulators added before the stop were counted, and a new session in the same process works."""
    script = (
        "import threading, time\n"
        "sc = s.sparkContext\n"
        "acc = sc.accumulator(0)\n"
        "sc.parallelize(range(10), 2).foreach(lambda x: acc.add(x))\n"
        "server = sc._accumulatorServer\n"
        "calls = []\n"
        "orig = server.shutdown\n"
        "server.shutdown = lambda: (calls.append(threading.current_thread().name), orig())\n"
        "stop_session(s)\n"
        "from pyspark import SparkContext\n"
        "assert SparkContext._active_spark_context is None\n"
        "deadline = time.monotonic() + 30\n"
        "while (not calls or server.socket.fileno() != -1) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "print('CALLS', calls, 'CLOSED', server.socket.fileno() == -1, 'ACC', acc.value)\n"
        "s = spark_session('local[1]', [('spark.ui.enabled', 'false')])\n"
        "acc2 = s.sparkContext.accumulator(0)\n"
        "s.sparkContext.parallelize(range(5), 1).foreach(lambda x: acc2.add(x))\n"
        "print('SECOND', acc2.value)\n"
    )
    p = _session_in_a_process(tmp_path, {jvm.ARCHIVE_ENV: "off"}, script)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "CALLS ['mtaq-accumulator-server-shutdown'] CLOSED True ACC 45" in p.stdout, p.stdout + p.stderr[-3000:]
    assert "SECOND 10" in p.stdout, p.stdout


def test_sql_on_demand_makes_the_sql_session_only_when_the_job_uses_spark_sql(tmp_path):
    """``mtaq analyze`` starts its local driver with ``sql_on_demand``: a job whose tables the driver adds up
    (a small log) never makes the SQL session, and gives the same totals as a job on that same context whose
    tables Spark adds up (``driver_table_rows``/``driver_merge_rows`` 0), which makes the session then, with
    the settings the job asked for before it existed (the Parquet timestamps) and the builder's (UTC). A task
    that fails raises PySpark's PythonException, as it does with a session; a stopped one cannot be used."""
    from test_analytics_merges import write_log

    spool = str(tmp_path / "spool")
    write_log(spool)
    script = (
        "import json\n"
        "from mtaq.analytics.job import Options, analyze\n"
        "from mtaq.analytics.session import SessionOnDemand, spark_session, stop_session\n"
        "t = spark_session('local[2]', [('spark.ui.enabled', 'false')], sql_on_demand=True)\n"
        "try:\n"
        "    t.sparkContext.parallelize([0], 1).map(lambda x: 1 // x).collect()\n"
        "except Exception as exc:\n"
        "    print('FAILED-TASK', type(exc).__name__, 'ZeroDivisionError' in str(exc), t.made)\n"
        "stop_session(t)\n"
        "try:\n"
        "    t.range(3)\n"
        "except RuntimeError as exc:\n"
        "    print('AFTER-STOP', exc)\n"
        "s = spark_session('local[2]', [('spark.ui.enabled', 'false')], sql_on_demand=True)\n"
        "print('LAZY', isinstance(s, SessionOnDemand), s.made)\n"
        f"a = analyze(s, Options(paths=[{spool!r}], out='out-a', plots=False))\n"
        "print('AFTER-DRIVER', s.made)\n"
        f"b = analyze(s, Options(paths=[{spool!r}], out='out-b', plots=False, driver_table_rows=0, "
        "driver_merge_rows=0))\n"
        "print('AFTER-SPARK', s.made, s.conf.get('spark.sql.parquet.outputTimestampType'),\n"
        "      s.conf.get('spark.sql.session.timeZone'))\n"
        "print('SAME', a.totals == b.totals, a.totals['delivered'])\n"
        "stop_session(s)\n"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, jvm.ARCHIVE_ENV: "off"}, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "LAZY True False" in p.stdout and "AFTER-DRIVER False" in p.stdout, p.stdout
    assert "AFTER-SPARK True TIMESTAMP_MICROS UTC" in p.stdout, p.stdout
    [same] = [line for line in p.stdout.splitlines() if line.startswith("SAME ")]
    assert same.startswith("SAME True ") and int(same.split()[2]) > 0, p.stdout
    # A failed task is PySpark's PythonException (the worker's traceback), as with a session made at once; a
    # stopped one starts no new context when used.
    assert "FAILED-TASK PythonException True False" in p.stdout, p.stdout
    assert "AFTER-STOP this Spark session was stopped" in p.stdout, p.stdout


def test_a_local_driver_listens_on_loopback_only(tmp_path):
    """Spark binds a driver's RPC and block manager ports (unauthenticated by default) to the host's first
    non-loopback address unless told otherwise: a local driver that mtaq analyze starts uses 127.0.0.1
    (SPARK_LOCAL_IP, unless the environment sets it), so nothing on the network can reach it."""
    env = {k: v for k, v in os.environ.items() if k != "SPARK_LOCAL_IP"}
    env[jvm.ARCHIVE_ENV] = "off"
    script = ("from mtaq.analytics.session import spark_session, stop_session\n"
              "s = spark_session('local[1]', [('spark.ui.enabled', 'false')], sql_on_demand=True)\n"
              "sc = s.sparkContext\n"
              "print('HOSTS', sc.getConf().get('spark.driver.host'),\n"
              "      sc._jsc.sc().getExecutorMemoryStatus().keys().mkString(','))\n"
              "stop_session(s)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                       cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    import ipaddress
    import socket

    [line] = [x for x in p.stdout.splitlines() if x.startswith("HOSTS ")]
    _, driver, block_managers = line.split(" ")
    for host in (driver, *(b.rsplit(":", 1)[0] for b in block_managers.split(","))):
        assert ipaddress.ip_address(socket.gethostbyname(host)).is_loopback, line  # 127.0.0.1, "localhost"


def test_the_job_environment_reaches_the_python_workers_and_keeps_the_administrators(tmp_path):
    """command.job_environment: the allocator settings mtaq analyze sets for the Spark processes it starts
    (MALLOC_* for glibc, read when a process starts; ARROW_DEFAULT_MEMORY_POOL) are what a Spark Python worker
    started afterwards has; a value the environment already holds is kept."""
    from mtaq.analytics.command import MALLOC_ENVIRONMENT

    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENVIRONMENT and k != "ARROW_DEFAULT_MEMORY_POOL"}
    env[jvm.ARCHIVE_ENV] = "off"
    env["MALLOC_TOP_PAD_"] = "4096"  # the administrator's
    script = ("import os\n"
              "from mtaq.analytics.command import job_environment\n"
              "job_environment()\n"
              "from mtaq.analytics.session import spark_session, stop_session\n"
              "s = spark_session('local[1]', [('spark.ui.enabled', 'false')], sql_on_demand=True)\n"
              "names = ['MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_', 'MALLOC_TOP_PAD_', 'ARROW_DEFAULT_MEMORY_POOL']\n"
              "def seen(it):\n"
              "    import os\n"
              "    yield {k: os.environ.get(k) for k in names}\n"
              "print('GOT', s.sparkContext.parallelize([0], 1).mapPartitions(seen).collect())\n"
              "stop_session(s)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                       cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    [line] = [x for x in p.stdout.splitlines() if x.startswith("GOT ")]
    assert ast.literal_eval(line[4:]) == [{"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
                                           "MALLOC_TOP_PAD_": "4096", "ARROW_DEFAULT_MEMORY_POOL": "system"}]
