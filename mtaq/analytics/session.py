"""The SparkSession of ``mtaq analyze``: its start (the driver JVM's class archive, :mod:`mtaq.analytics.jvm`),
its settings for a small job on a few cores, the Python its workers run, and its stop (issue 38, item 5: the
job split by concern)."""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

from pyspark.sql import SparkSession

from mtaq.analytics import jvm

__all__ = ["RemoteError", "class_archive", "is_connect", "one_line", "redact", "spark_session", "stop_session"]


class RemoteError(Exception):
    """The Spark Connect server refused or did not answer the session's first request (its message, one line)."""

CONNECT_TIMEOUT_S = 10.0  # --remote: seconds for a TCP connection to the Spark Connect server before giving up
_STARTS: dict[int, jvm.JvmStart] = {}  # how each session's driver JVM started, by id(session)


def spark_session(master: str | None = None, conf: Sequence[tuple[str, str]] = (), app: str = "mtaq analyze",
                  short_lived: bool = True, remote: str | None = None, sql_on_demand: bool = False) -> SparkSession:
    """A SparkSession in UTC. ``master`` None means ``local[*]``, except under ``spark-submit`` (its own).
    ``short_lived``: the driver JVM compiles with C1 only (:mod:`mtaq.analytics.jvm`): right for one job
    of seconds to minutes (``mtaq analyze``); False for a session that reads many rows into the JVM
    (the data source's own benchmark: C1 read its rows 15 % slower). ``remote`` (``sc://HOST:PORT``, not
    with ``master``): a Spark Connect session instead (:func:`_connect_session`).

    ``sql_on_demand`` (``mtaq analyze``): when this call starts a local driver, it returns a
    :class:`SessionOnDemand` in place of the session: the SparkContext at once, the SQL session made on
    first use (0.45 s of one core that a job with no Spark SQL in it does not spend)."""
    if remote is not None:
        return _connect_session(remote, conf)
    if "PYSPARK_PYTHON" not in os.environ:
        os.environ["PYSPARK_PYTHON"] = _worker_python(master) or sys.executable
    # collect() turns timestamps into naive datetimes in the process's local time zone: make that UTC.
    os.environ["TZ"] = "UTC"
    time.tzset()
    if _local_cores(master or "local[*]") is not None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        # A local driver this process starts listens on loopback only: Spark's default is the host's first
        # non-loopback address, so its RPC and block manager ports (no authentication by default) were open
        # on the network for the length of the job. Set by an administrator (or spark.driver.host): theirs.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    b = SparkSession.builder.appName(app)
    if master:
        b = b.master(master)
    elif "PYSPARK_GATEWAY_PORT" not in os.environ:  # not launched by spark-submit
        b = b.master("local[*]")
    # The driver JVM's start (mtaq/analytics/jvm.py): a class archive of Spark's classes and C1 only, for a
    # driver this process starts; the user's own extraJavaOptions (--conf, else spark-defaults.conf's, which
    # ours would replace) come after ours.
    from pyspark import SparkContext

    start = jvm.plan(master, c1=short_lived) if SparkContext._active_spark_context is None else jvm.JvmStart("", "off")
    theirs = " ".join(v for k, v in conf if k == "spark.driver.extraJavaOptions")
    if start.options and not any(k == "spark.driver.extraJavaOptions" for k, _ in conf):
        theirs = jvm.spark_defaults().get("spark.driver.extraJavaOptions", "")
    conf = [(k, v) for k, v in conf if k != "spark.driver.extraJavaOptions"]
    if start.options or theirs:
        b = b.config("spark.driver.extraJavaOptions", f"{start.options} {theirs}".strip())
    b = b.config("spark.sql.session.timeZone", "UTC").config("spark.ui.showConsoleProgress", "true")
    # The tables are small after aggregation: Spark's 200 shuffle partitions cost more than they bring here;
    # on this machine two per core (on local[2], 4 instead of 16 took about 3 s off the job: each of its
    # few dozen small stages ran 16 tasks).
    b = b.config("spark.sql.shuffle.partitions", str(_shuffle_partitions(master)))
    if (master or "local").startswith("local") and not (master is None and "PYSPARK_GATEWAY_PORT" in os.environ):
        b = b.config("spark.ui.enabled", "false")  # no web UI for a batch job on this machine
    for k, v in conf:
        b = b.config(k, v)
    on_demand = (sql_on_demand and _local_cores(master or "local[*]") is not None
                 and SparkContext._active_spark_context is None and "PYSPARK_GATEWAY_PORT" not in os.environ
                 and start.state != "creating"  # a first run makes the session: its classes go into the archive
                 # Spark Connect asked for another way (PySpark's own builder decides, as before)
                 and not any(k in ("spark.api.mode", "spark.remote") for k, _ in conf)
                 and not os.environ.get("SPARK_CONNECT_MODE_ENABLED") and not os.environ.get("SPARK_REMOTE"))
    if on_demand:
        from pyspark import SparkConf

        # The builder's own SparkConf (its options): its getOrCreate, on first use, finds this context.
        sc = SparkContext.getOrCreate(SparkConf().setAll(list(b._options.items())))
        sc.setLogLevel("ERROR")
        # What making a SparkSession also does: a failed task is raised as PySpark's PythonException (the
        # worker's traceback), not as py4j's error with the JVM's stack trace.
        from pyspark.errors.exceptions.captured import install_exception_handler

        install_exception_handler()
        lazy = SessionOnDemand(sc, lambda: _made(b.getOrCreate()))
        _STARTS[id(lazy)] = start
        return cast(SparkSession, lazy)  # it stands for the session (see SessionOnDemand)
    spark = _made(b.getOrCreate())
    _STARTS[id(spark)] = start
    return spark


