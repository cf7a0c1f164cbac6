"""Enrichment benchmark (issue 46): AS look-ups of two address fields per tuple on a 1M-prefix
MMDB database, against the fastest per-lookup MMDB readers on PyPI in the same run.

The database: written once by ``mmdb-writer`` (cached in bench/.cache), 1M+ networks: a prefix
around each address of the backbone bench trace (its /24, IPv6 /48) so that the trace's addresses
are in it, the rest random IPv4 /16-/24 and IPv6 /32-/48, AS numbers drawn from 80,000.

1. In the engine: the backbone trace's batches through ``Engine`` with a query grouping by
   ``src_asn, dst_asn``; what enrichment adds is its own time (``flowsieve_enrich_seconds_total``
   / tuples), median of 5 runs; the run's whole time per tuple beside it. Read ahead as
   ``replay`` and the daemon's file and live sources run (unpack and enrichment on the reading
   thread), and on one thread (as a flow or sFlow listener's batches are enriched).
2. The same look-up (``Enrichment.apply``, the engine's call) on uniform random addresses (85 %
   IPv4, 15 % IPv6): no locality.
3. Per-lookup readers on the same addresses (given as the strings they take, made outside the
   timer): ``maxminddb`` (its C extension) ``get``, ``maxminddb-rust`` ``get``, ``get_many``
   and ``get_many_path`` (a batch call reading only the AS number): the ratio is against the
   fastest of them.
4. Loading: ``Database`` compile time (median of 3) and the memory it holds (the process's RSS
   growth in a fresh process, and the compiled arrays' bytes).

Writes bench/results/enrich.json and prints a summary.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CACHE, write_result  # noqa: E402
from traces import trace  # noqa: E402

from capture import enrich  # noqa: E402
from capture.enrich import Database  # noqa: E402
from capture.pcap import open_capture  # noqa: E402
from collector.daemon.sources import ahead  # noqa: E402
from collector.metrics import Metrics  # noqa: E402
from collector.pipeline.engine import Engine  # noqa: E402
from collector.pipeline.spool import Spool  # noqa: E402
from planner.plan import build_plan  # noqa: E402
from planner.query import parse_queries  # noqa: E402

DB_VERSION = 1
QUERY = ("-- name: as_pairs\nSELECT time/60 AS t, src_asn, dst_asn, count(*) AS n, "
         "sum(wirelen) AS b FROM packets GROUP BY time/60, src_asn, dst_asn;\n")


def build_database(path: Path, hosts4: np.ndarray, hosts6: np.ndarray, total: int,
                   seed: int = 46) -> None:
    """The trace's /24s and /48s, then random prefixes up to ``total`` (mmdb-writer)."""
    from mmdb_writer import MMDBWriter
    from netaddr import IPSet
    rng = random.Random(seed)
    nets: dict[str, None] = {}
    for a in np.unique(hosts4 >> 8):
        nets[f"{ipaddress.IPv4Address(int(a) << 8)}/24"] = None
    for h in np.unique(hosts6[:, :6], axis=0):
        nets[f"{ipaddress.IPv6Address(bytes(h) + bytes(10))}/48"] = None
    while len(nets) < total:
        if rng.random() < 0.85:
            length = rng.choice([16, 18, 20, 21, 22, 23, 24, 24, 24, 24])
            bits = rng.getrandbits(length) << (32 - length)
            nets[f"{ipaddress.IPv4Address(bits)}/{length}"] = None
        else:
            length = rng.choice([32, 36, 40, 44, 48, 48])
            bits = (0x2 << (length - 3) | rng.getrandbits(length - 3)) << (128 - length)
            nets[f"{ipaddress.IPv6Address(bits)}/{length}"] = None
    by_as: dict[int, list[str]] = {}
    for net in nets:
        by_as.setdefault(rng.randint(1, 80_000), []).append(net)
    w = MMDBWriter(ip_version=6, database_type="flowsieve-bench-asn", ipv4_compatible=True)
    for asn, group in by_as.items():
        w.insert_network(IPSet(group), {"autonomous_system_number": asn,
                                        "autonomous_system_organization": f"AS{asn} bench"})
    tmp = path.with_suffix(".tmp")
    w.to_db_file(str(tmp))
    tmp.replace(path)


def database(arrays: dict, total: int) -> Path:
    path = CACHE / f"enrich-asn-{total}-{DB_VERSION}.mmdb"
    if not path.exists():
        ips = np.concatenate([arrays["src"], arrays["dst"]])
        v4 = (ips[:, 10] == 0xFF) & (ips[:, 11] == 0xFF) & (ips[:, :10] == 0).all(axis=1)
        hosts4 = np.unique(ips[v4, 12:].copy().view(">u4").reshape(-1).astype(np.int64))
        hosts6 = np.unique(ips[~v4], axis=0)
        print(f"writing the database ({total:,} prefixes, mmdb-writer; once)...", flush=True)
        t = time.perf_counter()
        build_database(path, hosts4, hosts6, total)
        print(f"  {time.perf_counter() - t:.0f} s", flush=True)
    return path


