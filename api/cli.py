"""The command line: ``flowsieve run | replay | decode | plan | fields | prepare`` (stable:
tests and benchmarks call it). It sits above the four packages (DESIGN: the one place that may
import them all). A command that fails prints one line ``error: …`` on stderr and exits
non-zero, never a traceback (``FLOWSIEVE_DEBUG=1`` prints the traceback too); long work shows
progress on a terminal."""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

from capture import enrich
from capture.errors import CaptureError
from capture.fields import (
    BYTES,
    CODE,
    IP,
    STREAMS,
    TS,
    decoded_fields,
    enriched,
    enrichment_inputs,
    fields,
    ip_text,
)
from capture.netflow import DEFAULT_FLOW_PORTS
from capture.sflow import DEFAULT_SFLOW_PORTS
from collector.pipeline.spool import SpoolFull
from planner.ir import QueryError

if TYPE_CHECKING:
    import pyarrow as pa

FROM_CONFIG = object()  # --bits not given: the config's planner.bit_budget


class CliError(Exception):
    """A failure reported as one ``error: …`` line."""


def _version() -> str:
    try:
        return version("flowsieve")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _ports(text: str) -> list[int]:
    try:
        ports = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port list: {text!r}") from None
    if not ports or any(not 0 < p < 65536 for p in ports):
        raise argparse.ArgumentTypeError(f"ports must be 1-65535: {text!r}")
    return ports


def _bits(text: str) -> int | None:
    if text.lower() in ("none", "unlimited"):
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a bit count: {text!r} (a number or none)") \
            from None
    if n < 0:
        raise argparse.ArgumentTypeError("the bit budget is 0 or more")
    return n


PORTS_HELP = ("UDP ports of flow exports, comma-separated (default "
              f"{','.join(map(str, DEFAULT_FLOW_PORTS))})")
SFLOW_PORTS_HELP = ("UDP ports of sFlow datagrams, comma-separated (default "
                    f"{','.join(map(str, DEFAULT_SFLOW_PORTS))})")
BITS_HELP = ("prefilter bit budget: a number, or none for one bit per rectangle (default: the "
             "config's planner.bit_budget, as the daemon compiles)")