def _made(spark: SparkSession) -> SparkSession:
    """A session just made by the builder, quiet and in UTC."""
    spark.sparkContext.setLogLevel("ERROR")
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    return spark


class SessionOnDemand:
    """A local driver's SparkContext, standing for its SparkSession until Spark SQL is used (issue 38.4).

    ``mtaq analyze``'s tasks are an RDD over groups of segments, and up to some 10,000,000 records the driver
    adds up everything they return with pyarrow: no Spark SQL in the run, yet the SQL session's start (the
    JVM's SQL configuration, catalog and planner) took 0.45 s of one core before the first task. Here
    ``sparkContext`` is the context, ``conf.set`` is kept until the session exists, ``stop`` stops whichever
    exists, and any other attribute (``read``, ``createDataFrame``, ``conf.get``...) makes the session (the
    builder's ``getOrCreate`` on this context, its settings, then the kept ``conf.set`` ones, in order) and is
    the session's; once stopped, it raises RuntimeError instead (no new context behind the caller's back).
    Thread-safe: the session is made once."""

    def __init__(self, sc: Any, make: Callable[[], SparkSession]) -> None:
        self.sparkContext = sc
        self._make = make
        self._session: SparkSession | None = None
        self._pending: list[tuple[str, Any]] = []
        self._stopped = False
        self._lock = threading.Lock()

    @property
    def made(self) -> bool:
        """Whether the SQL session exists."""
        return self._session is not None

    def session(self) -> SparkSession:
        """The SparkSession, made now if it was not. Raises RuntimeError after :meth:`stop`, and what a kept
        ``conf.set`` raises (once: the session is kept, the other settings applied)."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("this Spark session was stopped")
            if self._session is None:
                self._session = spark = self._make()
                pending, self._pending = self._pending, []
                errors = []
                for k, v in pending:
                    try:
                        spark.conf.set(k, v)
                    except Exception as exc:  # as conf.set would have raised it, at the first use
                        errors.append(exc)
                if errors:
                    raise errors[0]
            return self._session

    @property
    def conf(self) -> Any:
        return _PendingConf(self)

    def stop(self) -> None:
        """Stop the session if it was made, else the context."""
        with self._lock:
            self._stopped = True
            made = self._session
        if made is not None:
            made.stop()
        else:
            self.sparkContext.stop()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session(), name)


class _PendingConf:
    """``SessionOnDemand.conf``: ``set`` kept until the session is made, anything else the session's."""

    def __init__(self, owner: SessionOnDemand) -> None:
        self._owner = owner

    def set(self, key: str, value: Any) -> None:
        with self._owner._lock:
            made = self._owner._session
            if made is None and not self._owner._stopped:
                self._owner._pending.append((key, value))
                return
        if made is None:
            raise RuntimeError("this Spark session was stopped")
        made.conf.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._owner.session().conf, name)


