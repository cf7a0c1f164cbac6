"""``replay`` of DESIGN's Q1-Q3 through the whole pipeline (Spark included) against a reference
computed with dpkt (fields) and scapy's raw pcap reader (wire lengths)."""

from __future__ import annotations

import csv
import io
import ipaddress
import json
import os
import subprocess
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import dpkt
import pyarrow.parquet as pq
import pytest
from scapy.utils import RawPcapReader

from api.replay import replay
from collector.config import Settings, data_file
from collector.metrics import Metrics
from planner.query import parse_queries
from tests.helpers import ROOT, capture
from tests.pipelines import WHERE
from tests.processes import cli_spark
from tests.reference import packets, rows_of

pytestmark = pytest.mark.slow



def reference(path) -> dict[str, dict[tuple, tuple[int, int]]]:
    """Per query: (minute, src_ip, dst_ip) -> (count(*), sum(wirelen))."""
    wirelens = [meta.wirelen for _, meta in RawPcapReader(str(path))]
    out: dict[str, dict] = {q: defaultdict(lambda: [0, 0]) for q in WHERE}
    for p, wl in zip(packets(path), wirelens, strict=True):
        for q, where in WHERE.items():
            if where(p):
                acc = out[q][(p["time"] // 60, p["src_ip"], p["dst_ip"])]
                acc[0] += 1
                acc[1] += wl
    return {q: {k: tuple(v) for k, v in groups.items()} for q, groups in out.items()}


@pytest.mark.parametrize("name", ["ok.pcap", "test.pcap", "wikipedia.pcap"])
def test_replay_q123_equals_dpkt(name, spark, tmp_path):
    path = capture(name)
    queries = parse_queries(open(data_file("example.sql")).read())
    res = replay(path, queries, tmp_path, spark)
    assert res.error is None
    ref = reference(path)
    for q, table in res.answers:
        got = {(r["t"], r["src_ip"], r["dst_ip"]): (r["pkts"], r["bytes"])
               for r in rows_of(q, table)}
        assert len(got) == table.num_rows, "one row per (minute, src, dst)"
        assert got == ref[q.name], q.name
        assert ref[q.name], f"{q.name} has rows in {name}"
    # the spool was released by Spark's commits
    assert not list((tmp_path / "spool" / "packets" / "60").glob("*.arrow"))


def test_replay_in_parallel_equals_dpkt(spark, tmp_path):
    """Three processes read three byte ranges of one file into one spool (each its own probe,
    engine and LFTA); Spark merges their partials of the same window: dpkt's answers, and
    every packet counted once."""
    path = capture("wikipedia.pcap")
    queries = parse_queries(open(data_file("example.sql")).read())
    metrics = Metrics()
    res = replay(path, queries, tmp_path, spark, metrics=metrics,
                 settings=Settings(initial_queries=None, replay_workers=3))
    assert res.error is None and res.workers == 3
    ref = reference(path)
    for q, table in res.answers:
        got = {(r["t"], r["src_ip"], r["dst_ip"]): (r["pkts"], r["bytes"])
               for r in rows_of(q, table)}
        assert len(got) == table.num_rows and got == ref[q.name], q.name
    assert metrics.packets_in.labels("replay")._value.get() == len(packets(path))
    probes = {f.name.split(".")[1] for f in (tmp_path / "spool").rglob("*.parquet")}
    assert probes <= {"flowsieve_0", "flowsieve_1", "flowsieve_2"}


def test_replay_in_parallel_stops_where_the_file_does(spark, tmp_path):
    """A file cut inside its last record, read by three processes: the error names the byte
    the single reader names, and the answers are the single reader's."""
    cut = tmp_path / "cut.pcap"
    cut.write_bytes(capture("wikipedia.pcap").read_bytes()[:-7])
    queries = parse_queries(open(data_file("example.sql")).read())
    runs = {w: replay(cut, queries, tmp_path / f"w{w}", spark,
                      settings=Settings(initial_queries=None, replay_workers=w))
            for w in (1, 3)}
    assert runs[3].workers == 3
    assert runs[3].error.offset == runs[1].error.offset and runs[1].error.offset is not None
    assert str(runs[3].error) == str(runs[1].error)
    assert [rows_of(q, t) for q, t in runs[3].answers] == \
        [rows_of(q, t) for q, t in runs[1].answers]


def test_replay_reader_process_failure_is_one_error(spark, tmp_path, monkeypatch):
    """A reading process that fails is reported with its reason, not waited for forever."""
    import api.replay as rp

    def broken(*args):
        raise MemoryError("no room for the LFTA")
    monkeypatch.setattr(rp, "_new_engine", broken)
    queries = parse_queries(open(data_file("example.sql")).read())
    with pytest.raises(RuntimeError, match="worker 0: MemoryError: no room for the LFTA"):
        replay(capture("wikipedia.pcap"), queries, tmp_path, spark,
               settings=Settings(initial_queries=None, replay_workers=2))


def replay_command(path, fmt: str, engine: str | None = None) -> subprocess.CompletedProcess:
    """``flowsieve replay`` of Q1-Q3 in its own process (own JVM); ``engine``: the
    answer engine (spark.answer_engine), else the default."""
    env = {**os.environ, "FLOWSIEVE_SPARK__ANSWER_ENGINE": engine} if engine else None
    return cli_spark("replay", str(path), "--queries", data_file("example.sql"), "--format", fmt,
                     env=env)


@pytest.mark.parametrize("engine", ["python", "sql"])
def test_replay_command_csv(tmp_path, engine):
    """The command itself (own JVM): csv header, one row per result row, dpkt's numbers, rows
    in the README's order (a window's by its keys) whichever engine answers."""
    path = capture("wikipedia.pcap")
    out = replay_command(path, "csv", engine)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert list(rows[0]) == ["query", "t", "src_ip", "dst_ip", "bytes", "pkts", "window_start",
                             "window_end"]
    for r in rows:  # every row carries its window's start and end, in UTC
        start = datetime.fromisoformat(r["window_start"])
        assert start.timestamp() == int(r["t"]) * 60 and start.utcoffset() == timedelta(0)
        assert datetime.fromisoformat(r["window_end"]) - start == timedelta(seconds=60)
    ref = reference(path)
    got = defaultdict(dict)
    for r in rows:
        got[r["query"]][(int(r["t"]), r["src_ip"], r["dst_ip"])] = (int(r["pkts"]),
                                                                     int(r["bytes"]))
    assert dict(got) == ref
    # the README's example is this command's real output
    readme = (ROOT / "README.md").read_text()
    cmd = ("$ flowsieve replay tests/data/pcap/wikipedia.pcap --queries "
           "collector/data/example.sql --format csv\n")
    example = readme[readme.index(cmd) + len(cmd):]
    assert example[:example.index("```")] == out.stdout


def test_replay_corrupt_capture_answers_what_was_read(tmp_path):
    """A truncated capture: the records before the fault are answered, then `error: …`."""
    out = replay_command(capture("unexpected_eof_on_second_packet.pcap"), "json")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "at byte 248" in out.stderr
    # the one readable record is ok.pcap's first packet (tests/data/SOURCES.md): its answers are
    # those dpkt and scapy give for that packet alone
    ok = capture("ok.pcap")
    with open(ok, "rb") as a, open(capture("unexpected_eof_on_second_packet.pcap"), "rb") as b:
        assert next(iter(dpkt.pcap.Reader(a))) == next(iter(dpkt.pcap.Reader(b)))
    first = packets(ok)[0]
    wirelen = next(iter(RawPcapReader(str(ok))))[1].wirelen
    start = datetime.fromtimestamp(first["time"] // 60 * 60, UTC)
    want = [{"query": q, "t": first["time"] // 60, "src_ip": first["src_ip"],
             "dst_ip": first["dst_ip"], "bytes": wirelen, "pkts": 1,
             "window_start": start.strftime("%Y-%m-%dT%H:%M:%SZ"),
             "window_end": (start + timedelta(seconds=60)).strftime("%Y-%m-%dT%H:%M:%SZ")}
            for q, where in WHERE.items() if where(first)]
    assert want
    assert [json.loads(line) for line in out.stdout.splitlines()] == want


def engine_settings(engine: str) -> Settings:
    """The embedded settings with Spark's answers computed by ``engine`` (spark.answer_engine)."""
    return Settings(spark={"answer_engine": engine})


@pytest.mark.parametrize("engine", ["python", "sql"])
def test_replay_selection_topn_and_regexp(spark, tmp_path, engine):
    """Selection, HAVING + ORDER BY … LIMIT per window, avg/min/max and a regexp residual,
    against dpkt (fields) and scapy (wire lengths) on wikipedia.pcap (one minute), whichever
    engine answers."""
    path = capture("wikipedia.pcap")
    queries = parse_queries("""
-- name: dns_sel
SELECT ts, src_ip, dst_port FROM packets WHERE protocol = 17 AND dst_port = 53;
-- name: tcp_top
SELECT time/60 AS t, dst_port, count(*) AS n, avg(wirelen) AS mean, min(wirelen) AS lo,
       max(wirelen) AS hi
FROM packets WHERE protocol = 6 GROUP BY time/60, dst_port
HAVING count(*) >= 2 ORDER BY n DESC LIMIT 3;
-- name: wiki_names
SELECT time/60 AS t, count(*) AS n FROM packets WHERE regexp(dns_qname, 'wiki') GROUP BY time/60
""")
    res = replay(path, queries, tmp_path, spark, settings=engine_settings(engine))
    answers = {q.name: rows_of(q, t) for q, t in res.answers}
    wirelens = [meta.wirelen for _, meta in RawPcapReader(str(path))]
    pkts = packets(path)

    sel = [p for p in pkts if p["protocol"] == 17 and p["dst_port"] == 53]
    assert [(r["src_ip"], r["dst_port"]) for r in answers["dns_sel"]] == \
        [(p["src_ip"], 53) for p in sel]

    by_port = defaultdict(list)
    for p, wl in zip(pkts, wirelens, strict=True):
        if p["protocol"] == 6:
            by_port[p["dst_port"]].append(wl)
    groups = {port: (len(w), sum(w) / len(w), min(w), max(w)) for port, w in by_port.items()
              if len(w) >= 2}
    top = answers["tcp_top"]
    assert len(top) == min(3, len(groups))
    assert [r["n"] for r in top] == sorted((g[0] for g in groups.values()), reverse=True)[:3]
    for r in top:
        assert (r["n"], r["mean"], r["lo"], r["hi"]) == pytest.approx(groups[r["dst_port"]])

    wiki = sum(1 for p in pkts if p["dns_qname"] and "wiki" in p["dns_qname"])
    assert wiki > 0 and [r["n"] for r in answers["wiki_names"]] == [wiki]
    assert res.metrics.residual_evals.labels("packets")._value.get() > 0


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["python", "sql"])
def test_replay_flows_equals_nfdump(spark, tmp_path, engine):
    """Queries FROM flows over softflowd's IPFIX export of ok.pcap: per (minute, protocol) the
    records, packets and bytes equal nfcapd's flows of the same export (its CSV), whichever
    engine answers."""
    import csv
    import datetime as dt

    from tests.flowtools import PROTOCOLS
    from tests.helpers import flow_data
    base = "softflowd-generated/softflowd-ok-v10"
    queries = parse_queries(
        "-- name: by_proto\nSELECT time/60 AS t, protocol, count(*) AS flows, "
        "sum(packets) AS pkts, sum(est_bytes) AS bytes FROM flows GROUP BY time/60, protocol;\n"
        "-- name: tcp443\nSELECT src_ip, dst_ip, bytes FROM flows WHERE protocol = 6 AND "
        "src_port = 443;\n")
    res = replay(flow_data(f"{base}-export.pcap"), queries, tmp_path, spark,
                 settings=engine_settings(engine))
    assert res.error is None
    want: dict = {}
    want443 = []
    for r in csv.reader(flow_data(f"{base}-nfdump-flows.csv").open()):
        t = dt.datetime.strptime(r[0].strip(), "%Y-%m-%d %H:%M:%S.%f").replace(
            tzinfo=dt.UTC).timestamp()
        proto = PROTOCOLS[r[2].strip()]
        acc = want.setdefault((int(t) // 60, proto), [0, 0, 0])
        acc[0] += 1
        acc[1] += int(r[7])
        acc[2] += int(r[8])
        if proto == 6 and r[4].strip() == "443":
            want443.append((r[3].strip(), r[5].strip(), int(r[8])))
    answers = {q.name: rows_of(q, t) for q, t in res.answers}
    got = {(r["t"], r["protocol"]): [r["flows"], r["pkts"], r["bytes"]]
           for r in answers["by_proto"]}
    assert got == want
    got443 = sorted((r["src_ip"], r["dst_ip"], r["bytes"]) for r in answers["tcp443"])
    assert got443 == sorted(want443) and got443


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["python", "sql"])
def test_a_large_answer_spread_over_tasks_equals_nfdump_in_order(spark, tmp_path, engine):
    """Either answer engine with ``spark.answer_task_rows: 4``: the FROM flows GROUP BY src_ip,
    dst_ip of softflowd's IPFIX export of ok.pcap is answered by several tasks, its part
    several files, each its own share of the keys; read back, the rows equal nfdump's own
    aggregation, every pair once, in the query's order (by src_ip then dst_ip, as text)."""
    from collector.daemon.results import part_files
    from tests.helpers import flow_data
    base = "softflowd-generated/softflowd-ok-v10"
    queries = parse_queries(
        "-- name: pairs\nSELECT time/86400 AS d, src_ip, dst_ip, count(*) AS flows, "
        "sum(packets) AS pkts, sum(bytes) AS bytes FROM flows "
        "GROUP BY time/86400, src_ip, dst_ip")
    settings = Settings(spark={"answer_engine": engine, "answer_task_rows": 4})
    res = replay(flow_data(f"{base}-export.pcap"), queries, tmp_path, spark, settings=settings)
    assert res.error is None
    files = part_files(tmp_path / "results", "pairs")
    assert len(files) > 1
    (q, table), = res.answers
    rows = rows_of(q, table)
    keys = [(r["src_ip"], r["dst_ip"]) for r in rows]
    assert keys == sorted(keys)
    assert sum(pq.ParquetFile(f).metadata.num_rows for f in files) == len(rows)
    want = _nfdump_aggregated(flow_data(f"{base}-nfdump-A-srcip-dstip.txt"))
    assert {k: (r["flows"], r["pkts"], r["bytes"]) for k, r in zip(keys, rows, strict=True)} \
        == want


def _nfdump_aggregated(path) -> dict[tuple[str, str], tuple[int, int, int]]:
    """``nfdump -A srcip,dstip`` text: (src, dst) -> (flows, packets, bytes)."""
    out = {}
    for line in path.read_text().splitlines()[1:]:
        if line.startswith("Summary:"):
            break
        cols = line.split()  # date, time, duration, src, dst, packets, bytes, bps, bpp, flows
        out[(cols[3], cols[4])] = (int(cols[9]), int(cols[5]), int(cols[6]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("export", ["ok-v5", "ok-v9", "ok-v10", "test-v5", "test-v9",
                                    "test-v10"])
def test_replay_flows_group_by_equals_nfdump_aggregation(export, spark, tmp_path):
    """A FROM flows GROUP BY src_ip, dst_ip (one day-long window: every record of the export)
    equals nfdump's own aggregation of the same export (`nfdump -A srcip,dstip`)."""
    from tests.helpers import flow_data
    base = f"softflowd-generated/softflowd-{export}"
    queries = parse_queries(
        "-- name: pairs\nSELECT time/86400 AS d, src_ip, dst_ip, count(*) AS flows, "
        "sum(packets) AS pkts, sum(bytes) AS bytes FROM flows "
        "GROUP BY time/86400, src_ip, dst_ip")
    res = replay(flow_data(f"{base}-export.pcap"), queries, tmp_path, spark)
    assert res.error is None
    want = _nfdump_aggregated(flow_data(f"{base}-nfdump-A-srcip-dstip.txt"))
    (q, table), = res.answers
    rows = rows_of(q, table)
    assert len({r["d"] for r in rows}) == 1
    assert {(r["src_ip"], r["dst_ip"]): (r["flows"], r["pkts"], r["bytes"]) for r in rows} == want
    assert want


def test_replay_distinct_counts_and_bit_tests(spark, tmp_path):
    """count(DISTINCT f) (derived from the node that also groups by f) with HAVING and ORDER BY
    on it, and TCP flag bit tests, through replay over 4 ten-second windows of a capture of
    many services, against a pure-Python evaluation of the dpkt-decoded packets."""
    path = capture("var-services-std-ports.pcap")
    queries = parse_queries("""
-- name: fanout
SELECT time/10 AS t, src_ip, count(DISTINCT dst_ip) AS dsts, count(DISTINCT dst_port) AS ports,
       count(*) AS n, sum(wirelen) AS bytes
FROM packets WHERE protocol = 17 OR protocol = 6 GROUP BY time/10, src_ip;
-- name: fanin
SELECT time/10 AS t, dst_ip, count(DISTINCT src_ip) AS srcs FROM packets
WHERE dst_port < 1024 GROUP BY time/10, dst_ip HAVING count(DISTINCT src_ip) >= 2;
-- name: syn_ports
SELECT time/10 AS t, dst_ip, count(DISTINCT dst_port) AS ports FROM packets
WHERE (tcp_flags & 18) = 2 GROUP BY time/10, dst_ip ORDER BY ports DESC LIMIT 2;
-- name: acks
SELECT time/10 AS t, count(*) AS n, count(DISTINCT src_port) AS sports FROM packets
WHERE tcp_flags & 16 != 0 AND (tcp_flags & 5) = 0 GROUP BY time/10;
-- name: nets
SELECT time/10 AS t, prefix(dst_ip, 24) AS net, count(DISTINCT src_ip) AS srcs, count(*) AS n
FROM packets WHERE protocol = 17 GROUP BY time/10, prefix(dst_ip, 24);
-- name: lens
SELECT time/10 AS t, sum(ip_len) AS ipb, min(ip_len) AS lo, max(ip_len) AS hi, count(*) AS n
FROM packets GROUP BY time/10;
-- name: by_len
SELECT time/10 AS t, ip_len, count(DISTINCT src_ip) AS srcs, avg(ip_len) AS mean FROM packets
WHERE protocol = 6 GROUP BY time/10, ip_len;
-- name: fanout_approx
SELECT time/10 AS t, src_ip, approx_count_distinct(dst_ip) AS dsts, count(*) AS n,
       sum(wirelen) AS bytes
FROM packets WHERE protocol = 17 OR protocol = 6 GROUP BY time/10, src_ip
HAVING approx_count_distinct(dst_ip) >= 1;
-- name: names_approx
SELECT time/10 AS t, approx_count_distinct(dns_qname) AS names FROM packets GROUP BY time/10;
-- name: http_get
SELECT time/10 AS t, dst_ip, count(*) AS n FROM packets
WHERE dst_port = 80 AND contains(payload, 'GET /') GROUP BY time/10, dst_ip;
-- name: ssh_banner
SELECT ts, src_ip, payload FROM packets WHERE contains(payload, 'SSH-2.0');
-- name: reflect
SELECT time/10 AS t, dst_ip, count(DISTINCT src_ip) AS resolvers, count(*) AS n FROM packets
WHERE dns_qr = 1 AND dns_an_type IN (1, 28) AND dns_an_ttl >= 0 GROUP BY time/10, dst_ip;
-- name: ttls
SELECT time/10 AS t, dns_an_name, dns_an_addr, count(DISTINCT dns_an_ttl) AS ttls,
       min(wirelen) AS lo
FROM packets WHERE regexp(dns_an_name, '.') GROUP BY time/10, dns_an_name, dns_an_addr
""")
    res = replay(path, queries, tmp_path, spark)
    assert res.error is None
    got = {q.name: rows_of(q, t) for q, t in res.answers}
    pkts = packets(path)
    wirelens = [meta.wirelen for _, meta in RawPcapReader(str(path))]

    def groups(where, key):
        out = defaultdict(list)
        for p, wl in zip(pkts, wirelens, strict=True):
            if where(p):
                out[(p["time"] // 10, *(p[k] for k in key))].append((p, wl))
        return out

    def distinct(rows, f):
        return len({p[f] for p, _ in rows if p[f] is not None})

    flags = [p["tcp_flags"] for p in pkts]
    fanout = groups(lambda p: p["protocol"] in (6, 17), ["src_ip"])
    assert {(r["t"], r["src_ip"]): (r["dsts"], r["ports"], r["n"], r["bytes"])
            for r in got["fanout"]} == \
        {k: (distinct(v, "dst_ip"), distinct(v, "dst_port"), len(v), sum(w for _, w in v))
         for k, v in fanout.items()}
    assert len({k[0] for k in fanout}) >= 4, "several windows"
    # the answer task wrote the query's windows into one part, a row group per window
    from collector.daemon.results import part_files, windows
    q = next(q for q in queries if q.name == "fanout")
    assert [p.name for p in part_files(tmp_path / "results", "fanout")] == ["part-replay.parquet"]
    assert windows(tmp_path / "results", q) == sorted({k[0] * 10_000_000 for k in fanout})
    # HyperLogLog below its exact-list threshold counts these small sets exactly
    assert {(r["t"], r["src_ip"]): (r["dsts"], r["n"], r["bytes"])
            for r in got["fanout_approx"]} == \
        {k: (distinct(v, "dst_ip"), len(v), sum(w for _, w in v)) for k, v in fanout.items()}
    names = groups(lambda p: True, [])
    assert {r["t"]: r["names"] for r in got["names_approx"]} == \
        {k[0]: distinct(v, "dns_qname") for k, v in names.items()}
    fanin = groups(lambda p: p["dst_port"] is not None and p["dst_port"] < 1024, ["dst_ip"])
    want = {k: distinct(v, "src_ip") for k, v in fanin.items() if distinct(v, "src_ip") >= 2}
    assert want and {(r["t"], r["dst_ip"]): r["srcs"] for r in got["fanin"]} == want
    syn = groups(lambda p: p["tcp_flags"] is not None and p["tcp_flags"] & 18 == 2, ["dst_ip"])
    assert syn, "SYNs in the capture"
    for t in {k[0] for k in syn}:
        ranked = sorted((distinct(v, "dst_port") for k, v in syn.items() if k[0] == t),
                        reverse=True)[:2]
        assert [r["ports"] for r in got["syn_ports"] if r["t"] == t] == ranked
    acks = groups(lambda p: p["tcp_flags"] is not None and p["tcp_flags"] & 16
                  and not p["tcp_flags"] & 5, [])
    assert {r["t"]: (r["n"], r["sports"]) for r in got["acks"]} == \
        {k[0]: (len(v), distinct(v, "src_port")) for k, v in acks.items()}
    assert any(f is not None and f & 16 and f & 5 for f in flags), "the bit test excludes some"
    for p in pkts:
        if p["dst_ip"] is not None:
            p["net"] = str(ipaddress.ip_network(f"{p['dst_ip']}/24", strict=False))
    nets = groups(lambda p: p["protocol"] == 17, ["net"])
    assert any(":" in k[1] for k in nets) and any("." in k[1] for k in nets), "IPv4 and IPv6"
    assert {(r["t"], r["net"]): (r["srcs"], r["n"]) for r in got["nets"]} == \
        {k: (distinct(v, "src_ip"), len(v)) for k, v in nets.items()}
    # ip_len (dpkt's IP length field): NULL on frames without IP, which sum, min and max skip
    lens = groups(lambda p: True, [])
    assert any(p["ip_len"] is None for p in pkts), "frames without IP (ARP)"
    assert {r["t"]: (r["ipb"], r["lo"], r["hi"], r["n"]) for r in got["lens"]} == {
        k[0]: (sum(ls), min(ls), max(ls), len(v)) for k, v in lens.items()
        for ls in [[p["ip_len"] for p, _ in v if p["ip_len"] is not None]]}
    gets = groups(lambda p: p["dst_port"] == 80 and b"GET /" in (p["payload"] or b""),
                  ["dst_ip"])
    assert gets and {(r["t"], r["dst_ip"]): r["n"] for r in got["http_get"]} == \
        {k: len(v) for k, v in gets.items()}
    banners = [p for p in pkts if b"SSH-2.0" in (p["payload"] or b"")]
    assert banners and [(r["src_ip"], r["payload"]) for r in got["ssh_banner"]] == \
        [(p["src_ip"], p["payload"].hex()) for p in banners]  # bytes print as hex
    reflect = groups(lambda p: p["dns_qr"] == 1 and p["dns_an_type"] in (1, 28), ["dst_ip"])
    assert reflect and {(r["t"], r["dst_ip"]): (r["resolvers"], r["n"])
                        for r in got["reflect"]} == \
        {k: (distinct(v, "src_ip"), len(v)) for k, v in reflect.items()}
    ttls = groups(lambda p: p["dns_an_name"], ["dns_an_name", "dns_an_addr"])
    assert any(k[2] is None for k in ttls) and any(k[2] for k in ttls), "A/AAAA and others"
    assert {(r["t"], r["dns_an_name"], r["dns_an_addr"]): (r["ttls"], r["lo"])
            for r in got["ttls"]} == \
        {k: (distinct(v, "dns_an_ttl"), min(w for _, w in v)) for k, v in ttls.items()}
    by_len = groups(lambda p: p["protocol"] == 6, ["ip_len"])
    assert {(r["t"], r["ip_len"]): (r["srcs"], r["mean"]) for r in got["by_len"]} == \
        {k: (distinct(v, "src_ip"), k[1]) for k, v in by_len.items()}


def test_replay_joined_aggregates(spark, tmp_path):
    """WITH … JOIN: aggregates of the same windows combined per window on their keys (SYN
    minus SYN-ACK per host; a LEFT JOIN whose right part has no row in most windows; an inner
    join with arithmetic and a WHERE), against the dpkt-decoded packets joined by hand."""
    path = capture("var-services-std-ports.pcap")
    queries = parse_queries("""
-- name: half_open
WITH syn AS (SELECT time/10 AS t, dst_ip, count(*) AS n FROM packets
             WHERE (tcp_flags & 18) = 2 GROUP BY time/10, dst_ip),
     synack AS (SELECT time/10 AS t, src_ip, count(*) AS n FROM packets
                WHERE (tcp_flags & 18) = 18 GROUP BY time/10, src_ip)
SELECT syn.t AS t, syn.dst_ip AS host, syn.n AS syns, synack.n AS acks,
       syn.n - coalesce(synack.n, 0) AS open
FROM syn LEFT JOIN synack ON syn.t = synack.t AND syn.dst_ip = synack.src_ip;
-- name: resets
WITH a AS (SELECT time/10 AS t, count(*) AS n FROM packets WHERE protocol = 6 GROUP BY time/10),
     r AS (SELECT time/10 AS t, count(*) AS n FROM packets WHERE tcp_flags & 4 != 0
           GROUP BY time/10)
SELECT a.t AS t, a.n AS tcp, coalesce(r.n, 0) AS rsts FROM a LEFT JOIN r ON a.t = r.t;
-- name: asym
WITH o AS (SELECT time/10 AS t, src_ip, sum(wirelen) AS bytes, count(*) AS n FROM packets
           WHERE protocol = 17 GROUP BY time/10, src_ip),
     i AS (SELECT time/10 AS t, dst_ip, count(*) AS n FROM packets WHERE protocol = 17
           GROUP BY time/10, dst_ip)
SELECT o.t AS t, o.src_ip AS host, o.bytes / o.n AS mean, o.n - i.n AS d
FROM o JOIN i ON i.dst_ip = o.src_ip AND o.t = i.t WHERE o.n >= 2 AND o.n - i.n != 0;
-- name: syn_alone
SELECT time/10 AS t, dst_ip, count(*) AS n FROM packets WHERE (tcp_flags & 18) = 2
GROUP BY time/10, dst_ip
""")
    res = replay(path, queries, tmp_path, spark)
    assert res.error is None
    assert len(res.plan.queries) == 7, "each part planned as a query"
    got = {q.name: rows_of(q, t) for q, t in res.answers}
    pkts = packets(path)
    wirelens = [meta.wirelen for _, meta in RawPcapReader(str(path))]

    def count(where, key):
        out = defaultdict(lambda: [0, 0])
        for p, wl in zip(pkts, wirelens, strict=True):
            if where(p):
                acc = out[(p["time"] // 10, *(p[k] for k in key))]
                acc[0] += 1
                acc[1] += wl
        return out

    def flags(mask, value):
        return lambda p: p["tcp_flags"] is not None and p["tcp_flags"] & mask == value

    syn, synack = count(flags(18, 2), ["dst_ip"]), count(flags(18, 18), ["src_ip"])
    want = {k: (v[0], synack[k][0] if k in synack else None, v[0] - synack.get(k, [0])[0])
            for k, v in syn.items()}
    assert syn and any(k in synack for k in syn)
    assert {(r["t"], r["host"]): (r["syns"], r["acks"], r["open"])
            for r in got["half_open"]} == want
    assert {(r["t"], r["dst_ip"]): r["n"] for r in got["syn_alone"]} == \
        {k: v[0] for k, v in syn.items()}
    tcp, rst = count(lambda p: p["protocol"] == 6, []), count(flags(4, 4), [])
    assert len(rst) < len(tcp), "windows without a reset: the right part is empty there"
    assert {r["t"]: (r["tcp"], r["rsts"]) for r in got["resets"]} == \
        {k[0]: (v[0], rst.get(k, [0])[0]) for k, v in tcp.items()}
    out, inn = count(lambda p: p["protocol"] == 17, ["src_ip"]), \
        count(lambda p: p["protocol"] == 17, ["dst_ip"])
    want = {k: (v[1] / v[0], v[0] - inn[k][0]) for k, v in out.items()
            if k in inn and v[0] >= 2 and v[0] != inn[k][0]}
    assert want and {(r["t"], r["host"]): (r["mean"], r["d"]) for r in got["asym"]} == want


def test_the_warm_up_runs_only_while_the_capture_is_being_read(monkeypatch):
    """Spark's warm-up job runs on a JVM that is up while ``replay`` reads; a JVM up only once
    the capture is read skips it (the answer job would wait for it)."""
    import threading
    from concurrent.futures import Future

    import collector.spark.merge as merge
    from api.replay import _warm_up
    ran = []
    monkeypatch.setattr(merge, "warm_up", lambda spark, engine: ran.append((spark, engine)))
    for read_first in (False, True):
        starting, captured = Future(), threading.Event()
        t = _warm_up(starting, "sql", captured)
        if read_first:
            captured.set()
        starting.set_result(f"session {read_first}")
        t.join(10)
        assert not t.is_alive()
    assert ran == [("session False", "sql")]


def test_the_startup_heap_is_frozen_once_per_process():
    """``freeze_startup_heap`` (replay's and the daemon's start) takes the process's objects
    out of the full collections once; a later call leaves the objects made since (one
    replay's garbage) to the collector."""
    import gc

    from collector.daemon.process import freeze_startup_heap
    freeze_startup_heap()
    frozen = gc.get_freeze_count()
    assert frozen > 0
    garbage = [[] for _ in range(1000)]
    for a, b in zip(garbage, garbage[1:], strict=False):
        a.append(b)
        b.append(a)
    freeze_startup_heap()
    # nothing more frozen (a frozen object may still die: the count never grows)
    assert gc.get_freeze_count() <= frozen


def test_replay_runs_on_small_pages(spark, tmp_path):
    """``replay`` (as the daemon) has numpy stop asking for huge pages for its arrays
    (``collector.no_huge_pages``): on a machine that gives them on request their first touch
    cost the telemetry bench's warm replays 0.2 s."""
    import numpy as np
    madvise = np._core.multiarray
    madvise._set_madvise_hugepage(True)
    try:
        res = replay(capture("var-services-std-ports.pcap"), parse_queries(
            "SELECT time/60 AS t, protocol, count(*) AS n FROM packets GROUP BY time/60, "
            "protocol"), tmp_path, spark, settings=Settings(initial_queries=None))
        assert res.error is None and res.answers[0][1].num_rows
        assert madvise._get_madvise_hugepage() is False
    finally:
        madvise._set_madvise_hugepage(False)