CONFIG_HELP = "YAML config (default: the embedded defaults)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flowsieve",
        description="Many continuous queries over packets and flow exports: a numba prefilter "
                    "in front of Apache Spark.")
    p.add_argument("--version", action="version", version=f"flowsieve {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="the daemon: API, capture sources, Spark job",
                       description="Run the daemon: the REST control plane, the capture "
                                   "sources and the Spark job.")
    r.add_argument("--config", help=CONFIG_HELP)

    rp = sub.add_parser("replay", help="run queries over a capture through the whole pipeline",
                        description="Run queries over a capture file through the whole "
                                    "pipeline, Spark included, and print every result row.")
    rp.add_argument("capture", help="pcap or pcapng file: its packets for queries FROM packets, "
                    "its NetFlow/IPFIX datagrams for queries FROM flows")
    rp.add_argument("--queries", required=True, help="file of SQL statements")
    rp.add_argument("--config", help=CONFIG_HELP + "; its planner, asc and spark sections apply")
    rp.add_argument("--flow-ports", type=_ports, default=list(DEFAULT_FLOW_PORTS),
                    help=PORTS_HELP)
    rp.add_argument("--sflow-ports", type=_ports, default=list(DEFAULT_SFLOW_PORTS),
                    help=SFLOW_PORTS_HELP)
    rp.add_argument("--out", help="keep the spool, results and checkpoints in this folder "
                    "(must be empty)")
    rp.add_argument("--format", choices=("table", "csv", "json"), default="table",
                    help="table for people, csv or json lines for scripts (default table)")
    rp.add_argument("--time", choices=("iso", "epoch", "bucket"), default="iso",
                    help="windows' start and end as ISO 8601 UTC (default), epoch seconds, or "
                    "bucket: left out (the query's own time/N column only, the old form)")
    rp.add_argument("--bits", type=_bits, default=FROM_CONFIG, help=BITS_HELP)
    rp.add_argument("--workers", type=_workers, default=None,
                    help="processes that read a classic pcap file, each a byte range (default "
                    "replay_workers of the config: 0, one per core but one, up to 4, for "
                    "files of 128 MiB and more)")

    d = sub.add_parser("decode", help="print unpacked tuples, flow records or sFlow samples",
                       description="Print the catalogue fields of every packet, every "
                                   "NetFlow/IPFIX record, or every sFlow flow or counter "
                                   "sample, of a capture.")
    d.add_argument("capture", help="pcap or pcapng file, or - for a pcap or pcapng stream on "
                   "stdin (--stream flows: the NetFlow/IPFIX datagrams it holds; samples, "
                   "counters: its sFlow datagrams)")
    d.add_argument("--stream", choices=STREAMS, default="packets",
                   help="packets: unpacked packet fields; flows: NetFlow v5/v9/IPFIX records; "
                   "samples: sFlow flow samples (their headers unpacked); counters: sFlow "
                   "counter samples")
    d.add_argument("--flow-ports", type=_ports, default=list(DEFAULT_FLOW_PORTS),
                   help=PORTS_HELP)
    d.add_argument("--sflow-ports", type=_ports, default=list(DEFAULT_SFLOW_PORTS),
                   help=SFLOW_PORTS_HELP)
    d.add_argument("--fields", help="comma-separated catalogue fields (default: all but "
                   "payload, which prints as hex when named, and the enrichment fields, which "
                   "need --config's enrich databases; see flowsieve fields)")
    d.add_argument("--config", help=CONFIG_HELP + "; its enrich section applies")
    d.add_argument("--format", choices=("csv", "json", "parquet"), default="csv",
                   help="csv with a header row, one JSON object per line, or Parquet (a row "
                   "group per batch read; addresses as text, ts in ns; default csv)")
    d.add_argument("--output", metavar="FILE",
                   help="write to FILE (replaced when complete) instead of standard output")

    pl = sub.add_parser("plan", help="print the compiled plan",
                        description="Compile queries and print the plan the daemon would run: "
                                    "predicates, prefilter bits, ASCs, signatures, residuals.")
    pl.add_argument("--queries", required=True, help="file of SQL statements")
    pl.add_argument("--config", help=CONFIG_HELP + "; its planner and asc sections apply")
    pl.add_argument("--bits", type=_bits, default=FROM_CONFIG, help=BITS_HELP)
    pl.add_argument("--capture", help="measure selectivities and choose the ASC sequences on "
                    "this pcap (adds expected invocations per tuple)")
    pl.add_argument("--format", choices=("text", "json"), default="text",
                    help="text for people, json for scripts (default text)")

    pr = sub.add_parser("prepare", help="compile the kernels and make the JVM's class-data "
                        "archive (make run's install does it)",
                        description="Compile every numba kernel into numba's cache and have a "
                                    "JVM run Spark's jobs and write its class-data archive, so "
                                    "that the first run after an install is as fast as the "
                                    "second. The install step of make run and the image's "
                                    "build run it; about a minute.")
    pr.add_argument("--config", help=CONFIG_HELP + "; its spark section applies (the "
                    "archive's folder, class_archive_dir)")
    pr.add_argument("--force", action="store_true",
                    help="make the class-data archive again even if it exists")

    f = sub.add_parser("fields", help="list the field catalogue",
                       description="List the fields queries and decode can use, with their "
                                   "types and meanings.")
    f.add_argument("--stream", choices=(*STREAMS, "all"), default="all",
                   help="the stream whose fields to list (default all)")
    f.add_argument("--format", choices=("text", "json"), default="text",
                   help="an aligned table, or a JSON list (default text)")
    return p


def check_java() -> None:
    """Spark needs Java 17 or newer: say so clearly instead of a JVM stack trace."""
    java = shutil.which("java")
    if java is None:
        raise CliError("Java not found: Spark needs Java 17 "
                       "(Debian/Ubuntu: apt-get install -y openjdk-17-jre-headless)")
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    m = re.search(r'version "(\d+)', out)
    if m and int(m.group(1)) < 17:
        raise CliError(f"Java {m.group(1)} found, Spark needs Java 17 or newer")


def check_capture(path: str) -> None:
    """A capture argument that can be read, checked before any output is written."""
    if path == "-":
        return
    p = Path(path)
    if not p.exists():
        raise CliError(f"capture {path} does not exist")
    if p.is_dir():
        raise CliError(f"capture {path} is a directory, not a pcap or pcapng file")
    try:
        with open(p, "rb"):
            pass
    except OSError as e:
        raise CliError(f"capture {path} cannot be read: {e.strerror}") from e


def check_exposure(api) -> None:
    """Without a token the API listens on loopback only (anyone who reaches the port could
    register or delete queries)."""
    from api.security import is_loopback
    if not is_loopback(api.host) and not api.scopes():
        raise CliError(f"api.host is {api.host}, not a loopback address, and no token is set: "
                       "set api.token (or FLOWSIEVE_API__TOKEN) or bind 127.0.0.1")