def is_connect(spark: SparkSession) -> bool:
    """Whether ``spark`` is a Spark Connect session (no SparkContext, no RDDs: the job's tasks run as
    ``mapInArrow`` instead, :mod:`mtaq.analytics.connect`)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


# Settings of a local driver that a Spark Connect server owns: setting them from a client is an error
# (CANNOT_MODIFY_CONFIG), so --quiet's is dropped for a remote session.
_SERVER_ONLY = ("spark.ui.showConsoleProgress",)


def _connect_session(remote: str, conf: Sequence[tuple[str, str]]) -> SparkSession:
    """A Spark Connect session on ``remote`` (``sc://HOST:PORT[/;param=value...]``, PySpark 4's client,
    issue 38.2), in UTC, with ``conf`` applied as session settings (runtime SQL settings only: the server
    refuses the others), and this mtaq's modules shipped as a Python artifact (``addArtifacts(...,
    pyfile=True)``) so that the server's Python workers import the same code as this client. The server
    runs the tasks and reads ``--segments`` and writes the tables itself: both must be paths it shares with
    this machine (one machine, or a shared file system), as for ``spark-submit`` in client mode. Raises
    ImportError without PySpark's connect extra (grpcio, pandas), ValueError for a URL PySpark does not
    take, OSError when no TCP connection to the server's port opens within ``CONNECT_TIMEOUT_S`` seconds,
    RemoteError when the server does not answer the first request within a few retries or refuses it (a
    wrong token: UNAUTHENTICATED) or a setting of ``conf`` (one the server owns)."""
    os.environ["TZ"] = "UTC"  # collect()'s naive datetimes in UTC, as for a local session
    time.tzset()
    import socket

    # PySpark warns RETRIES_EXCEEDED besides raising it: the error is the one line the command prints.
    warnings.filterwarnings("ignore", message=r"\[RETRIES_EXCEEDED\]")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # not gRPC's own INFO lines (a failed TLS handshake) on stderr
    from pyspark.sql.connect.client import DefaultChannelBuilder  # ImportError: the connect extra is missing

    # PySpark's client retries an unreachable server for minutes: find out at once (ValueError: a bad URL).
    endpoint = DefaultChannelBuilder(remote)
    port = int(endpoint.endpoint.rpartition(":")[2])
    host = endpoint.host.removeprefix("[").removesuffix("]")  # sc://[::1]:PORT: PySpark keeps the brackets
    socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    from pyspark.errors import PySparkException
    from pyspark.sql.connect.client.retries import DefaultPolicy

    # No options on the builder: they would be the first requests, under PySpark's retries of ten minutes (a
    # TLS URL against a plain server, say). The first request gets a few seconds of retries, the job's
    # requests about 25 s each (below).
    spark = SparkSession.builder.remote(remote).getOrCreate()
    client = spark.client
    client.set_retry_policies([DefaultPolicy(max_retries=3, max_backoff=2000)])
    with warnings.catch_warnings():  # PySpark warns RETRIES_EXCEEDED besides raising it
        warnings.simplefilter("ignore")
        try:
            spark.conf.set("spark.sql.session.timeZone", "UTC")
        except PySparkException as exc:
            spark.stop()
            raise RemoteError(one_line(exc)) from exc
        finally:
            # The job's requests: about 25 s of retries each (PySpark's own: ten minutes, twice with the stop)
            # before a server that went away mid-job ends the run with one line (command.run).
            client.set_retry_policies([DefaultPolicy(max_retries=6, max_backoff=10000)])
    for k, v in [("spark.sql.shuffle.partitions", "16"), *conf]:
        if k not in _SERVER_ONLY:
            try:
                spark.conf.set(k, v)
            except PySparkException as exc:
                spark.stop()
                raise RemoteError(f"--conf {k}: {one_line(exc)}") from exc
    _STARTS[id(spark)] = jvm.JvmStart("", "off")
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory(prefix="mtaq-connect-") as tmp:
        shipped = package_zip(os.path.join(tmp, "mtaq.zip"))
        with zipfile.ZipFile(shipped) as z:
            if "mtaq/analytics/connect.py" not in z.namelist():  # mtaq imported from a zip or a pex: nothing to walk
                spark.stop()
                raise RemoteError("cannot ship mtaq to the server: its modules are not files on this machine")
        spark.addArtifacts(shipped, pyfile=True)
    return spark


def redact(remote: str) -> str:
    """``remote`` with the value of its ``token`` parameter hidden (for progress lines and errors)."""
    import re

    return re.sub(r"(;\s*token=)[^;]*", r"\1***", remote, flags=re.IGNORECASE)


def one_line(exc: BaseException) -> str:
    """A PySpark Connect error as one line: the gRPC status and details where there are some (a refused token:
    "UNAUTHENTICATED: Invalid authentication token"), else its message without the JVM's stack trace."""
    seen: BaseException | None = exc
    while seen is not None:
        code, details = getattr(seen, "code", None), getattr(seen, "details", None)
        if callable(code) and callable(details):
            try:
                return f"{code().name}: {' '.join(str(details()).split())}"[:300]
            except Exception:  # not a gRPC call's error after all
                pass
        seen = seen.__cause__ or seen.__context__
    return " ".join(str(exc).split("JVM stacktrace:")[0].split())[:300]


