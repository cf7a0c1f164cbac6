"""The Spark session flowsieve runs on: its configuration, and the JVM's start-up options (a
class-data archive, so that Spark starts sooner)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from pyspark import SparkConf, SparkContext
from pyspark.java_gateway import launch_gateway
from pyspark.sql import SparkSession

from collector.spark.source import SpoolDataSource

ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"

# replay of a capture smaller than this starts its JVM with ``quick_start`` (C1 only): the
# compiling it saves outweighs the slower code on so little work (the 851-packet sample: 10.3
# against 12.2 s); a larger one's answer job runs on C2's code (the 3M-packet CSV bench's
# answer job: 5.6 against 8.7 s, warm)
QUICK_START_BYTES = 64 << 20
ARROW_BATCH_ROWS = 65536  # rows per Arrow batch to and from Spark's Python workers
_dump_ready: Path | None = None  # marks this process's JVM's class dump as worth keeping
_dump: Path | None = None  # the class dump this process's JVM writes when it exits


def jvm_options(class_archive: str | os.PathLike | None, quick_start: bool) -> list[str]:
    """JVM start-up options. A class-data archive (AppCDS) maps the classes Spark loads instead
    of parsing them from its jars: a JVM that finds none writes one when it exits, and later
    ones start about 2 s sooner and run their first job about 1.4 s sooner (bench/README.md).
    A dump is kept only from a JVM that ran a job (``class_dump_ready``): one that only started
    holds a fifth of the classes a merge loads. It is promoted to ``class_archive`` once the
    process that started its JVM is gone and it has not changed for 10 s; a stale or foreign
    archive is ignored by the JVM (``-Xshare:auto``)."""
    global _dump_ready, _dump
    opts = []
    if quick_start:
        opts += ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"]
    if class_archive is not None:
        archive = Path(class_archive)
        archive.parent.mkdir(parents=True, exist_ok=True)
        _promote(archive)
        _forget_others(archive)
        opts.append("-Xlog:cds=off,cds+dynamic=off")
        if archive.exists():
            with contextlib.suppress(OSError):
                os.utime(archive)  # its last use: another installation's cleanup reads it
            opts.append(f"-XX:SharedArchiveFile={archive}")
        else:
            dump = archive.with_name(f"{archive.name}.dump-{os.getpid()}")
            opts.append(f"-XX:ArchiveClassesAtExit={dump}")
            _dump_ready = dump.with_name(dump.name + ".ready")
            _dump = dump
    return opts


def _promote(archive: Path) -> None:
    """Dumps of JVMs that are gone become the archive (one that ran a job) or are removed."""
    now = time.time()
    paths = sorted(archive.parent.glob(archive.name + ".dump-*"),
                   key=lambda p: p.suffix == ".ready")  # each dump before the markers
    for path in paths:
        dump = path.with_name(path.name.removesuffix(".ready"))
        try:
            pid = _dump_pid(path)
            if _alive(pid) or now - path.stat().st_mtime <= 10:
                continue
            ready = dump.with_name(dump.name + ".ready")
            if path == dump and ready.exists() and not archive.exists():
                os.replace(dump, archive)
            else:
                path.unlink()  # a dump of a JVM that ran no job, or a marker left over
        except (FileNotFoundError, ValueError):
            pass


FORGET_ARCHIVE_S = 30 * 86400  # another installation's archive unused this long is removed
FORGET_DUMP_S = 86400  # ... and a dump its JVM left this long ago that it never promoted


def _dump_pid(path: Path) -> int:
    """The process whose JVM wrote a dump ``….jsa.dump-<pid>`` (or its ``.ready`` marker)."""
    return int(path.name.removesuffix(".ready").rsplit("-", 1)[1])


def _forget_others(archive: Path) -> None:
    """Class-data files of other pyspark installations sharing the folder (180 MB each):
    an archive no JVM has used for 30 days (a deleted virtual environment's) and a dump whose
    JVM is gone for a day without its installation starting again to promote it."""
    now = time.time()
    for path in archive.parent.glob("spark-*-job-classes.jsa*"):
        if path.name.startswith(archive.name):
            continue  # this installation's: _promote's
        try:
            age = now - path.stat().st_mtime
            if path.name.endswith(".jsa"):
                stale = age > FORGET_ARCHIVE_S
            else:
                stale = age > FORGET_DUMP_S and not _alive(_dump_pid(path))
            if stale:
                path.unlink()
        except (FileNotFoundError, ValueError, IndexError):
            pass


def class_dump_ready() -> None:
    """This process's JVM has run a Spark job: the class dump it writes at exit holds the
    classes a job needs and is kept (marked once: every later batch finds nothing to do)."""
    global _dump_ready
    if _dump_ready is not None:
        with contextlib.suppress(OSError):
            _dump_ready.touch()
        _dump_ready = None


def stop_jvm(spark: SparkSession | None, timeout_s: float) -> str:
    """Stop the session and the JVM this process launched for it, within ``timeout_s``: the
    SparkContext stops (its executors and Python workers with it), Py4J's connections close,
    and the JVM, told by the end of its standard input (pyspark's gateway exits then), ends
    by itself, writing its class dump if it has one to write. One that has not ended by then
    is killed and its unfinished dump removed: a daemon never leaves its JVM running behind
    it. How it ended: ``exited`` (its code), ``killed``, or ``none`` (no JVM of ours)."""
    import subprocess
    global _dump_ready
    deadline = time.monotonic() + timeout_s
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if spark is not None:
        with contextlib.suppress(Exception):  # a dead JVM cannot stop: nothing to stop then
            spark.stop()
    if gateway is not None:
        with contextlib.suppress(Exception):
            gateway.shutdown()
    SparkContext._gateway = SparkContext._jvm = None
    SparkContext._active_spark_context = None
    SparkSession._instantiatedSession = SparkSession._activeSession = None
    if proc is None:
        return "none"
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        return f"exited ({proc.wait(max(0.0, deadline - time.monotonic()))})"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if _dump is not None:  # a dump cut short is no archive: it and its marker go
        for path in (_dump, _dump.with_name(_dump.name + ".ready")):
            with contextlib.suppress(OSError):
                path.unlink()
    _dump_ready = None
    return "killed"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def class_archive_path(folder: str | os.PathLike) -> Path:
    """The class-data archive of this pyspark installation in ``folder``. The JVM ignores an
    archive dumped with another class path (``-Xshare:auto``), so the name holds a digest of
    where this pyspark's jars are: two installations (two virtual environments) sharing a
    cache each keep their own, where one name kept the first one's, useless to the other."""
    import hashlib

    import pyspark
    where = hashlib.sha1(str(Path(pyspark.__file__).resolve().parent).encode()).hexdigest()
    return Path(folder) / f"spark-{pyspark.__version__}-{where[:10]}-job-classes.jsa"


def build_session(master: str = "local[*]", driver_memory: str = "2g", shuffle_partitions: int = 4,
                  rocksdb: bool = True, extra: dict[str, str] | None = None,
                  app_name: str = "flowsieve", jvm_log: str | os.PathLike | None = None,
                  class_archive: str | os.PathLike | None = None, quick_start: bool = False
                  ) -> SparkSession:
    """A Spark session configured for flowsieve (workers run this interpreter). With
    ``jvm_log`` the JVM's own output (its stack traces, log4j's console) goes to that file
    instead of this process's terminal: commands report Spark's failures in one line.
    ``class_archive`` is a class-data archive of the JVM (``jvm_options``); ``quick_start``
    trades peak JIT speed for start-up (a command that runs once, such as ``replay``)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    local = master.startswith("local")
    if local:  # nothing outside this host talks to a local driver
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    log4j = Path(__file__).with_name("log4j2.properties")
    b = (SparkSession.builder.master(master).appName(app_name)
         .config("spark.driver.memory", driver_memory)
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
         .config("spark.sql.session.timeZone", "UTC")
         .config("spark.sql.streaming.noDataMicroBatches.enabled", "true")
         .config("spark.sql.files.ignoreCorruptFiles", "true")
         # answers: timestamps as UTC instants (INT96 would read back as local times), the
         # Python stages fed large Arrow batches (fewer calls; a group is whole anyway)
         .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
         .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(ARROW_BATCH_ROWS))
         # Python workers forked with the answer tasks' modules imported (worker.py)
         .config("spark.python.daemon.module", "collector.spark.worker")
         .config("spark.driver.extraJavaOptions", " ".join(
             [f"-Dlog4j2.configurationFile=file:{log4j}",
              *jvm_options(class_archive, quick_start)])))
    if local:  # a cluster's executors reach the driver at spark.driver.host (spark.extra)
        b = b.config("spark.driver.bindAddress", "127.0.0.1")
    if rocksdb:
        b = b.config("spark.sql.streaming.stateStore.providerClass", ROCKSDB).config(
            "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
    for k, v in (extra or {}).items():
        b = b.config(k, v)
    if jvm_log is not None and SparkContext._gateway is None:
        # the gateway pyspark would launch, with the JVM's stdout and stderr in the log file
        out = open(jvm_log, "ab")  # noqa: SIM115 - the JVM holds it for its lifetime
        conf = SparkConf().setAll(list(b._options.items()))
        SparkContext._gateway = launch_gateway(conf, popen_kwargs={"stdout": out,
                                                                   "stderr": out})
        SparkContext._jvm = SparkContext._gateway.jvm
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(SpoolDataSource)
    return spark


OOM_EXIT = 52  # Spark's exit code for a JVM that died of an OutOfMemoryError (SparkExitCode)
_MEMORY = ("raise spark.driver_memory (FLOWSIEVE_SPARK__DRIVER_MEMORY; on a cluster, "
           "spark.executor.memory in spark.extra)")
_WORKER = ("give Spark's Python workers more memory (spark.executor.pyspark.memory in "
           "spark.extra, or a host with more)")


def jvm_exit_code(wait_s: float = 0.0) -> int | None:
    """The exit code of the JVM this process launched for Spark, if it has died (waiting up
    to ``wait_s`` for one that is on its way out)."""
    import subprocess
    proc = getattr(SparkContext._gateway, "proc", None)
    if proc is None:
        return None
    try:
        return proc.wait(wait_s) if wait_s else proc.poll()
    except subprocess.TimeoutExpired:
        return None


def death_reason(code: int | None) -> str:
    """Why the JVM this process launched for Spark died, from its exit: out of memory (Spark's
    exit code for an OutOfMemoryError) with the setting to raise, a signal, or the code."""
    import signal
    if code == OOM_EXIT:
        return f"it ran out of memory (java.lang.OutOfMemoryError): {_MEMORY}"
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"it was killed ({name}" + (": the kernel's OOM killer does this, or a person)"
                                           if -code == signal.SIGKILL else ")")
    return f"it exited (exit code {code})"


def _said(e: BaseException) -> str:
    """What an error says, without asking a dead JVM: a Py4JJavaError's ``str`` fetches the
    Java exception's text over the gateway, which raises again once the JVM is gone."""
    try:
        return str(e)
    except Exception:  # noqa: BLE001 - any failure of the gateway: say what Python holds
        return " ".join(str(a) for a in getattr(e, "args", ()) if isinstance(a, str)) \
            or type(e).__name__


def failure_reason(e: BaseException, jvm_log: str | os.PathLike | None = None) -> str | None:
    """One line saying why Spark failed, from the error a PySpark call raised, the JVM's exit
    and its log (None: not Spark's). Running out of memory says so and names the setting to
    raise, whether the JVM ran out (an OutOfMemoryError; a JVM that died of one) or a Python
    worker did (a MemoryError under its limit; a worker killed, as the kernel's OOM killer
    does); a JVM that died otherwise says it died, never just "Connection refused"."""
    import re
    text = "\n".join(_said(x) for x in (e, e.__cause__, e.__context__) if x)
    names = {type(x).__module__.split(".")[0] for x in (e, e.__cause__, e.__context__) if x}
    logged = ""
    if jvm_log is not None:
        try:
            with open(jvm_log, errors="replace") as f:
                f.seek(max(0, os.path.getsize(jvm_log) - (1 << 20)))
                logged = f.read()
        except OSError:
            pass
    # a JVM on its way out: Py4J lost it, its jobs were cancelled, its scheduler is gone (the
    # error's text fetched while it stops), or it logged an OutOfMemoryError, which ends it
    lost = any(isinstance(x, ConnectionError) or type(x).__name__ == "Py4JNetworkError"
               for x in (e, e.__cause__, e.__context__) if x) or \
        re.search(r"SparkContext (was|has been) shut ?down|stopped SparkContext|dagScheduler",
                  text) is not None or "OutOfMemoryError" in logged
    code = jvm_exit_code(10.0 if lost else 0.0)
    if not names & {"py4j", "pyspark"} and "java." not in text and code is None:
        return None
    if "OutOfMemoryError" in text or code == OOM_EXIT or (
            code is not None and "OutOfMemoryError" in logged):
        return f"the Spark JVM ran out of memory (java.lang.OutOfMemoryError): {_MEMORY}"
    python = "Python worker" in text or "PythonException" in text
    if python and re.search(r"\bMemoryError\b|failed to map segment|Cannot allocate memory",
                            text):
        return f"a Spark Python worker ran out of memory (MemoryError): {_WORKER}"
    if re.search(r"Python worker exited unexpectedly|worker.*(killed|crashed)", text,
                 re.IGNORECASE):
        return f"a Spark Python worker was killed (out of memory?): {_WORKER}"
    if code is not None:
        return f"the Spark JVM died (exit code {code})"
    if python:  # a Python worker's traceback: its exception's line
        raised = [ln.strip() for ln in text.splitlines()
                  if re.match(r"\w+(\.\w+)*(Error|Exception)\b", ln.strip())]
        if raised:
            return f"a Spark Python worker failed: {raised[-1][:300]}"
    for line in text.splitlines():
        line = line.strip()
        m = re.search(r"((?:java|org\.apache\.spark)[\w.$]*(?:Exception|Error)): ?(.*)", line)
        if m:
            return f"{m.group(1)}: {m.group(2)}".rstrip(": ")
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return first[:300]