def api_socket(host: str, port: int) -> socket.socket:
    """The API's socket, bound before Spark starts: a clash shows at once, not 40 s later, and
    nothing else (an ephemeral port of Spark, py4j or another process) can take the port while
    Spark starts (uvicorn binds only after the app's start-up)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise CliError(f"api: cannot listen on {host}:{port}: {e.strerror} (set api.port "
                       "in the config or FLOWSIEVE_API__PORT)") from e
    return s  # not inherited by Spark's processes (PEP 446)


def _settings(path: str | None):
    from pydantic import ValidationError

    from collector.config import load_settings
    try:
        return load_settings(path)
    except FileNotFoundError as e:
        raise CliError(f"config: {e}") from e
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "config"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise CliError(f"config: {where}: {first['msg']}{more}") from e
    except ValueError as e:
        raise CliError(f"config: {e}".replace("\n", "; ")) from e


def _workers(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 64:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of processes from 0 to 64")
    return n


def _with_bits(settings, bits):
    if bits is not FROM_CONFIG:
        settings.planner.bit_budget = bits
    return settings


def _read_queries(path: str):
    from planner.query import parse_queries
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror}") from e
    try:
        return parse_queries(text)
    except QueryError as e:
        raise CliError(f"{path}: {e}") from e


class Progress:
    """A progress bar on the terminal (rich, on stderr) while stdout is a terminal; nothing
    when output goes to a file or a pipe."""

    def __init__(self, what: str, total_bytes: int | None):
        self.bar = None
        if not (sys.stdout.isatty() and sys.stderr.isatty()):
            return
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar
        self.bar = Bar(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                       TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                       console=Console(stderr=True), transient=True)
        self.task = self.bar.add_task(what, total=total_bytes, rate="")
        self.bar.start()

    def update(self, description: str, done_bytes: int | None, records: int,
               elapsed: float) -> None:
        if self.bar is None:
            return
        rate = f"{records / elapsed:,.0f} records/s" if elapsed > 0 and records else ""
        kw = {"completed": done_bytes} if done_bytes is not None else {}
        self.bar.update(self.task, description=description, rate=rate, **kw)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _file_size(path: str) -> int | None:
    try:
        return os.stat(path).st_size if path != "-" else None
    except OSError:
        return None


def _measure(plan, capture: str, residual=None):
    """Selectivity of every cheap predicate on a capture, the ASC sequence chosen on it, a
    sample of the tuples that pass the prefilter (aggregate-tree node sizes), and the order
    the residual stage kept on it (``residual``: its configuration)."""
    import numpy as np

    from capture.pcap import open_capture
    from capture.unpack import unpack
    from collector.config import ResidualConfig
    from collector.pipeline.asc_runtime import AscRuntime
    from collector.pipeline.compiled_prefilter import compile_prefilter
    from collector.pipeline.prefilter import run_prefilter
    from collector.pipeline.residual import Residual, ValueCache, eval_predicate
    from collector.pipeline.sampling import TupleSampler
    hits: dict[str, int] = {}
    total = 0
    cp = compile_prefilter(plan, "packets")
    asc = AscRuntime(cp, "hybrid", period=1 << 62, sample=1 << 16)
    size = os.path.getsize(capture)
    sampler = TupleSampler(rows=8192, probability=min(1.0, 8192 * 100 / max(size, 1)))
    aggs = [qp for qp in plan.queries if qp.query.stream == "packets"
            and not qp.query.is_selection]
    keys = sorted({k for qp in aggs for k in qp.query.keys})
    r = residual or ResidualConfig()
    stage = Residual(plan, "packets", r.ordering, r.profile_probability, r.profile_window,
                     r.alpha, r.sweep_stage, ValueCache(r.value_cache, r.adapt),
                     budget=r.profile_budget, adapt=r.adapt)
    for raw in open_capture(capture):
        tb = unpack(raw)
        rows = np.arange(len(tb))
        total += len(tb)
        for info in plan.predicates:
            if info.cheap and info.predicate.stream == "packets":
                hits[info.predicate.text] = hits.get(info.predicate.text, 0) + int(
                    eval_predicate(info.predicate, tb, rows).sum())
        _, Q = run_prefilter(cp, tb, asc)
        if stage:
            stage.apply(tb, Q)
        if aggs:
            kept = np.flatnonzero(Q.any(axis=1))
            sampler.observe("packets", tb.take(kept), Q[kept], keys, [qp.slot for qp in aggs])
    if asc._R:
        asc.choose(np.concatenate(asc._R), np.concatenate(asc._Q0))
    return ({k: v / total for k, v in hits.items()} if total else {}), (
        asc.describe() if cp.ascs else None), sampler.samples(), (
        stage.describe() if stage else None)


def _tables(settings, queries=()) -> None:
    """Load the configured prefix tables and user predicates (a bad file or reference is a
    one-line error) and check that the queries name only those."""
    from collector.pipeline import enrichment, prefix_tables, user_predicates
    try:
        prefix_tables.configure(settings.tables)
        user_predicates.configure(settings.predicates)
        enrichment.configure(settings.enrich)
    except ValueError as e:
        raise CliError(str(e)) from None
    for q in queries:
        prefix_tables.check(q)
        user_predicates.check(q)
        enrichment.check(q)


def cmd_plan(args) -> int:
    from planner.plan import build_plan
    settings = _with_bits(_settings(args.config), args.bits)
    queries = _read_queries(args.queries)
    _tables(settings, queries)
    plan = build_plan(queries, **settings.plan_options())
    sequence = residual = None
    if args.capture:
        check_capture(args.capture)
        selectivity, sequence, samples, residual = _measure(plan, args.capture,
                                                            settings.residual)
        plan = build_plan(queries, selectivity=selectivity, samples=samples,
                          **settings.plan_options())
    if args.format == "json":
        doc = plan.to_json()
        if sequence is not None:
            doc["asc_sequence"] = sequence
        if residual is not None:
            doc["residual_runtime"] = [{"stream": "packets", **residual}]
        print(json.dumps(doc, indent=2))
    else:
        print(plan.explain())
        if sequence is not None:
            micro = ", ".join(f"{m['from']} {m['region']} -> {m['to']}"
                              for m in sequence["micro_arrows"]) or "none"
            print(f"\nASC sequence chosen on {args.capture}: macro "
                  f"{' -> '.join(sequence['macro_sequence'])}; micro-arrows: {micro}; "
                  f"{sequence['asc_evaluations_per_tuple'] or 0:.2f} ASCs evaluated per tuple "
                  "(in plan order while measuring)")
        if residual is not None:
            print(f"\nresidual order kept by {residual['ordering']} on {args.capture}: "
                  + " -> ".join(residual["order"])
                  + f" ({residual['reorders']} reorders over {residual['profile_tuples']} "
                  f"profiled tuples; value cache {residual['cache_hits']} hits, "
                  f"{residual['cache_misses']} misses)")
    return 0


def cmd_fields(args) -> int:
    streams = STREAMS if args.stream == "all" else (args.stream,)

    def meaning(s: str, f) -> str:  # an enrichment field: where its value comes from
        e = enriched(s).get(f.name)
        return f"{f.doc}; from {e.describe()}" if e else f.doc
    rows = [(s, f.name, "text" if f.kind == CODE else f.kind, "group" if f.groupable else "",
             "measure" if f.measure else "", meaning(s, f))
            for s in streams for f in fields(s).values()]
    if args.format == "json":
        print(json.dumps([{"stream": s, "name": n, "type": k, "groupable": bool(g),
                           "measure": bool(m), "meaning": doc,
                           "enrichment": n in enriched(s)}
                          for s, n, k, g, m, doc in rows], indent=2))
        return 0
    head = ("stream", "field", "type", "group by", "measure", "meaning")
    width = [max(len(str(r[i])) for r in [head, *rows]) for i in range(5)]
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r[:5], width, strict=True)) +
              "  " + r[5])
    return 0


def _cell(kind: str, v, for_json: bool):
    if v is None:
        return None if for_json else ""
    if kind == IP:
        return ip_text(v)
    if kind == BYTES:  # payload bytes as hex, as the results print them
        return v.hex()
    if kind == TS:
        s = f"{v // 1_000_000_000}.{v % 1_000_000_000:09d}"
        return float(s) if for_json else s
    return v


def _write_rows(out, writer, names: list[str], kinds: list[str], cols: list[list]) -> None:
    """Rows of columns as CSV (``writer``) or JSON lines."""
    for row in zip(*cols, strict=True):
        vals = [_cell(k, v, writer is None) for k, v in zip(kinds, row, strict=True)]
        if writer:
            writer.writerow(vals)
        else:
            out.write(json.dumps(dict(zip(names, vals, strict=True))) + "\n")


def _field_names(stream: str, text: str | None) -> list[str]:
    cat = fields(stream)  # by default every decoded field but the payload bytes (ask for them)
    names = [n for n, f in decoded_fields(stream).items() if f.kind != BYTES] if not text \
        else [f.strip() for f in text.split(",")]
    bad = [n for n in names if n not in cat]
    if bad:
        raise CliError(f"unknown {stream} field {bad[0]!r} (fields: {', '.join(cat)})")
    return names


def _decoded_schema(stream: str, names: list[str]) -> pa.Schema:
    """Decoded columns for Parquet: addresses as text, a packet's ``ts`` in nanoseconds, every
    other field as the catalogue types it."""
    import pyarrow as pa
    cat = fields(stream)

    def arrow_type(n: str):
        if cat[n].kind == IP:
            return pa.string()
        if n == "ts" and stream != "flows":  # a packet's or a datagram's arrival
            return pa.timestamp("ns", tz="UTC")
        return cat[n].arrow_type
    return pa.schema([pa.field(n, arrow_type(n)) for n in names])


def _decoded_table(batch, schema: pa.Schema) -> pa.Table:
    """One batch's columns (a TupleBatch or a FlowBatch) in ``schema``."""
    import pyarrow as pa

    from collector.spark.answers import ip_strings
    cols = []
    for f in schema:
        if pa.types.is_timestamp(f.type) and f.type.unit == "ns":
            col = pa.array(batch.ts_ns, f.type)
        else:
            col = batch.arrow(f.name)
            if pa.types.is_string(f.type) and pa.types.is_binary(col.type):
                col = ip_strings(col)
        cols.append(col.cast(f.type))
    return pa.Table.from_arrays(cols, schema=schema)


