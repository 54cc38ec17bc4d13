"""The Spark driver JVM's start on this machine: a class-data-sharing archive of Spark's classes (issue 17).

Most of a fresh ``mtaq analyze``'s start-up was the driver JVM loading and verifying some 15,000 classes
from Spark's jars (4.5 s to a SparkSession and 2.3 s more to a first trivial job on a 2-core machine; with
the archive 1.8 s and 0.9 s: docs/performance.md, "Eighth round (issue 17)"). The JDK's *dynamic CDS
archive* (JDK 13+, JEP 350) keeps those classes parsed and verified in a file the next JVM maps:

* the first run on a machine (no archive for this JVM and these jars) starts the driver with
  ``-XX:ArchiveClassesAtExit=TMP``; when the job is over, :func:`stop` shuts the JVM down, waits for it to
  write the archive (a few seconds, once) and, if it exited 0, renames TMP to its final name, which
  carries the file's size;
* later runs start it with ``-XX:SharedArchiveFile=FINAL -XX:+VerifySharedSpaces``, but only when FINAL's
  size is still the size in its name: the JVM does not check an archive's length, and a truncated one
  makes it crash (SIGBUS) instead of starting without it. ``VerifySharedSpaces`` checks the archive's
  checksums: a damaged one of the right size is ignored by the JVM, which then starts as without it.
  The JVM also ignores an archive made for another class path or JVM.

The archive is keyed by the ``java`` that ``spark-submit`` runs (its real path, size and time) and
PySpark's jars (names, sizes, times): another JDK or PySpark gets its own. It lives in
``$MTAQ_SPARK_CLASS_ARCHIVE`` (a directory), else ``$XDG_CACHE_HOME/mtaq`` (``~/.cache/mtaq``), made
mode 0700, used only when this user owns it and no one else may write to it, as are the archives in it
(the JVM checks an archive's checksums, not who wrote it: a planted one would run as this user); about
190 MB; deleting it is always safe. Each run touches the archive it uses, and deletes another key's archive
not used for 30 days (a new virtualenv is a new key: they would pile up). ``MTAQ_SPARK_CLASS_ARCHIVE=off``
turns it off. Only for a driver this process starts (``local`` and ``local-cluster`` masters, not under
``spark-submit``, whose JVM runs already).

Also ``-XX:TieredStopAtLevel=1`` (unless ``c1=False``): the driver compiles with C1 only. The job's driver
runs short Spark plans; C2's compilations cost more CPU than they return in a job of seconds (0.9 s of a
1,000,000-record job of 8.9 s; the same at 10,000,000 records). A session that reads many rows into the
JVM (the data source's benchmark) read them 15 % slower with C1 only.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import sys
import threading
import time
from dataclasses import dataclass

__all__ = ["ARCHIVE_ENV", "JvmStart", "archive_dir", "plan", "spark_defaults", "stop"]

ARCHIVE_ENV = "MTAQ_SPARK_CLASS_ARCHIVE"
_QUIET = "-Xlog:cds*=off"  # the archive's warnings (signed jars skipped, an archive not usable) are not ours to show
_C1 = "-XX:TieredStopAtLevel=1"
_STALE_S = 3600.0  # a TMP archive older than this was left by a killed run
_UNUSED_S = 30 * 86400.0  # another key's archive (another JDK or PySpark) not used for this long is deleted


@dataclass
class JvmStart:
    """How the driver JVM is started: ``options`` (for ``spark.driver.extraJavaOptions``, before the user's),
    ``state`` ("used": an archive is mapped; "creating": this run writes it at exit; "off"), and for
    "creating" the TMP and FINAL-without-size paths :func:`stop` needs."""

    options: str
    state: str
    tmp: str | None = None
    final_stem: str | None = None


def archive_dir() -> str | None:
    """The archive directory, or None when ``MTAQ_SPARK_CLASS_ARCHIVE`` is ``off``."""
    got = os.environ.get(ARCHIVE_ENV, "")
    if got.strip().lower() in ("off", "0", "no", "false"):
        return None
    if got:
        return got
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mtaq")


def _key() -> str | None:
    """A digest of the ``java`` spark-submit runs and PySpark's jars; None if either is not found."""
    import pyspark

    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    jars = os.path.join(os.environ.get("SPARK_HOME") or os.path.dirname(os.path.abspath(pyspark.__file__)), "jars")
    if not java or not os.path.exists(java) or not os.path.isdir(jars):
        return None
    h = hashlib.sha256()
    real = os.path.realpath(java)
    st = os.stat(real)
    h.update(f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{pyspark.__version__}\0".encode())
    for name in sorted(os.listdir(jars)):
        st = os.stat(os.path.join(jars, name))
        h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def plan(master: str | None, c1: bool = True) -> JvmStart:
    """How to start the driver JVM for ``master`` (None: ``local[*]``); ``c1``: with C1 only. Never raises:
    where the archive cannot be had (no directory, no java found, under spark-submit), the options are C1
    only or nothing."""
    if "PYSPARK_GATEWAY_PORT" in os.environ or not (master or "local").startswith("local"):
        return JvmStart("", "off")
    _c1 = _C1 if c1 else ""
    directory = archive_dir()
    try:
        key = _key() if directory else None
    except OSError:
        key = None
    if directory is None or key is None:
        return JvmStart(_c1, "off")
    stem = os.path.join(directory, f"spark-classes-{key}")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.stat(directory)
        names = os.listdir(directory)
    except OSError:
        return JvmStart(_c1, "off")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        # Another user who can put a file there could have our JVM map an archive of their making: the JVM
        # checks its checksums, not who wrote it. Only a directory of ours that no one else can write to.
        return JvmStart(_c1, "off")
    prefix = os.path.basename(stem) + "-"
    used: str | None = None
    for name in names:
        path = os.path.join(directory, name)
        try:
            if not name.startswith(prefix):
                # another JDK's or PySpark's (another virtualenv's): deleted when unused for long, a TMP when stale
                if name.startswith("spark-classes-") and (name.endswith(".jsa") or ".tmp-" in name) and \
                        time.time() - os.stat(path).st_mtime > (_UNUSED_S if name.endswith(".jsa") else _STALE_S):
                    os.unlink(path)
                continue
            if ".tmp-" in name:
                if time.time() - os.stat(path).st_mtime > _STALE_S:
                    os.unlink(path)
                continue
            if name.endswith(".jsa") and used is None:
                size = name[len(prefix):-len(".jsa")]
                fst = os.stat(path)
                if fst.st_uid != os.getuid():  # not ours (the directory is): neither mapped nor deleted
                    continue
                if size.isdigit() and fst.st_size == int(size) > 0:
                    used = path
                    os.utime(path)  # in use: not for another installation's run to delete
                    continue
                os.unlink(path)  # not the length it was written with: never mapped (a truncated one crashes the JVM)
        except OSError:
            pass
    if used is not None:
        return JvmStart(f"{_arg('-XX:SharedArchiveFile', used)} -XX:+VerifySharedSpaces {_QUIET} {_c1}".strip(), "used")
    if not os.access(directory, os.W_OK | os.X_OK):  # the JVM would build the archive at exit, then fail to write it
        return JvmStart(_c1, "off")
    tmp = f"{stem}-x.tmp-{os.getpid()}"
    return JvmStart(f"{_arg('-XX:ArchiveClassesAtExit', tmp)} {_QUIET} {_c1}".strip(), "creating", tmp, stem)


def _arg(flag: str, path: str) -> str:
    """``FLAG=PATH`` as one option of ``spark.driver.extraJavaOptions``, which Spark splits at whitespace with
    a shell's quotes: quoted where the path needs it (a space in it made the JVM fail to start)."""
    return shlex.quote(f"{flag}={path}")


def spark_defaults() -> dict[str, str]:
    """The properties spark-submit reads from its properties file (``--properties-file`` in
    ``PYSPARK_SUBMIT_ARGS``, else ``spark-defaults.conf`` in ``SPARK_CONF_DIR``, by default ``SPARK_HOME/conf``),
    values trimmed as Spark's launcher trims them; {} when there is none or it cannot be read. The job gives
    ``spark.driver.extraJavaOptions`` with ``--conf``, which replaces the file's: it adds the file's after its own."""
    import pyspark

    try:
        args = shlex.split(os.environ.get("PYSPARK_SUBMIT_ARGS", ""))
    except ValueError:
        args = []
    path = next((a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
                 for i, a in enumerate(args) if a.split("=", 1)[0] == "--properties-file"), None)
    if path is None:
        home = os.environ.get("SPARK_HOME") or os.path.dirname(os.path.abspath(pyspark.__file__))
        path = os.path.join(os.environ.get("SPARK_CONF_DIR") or os.path.join(home, "conf"), "spark-defaults.conf")
    from jproperties import Properties  # java.util.Properties' format, as Spark's launcher reads the file

    props = Properties()
    try:
        with open(path, "rb") as f:
            props.load(f, "utf-8")
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return {k: v.data.strip() for k, v in props.items()}


def stop(spark: object, start: JvmStart, wait_s: float = 120.0) -> None:
    """``spark.stop()``; when this run creates the archive, also shut the driver JVM down, wait for it (at
    most ``wait_s`` seconds) and, if it exited 0 having written the archive, put it in place under its
    final name. Failures to do so only leave no archive (the next run tries again).

    PySpark's own stop waits for its accumulator server (a TCP server on loopback) to shut down, and that
    server's handler looks for the shutdown once a second: 0.7-1 s of every ``mtaq analyze`` went there
    (docs/performance.md, "Ninth round (issue 38)"). Here the context is stopped without that wait and the
    server is shut down on a daemon thread: it ends within a second in a process that goes on, and with the
    process in the CLI. A Unix-socket server (``spark.python.unix.domain.socket.enabled``), whose shutdown
    also removes its socket file, is still waited for."""
    shutting = _stop_without_waiting_for_accumulators(spark)
    if start.state != "creating" or start.tmp is None or start.final_stem is None:
        return
    if shutting is not None:
        # The JVM about to exit closes the server's connection: a handler still polling it would then print
        # an EOFError traceback. Once a machine, so wait for the server here (at most about 1 s).
        shutting.join(timeout=5.0)
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    try:
        if proc is None:
            return
        gateway.shutdown()  # type: ignore[union-attr]
        if proc.stdin is not None:
            proc.stdin.close()  # spark-submit's gateway exits when its stdin closes, and writes the archive
        rc = proc.wait(timeout=wait_s)
        SparkContext._gateway = None
        SparkContext._jvm = None
        size = os.path.getsize(start.tmp) if os.path.exists(start.tmp) else 0
        if rc == 0 and size > 0:
            os.replace(start.tmp, f"{start.final_stem}-{size}.jsa")
    except Exception as exc:  # an archive not made is no failure of the job
        print(f"mtaq analyze: no class archive this time: {exc}", file=sys.stderr)
    finally:
        if os.path.exists(start.tmp):
            try:
                os.unlink(start.tmp)
            except OSError:
                pass


def _stop_without_waiting_for_accumulators(spark: object) -> threading.Thread | None:
    """``spark.stop()``, with PySpark's accumulator server (if it is a TCP one) shut down on a daemon thread
    instead of in the caller (see :func:`stop`); that thread, started, or None where there was none."""
    sc = getattr(spark, "sparkContext", None)
    server = getattr(sc, "_accumulatorServer", None)
    quick = server is not None and not isinstance(getattr(server, "server_address", None), str)
    if quick:
        sc._accumulatorServer = None  # type: ignore[union-attr]  # SparkContext.stop() skips its shutdown
    try:
        spark.stop()  # type: ignore[attr-defined]
    finally:
        thread = None
        if quick:
            thread = threading.Thread(target=server.shutdown, name="mtaq-accumulator-server-shutdown",  # type: ignore[union-attr]
                                      daemon=True)
            thread.start()
    return thread
