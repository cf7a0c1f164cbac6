"""Fuzz target of the NetFlow/IPFIX decoder (issue 5): ``--inputs`` (default 120k) mutated real
exports (byte flips, cuts, insertions, 16-bit length/id fields set to edge values), decoded in
batches by one long-lived decoder that learns templates from the seeds. Nothing may raise or
hang; every rejected input is counted by reason. Writes bench/results/netflow_fuzz.json."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_result  # noqa: E402

from capture.netflow import Datagrams, Decoder  # noqa: E402

DATA = ROOT / "tests" / "data" / "netflow"
EDGES = (0, 1, 3, 4, 255, 256, 65535)


def seeds() -> list[bytes]:
    out = []
    for f in sorted((DATA / "python-netflow-hex").glob("*.hex")):
        out += [bytes.fromhex(x.strip()) for x in f.read_text().splitlines() if x.strip()]
    for f in sorted((DATA / "logstash-dat").glob("*.dat")):
        out.append(f.read_bytes())
    return out


def mutate(rng: np.random.Generator, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(int(rng.integers(1, 9))):
        op = int(rng.integers(0, 4))
        pos = int(rng.integers(0, max(1, len(b))))
        if op == 0 and b:
            b[pos] = int(rng.integers(0, 256))
        elif op == 1:
            del b[pos:]
        elif op == 2:
            b[pos:pos] = rng.integers(0, 256, int(rng.integers(1, 65))).astype(np.uint8).tobytes()
        elif op == 3 and len(b) > pos + 2:
            v = EDGES[int(rng.integers(0, len(EDGES)))] if rng.random() < 0.7 else \
                int(rng.integers(0, 65536))
            b[pos:pos + 2] = v.to_bytes(2, "big")
    return bytes(b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", type=int, default=120_000)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="10k inputs; no file")
    args = ap.parse_args()
    n = 10_000 if args.quick else args.inputs
    rng = np.random.default_rng(args.seed)
    pool = seeds()
    d = Decoder(pending_max_bytes=1 << 20)
    d.decode(Datagrams.from_payloads(pool, "192.0.2.1", 0))
    t0 = time.perf_counter()
    records = 0
    done = 0
    batch = 1000
    while done < n:
        k = min(batch, n - done)
        inputs = [mutate(rng, pool[int(rng.integers(0, len(pool)))]) for _ in range(k)]
        exporters = rng.integers(1, 5)  # a few exporters, so state is shared and not
        dg = Datagrams.from_payloads(inputs, f"192.0.2.{exporters}", done * 1_000_000)
        records += len(d.decode(dg))
        done += k
    d.finish()
    secs = time.perf_counter() - t0
    res = {"inputs": n, "seconds": round(secs, 1), "records_decoded": records,
           "rejected_by_reason": dict(sorted(d.errors.items())), "crashes": 0}
    print(res)
    if not args.quick:
        print("wrote", write_result("netflow_fuzz", res))


if __name__ == "__main__":
    main()