class _DecodeOutput:
    """Where decoded rows go: CSV, JSON lines or Parquet, on standard output or into a file
    written under a hidden name and renamed into place once complete (a failed decode leaves
    no half file)."""

    def __init__(self, fmt: str, path: str | None, stream: str, names: list[str]):
        import pyarrow.parquet as pq
        self.fmt, self.path, self.names = fmt, path, names
        self.kinds = [fields(stream)[n].kind for n in names]
        self.schema = _decoded_schema(stream, names)
        if fmt == "parquet" and path is None and sys.stdout.isatty():
            raise CliError("Parquet is binary: give --output FILE or redirect standard output")
        self.tmp = None
        if path is not None:
            target = Path(path)
            if target.is_dir():
                raise CliError(f"output {path} is a directory")
            self.tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        binary = fmt == "parquet"
        try:
            self.out = open(self.tmp, "wb" if binary else "w", newline=None if binary else "") \
                if self.tmp is not None else (sys.stdout.buffer if binary else sys.stdout)
        except OSError as e:
            raise CliError(f"output {path} cannot be written: {e.strerror}") from e
        self.csv = csv.writer(self.out, lineterminator="\n") if fmt == "csv" else None
        self.parquet = pq.ParquetWriter(self.out, self.schema) if binary else None
        if self.csv:
            self.csv.writerow(names)

    def write(self, batch) -> None:
        if self.parquet is not None:
            self.parquet.write_table(_decoded_table(batch, self.schema))
            return
        if hasattr(batch, "ts_ns"):  # packets: ts as integer nanoseconds
            cols = [batch.ts_ns.tolist() if n == "ts" else batch.arrow(n).to_pylist()
                    for n in self.names]
        else:  # flow records: integers (times in ns) as the decoder holds them
            cols = [batch.arrow(n).to_pylist() if k in (IP, CODE) else
                    [None if v < 0 else int(v) for v in batch.column(n)]
                    for n, k in zip(self.names, self.kinds, strict=True)]
        _write_rows(self.out, self.csv, self.names, self.kinds, cols)

    def close(self, ok: bool) -> None:
        if self.parquet is not None:
            self.parquet.close()
        if self.tmp is None:
            self.out.flush()
            return
        self.out.close()
        if ok:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)


