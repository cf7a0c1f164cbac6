"""sFlow v5 collector benchmark (issue 45), two parts, each with its baseline in the run:

1. Decode: an export capture of pmacct's sFlow (``pmacctd``'s sfprobe over the sample capture,
   sampling rate 1, its datagrams repeated with their datagram and sample sequence numbers
   continued) read by flowsieve's decoder (datagrams out of the capture, flow samples decoded,
   their headers unpacked to the 5-tuple and length) on one core, against pmacct's own
   collector ``sfacctd`` reading the same file (``pcap_savefile``, print plugin aggregating the
   5-tuple: what its documentation shows), its wall time whole.
2. Loopback receive: a sender process paces the datagrams at rising rates, ``--seconds`` each,
   into listener -> decoder -> engine (a query FROM samples) -> spool, Spark not running. A rate
   has zero loss when the kernel dropped nothing and every sample sent was decoded, with no
   sequence loss.

Writes bench/results/sflow.json and prints a summary.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median_time, write_result  # noqa: E402

from capture.listen import FlowListener  # noqa: E402
from capture.sflow import SflowDecoder, capture_sflow  # noqa: E402
from collector.config import data_file  # noqa: E402

FIVE = ["src_ip", "dst_ip", "src_port", "dst_port", "protocol", "wirelen"]
QUERY = ("-- name: top_src\nSELECT time/60 AS t, src_ip, count(*) AS n, sum(est_bytes) AS b "
         "FROM samples WHERE protocol = 6 OR protocol = 17 GROUP BY time/60, src_ip;\n")
PMACCTD = """daemonize: false
plugins: sfprobe
pcap_savefile: {capture}
pcap_savefile_wait: false
sfprobe_receiver: 127.0.0.1:{port}
sfprobe_agentip: 192.0.2.1
sampling_rate: 1
"""
SFACCTD = """daemonize: false
plugins: print
pcap_savefile: {capture}
pcap_savefile_wait: false
aggregate: src_host, dst_host, src_port, dst_port, proto
print_output: csv
print_output_file: {out}
print_refresh_time: 300
"""


def pmacct_datagrams(work: Path) -> list[bytes]:
    """pmacctd's sFlow export of the sample capture (851 packets: 130 datagrams)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(("127.0.0.1", 0))
    conf = work / "pmacctd.conf"
    conf.write_text(PMACCTD.format(capture=data_file("sample.pcap"),
                                   port=sock.getsockname()[1]))
    subprocess.run(["pmacctd", "-f", str(conf)], capture_output=True, timeout=120)
    sock.settimeout(3)
    out = []
    try:
        while True:
            out.append(sock.recv(65535))
    except TimeoutError:
        pass
    sock.close()
    return out


def sample_seq_offsets(d: bytes) -> list[int]:
    """Where each flow sample's sequence number is in a datagram of an IPv4 agent."""
    n = struct.unpack_from(">I", d, 24)[0]
    p, out = 28, []
    for _ in range(n):
        fmt, length = struct.unpack_from(">II", d, p)
        if fmt in (1, 3):
            out.append(p + 8)
        p += 8 + length
    return out


class Renumber:
    """The datagrams again and again, their datagram and sample sequence numbers continued."""

    def __init__(self, dgrams: list[bytes]):
        self.bufs = [bytearray(d) for d in dgrams]
        self.offsets = [sample_seq_offsets(d) for d in dgrams]
        self.seq = 0
        self.sample_seq = 0
        self.i = 0

    def next(self) -> tuple[bytearray, int]:
        k = self.i % len(self.bufs)
        self.i += 1
        b = self.bufs[k]
        self.seq += 1
        struct.pack_into(">I", b, 16, self.seq)
        for off in self.offsets[k]:
            self.sample_seq += 1
            struct.pack_into(">I", b, off, self.sample_seq)
        return b, len(self.offsets[k])


def write_capture(path: Path, dgrams: list[bytes], n_datagrams: int) -> int:
    """A pcap of ``n_datagrams`` to UDP 6343; returns the flow samples in it."""
    import dpkt
    r = Renumber(dgrams)
    samples = 0
    with open(path, "wb") as f:
        w = dpkt.pcap.Writer(f)
        for i in range(n_datagrams):
            b, k = r.next()
            samples += k
            udp = dpkt.udp.UDP(sport=40000, dport=6343, data=bytes(b))
            udp.ulen = 8 + len(b)
            ip = dpkt.ip.IP(src=bytes([192, 0, 2, 1]), dst=bytes([192, 0, 2, 2]), p=17,
                            data=udp)
            ip.len = 20 + udp.ulen
            eth = dpkt.ethernet.Ethernet(src=b"\x02\0\0\0\0\1", dst=b"\x02\0\0\0\0\2",
                                         type=dpkt.ethernet.ETH_TYPE_IP, data=ip)
            w.writepkt(bytes(eth), ts=1_700_000_000 + i / 10_000)
    return samples


