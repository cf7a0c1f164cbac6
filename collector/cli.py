"""The command line: ``flowsieve run | replay | decode | plan`` (stable: tests call it)."""

from __future__ import annotations

import argparse
import csv
import json
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from capture.errors import DecodeError
from capture.fields import IP, TS, fields
from planner.query import QueryError

DEFAULT_FLOW_PORTS = "2055,4739,9995,9996"


class CliError(Exception):
    """A failure reported as one ``error: …`` line."""


def _ports(text: str) -> list[int]:
    try:
        ports = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port list: {text!r}") from None
    if not ports or any(not 0 < p < 65536 for p in ports):
        raise argparse.ArgumentTypeError(f"ports must be 1-65535: {text!r}")
    return ports


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flowsieve",
        description="Many continuous queries over packets and flow exports: a numba prefilter "
                    "in front of Apache Spark.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="the daemon: API, capture sources, Spark job")
    r.add_argument("--config", help="YAML config (default: the embedded defaults)")

    rp = sub.add_parser("replay", help="run queries over a capture through the whole pipeline")
    rp.add_argument("capture", help="pcap or pcapng file: its packets for queries FROM packets, "
                    "its NetFlow/IPFIX datagrams for queries FROM flows")
    rp.add_argument("--queries", required=True, help="file of SQL statements")
    rp.add_argument("--flow-ports", type=_ports, default=_ports(DEFAULT_FLOW_PORTS),
                    help=f"UDP ports of flow exports (default {DEFAULT_FLOW_PORTS})")
    rp.add_argument("--out", help="keep the spool, results and checkpoints in this folder")
    rp.add_argument("--format", choices=("table", "csv", "json"), default="table")
    rp.add_argument("--bits", type=int, default=None, help="prefilter bit budget")

    d = sub.add_parser("decode", help="print unpacked tuples or flow records")
    d.add_argument("capture", help="pcap or pcapng file, or - for a pcap or pcapng stream on "
                   "stdin (--stream flows: the NetFlow/IPFIX datagrams it holds)")
    d.add_argument("--stream", choices=("packets", "flows"), default="packets",
                   help="packets: unpacked packet fields; flows: NetFlow v5/v9/IPFIX records")
    d.add_argument("--flow-ports", type=_ports, default=_ports(DEFAULT_FLOW_PORTS),
                   help=f"UDP ports of flow exports (default {DEFAULT_FLOW_PORTS})")
    d.add_argument("--fields", help="comma-separated catalogue fields (default: all)")
    d.add_argument("--format", choices=("csv", "json"), default="csv")

    pl = sub.add_parser("plan", help="print the compiled plan")
    pl.add_argument("--queries", required=True, help="file of SQL statements")
    pl.add_argument("--bits", type=int, default=None, help="prefilter bit budget")
    pl.add_argument("--capture", help="measure selectivities and choose the ASC sequences on "
                    "this pcap (adds expected invocations per tuple)")
    pl.add_argument("--format", choices=("text", "json"), default="text")
    return p


def check_java() -> None:
    """Spark needs Java 17 or newer: say so clearly instead of a JVM stack trace."""
    java = shutil.which("java")
    if java is None:
        raise CliError("Java not found: Spark needs Java 17 "
                       "(Debian/Ubuntu: apt-get install -y openjdk-17-jre-headless)")
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    import re
    m = re.search(r'version "(\d+)', out)
    if m and int(m.group(1)) < 17:
        raise CliError(f"Java {m.group(1)} found, Spark needs Java 17 or newer")


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


def _measure(plan, capture: str):
    """Selectivity of every cheap predicate on a capture, and the ASC sequence chosen on it."""
    import numpy as np

    from capture.pcap import open_capture
    from capture.unpack import unpack
    from collector.prefilter import AscRuntime, compile_prefilter, run_prefilter
    from collector.residual import eval_predicate
    hits: dict[str, int] = {}
    total = 0
    cp = compile_prefilter(plan, "packets")
    asc = AscRuntime(cp, "hybrid", period=1 << 62, sample=1 << 16)
    for raw in open_capture(capture):
        tb = unpack(raw)
        rows = np.arange(len(tb))
        total += len(tb)
        for info in plan.predicates:
            if info.cheap and info.predicate.stream == "packets":
                hits[info.predicate.text] = hits.get(info.predicate.text, 0) + int(
                    eval_predicate(info.predicate, tb, rows).sum())
        run_prefilter(cp, tb, asc)
    if asc._R:
        asc.choose(np.concatenate(asc._R), np.concatenate(asc._Q0))
    return ({k: v / total for k, v in hits.items()} if total else {}), (
        asc.describe() if cp.ascs else None)