def cmd_decode(args) -> int:

    from capture.netflow import Decoder, capture_flows
    from capture.pcap import open_capture
    from capture.sflow import SflowDecoder, capture_sflow
    from capture.unpack import unpack
    stream = args.stream
    names = _field_names(stream, args.fields)
    check_capture(args.capture)
    extra = [n for n in names if n in enriched(stream)]
    if extra:  # looked up in the configured databases, from the fields they need
        from collector.pipeline import enrichment
        try:
            enrichment.configure(_settings(args.config).enrich)
        except ValueError as e:
            raise CliError(str(e)) from None
        missing = enrich.missing(stream, extra)
        if missing:
            raise CliError(f"{missing[0][0]} needs an enrichment database: set "
                           f"enrich.{missing[0][1]} in --config's file")
    need = sorted(set(names) | enrichment_inputs(stream, extra))
    progress = Progress(f"decode {stream}", _file_size(args.capture))
    decoder = Decoder() if stream == "flows" else SflowDecoder() if stream in (
        "samples", "counters") else None
    reader = open_capture(args.capture)  # the file is opened before any output is written
    output = _DecodeOutput(args.format, args.output, stream, names)
    ok = False
    try:
        t0, records = time.monotonic(), 0
        if stream == "packets":
            batches = (unpack(raw, need) for raw in reader)
        elif stream == "flows":
            batches = capture_flows(reader, args.flow_ports, decoder)
        else:
            batches = (b.samples(need) if stream == "samples" else b.counters()
                       for b in capture_sflow(reader, args.sflow_ports, decoder))
        for batch in batches:
            if extra:
                batch = enrich.current().apply(batch, extra)
            output.write(batch)
            records += len(batch)
            progress.update(f"decode {stream}", reader.stats.bytes, records,
                            time.monotonic() - t0)
        ok = True
    finally:
        progress.close()
        output.close(ok)
    errors = getattr(decoder, "all_errors", None) or getattr(decoder, "errors", None)
    if errors:
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(errors.items()))
        print(f"decode: input skipped ({detail})", file=sys.stderr)
    return 0