def package_zip(path: str) -> str:
    """Write this mtaq's modules and shipped TOML files to the zip file ``path`` (what ``make spark-zip`` writes
    to ``dist/mtaq.zip`` for ``spark-submit --py-files``); return ``path``. Raises OSError."""
    import zipfile

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above mtaq/analytics/
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for d, dirs, names in os.walk(os.path.join(root, "mtaq")):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for name in sorted(names):
                if name.endswith((".py", ".toml")):
                    full = os.path.join(d, name)
                    z.write(full, os.path.relpath(full, root))
    return path


def class_archive(spark: SparkSession) -> str:
    """How ``spark``'s driver JVM started (:mod:`mtaq.analytics.jvm`): "used" (a class archive mapped),
    "creating" (this run writes it when stopped by :func:`stop_session`) or "off"."""
    start = _STARTS.get(id(spark))
    return "off" if start is None else start.state


def stop_session(spark: SparkSession) -> None:
    """Stop a session made by :func:`spark_session`; the first run on a machine also waits for its driver JVM
    to write the class archive (a few seconds, once: :func:`mtaq.analytics.jvm.stop`)."""
    jvm.stop(spark, _STARTS.pop(id(spark), jvm.JvmStart("", "off")))


def _shuffle_partitions(master: str | None) -> int:
    """Shuffle partitions for ``master``: two per core on ``local[N]``/``local[*]``/``local``, else 16."""
    cores = _local_cores(master or "local[*]")
    return 16 if cores is None else max(4, 2 * cores)


def _local_cores(master: str | None) -> int | None:
    """The cores of a ``local``, ``local[N]`` or ``local[*]`` (this machine's) master, ``local[N,F]`` included;
    None for another master or none."""
    import re

    m = re.fullmatch(r"local(?:\[(\d+|\*)(?:,\d+)?\])?", master or "")
    if m is None:
        return None
    if m.group(1) is None:
        return 1
    if m.group(1) == "*":
        return os.cpu_count() or 2
    return int(m.group(1))


def _worker_python(master: str | None) -> str | None:
    """A wrapper of this interpreter for Spark's Python workers that drops ``pyspark.zip`` from their PYTHONPATH,
    or None where it does not apply.

    Spark puts ``SPARK_HOME/python/lib/pyspark.zip`` first on every Python worker's PYTHONPATH. Python keeps
    no bytecode for modules imported from a zip, so each new worker process (the data source's planner
    processes, the worker daemon and every worker it forks) compiled pyspark's modules from source again:
    about 20 s of a 30 s first scan on a loaded 2-core machine (docs/performance.md, "Analytics"). When the
    same pyspark is installed in this interpreter (pip: SPARK_HOME is that package), the workers import it
    from there, with its compiled bytecode. Only for a master on this machine (``local``, ``local-cluster``),
    never under spark-submit, and never when PYSPARK_PYTHON is set.
    """
    import pyspark

    home = os.path.dirname(os.path.abspath(pyspark.__file__))
    if "PYSPARK_GATEWAY_PORT" in os.environ or not (master or "local").startswith("local"):
        return None
    if os.environ.get("SPARK_HOME", home) != home or not os.path.exists(os.path.join(home, "python", "lib", "pyspark.zip")):
        return None
    import hashlib
    import shlex
    import tempfile

    script = (
        "#!/bin/sh\n"
        "# mtaq analyze: Spark's Python workers without pyspark.zip on PYTHONPATH (mtaq/analytics/job.py)\n"
        "PYTHONPATH=$(printf '%s' \"$PYTHONPATH\" | tr ':' '\\n' | grep -v '/pyspark\\.zip$' | paste -sd: -)\n"
        "export PYTHONPATH\n"
        f"exec {shlex.quote(sys.executable)} \"$@\"\n"
    )
    digest = hashlib.sha256(script.encode()).hexdigest()[:12]
    path = os.path.join(tempfile.gettempdir(), f"mtaq-spark-python-{os.getuid()}-{digest}")
    try:
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(script)
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)
    except OSError:
        return None
    return path
