"""The Spark session flowsieve runs on: its configuration, and the JVM's start-up options (a
class-data archive, so that Spark starts sooner)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
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
# a JVM that runs one command's jobs and exits (``replay``) compiles a method once it is three
# times as hot as HotSpot's default: its JIT threads spent 32 s of CPU (20,000 methods:
# Spark's planner, Janino, ANTLR, Java serialization) in the 28 s of a 2-core JVM answering the
# 3M-packet CSV bench, most of it on code that runs a few times; the whole command took 28-29
# against 29-31 s with Spark's engine, 21-23 against 23 s with the Python engine (C1 alone:
# 43.6 against 32.5 s with Spark's engine)
ONE_SHOT_COMPILE_SCALING = 3
ARROW_BATCH_ROWS = 65536  # rows per Arrow batch to and from Spark's Python workers
# HotSpot compiles methods of any size, on the driver and on executors: Spark generates a
# whole stage's code in one method of up to ``spark.sql.codegen.hugeMethodLimit`` (65,535
# bytes of bytecode), and HotSpot's own limit (8,000, DontCompileHugeMethods) left such a
# method interpreted, 2x slower than no whole-stage code at all (the Spark SQL answers of 50
# queries; a limit of 8,000 in Spark fell back to that instead). Compiled, the CSV bench's
# answers took 17.5-18.3 s against 20.2-20.7 s in a fresh JVM, 10.5-10.7 against 11.8-12.9 s
# warm
COMPILE_HUGE_METHODS = "-XX:-DontCompileHugeMethods"
DRIVER_OPTIONS = "spark.driver.extraJavaOptions"
EXECUTOR_OPTIONS = "spark.executor.extraJavaOptions"


def jvm_options(class_archive: str | os.PathLike | None, quick_start: bool,
                dump: str | os.PathLike | None = None, one_shot: bool = False) -> list[str]:
    """JVM start-up options. A class-data archive (AppCDS) maps the classes Spark loads
    instead of parsing them from its jars: a JVM that finds ``class_archive`` starts about 2 s
    sooner and runs its first job about 1.4 s sooner (bench/README.md). No JVM of the daemon
    or of ``replay`` writes one: ``flowsieve prepare`` does, at install (``dump``: this JVM
    writes its classes there when it exits, however long that takes). Writing one at exit
    took a stop past its deadline (about 190 MB, killed half-written at 20 s). A stale or
    foreign archive is ignored by the JVM (``-Xshare:auto``). ``quick_start``: C1 only;
    ``one_shot``: a JVM of one command compiles only its hottest methods
    (``ONE_SHOT_COMPILE_SCALING``)."""
    opts = []
    if quick_start:
        opts += ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"]
    elif one_shot:
        opts.append(f"-XX:CompileThresholdScaling={ONE_SHOT_COMPILE_SCALING}")
    if class_archive is not None or dump is not None:
        opts.append("-Xlog:cds=off,cds+dynamic=off")
    if dump is not None:
        opts.append(f"-XX:ArchiveClassesAtExit={dump}")
    elif class_archive is not None:
        archive = Path(class_archive)
        _forget_others(archive)
        if archive.exists():
            with contextlib.suppress(OSError):
                os.utime(archive)  # its last use: another installation's cleanup reads it
            opts.append(f"-XX:SharedArchiveFile={archive}")
    return opts


FORGET_ARCHIVE_S = 30 * 86400  # another installation's archive unused this long is removed
FORGET_DUMP_S = 3600  # ... and a dump ``prepare`` left this long ago (its process is gone)


def _forget_others(archive: Path) -> None:
    """Class-data files of other pyspark installations sharing the folder (about 190 MB
    each): an archive no JVM has used for 30 days (a deleted virtual environment's), and a
    dump that a ``prepare`` stopped part way left behind."""
    now = time.time()
    for path in archive.parent.glob("spark-*-job-classes.jsa*"):
        if path == archive:
            continue
        try:
            age = now - path.stat().st_mtime
            if path.name.endswith(".jsa"):
                stale = age > FORGET_ARCHIVE_S
            else:
                stale = age > FORGET_DUMP_S and not _alive(int(path.name.rsplit("-", 1)[1]))
            if stale:
                path.unlink()
        except (FileNotFoundError, ValueError, IndexError):
            pass


def quiet_jvm(sc: SparkContext) -> None:
    """Silence the JVM for its teardown: log4j, and its standard error, where Scala's
    executors print the stack trace of each callback that a pool Spark shuts down as it stops
    refused (a RejectedExecutionException; twice in 1 of CI's 10 stops under traffic, a batch
    abandoned). Not news: the daemon says how its stop went."""
    with contextlib.suppress(Exception):  # a JVM already gone is quiet
        sc.setLogLevel("OFF")
        io = sc._jvm.java.io
        sc._jvm.java.lang.System.setErr(io.PrintStream(io.OutputStream.nullOutputStream()))


def stop_jvm(spark: SparkSession | None, timeout_s: float) -> str:
    """Stop the session and the JVM this process launched for it, within ``timeout_s``: the
    SparkContext stops (its executors and Python workers with it), Py4J's connections close,
    and the JVM, told by the end of its standard input (pyspark's gateway exits then), ends
    by itself. One that has not ended by then is killed: a daemon never leaves its JVM
    running behind it. How it ended: ``exited`` (its code), ``killed``, or ``none`` (no JVM
    of ours)."""
    import subprocess
    deadline = time.monotonic() + timeout_s
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if spark is not None:
        with contextlib.suppress(Exception):  # a dead JVM cannot stop: nothing to stop then
            sc = spark.sparkContext
            # the tasks of a cancelled job (an abandoned batch) report their end first: the
            # context stopped under them logged a stack trace per task; what the JVM logs
            # as it stops is its teardown, not news (the daemon says how its stop went)
            settle = time.monotonic() + min(3.0, timeout_s / 3)
            while sc.statusTracker().getActiveStageIds() and time.monotonic() < settle:
                time.sleep(0.05)
            quiet_jvm(sc)
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
                  class_archive: str | os.PathLike | None = None, quick_start: bool = False,
                  class_dump: str | os.PathLike | None = None, one_shot: bool = False
                  ) -> SparkSession:
    """A Spark session configured for flowsieve (workers run this interpreter). With
    ``jvm_log`` the JVM's own output (its stack traces, log4j's console) goes to that file
    instead of this process's terminal: commands report Spark's failures in one line.
    ``class_archive`` is a class-data archive of the JVM, ``class_dump`` where this JVM writes
    one when it exits (``jvm_options``); ``quick_start`` trades peak JIT speed for start-up,
    and ``one_shot`` compiles less (a command that runs once, such as ``replay``). ``extra``:
    more Spark settings (``spark.extra``); JVM options there come after flowsieve's."""
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
         .config(DRIVER_OPTIONS, " ".join(
             [f"-Dlog4j2.configurationFile=file:{log4j}", COMPILE_HUGE_METHODS,
              *jvm_options(class_archive, quick_start, class_dump, one_shot)]))
         .config(EXECUTOR_OPTIONS, COMPILE_HUGE_METHODS))
    if local:  # a cluster's executors reach the driver at spark.driver.host (spark.extra)
        b = b.config("spark.driver.bindAddress", "127.0.0.1")
    if rocksdb:
        b = b.config("spark.sql.streaming.stateStore.providerClass", ROCKSDB).config(
            "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
    for k, v in (extra or {}).items():
        if k in (DRIVER_OPTIONS, EXECUTOR_OPTIONS):  # the user's options after ours
            v = f"{b._options[k]} {v}"
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
    return spark


_REGISTERED: set[str] = set()  # the Spark applications that know the Arrow spool's source
_REGISTERED_LOCK = threading.Lock()


def register_spool_source(spark: SparkSession) -> None:
    """Make ``format("flowsieve_spool")`` (the Arrow IPC spool's Python data source) known to
    ``spark``, once per application: registering it takes about 1.1 s (its class pickled and
    handed to the JVM), which a session that reads the default Parquet spool never pays."""
    app = spark.sparkContext.applicationId
    with _REGISTERED_LOCK:
        if app not in _REGISTERED:
            spark.dataSource.register(SpoolDataSource)
            _REGISTERED.add(app)


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


_RAISED = re.compile(r"(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)(?::\s*(.*))?")
_ERROR_CLASS = re.compile(r"^\[[A-Z0-9_.]+\]\s*")  # PySpark's "[PACKAGE_NOT_INSTALLED] …"


def raised(text: str) -> tuple[str, str] | None:
    """The exception the last Python traceback in ``text`` ends with: its class's name and
    its message's first line (None: no traceback). A Python worker's failure and an error of
    the driver's Py4J callback reach Spark as such text."""
    found = None
    in_trace = indented = False
    for line in text.splitlines():
        if "Traceback (most recent call last)" in line:
            in_trace, indented = True, False
        elif in_trace and line[:1] in (" ", "\t"):
            indented = True
        elif in_trace and indented and line.strip():
            m = _RAISED.fullmatch(line.strip())
            if m:
                found = (m.group(1), m.group(2) or "")
            in_trace = False
    return found


def one_line(e: BaseException) -> str:
    """An error in one line, ``Class: message``: the Python exception a traceback in it ends
    with (a worker's, a callback's), else a Py4J error's Java exception, else its own class
    and first line; PySpark's ``[ERROR_CLASS]`` prefix left out."""
    text = _said(e)
    name, message = raised(text) or (type(e).__name__, "")
    if name == type(e).__name__ and not message:
        if name == "Py4JJavaError":
            for line in text.splitlines():
                m = re.search(r"((?:java|org\.apache\.spark)[\w.$]*(?:Exception|Error)): ?(.*)",
                              line)
                if m:
                    name, message = m.group(1).rsplit(".", 1)[-1], m.group(2)
                    break
        if not message:
            message = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    message = _ERROR_CLASS.sub("", message.strip())
    return f"{name}: {message}"[:300].rstrip(": ") if message else name


def failure_reason(e: BaseException, jvm_log: str | os.PathLike | None = None) -> str | None:
    """One line saying why Spark failed, from the error a PySpark call raised, the JVM's exit
    and its log (None: not Spark's). Running out of memory says so and names the setting to
    raise, whether the JVM ran out (an OutOfMemoryError; a JVM that died of one) or a Python
    worker did (a MemoryError under its limit; a worker killed, as the kernel's OOM killer
    does); a JVM that died otherwise says it died, never just "Connection refused"."""
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
    if python and raised(text):  # a Python worker's traceback: its exception
        return f"a Spark Python worker failed: {one_line(e)}"
    for line in text.splitlines():
        line = line.strip()
        m = re.search(r"((?:java|org\.apache\.spark)[\w.$]*(?:Exception|Error)): ?(.*)", line)
        if m:
            return f"{m.group(1)}: {m.group(2)}".rstrip(": ")
    return one_line(e)