def cmd_replay(args) -> int:
    from concurrent.futures import Future

    from collector.config import cache_dir
    from collector.spark.session import (
        QUICK_START_BYTES,
        build_session,
        class_archive_path,
        failure_reason,
    )
    queries = _read_queries(args.queries)
    check_capture(args.capture)
    settings = _with_bits(_settings(args.config), args.bits)
    if args.workers is not None:
        settings.replay_workers = args.workers
    _tables(settings, queries)
    check_java()
    s = settings.spark
    tmp = None
    if args.out:
        work = Path(args.out)
        if work.exists() and any(work.iterdir()):
            raise CliError(f"--out {work} is not empty (replay needs a fresh spool and "
                           "checkpoints)")
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="flowsieve-replay-")
        work = Path(tmp.name)
    size = _file_size(args.capture)
    progress = Progress("starting Spark", size)
    t0 = time.monotonic()
    # the JVM's own output (stack traces) goes to a log the error line names, not the terminal
    jvm_log = Path(tempfile.gettempdir()) / f"flowsieve-replay-{os.getpid()}-spark.log"
    forget_jvm_logs(jvm_log.parent)

    def report(stage: str, records: int | None) -> None:
        if records is None:  # Spark's stage: the input is all read
            progress.update(stage, size, 0, 0)
        else:
            progress.update(stage, None, records, time.monotonic() - t0)
    # the JVM starts while the capture is read (a daemon thread: a command that fails before
    # Spark's stage does not wait for it)
    starting: Future = Future()

    def start() -> None:
        try:
            starting.set_result(build_session(
                s.master, s.driver_memory, s.shuffle_partitions, s.state_store == "rocksdb",
                s.extra, "flowsieve-replay", jvm_log=jvm_log,
                class_archive=class_archive_path(cache_dir()) if s.class_archive else None,
                quick_start=size is not None and size < QUICK_START_BYTES, one_shot=True))
        except Exception as e:  # noqa: BLE001 - the JVM did not start: say why in one line
            starting.set_exception(CliError(f"Spark did not start: {failure_reason(e) or e} "
                                            f"(its log: {jvm_log})"))
    threading.Thread(target=start, name="spark-start", daemon=True).start()
    # the pipeline's modules (half a second) load while the JVM starts
    from api.formats import write_answers
    from api.replay import replay
    try:
        try:
            res = replay(args.capture, queries, work, starting, settings=settings,
                         flow_ports=args.flow_ports, progress=report,
                         sflow_ports=args.sflow_ports)
        except CliError:
            raise
        except Exception as e:
            reason = failure_reason(e, jvm_log)
            if reason is None:
                raise
            raise CliError(f"Spark failed: {reason} (its log: {jvm_log})") from e
        finally:
            if starting.done() and starting.exception() is None:
                with contextlib.suppress(Exception):
                    starting.result().stop()
        jvm_log.unlink(missing_ok=True)
        progress.close()
        sys.stdout.flush()
        write_answers(sys.stdout.buffer, args.format, res.results, queries, args.time)
        sys.stdout.buffer.flush()
        if res.error is not None:
            raise res.error
    finally:
        progress.close()
        if tmp is not None:
            tmp.cleanup()
    return 0