def bench_decode(work: Path, dgrams: list[bytes], n_datagrams: int, repeat: int) -> dict:
    path = work / "export.pcap"
    n = write_capture(path, dgrams, n_datagrams)
    size = path.stat().st_size

    def ours() -> int:
        dec = SflowDecoder()
        return sum(len(b.samples(FIVE)) for b in capture_sflow(path, [6343], dec,
                                                               batch_size=8192))
    assert ours() == n  # warm: the kernels compiled
    t = median_time(ours, repeat)
    out = work / "sfacctd.csv"
    conf = work / "sfacctd.conf"
    conf.write_text(SFACCTD.format(capture=path, out=out))

    def theirs() -> None:
        subprocess.run(["sfacctd", "-f", str(conf)], capture_output=True, timeout=900,
                       check=False)
    theirs()
    packets = sum(int(line.split(",")[5]) for line in out.read_text().splitlines()[1:])
    assert packets == n, (packets, n)  # sfacctd counted every sample
    tb = median_time(theirs, max(3, repeat // 2))
    # sfacctd's start and stop alone: the same run over a capture of one datagram
    write_capture(path, dgrams, 1)
    fixed = median_time(theirs, 3)
    return {"datagrams": n_datagrams, "samples": n, "file_mib": round(size / 2**20),
            "flowsieve_samples_per_s": round(n / t), "sfacctd_samples_per_s": round(n / tb),
            "ratio": round(tb / t, 1), "sfacctd_start_stop_s": round(fixed, 2),
            "sfacctd_samples_per_s_without_start_stop": round(n / max(tb - fixed, 1e-9)),
            "ratio_without_start_stop": round((tb - fixed) / t, 1)}


def _sender(dgrams, dest, rate, seconds, q):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    r = Renumber(dgrams)
    per = sum(len(o) for o in r.offsets) / len(r.offsets)
    dgram_rate = rate / per
    sent_d = sent_s = 0
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter() - t0
        if now >= seconds:
            break
        due = int(now * dgram_rate) + 1
        while sent_d < due:
            b, k = r.next()
            s.sendto(b, dest)
            sent_d += 1
            sent_s += k
        time.sleep(0.0005)
    q.put({"datagrams": sent_d, "samples": sent_s, "seconds": time.perf_counter() - t0})


def load_run(dgrams: list[bytes], rate: float, seconds: float, workdir: Path) -> dict:
    from collector.pipeline.engine import Engine
    from collector.pipeline.spool import Spool
    from planner.plan import build_plan
    from planner.query import parse_queries
    lst = FlowListener(["127.0.0.1:0"], rcvbuf=32 << 20)
    lst.open()
    dec = SflowDecoder()
    engine = Engine(Spool(workdir / f"spool-{int(rate)}", policy="drop"), "samples",
                    probe="bench")
    engine.set_plan(build_plan(parse_queries(QUERY)))
    stop = threading.Event()
    got, busy = [0], [0.0]

    def receive():
        for dg in lst.batches(stop, poll_s=0.1, linger_s=0.02):
            if dg is None:
                continue
            t = time.perf_counter()
            batch = dec.decode(dg)
            engine.process(batch, "bench")
            busy[0] += time.perf_counter() - t
            got[0] += len(batch)

    t = threading.Thread(target=receive)
    t.start()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_sender, args=(dgrams, lst.bound[0], rate, seconds, q))
    p.start()
    sent = q.get()
    p.join()
    deadline = time.monotonic() + 30
    while got[0] < sent["samples"] and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    stop.set()
    t.join()
    drops = lst.update_drops()
    lst.close()
    lost = sum(s["sequence"]["lost"] + s["samples"]["lost"] for s in dec.streams())
    return {"rate": rate, "sent_samples": sent["samples"],
            "achieved_send_rate": round(sent["samples"] / sent["seconds"]),
            "decoded_samples": got[0], "kernel_drops": drops, "sequence_lost": lost,
            "decode_errors": dec.all_errors,
            "receiver_busy_fraction": round(busy[0] / sent["seconds"], 3),
            "zero_loss": drops == 0 and got[0] == sent["samples"] and not lost
            and not dec.all_errors}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small sizes, 3 s per rate; no file")
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    quick = args.quick
    seconds = 3.0 if quick else args.seconds
    res = {"machine": f"{os.cpu_count()} cores",
           "note": "medians; decode on one core; sfacctd's whole run (start to exit)"}
    with tempfile.TemporaryDirectory(prefix="flowsieve-bench-sflow-") as tmp:
        work = Path(tmp)
        dgrams = pmacct_datagrams(work)
        print(f"pmacctd exported {len(dgrams)} datagrams of the sample capture", flush=True)
        print("decode (flowsieve vs sfacctd, the same export capture)...", flush=True)
        res["decode"] = bench_decode(work, dgrams, 20_000 if quick else 300_000,
                                     3 if quick else 5)
        d = res["decode"]
        print(f"  {d['samples']:,} samples: flowsieve {d['flowsieve_samples_per_s']:,}/s, "
              f"sfacctd {d['sfacctd_samples_per_s']:,}/s = {d['ratio']}x (sfacctd without its "
              f"{d['sfacctd_start_stop_s']} s of start and stop: "
              f"{d['sfacctd_samples_per_s_without_start_stop']:,}/s, "
              f"{d['ratio_without_start_stop']}x)", flush=True)
        rates = [100_000, 200_000, 300_000, 400_000, 600_000, 800_000]
        print(f"loopback receive, {seconds:.0f} s per rate...", flush=True)
        runs = []
        for rate in rates[:2] if quick else rates:
            r = load_run(dgrams, rate, seconds, work)
            runs.append(r)
            print(f"  {rate:>9,.0f}/s: sent {r['sent_samples']:,} at "
                  f"{r['achieved_send_rate']:,}/s, decoded {r['decoded_samples']:,}, kernel "
                  f"drops {r['kernel_drops']}, busy {r['receiver_busy_fraction']}", flush=True)
            if not r["zero_loss"]:
                break
        ok = [r["rate"] for r in runs if r["zero_loss"]]
        res["load"] = {"runs": runs, "seconds_per_rate": seconds,
                       "highest_zero_loss_rate": max(ok) if ok else 0}
    if not quick:
        print("wrote", write_result("sflow", res))


if __name__ == "__main__":
    main()
