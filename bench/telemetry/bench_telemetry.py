"""The telemetry applications at speed (issue 16): all of ``apps.sql`` registered at once in
flowsieve (``replay``'s path: prefilter, LFTA, aggregate trees, the HFTA on Spark's
executors) against two baselines: ``batch``, the fair one (bench/spark_sql.py: what a Spark user
writes for a finite capture: the decoded fields as a cached DataFrame, one Spark SQL statement
per application, counts of distinct values and joins included, on Spark's default JVM; only the
statements are timed), and ``naive``, one Spark streaming query per application (over
flowsieve's decoded tuples as Parquet; Spark streams cannot count distinct values or join two
aggregations, so each query keeps the finest groups Spark can and its foreachBatch finishes the
count or the difference). Every mode's answers must equal the pandas truth of ``attacks.py``.

Each run is a fresh process that, after the JVM's start, passes the capture through twice:
cold (as a fresh ``flowsieve replay`` does) and warm (the same JVM and Python process again).
A run imports what a deployed flowsieve has: not the development environment's scipy.

``python bench/telemetry/bench_telemetry.py [--quick]``; figures in
``bench/results/telemetry.json`` and a line in ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.bench_spark import TreeRss, raw_parquet, start_spark, stop_spark  # noqa: E402
from bench.common import CACHE, answer_rows, spark_rows, write_result  # noqa: E402
from bench.telemetry.attacks import COLUMNS, capture, frame, truth  # noqa: E402

APPS = Path(__file__).with_name("apps.sql")
SIZE, QUICK = 2_000_000, 200_000
NEED = ["time", "ip_version", "src_ip", "dst_ip", "protocol", "src_port", "dst_port",
        "tcp_flags", "ip_len", "dns_qr", "dns_ancount", "dns_an_type", "dns_an_ttl",
        "dns_an_name"]


def naive_queries(F):
    """Per application: (the tuples it reads, its streaming aggregation per window ``ws``, its
    finishing step over the aggregation's rows as a pandas DataFrame with the minute ``t``):
    the PySpark a user writes for apps.sql."""
    tcp = F.col("protocol") == 6
    udp = F.col("protocol") == 17
    syn = tcp & (F.col("tcp_flags").bitwiseAND(18) == 2)
    synack = tcp & (F.col("tcp_flags").bitwiseAND(18) == 18)
    fin = tcp & (F.col("tcp_flags").bitwiseAND(1) != 0)
    ip = F.col("ip_version").isin(4, 6)

    def distinct(keys, field, over):
        def finish(df):
            g = df.groupby(["t", *keys])[field].nunique()
            return g[g > over]
        return finish

    def having(key, col, over):
        def finish(df):
            s = df.groupby(["t", key])[col].sum()
            return s[s > over]
        return finish

    def slowloris(df):
        g = df.groupby(["t", "dst_ip"]).agg(conns=("src_port", "size"), b=("b", "sum"))
        per = g["b"] / g["conns"]
        keep = (g["conns"] > 1000) & (per < 500)
        return {k: (c, x) for k, c, x in zip(g.index[keep], g["conns"][keep], per[keep],
                                              strict=True)}
    return {  # (the tuples it reads, its aggregation, its finishing step)
        "new_tcp": (syn, lambda d: d.groupBy("ws", "dst_ip").count(),
                    having("dst_ip", "count", 1000)),
        "heavy_hitters": (ip, lambda d: d.groupBy("ws", "src_ip").agg(
            F.sum("ip_len").alias("b")), having("src_ip", "b", 10_000_000)),
        "superspreader": (ip, lambda d: d.groupBy("ws", "src_ip", "dst_ip").count(),
                          distinct(["src_ip"], "dst_ip", 2500)),
        "port_scan": (tcp, lambda d: d.groupBy("ws", "src_ip", "dst_port").count(),
                      distinct(["src_ip"], "dst_port", 2000)),
        "syn_flood": (syn | synack, lambda d: d.withColumn(
            "host", F.when(syn, F.col("dst_ip")).otherwise(F.col("src_ip"))).groupBy(
            "ws", "host").agg(F.sum(syn.cast("long")).alias("s"),
                              F.sum(synack.cast("long")).alias("a")),
            lambda df: _diff(df, "host", "s", "a", 1000)),
        "completed_flows": (syn | fin, lambda d: d.groupBy("ws", "dst_ip").agg(
            F.sum(syn.cast("long")).alias("s"), F.sum(fin.cast("long")).alias("a")),
            lambda df: _diff(df, "dst_ip", "s", "a", 1000)),
        "slowloris": (tcp, lambda d: d.groupBy("ws", "dst_ip", "src_port").agg(
            F.sum("ip_len").alias("b")), slowloris),
        "udp_asym": (udp, lambda d: d.select("ws", F.explode(F.array(
            F.struct(F.col("dst_ip").alias("host"), F.lit(1).alias("i")),
            F.struct(F.col("src_ip").alias("host"), F.lit(0).alias("i")))).alias("e")).select(
            "ws", "e.host", "e.i").groupBy("ws", "host").agg(
            F.sum("i").alias("s"), F.sum(1 - F.col("i")).alias("a")),
            lambda df: _diff(df, "host", "s", "a", 5000)),
        "dns_reflection": (udp & (F.col("src_port") == 53) & (F.col("dns_qr") == 1) &
                           (F.col("dns_an_type") == 16),
                           lambda d: d.groupBy("ws", "dst_ip", "src_ip").count(),
                           distinct(["dst_ip"], "src_ip", 100)),
        "dns_ttl": ((F.col("dns_qr") == 1) & (F.col("dns_ancount") > 0),
                    lambda d: d.groupBy("ws", "dns_an_name", "dns_an_ttl").count(),
                    distinct(["dns_an_name"], "dns_an_ttl", 4)),
        "ssh_brute": (tcp & (F.col("dst_port") == 22),
                      lambda d: d.groupBy("ws", "dst_ip", "ip_len", "src_ip").count(),
                      distinct(["dst_ip", "ip_len"], "src_ip", 100)),
    }


def _diff(df, key, a, b, over):
    """``a - b`` per (t, key) where ``a`` counted something (the LEFT JOIN's left side)."""
    g = df.groupby(["t", key])[[a, b]].sum()
    g = g[g[a] > 0]
    d = g[a] - g[b]
    return d[d > over]


def _naive(spark, path: Path, work: Path, stages: dict, t1: float):
    """Tuples as Parquet, one streaming query per application (all started at once).
    Returns (answers, rows read by Spark)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from pyspark.sql import functions as F

    from capture.fields import ip_text
    raw, punct, schema, rows = raw_parquet(spark, path, NEED, work)
    stages["spark"] = time.perf_counter() - t1
    got: dict[str, list] = {}
    running = []
    apps = naive_queries(F)
    for name, (cond, build, _) in apps.items():
        # the punctuation row joins after the filter (Spark would push the filter below the
        # watermark, and the row closes the last windows only if the watermark sees it)
        src = (spark.readStream.schema(schema).parquet(str(raw)).where(cond)
               .unionByName(spark.readStream.schema(schema).parquet(str(punct)))
               .withColumn("ws", F.timestamp_seconds(F.floor(F.col("time") / 60) * 60))
               .withWatermark("ws", "1 seconds"))

        def sink(bdf, _id, name=name):
            t = bdf.toArrow()
            if t.num_rows:
                got.setdefault(name, []).append(t)
        running.append(build(src).writeStream.outputMode("append").foreachBatch(sink)
                       .option("checkpointLocation", str(work / "ck" / name))
                       .trigger(availableNow=True).start())
    for sq in running:
        sq.awaitTermination()
        if sq.exception() is not None:
            raise RuntimeError(f"{sq.name}: {sq.exception()}")
    answers = {}
    for name, (_, _, finish) in apps.items():
        if name not in got:
            answers[name] = []
            continue
        t = pa.concat_tables(got[name])
        minute = pc.divide(pc.cast(t.column("ws"), pa.int64()), 60_000_000)
        df = t.drop(["ws"]).append_column("t", minute).to_pandas()
        for c in ("src_ip", "dst_ip", "host"):
            if c in df.columns:
                df[c] = [ip_text(v) for v in df[c]]
        answers[name] = _rows(finish(df))
    return answers, rows * len(running)


def _batch(spark, path: Path, work: Path) -> tuple[dict, int, float]:
    """The fair baseline: the decoded tuples as Parquet, cached and counted (not timed), one
    Spark SQL statement per application (timed). Returns (rows by application, rows Spark
    read, seconds)."""
    from bench.spark_sql import cached_packets, run_queries
    from planner.query import parse_queries
    raw, _, _, _ = raw_parquet(spark, path, NEED, work)
    n = cached_packets(spark, raw)
    queries = parse_queries(APPS.read_text())
    rows, wall = run_queries(spark, queries)
    return rows, n * len(queries), wall


def _rows(found) -> list:
    """Answers as JSON rows: [key…, value…], sorted."""
    out = []
    for k, v in dict(found).items():
        k = k if isinstance(k, tuple) else (k,)
        v = v if isinstance(v, tuple) else (v,)
        out.append([x.item() if hasattr(x, "item") else x for x in (*k, *v)])
    return sorted(out, key=repr)


def run_one(mode: str, n: int, out: Path) -> None:
    """Two measured passes over the capture in this (fresh) process: the first as a fresh
    ``flowsieve replay`` runs (after the JVM's start), the second warm (the same JVM and
    Python process: what a running collector does with the next capture); writes their
    figures and answers to ``out``."""
    path, p, _ = capture(n, CACHE)
    packets = len(p["ts_us"])
    del p  # the generator's arrays are the orchestrator's truth, not part of this run
    rss = TreeRss()
    if mode == "batch":
        from bench.spark_sql import start_session
        spark, jvm_s = start_session("bench-telemetry-batch")
    else:
        spark, jvm_s = start_spark("bench-telemetry", path)
    cold = _pass(mode, spark, path)
    memory = rss.stop()  # of the first pass (the second's would add the first's garbage)
    warm = _pass(mode, spark, path)
    stop_spark(spark)
    out.write_text(json.dumps({
        "mode": mode, "packets": packets, "jvm_start_s": jvm_s, **cold, **memory,
        "warm": {k: warm[k] for k in ("wall_s", "stages_s", "rows_into_spark")},
        "warm_answers": warm.pop("answers")}))


def _pass(mode: str, spark, path: Path) -> dict:
    """One pass in its own work folder: wall time (the answers' tables made; their check is
    not timed), stages, rows into Spark and answers."""
    from collector.config import Settings
    from planner.query import parse_queries

    settings = Settings(initial_queries=None)
    work = Path(tempfile.mkdtemp(prefix=f"bench-telemetry-{mode}-", dir=CACHE))
    stages: dict[str, float] = {}
    t1 = time.perf_counter()
    rows: dict[str, list[dict]] = {}
    if mode == "batch":
        rows, rows_in, wall = _batch(spark, path, work)
    elif mode == "naive":
        answers, rows_in = _naive(spark, path, work, stages, t1)
    else:
        from api.replay import replay
        from collector.metrics import Metrics
        metrics = Metrics()
        res = replay(path, parse_queries(APPS.read_text()), work, spark, settings=settings,
                     metrics=metrics)
        if res.error is not None:
            raise RuntimeError(res.error)
        stages.update({f"spark_{k}": v for k, v in res.timings.items()})
        rows_in = spark_rows(metrics)
    if mode != "batch":
        wall = time.perf_counter() - t1  # the answers are written; reading them is not timed
    if mode == "full":
        rows = {q.name: answer_rows(q, t) for q, t in res.answers}
    if mode != "naive":
        answers = {}
        for name, got in rows.items():
            keys, values = COLUMNS[name]
            answers[name] = sorted(([r[k] for k in keys] + [r[v] for v in values]
                                    for r in got), key=repr)
    # the pass's files go with it: their dirty pages would otherwise be written back while
    # the next pass or run is measured (the naive plan's: 70 MB)
    shutil.rmtree(work, ignore_errors=True)
    return {"wall_s": wall, "stages_s": stages, "rows_into_spark": rows_in, "answers": answers}


def measure(mode: str, n: int, timeout: float = 3600) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", dir=CACHE, delete=False) as f:
        out = Path(f.name)
    os.sync()  # each run starts with nothing left to write back
    proc = subprocess.run([sys.executable, __file__, "--one", mode, str(n), str(out)],
                          timeout=timeout, capture_output=True, text=True)
    if proc.returncode != 0 or not out.stat().st_size:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"mode": mode, "failure": " | ".join(tail)}
    doc = json.loads(out.read_text())
    out.unlink()
    return doc


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a small capture, one repeat")
    ap.add_argument("--one", nargs=3, metavar=("MODE", "N", "OUT"))
    args = ap.parse_args()
    if args.one:
        # a run imports what a deployed flowsieve has (deploy/Dockerfile: flowsieve[live]):
        # scipy is a development dependency (planner/reference.py's ILP) that numba imports at
        # its first compile when it finds it (0.05-0.1 s of a fresh process, both modes)
        sys.modules.setdefault("scipy", None)
        run_one(args.one[0], int(args.one[1]), Path(args.one[2]))
        return 0
    n, repeat = (QUICK, 1) if args.quick else (SIZE, 3)
    CACHE.mkdir(exist_ok=True)
    _, p, _ = capture(n, CACHE)
    right = truth(frame(p))
    want = {app: sorted(([*k, *v] for k, v in rows.items()), key=repr)
            for app, rows in right.items()}
    want = json.loads(json.dumps(want, default=lambda x: x.item()))
    packets = len(p["ts_us"])
    print(f"== {packets:,} packets, {len(want)} applications", flush=True)
    del p, right  # the runs' parent holds no trace (bench_spark.py: it slows them)
    gc.collect()
    runs: dict[str, list] = {"full": [], "batch": [], "naive": []}
    wrong = []
    for _ in range(repeat):
        for mode in runs:
            doc = measure(mode, n)
            if "failure" in doc:
                print(f"   {mode}: failed: {doc['failure']}", flush=True)
                wrong.append(mode)
                continue
            got, got_warm = doc.pop("answers"), doc.pop("warm_answers")
            bad = sorted({a for a in want if got.get(a) != want[a] or got_warm.get(a) != want[a]})
            doc["correct"] = not bad
            doc["pps"] = doc["packets"] / doc["wall_s"]
            doc["warm"]["pps"] = doc["packets"] / doc["warm"]["wall_s"]
            doc["rows_per_packet"] = doc["rows_into_spark"] / doc["packets"]
            runs[mode].append(doc)
            if bad:
                wrong.append(mode)
            print(f"   {mode:5}: {doc['pps'] / 1e3:8,.0f} kpps, wall {doc['wall_s']:6.1f} s "
                  f"(JVM {doc['jvm_start_s']:.1f} s; warm {doc['warm']['pps'] / 1e3:,.0f} kpps, "
                  f"{doc['warm']['wall_s']:.1f} s), rows into Spark per packet "
                  f"{doc['rows_per_packet']:.4f}, peak RSS {doc['peak_rss_total_mib']:,.0f} MiB"
                  + (f", WRONG: {', '.join(bad)}" if bad else ", answers equal the truth"),
                  flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in
               ("pps", "wall_s", "rows_per_packet", "peak_rss_total_mib")}
           for m, rs in runs.items() if rs}
    for m, rs in runs.items():
        if rs:
            med[m]["warm"] = {k: statistics.median(r["warm"][k] for r in rs)
                              for k in ("pps", "wall_s")}
    for base in ("batch", "naive"):
        if "full" in med and base in med:
            med[f"ratio_{base}"] = med["full"]["pps"] / med[base]["pps"]
            med[f"ratio_{base}_warm"] = med["full"]["warm"]["pps"] / med[base]["warm"]["pps"]
            print(f"== flowsieve / {base} PySpark: {med[f'ratio_{base}_warm']:.1f}x in a "
                  f"running collector (warm: the second capture through the same process), "
                  f"{med[f'ratio_{base}']:.1f}x in a fresh process (cold)"
                  + (" (target >= 3x)" if base == "batch" else ""), flush=True)
    if not args.quick:
        write_result("telemetry", {"packets": packets, "runs": runs, "median": med})
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