def cmd_plan(args) -> int:
    from collector.config import load_settings
    from planner.plan import build_plan
    settings = load_settings()
    queries = _read_queries(args.queries)
    kw = {"bit_budget": args.bits, "cheap_cost": settings.planner.cheap_cost,
          "max_j": settings.planner.max_j, "asc_min_constants": settings.asc.min_constants}
    plan = build_plan(queries, **kw)
    sequence = None
    if args.capture:
        if not Path(args.capture).is_file():
            raise CliError(f"capture {args.capture} does not exist")
        selectivity, sequence = _measure(plan, args.capture)
        plan = build_plan(queries, selectivity=selectivity, **kw)
    if args.format == "json":
        doc = plan.to_json()
        if sequence is not None:
            doc["asc_sequence"] = sequence
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
    return 0


def _cell(kind: str, v, for_json: bool):
    if v is None:
        return None if for_json else ""
    if kind == IP:
        from capture.fields import ip_text
        return ip_text(v)
    if kind == TS:
        s = f"{v // 1_000_000_000}.{v % 1_000_000_000:09d}"
        return float(s) if for_json else s
    return v


def cmd_decode(args) -> int:
    from capture.pcap import open_capture
    from capture.unpack import unpack
    if args.stream == "flows":
        return _decode_flows(args)
    cat = fields("packets")
    names = _field_names("packets", args.fields)
    out = sys.stdout
    writer = csv.writer(out, lineterminator="\n") if args.format == "csv" else None
    if writer:
        writer.writerow(names)
    reader = open_capture(args.capture)
    try:
        for raw in reader:
            tb = unpack(raw, names)
            _write_rows(out, writer, names, [cat[n].kind for n in names],
                        [tb.ts_ns.tolist() if n == "ts" else tb.arrow(n).to_pylist()
                         for n in names])
    finally:
        out.flush()
    return 0


def _write_rows(out, writer, names: list[str], kinds: list[str], cols: list[list]) -> None:
    """Rows of columns as CSV (``writer``) or JSON lines."""
    for row in zip(*cols, strict=True):
        vals = [_cell(k, v, writer is None) for k, v in zip(kinds, row, strict=True)]
        if writer:
            writer.writerow(vals)
        else:
            out.write(json.dumps(dict(zip(names, vals, strict=True))) + "\n")


def _field_names(stream: str, text: str | None) -> list[str]:
    cat = fields(stream)
    names = list(cat) if not text else [f.strip() for f in text.split(",")]
    bad = [n for n in names if n not in cat]
    if bad:
        raise CliError(f"unknown {stream} field {bad[0]!r} (fields: {', '.join(cat)})")
    return names


def _decode_flows(args) -> int:
    """Flow records of the NetFlow/IPFIX datagrams a capture holds (UDP to the flow ports)."""
    from capture.netflow import Decoder, capture_flows
    cat = fields("flows")
    names = _field_names("flows", args.fields)
    kinds = [cat[n].kind for n in names]
    out = sys.stdout
    writer = csv.writer(out, lineterminator="\n") if args.format == "csv" else None
    if writer:
        writer.writerow(names)
    decoder = Decoder()
    try:
        for fb in capture_flows(args.capture, args.flow_ports, decoder):
            _write_rows(out, writer, names, kinds,
                        [fb.arrow(n).to_pylist() if cat[n].kind == IP
                         else [None if v < 0 else int(v) for v in fb.column(n)]
                         for n in names])
    finally:
        out.flush()
    if decoder.errors:
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(decoder.errors.items()))
        print(f"decode: input skipped ({detail})", file=sys.stderr)
    return 0


def cmd_replay(args) -> int:
    from collector.config import load_settings
    from collector.replay import replay
    from collector.results import format_results, rows_of
    from collector.spark.job import build_session
    queries = _read_queries(args.queries)
    if not Path(args.capture).is_file():
        raise CliError(f"capture {args.capture} does not exist")
    check_java()
    settings = load_settings()
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
    try:
        spark = build_session(s.master, s.driver_memory, s.shuffle_partitions,
                              s.state_store == "rocksdb", s.extra, "flowsieve-replay")
        try:
            res = replay(args.capture, queries, work, spark, bit_budget=args.bits,
                         cheap_cost=settings.planner.cheap_cost,
                         watermark_delay_s=s.watermark_delay_s, asc=settings.asc,
                         flow_ports=args.flow_ports)
        finally:
            spark.stop()
        sys.stdout.write(format_results(
            [(q, rows_of(q, t)) for q, t in res.answers], args.format))
        sys.stdout.flush()
        if res.error is not None:
            raise res.error
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


def cmd_run(args) -> int:
    import uvicorn

    from api.app import create_app
    from collector.config import load_settings
    from collector.service import Collector
    try:
        settings = load_settings(args.config)
    except (FileNotFoundError, ValueError) as e:
        raise CliError(f"config: {e}".replace("\n", "; ")) from e
    check_java()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)  # one INFO line per Spark callback
    collector = Collector(settings)
    app = create_app(collector, manage=True)
    uvicorn.run(app, host=settings.api.host, port=settings.api.port, log_level="info")
    return 0


COMMANDS = {"run": cmd_run, "replay": cmd_replay, "decode": cmd_decode, "plan": cmd_plan}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (CliError, DecodeError, QueryError) as e:
        sys.stdout.flush()
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