JVM_LOG_DAYS = 1  # a failed replay's JVM log is kept this long for its user to read


def forget_jvm_logs(folder: Path, now: float | None = None) -> int:
    """Remove the JVM logs that failed replays left (each names its log in its error line)
    more than a day ago; how many."""
    from collector.spark.write import remove_older
    return remove_older(folder.glob("flowsieve-replay-*-spark.log"), JVM_LOG_DAYS * 86400, now)


def cmd_prepare(args) -> int:
    from api.prepare import compile_kernels, make_class_archive
    settings = _settings(args.config)
    check_java()
    t0 = time.monotonic()

    def say(line: str) -> None:
        print(f"prepare: {line}", file=sys.stderr, flush=True)
    kernels = compile_kernels(say)
    try:
        archive = make_class_archive(settings, say, force=args.force)
    except Exception as e:
        from collector.spark.session import failure_reason
        raise CliError(f"the class-data archive: {failure_reason(e) or e}") from e
    print(json.dumps({"kernels": {k: kernels[k] for k in ("kernels", "overloads", "compiled",
                                                         "loaded", "seconds")},
                      "class_archive": archive,
                      "seconds": round(time.monotonic() - t0, 1)}))
    return 0


def _check_initial(settings) -> None:
    """The initial queries parse and their alert directives name configured receivers: said
    in one line before anything starts (the daemon would stop in its start-up otherwise)."""
    if not settings.initial_queries or settings.role == "capture":
        return
    from collector.daemon.alerts.rules import check_rule, parse_directive
    from planner.ir import QueryError
    from planner.query import parse_queries
    try:
        for q in parse_queries(Path(settings.initial_queries).read_text()):
            if q.alert is not None:
                check_rule(parse_directive(q.alert), q, set(settings.alerts.receivers))
    except (QueryError, ValueError, OSError) as e:
        raise CliError(f"initial_queries {settings.initial_queries}: {e}") from e


def cmd_run(args) -> int:
    from collector.daemon.process import raise_capture_capabilities
    raised = raise_capture_capabilities()  # before any thread starts: they inherit it
    settings = _settings(args.config)
    check_exposure(settings.api)
    _check_initial(settings)
    from collector import crashpoints
    try:
        armed = crashpoints.configure()  # a test's (tests/test_crash_points.py)
    except ValueError as e:
        raise CliError(str(e)) from e
    sock = api_socket(settings.api.host, settings.api.port)
    check_java()
    _tables(settings)
    from collector.daemon.cluster import owner, probe_in_use
    other = probe_in_use(settings.spool_dir, settings.probe, owner(settings.var_dir),
                         max(10.0, 5 * settings.spark.trigger_s))
    if other:
        raise CliError(f"probe name {settings.probe!r} is in use in spool {settings.spool_dir} "
                       f"by {other}: give each daemon sharing a spool its own `probe`")
    import uvicorn

    from api.app import create_app
    from collector.daemon.service import Collector
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)  # one INFO line per Spark callback
    # a failed answer batch's traceback: the Spark job logs its one line (collector.spark)
    logging.getLogger("py4j.clientserver").addFilter(_NotProxyError())
    if raised:
        logging.getLogger("flowsieve").info("capture capabilities in effect: %s",
                                            ", ".join(raised))
    if armed is not None:
        logging.getLogger("flowsieve").warning("crash point armed: %s:%d%s", armed[0], armed[1],
                                               ":jvm" if armed[2] else "")
        crashpoints.watch_checkpoints(settings.checkpoint_dir)
    collector = Collector(settings)
    logging.getLogger().addFilter(_Py4JRetry(collector))
    host = f"[{settings.api.host}]" if ":" in settings.api.host else settings.api.host
    logging.getLogger("flowsieve").info("starting; the API on http://%s:%d answers once "
                                        "started", host, settings.api.port)
    _start(collector)
    app = create_app(collector, manage=True)
    # SIGTERM: open requests get 5 s, then the collector stops (shutdown_timeout_s, counted
    # from the signal)
    config = uvicorn.Config(app, host=settings.api.host, port=settings.api.port,
                            log_level="info", timeout_graceful_shutdown=5)
    with sock:
        _server(config, collector).run(sockets=[sock])
    return 0 if collector.stopped_cleanly else 1