def engine_run(raws, plan, read_ahead: bool) -> dict:
    """The batches through an engine: read ahead as ``replay`` and the daemon's file and
    live sources run (unpack and enrichment on the reading thread, the engine's stages on
    another), or all on one thread as a flow or sFlow listener's batches go."""
    metrics = Metrics()
    with tempfile.TemporaryDirectory(prefix="flowsieve-bench-enrich-") as tmp:
        eng = Engine(Spool(Path(tmp), 1 << 40, "block"), "packets", metrics, finite=True)
        eng.set_plan(plan)
        eng.take_plan()
        t = time.perf_counter()
        if read_ahead:
            with closing(ahead(raws, eng.prepare)) as read:
                for raw, tuples in read:
                    eng.process(raw, prepared=tuples)
        else:
            for raw in raws:
                eng.process(raw)
        wall = time.perf_counter() - t
    n = sum(len(r) for r in raws)
    seconds = metrics.enrich_seconds.labels("packets")._value.get()
    tuples = metrics.enrich_tuples.labels("packets")._value.get()
    return {"tuples": n, "engine_ns_per_tuple": wall / n * 1e9,
            "enrich_ns_per_tuple": seconds / tuples * 1e9}


class Addresses:
    """A batch of two address fields only (for ``Enrichment.apply``)."""

    stream = "packets"

    def __init__(self, src, dst):
        self.cols = {"src_ip": src, "dst_ip": dst}

    def __len__(self):
        return len(self.cols["src_ip"])

    def column(self, name):
        return self.cols[name]

    def ip_valid(self, name):
        return np.ones(len(self), bool)


def uniform(n: int, seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.zeros((n, 16), np.uint8)
    v6 = rng.random(n) < 0.15
    out[~v6, 10:12] = 0xFF
    out[~v6, 12:] = rng.integers(0, 256, (int((~v6).sum()), 4))
    out[v6] = rng.integers(0, 256, (int(v6.sum()), 16))
    out[v6, 0] = 0x20 | (out[v6, 0] & 0x1F)  # 2000::/3, where the database's IPv6 lies
    return out


def texts(col: np.ndarray) -> list[str]:
    v4 = (col[:, 10] == 0xFF) & (col[:, 11] == 0xFF) & (col[:, :10] == 0).all(axis=1)
    return [str(ipaddress.IPv4Address(bytes(r[12:]))) if m else
            str(ipaddress.IPv6Address(bytes(r))) for r, m in zip(col, v4, strict=True)]


def readers(path: Path, addrs: list[str], repeat: int) -> dict:
    import maxminddb
    import maxminddb_rust
    out = {}
    c = maxminddb.open_database(str(path), maxminddb.MODE_MMAP_EXT)
    rust = maxminddb_rust.open_database(str(path))
    runs = {
        "maxminddb_get": lambda: [c.get(a) for a in addrs],
        "maxminddb_rust_get": lambda: [rust.get(a) for a in addrs],
        "maxminddb_rust_get_many": lambda: rust.get_many(addrs),
        "maxminddb_rust_get_many_path": lambda: rust.get_many_path(
            addrs, ("autonomous_system_number",)),
    }
    for name, fn in runs.items():
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times) / len(addrs) * 1e9
    c.close()
    return out


