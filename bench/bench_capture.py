"""Capture benchmark (issue 4): unpack speed vs dpkt, group unpacking, memory on a 2 GB file.

Run by ``make bench`` (or ``python bench/bench_capture.py [--quick]``). The trace is the seeded
``packet_trace`` of bench/workloads.py (1M whole Ethernet frames, realistic mix), read from the
page cache. Writes bench/results/capture.json and prints a summary.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import dpkt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CACHE, median_time, write_result  # noqa: E402
from bench.workloads import SEED, gigascope_sql, packet_trace  # noqa: E402
from capture.pcap import open_capture  # noqa: E402
from capture.unpack import unpack  # noqa: E402
from planner.plan import build_plan  # noqa: E402
from planner.query import parse_queries  # noqa: E402

# the 5-tuple and 12 more fields, as a monitoring query set reads them
FIELDS = ("ts", "time", "wirelen", "eth_type", "vlan", "ip_version", "src_ip", "dst_ip",
          "protocol", "ttl", "tos", "src_port", "dst_port", "tcp_flags", "icmp_type",
          "icmp_code", "dns_qr")


def trace_path(n: int) -> Path:
    CACHE.mkdir(exist_ok=True)
    path = CACHE / f"trace-{SEED}-{n}.pcap"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        packet_trace(tmp, n)
        tmp.replace(path)
    return path


def flowsieve_pass(path, want) -> int:
    """Read the file and unpack every batch (one core)."""
    n = 0
    for raw in open_capture(path):
        n += len(unpack(raw, want))
    return n


def dpkt_fields(ts, buf) -> tuple:
    """The same fields with dpkt, the way a Python collector extracts them."""
    vlan = sport = dport = flags = it = ic = qr = None
    eth = dpkt.ethernet.Ethernet(buf)
    tags = getattr(eth, "vlan_tags", None)
    if tags:
        vlan = tags[0].id
    net = eth.data
    if isinstance(net, dpkt.ip.IP):
        ver, src, dst, p, ttl, tos = 4, net.src, net.dst, net.p, net.ttl, net.tos
    elif isinstance(net, dpkt.ip6.IP6):
        ver, src, dst, p, ttl, tos = 6, net.src, net.dst, net.p, net.hlim, net.fc
    else:
        return (ts, int(ts), len(buf), eth.type, vlan) + (None,) * 12
    l4 = net.data
    if isinstance(l4, dpkt.tcp.TCP | dpkt.udp.UDP):
        sport, dport = l4.sport, l4.dport
        if isinstance(l4, dpkt.tcp.TCP):
            flags = l4.flags
        elif 53 in (sport, dport) and len(l4.data) >= 12:
            qr = l4.data[2] >> 7
    elif isinstance(l4, dpkt.icmp.ICMP | dpkt.icmp6.ICMP6):
        it, ic = l4.type, l4.code
    return (ts, int(ts), len(buf), eth.type, vlan, ver, src, dst, p, ttl, tos, sport, dport,
            flags, it, ic, qr)


def dpkt_pass(path, limit: int) -> int:
    n = 0
    with open(path, "rb") as fh:
        for ts, buf in dpkt.pcap.Reader(fh):
            dpkt_fields(ts, buf)
            n += 1
            if n >= limit:
                break
    return n


def bench_speed(path, n: int, dpkt_n: int, repeat: int) -> dict:
    flowsieve_pass(path, FIELDS)  # compile (cached) and warm the page cache
    secs = median_time(lambda: flowsieve_pass(path, FIELDS), repeat)
    read_secs = median_time(lambda: sum(len(r) for r in open_capture(path)), repeat)
    d_secs = median_time(lambda: dpkt_pass(path, dpkt_n), max(3, repeat // 2))
    ours, theirs = n / secs, dpkt_n / d_secs
    return {"packets": n, "fields": list(FIELDS), "flowsieve_s": secs,
            "flowsieve_mpps": ours / 1e6, "read_only_mpps": n / read_secs / 1e6,
            "flowsieve_gbps": path.stat().st_size * 8 / secs / 1e9,
            "dpkt_packets": dpkt_n, "dpkt_s": d_secs, "dpkt_kpps": theirs / 1e3,
            "speedup_vs_dpkt": ours / theirs}


def bench_groups(path, repeat: int) -> dict:
    """Unpack only (batches already indexed): the plan's groups vs every field."""
    raws = list(open_capture(path))
    n = sum(len(r) for r in raws)
    plan = build_plan(parse_queries(gigascope_sql()))
    u = plan.unpacking("packets")
    cases = {"gigascope_plan": u.fields, "five_tuple_plus_12": FIELDS,
             "five_tuple": ("ts", "time", "src_ip", "dst_ip", "protocol", "src_port",
                            "dst_port"),
             "everything": None}
    out = {"packets": n, "plan_groups": list(u.groups), "plan_singles": list(u.singles),
           "plan_fields": list(u.fields), "model_cost": u.cost,
           "model_cost_all": u.cost_all}
    for name, want in cases.items():
        for r in raws[:2]:
            unpack(r, want)
        secs = median_time(lambda want=want: [unpack(r, want) for r in raws], repeat)
        out[name] = {"s": secs, "mpps": n / secs / 1e6,
                     "fields": None if want is None else len(want)}
    every = out["everything"]["s"]
    for name in cases:
        out[name]["saving_vs_everything"] = 1 - out[name]["s"] / every
    return out


CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from capture.pcap import open_capture
from capture.unpack import unpack
fields = {fields!r}
t = time.perf_counter()
n = 0
for raw in open_capture(sys.argv[1]):
    n += len(unpack(raw, fields))
dt = time.perf_counter() - t
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forking parent across exec
hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM")][0].split()[1]
print(n, dt, hwm)
"""


def bench_memory(trace: Path, target_bytes: int) -> dict:
    """Peak RSS of a process reading a file of ``target_bytes`` vs one reading a small file."""
    big = CACHE / f"big-{SEED}-{target_bytes >> 20}MiB.pcap"
    body = trace.read_bytes()
    if not big.exists():
        tmp = big.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            fh.write(body[:24])
            written = 24
            while written < target_bytes:
                fh.write(body[24:])
                written += len(body) - 24
        tmp.replace(big)
    small = Path(__file__).resolve().parent.parent / "tests" / "data" / "pcap" / "ok.pcap"
    code = CHILD.format(root=str(Path(__file__).resolve().parent.parent), fields=FIELDS)
    runs = {}
    for name, path in (("small", small), ("big", big)):
        out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                             text=True, check=True)
        n, secs, rss_kb = out.stdout.split()
        runs[name] = {"file_bytes": path.stat().st_size, "packets": int(n),
                      "seconds": float(secs), "peak_rss_mib": int(rss_kb) / 1024}
    return {**runs, "rss_growth_mib": runs["big"]["peak_rss_mib"] - runs["small"]["peak_rss_mib"],
            "big_mpps": runs["big"]["packets"] / runs["big"]["seconds"] / 1e6}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller trace, fewer runs")
    args = ap.parse_args()
    n = 200_000 if args.quick else 1_000_000
    repeat = 3 if args.quick else 5
    path = trace_path(n)
    t0 = time.time()
    res = {"machine": {"cpu": platform.processor() or platform.machine(),
                       "cores": os.cpu_count(), "python": platform.python_version()},
           "trace": {"packets": n, "bytes": path.stat().st_size, "seed": SEED}}
    res["speed"] = bench_speed(path, n, 20_000 if args.quick else 100_000, repeat)
    s = res["speed"]
    print(f"unpack {len(FIELDS)} fields: {s['flowsieve_mpps']:.2f} Mpps "
          f"({s['flowsieve_gbps']:.1f} Gbit/s of capture), dpkt {s['dpkt_kpps']:.0f} kpps: "
          f"{s['speedup_vs_dpkt']:.0f}x; reading alone {s['read_only_mpps']:.1f} Mpps")
    res["groups"] = g = bench_groups(path, repeat)
    for k in ("gigascope_plan", "five_tuple", "five_tuple_plus_12", "everything"):
        print(f"  unpack {k:20} {g[k]['mpps']:6.2f} Mpps, saves "
              f"{100 * g[k]['saving_vs_everything']:5.1f} % vs everything")
    res["memory"] = m = bench_memory(path, (1 << 29) if args.quick else (2 << 30))
    print(f"peak RSS: {m['big']['peak_rss_mib']:.0f} MiB reading "
          f"{m['big']['file_bytes'] / 2**30:.2f} GiB ({m['big']['packets']} packets, "
          f"{m['big_mpps']:.2f} Mpps), {m['small']['peak_rss_mib']:.0f} MiB reading ok.pcap")
    res["targets"] = {"mpps_per_core>=5": s["flowsieve_mpps"] >= 5,
                      "speedup_vs_dpkt>=50": s["speedup_vs_dpkt"] >= 50}
    res["seconds"] = time.time() - t0
    if not args.quick:
        print(f"wrote {write_result('capture', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