def _start(collector) -> None:
    """Start the collector before the API serves (it answers once started). A failure is one
    line (``error: start-up failed: …``; its traceback with ``FLOWSIEVE_DEBUG=1``), after
    what had started is stopped; a SIGTERM or Ctrl-C meanwhile (a JVM takes seconds to
    start) stops the daemon cleanly once it has started."""
    import signal

    from collector.spark.session import failure_reason, one_line
    asked: list[int] = []
    handlers = {sig: signal.signal(sig, lambda n, _f: asked.append(n))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        collector.start()
    except Exception as e:
        if os.environ.get("FLOWSIEVE_DEBUG") == "1":
            traceback.print_exc()
        with contextlib.suppress(Exception):
            collector.stop()
        said = str(e) if isinstance(e, OSError | ValueError) and str(e) else \
            failure_reason(e) or one_line(e)  # Spark that did not start: why, in one line
        raise CliError(f"start-up failed: {said}") from e
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if asked:
        collector.stop()
        raise _StoppedWhileStarting()


class _StoppedWhileStarting(Exception):
    """A signal came while the daemon started: it stopped once started (exit status 0)."""


def _server(config, collector):
    """uvicorn's server, where SIGTERM is the daemon's normal stop: the collector's deadline
    counts from the signal, and the process exits 0 once stopped cleanly (uvicorn raises the
    signal again after its shutdown, which made the exit status 143)."""
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if collector.stop_requested is None:
                collector.stop_requested = time.monotonic()
            if sig == signal.SIGTERM:
                self.should_exit = True
                return
            super().handle_exit(sig, frame)
    return Server(config)


COMMANDS = {"run": cmd_run, "replay": cmd_replay, "decode": cmd_decode, "plan": cmd_plan,
            "fields": cmd_fields, "prepare": cmd_prepare}


class _NotPy4J(logging.Filter):
    """Drops what Py4J logs itself: when the JVM dies under a call, Py4J logs the lost
    connection with its traceback (``logging.exception`` on the root logger), which a command
    would print before its one ``error:`` line saying why Spark failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        return f"{os.sep}py4j{os.sep}" not in record.pathname


class _Py4JRetry(logging.Filter):
    """Drops what Py4J logs on the root logger when a connection to the JVM is lost under a
    call: always its retry note (INFO, with the lost call's traceback: the retry follows), and
    everything once the daemon stops (the JVM going away under the calls in flight is the
    stop itself)."""

    def __init__(self, collector) -> None:
        super().__init__()
        self.collector = collector

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}py4j{os.sep}" not in record.pathname:
            return True
        return record.levelno >= logging.WARNING and self.collector.stop_requested is None


class _NotProxyError(logging.Filter):
    """Drops Py4J's traceback of a Python callback that raised (a failed answer batch),
    which the Spark job reports in one line itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "exception while executing the Python Proxy" not in record.getMessage()


def quiet_py4j() -> None:
    """A command's Spark failures reach the user as its one error line, not as Py4J's logs."""
    logging.getLogger().addFilter(_NotPy4J())
    logging.getLogger("py4j").setLevel(logging.CRITICAL)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command != "run":  # the daemon logs Py4J's lines (cmd_run configures logging)
        quiet_py4j()
    try:
        return COMMANDS[args.command](args)
    except (CliError, CaptureError, QueryError, SpoolFull) as e:
        return _fail(str(e))
    except _StoppedWhileStarting:
        return 0
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        if os.environ.get("FLOWSIEVE_DEBUG") == "1":
            traceback.print_exc()
        reason = _spark_failure(e)  # "Connection refused": the JVM behind Py4J is gone
        if reason:
            return _fail(f"Spark failed: {reason}")
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"{where}{e.strerror or e}")
    except Exception as e:  # never a traceback: one line, the traceback on request
        if os.environ.get("FLOWSIEVE_DEBUG") == "1":
            traceback.print_exc()
        reason = _spark_failure(e)
        if reason:
            return _fail(f"Spark failed: {reason}")
        first = str(e).splitlines()[0] if str(e) else ""
        return _fail(f"internal error: {type(e).__name__}: {first} (FLOWSIEVE_DEBUG=1 prints "
                     "the traceback)")


def _spark_failure(e: BaseException) -> str | None:
    """Why Spark failed (``failure_reason``), when this command used Spark at all."""
    if "pyspark" not in sys.modules:
        return None
    from collector.spark.session import failure_reason
    return failure_reason(e)


def _fail(message: str) -> int:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