def load_child(path: str) -> None:
    """In a fresh process: the database's compile time and the RSS it adds."""
    def rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0
    # the kernels loaded (numba's cache) and compiled on a small database first: their code
    # is not the database's memory
    Database("asn", Path(__file__).resolve().parent.parent / "tests" / "data" / "mmdb" /
             "GeoLite2-ASN-Test.mmdb").attribute("asn", np.zeros((1, 16), np.uint8),
                                                  np.ones(1, bool))
    import gc
    gc.collect()
    before = rss()
    t = time.perf_counter()
    db = Database("asn", path)
    took = time.perf_counter() - t
    gc.collect()
    print(json.dumps({"load_s": took, "rss_growth": rss() - before, "arrays_bytes": db.nbytes,
                      "networks": db.networks, "records": db.records,
                      "intervals": db.index.intervals}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefixes", type=int, default=1_000_000)
    ap.add_argument("--packets", type=int, default=6_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--load-child")
    args = ap.parse_args()
    if args.load_child:
        load_child(args.load_child)
        return
    pcap, arrays = trace("backbone", args.packets, CACHE)
    path = database(arrays, args.prefixes)
    res: dict = {"machine": f"{os.cpu_count()} cores", "prefixes_asked": args.prefixes,
                 "note": "medians; ns per tuple = two address look-ups (src_ip, dst_ip)"}
    # loading, in fresh processes (the first compiles and caches the kernels)
    loads = []
    for _ in range(4):
        out = subprocess.run([sys.executable, __file__, "--load-child", str(path)],
                             capture_output=True, text=True, check=True)
        loads.append(json.loads(out.stdout.strip().splitlines()[-1]))
    loads = loads[1:]
    res["load"] = {"load_s": statistics.median(x["load_s"] for x in loads),
                   "rss_growth_mib": statistics.median(x["rss_growth"] for x in loads) / 2**20,
                   "arrays_mib": loads[0]["arrays_bytes"] / 2**20,
                   "networks": loads[0]["networks"], "records": loads[0]["records"],
                   "intervals": loads[0]["intervals"], "file_mib": path.stat().st_size / 2**20}
    lo = res["load"]
    print(f"database: {lo['networks']:,} networks, {lo['records']:,} records, "
          f"{lo['file_mib']:.0f} MiB file; load {lo['load_s']:.2f} s, "
          f"+{lo['rss_growth_mib']:.0f} MiB RSS ({lo['arrays_mib']:.0f} MiB of arrays)",
          flush=True)
    enrich.configure({"asn": (str(path), {})})
    raws = list(open_capture(pcap))
    plan = build_plan(parse_queries(QUERY))
    for mode, read_ahead in (("engine", True), ("engine_one_thread", False)):
        engine_run(raws[:2], plan, read_ahead)  # the kernels compiled
        runs = [engine_run(raws, plan, read_ahead) for _ in range(args.repeat)]
        res[mode] = {"tuples": runs[0]["tuples"],
                     "enrich_ns_per_tuple": statistics.median(
                         r["enrich_ns_per_tuple"] for r in runs),
                     "engine_ns_per_tuple": statistics.median(
                         r["engine_ns_per_tuple"] for r in runs),
                     "runs": runs}
        e = res[mode]
        print(f"{mode}, backbone trace ({e['tuples']:,} packets): enrichment "
              f"{e['enrich_ns_per_tuple']:.1f} ns/tuple; the run {e['engine_ns_per_tuple']:.0f} "
              "ns/tuple", flush=True)
    e = res["engine"]
    # uniform random addresses, and the same addresses through the readers
    n = 1_000_000
    col = uniform(2 * n)
    batch = Addresses(col[:n], col[n:])
    ours = enrich.current()
    ours.apply(batch, ["src_asn", "dst_asn"])
    times = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        ours.apply(batch, ["src_asn", "dst_asn"])
        times.append(time.perf_counter() - t)
    res["uniform"] = {"tuples": n, "enrich_ns_per_tuple": statistics.median(times) / n * 1e9}
    print(f"uniform random addresses: {res['uniform']['enrich_ns_per_tuple']:.1f} ns/tuple",
          flush=True)
    # readers: 200k addresses of each kind, the trace's and uniform ones
    m = 200_000
    sample = np.random.default_rng(3).integers(0, len(arrays["src"]), m)
    trace_addrs = texts(np.concatenate([arrays["src"][sample[:m // 2]],
                                        arrays["dst"][sample[m // 2:]]]))
    uniform_addrs = texts(col[:m])
    res["readers"] = {"trace": readers(path, trace_addrs, 3),
                      "uniform": readers(path, uniform_addrs, 3)}
    # correctness on the way: ours equal maxminddb's on the sampled addresses
    import maxminddb
    with maxminddb.open_database(str(path)) as r:
        want = [(r.get(a) or {}).get("autonomous_system_number", -1) for a in trace_addrs]
    db = ours.databases["asn"]
    from capture.fields import ip_bytes
    got = db.attribute("asn", np.frombuffer(b"".join(ip_bytes(a) for a in trace_addrs),
                                            np.uint8).reshape(-1, 16), np.ones(m, bool)).tolist()
    res["equal_to_maxminddb"] = got == want
    for kind, ns_tuple in (("trace", e["enrich_ns_per_tuple"]),
                           ("uniform", res["uniform"]["enrich_ns_per_tuple"])):
        rd = res["readers"][kind]
        best = min(rd, key=rd.get)
        res["readers"][kind]["fastest"] = best
        res["readers"][kind]["ratio_vs_fastest"] = rd[best] / (ns_tuple / 2)
        print(f"{kind}: per look-up ours {ns_tuple / 2:.1f} ns; " +
              ", ".join(f"{k} {v:.0f} ns" for k, v in rd.items()
                        if isinstance(v, float) and k != "ratio_vs_fastest") +
              f" -> {res['readers'][kind]['ratio_vs_fastest']:.0f}x the fastest ({best})",
              flush=True)
    print("equal to maxminddb on the trace's addresses:", res["equal_to_maxminddb"])
    print("wrote", write_result("enrich", res))


if __name__ == "__main__":
    main()
