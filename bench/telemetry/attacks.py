"""A seeded backbone-shaped capture with the telemetry applications' attacks injected at known
hosts and windows, and the applications' truth computed from the generator's own arrays (numpy
and pandas, never from what flowsieve read).

The background is ``bench.traces.backbone`` (Pareto flows, Zipf hosts, IPv4 and IPv6, TCP, DNS,
UDP, ICMP). The attacks use hosts of 10.0.0.0/8 (absent from the background) and one one-minute
window each:

========================  ============================================================
attack                    packets
========================  ============================================================
SYN flood                 SYNs to a victim's port 80 from spoofed sources, unanswered
heavy hitter              full-size TCP segments (ACK) from one host to another
superspreader             one SYN from one source to each of many destinations
port scan                 FIN probes from one source to many ports of one host
Slowloris                 many connections to a web server, each a few tiny segments
UDP flood                 UDP to a victim from many sources, never answered
DNS reflection            TXT responses to a victim from many resolvers
fast flux                 answers for one name with a different TTL each
SSH brute force           many sources to a server's port 22, every attempt alike
========================  ============================================================
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pandas as pd

from bench.traces import T0, _v4, backbone, write_pcap

PERIOD = 60
NET = 0x0A000000  # 10.0.0.0/8 (below the background's addresses): attackers, victims, resolvers
FLUX_NAME = "flux.example.net"
VERSION = 1  # of this generator: cached captures of another version are made again


def host(i: int) -> int:
    return NET + i


def _dns_response(name: str, qid: int, rtype: int, ttl: int, rdata: bytes) -> bytes:
    q = b"".join(bytes([len(lab)]) + lab.encode() for lab in name.split(".")) + b"\0"
    return (struct.pack(">HHHHHH", qid, 0x8180, 1, 1, 0, 0) + q + struct.pack(">HH", rtype, 1)
            + b"\xc0\x0c" + struct.pack(">HHIH", rtype, 1, ttl, len(rdata)) + rdata)


# DNS responses of the attacks: (owner name, type, TTL, wire bytes)
VARIANTS = [(f"amp{i}.example.org", 16, 300, _dns_response(
    f"amp{i}.example.org", 0x4242, 16, 300, b"\x20" + b"x" * 32)) for i in range(2)]
VARIANTS += [(FLUX_NAME, 1, 60 + 7 * k, _dns_response(
    FLUX_NAME, 0x5151, 1, 60 + 7 * k, bytes([203, 0, 113, k]))) for k in range(12)]


def _rows(n: int, window: int, rng, **cols) -> dict:
    """``n`` packets spread over one window, columns as the background's (scalars repeat)."""
    out = {"ts_us": (T0 + window * PERIOD) * 1_000_000 + np.sort(
        rng.integers(0, PERIOD * 1_000_000, n))}
    base = {"ipv": 4, "proto": 6, "ttl": 64, "qname": -1, "icmp_type": 0, "sport": 40000,
            "dport": 80, "dns_qr": -1, "flags": 0x10, "wirelen": 60, "dnsv": -1}
    for k, v in {**base, **cols}.items():
        if k in ("src", "dst"):
            out[k] = _v4(np.broadcast_to(np.asarray(v, np.int64), (n,)))
        else:
            out[k] = np.broadcast_to(np.asarray(v, np.int64), (n,)).copy()
    return out


def inject(rng) -> tuple[list[dict], dict[str, set]]:
    """The attack packets and, per application, the keys (window, …) it must report."""
    a, want = [], {}

    def add(app, key):
        want.setdefault(app, set()).add(key)

    # SYN flood on host 1, window 1: spoofed sources, nobody answers
    n = 6000
    a.append(_rows(n, 1, rng, src=host(10_000) + rng.integers(0, 60_000, n), dst=host(1),
                   sport=rng.integers(1024, 65536, n), flags=0x02))
    for app in ("new_tcp", "syn_flood", "completed_flows", "slowloris"):
        add(app, (1, host(1)))  # a SYN flood is also many connections of few bytes
    # heavy hitter: host 2 sends 1500-byte segments to host 3, window 2
    a.append(_rows(40_000, 2, rng, src=host(2), dst=host(3), sport=50000, dport=443,
                   flags=0x10, wirelen=1514))
    add("heavy_hitters", (2, host(2)))
    # superspreader: host 4 probes 4000 destinations once each, window 3
    a.append(_rows(4000, 3, rng, src=host(4), dst=host(100_000) + np.arange(4000),
                   dport=445, flags=0x02, sport=rng.integers(1024, 65536, 4000)))
    add("superspreader", (3, host(4)))
    # port scan: host 5 sends FIN probes to 3000 ports of host 6, window 0
    a.append(_rows(3000, 0, rng, src=host(5), dst=host(6), sport=61000,
                   dport=1 + rng.permutation(60_000)[:3000], flags=0x01))
    add("port_scan", (0, host(5)))
    # Slowloris: 1500 connections from host 7 to web server host 8, 4 tiny segments each
    n = 6000
    a.append(_rows(n, 4, rng, src=host(7), dst=host(8), sport=20000 + np.arange(n) % 1500,
                   dport=80, flags=0x18, wirelen=60))
    add("slowloris", (4, host(8)))
    # UDP flood on host 9 from 2000 sources, window 2
    n = 20_000
    a.append(_rows(n, 2, rng, src=host(20_000) + rng.integers(0, 2000, n), dst=host(9),
                   proto=17, sport=rng.integers(1024, 65536, n), dport=27015, flags=0,
                   wirelen=200))
    add("udp_asym", (2, host(9)))
    # DNS reflection on host 11: TXT responses from 500 resolvers, window 3
    n = 5000
    v = rng.integers(0, 2, n)
    a.append(_rows(n, 3, rng, src=host(30_000) + rng.integers(0, 500, n), dst=host(11),
                   proto=17, sport=53, dport=rng.integers(1024, 65536, n), flags=0, dns_qr=1,
                   dnsv=v, wirelen=42 + np.array([len(x[3]) for x in VARIANTS])[v]))
    add("dns_reflection", (3, host(11)))
    # fast flux: 240 answers for one name, 12 TTLs, window 1, from resolver host 12 to host 13
    n = 240
    v = 2 + np.arange(n) % 12
    a.append(_rows(n, 1, rng, src=host(12), dst=host(13), proto=17, sport=53,
                   dport=rng.integers(1024, 65536, n), flags=0, dns_qr=1, dnsv=v,
                   wirelen=42 + np.array([len(x[3]) for x in VARIANTS])[v]))
    add("dns_ttl", (1, FLUX_NAME))
    # SSH brute force on host 14 from 400 sources, every attempt 100 bytes of IP, window 4
    n = 4000
    a.append(_rows(n, 4, rng, src=host(40_000) + rng.integers(0, 400, n), dst=host(14),
                   sport=rng.integers(1024, 65536, n), dport=22, flags=0x18, wirelen=114))
    add("ssh_brute", (4, host(14), 100))
    add("slowloris", (4, host(14)))  # so is a brute force: short attempts from many ports
    return a, want


def generate(n: int = 400_000, seed: int = 20261124) -> tuple[dict, dict[str, set]]:
    """The background of ``n`` packets plus the attacks, in time order, and what each
    application must find."""
    rng = np.random.default_rng(seed)
    p = backbone(n, seed=seed)
    p["dnsv"] = np.full(len(p["ts_us"]), -1, np.int64)
    p["ipv"] = p["ipv"].astype(np.int64)
    v4 = p["ipv"] == 4
    bg = np.concatenate([p["src"][v4, 12:], p["dst"][v4, 12:]]).view(">u4").reshape(-1)
    assert not ((bg >> 24) == (NET >> 24)).any(), "the background uses 10.0.0.0/8"
    attacks, want = inject(rng)
    parts = [p, *attacks]
    p = {k: np.concatenate([np.asarray(x[k]) for x in parts]) for k in p}
    order = np.argsort(p["ts_us"], kind="stable")
    return {k: v[order] for k, v in p.items()}, want


def patch_dns(p: dict):
    """``write_pcap``'s hook: the attacks' DNS responses over the frames' UDP payload."""
    table = np.zeros((len(VARIANTS), max(len(v[3]) for v in VARIANTS)), np.uint8)
    for i, v in enumerate(VARIANTS):
        table[i, :len(v[3])] = np.frombuffer(v[3], np.uint8)

    def patch(m: np.ndarray, rows: np.ndarray) -> None:
        k = np.flatnonzero(p["dnsv"][rows] >= 0)
        if not len(k):
            return
        at = 14 + 20 + 8  # attack packets are IPv4
        width = min(table.shape[1], m.shape[1] - at)
        m[k, at:at + width] = table[p["dnsv"][rows][k], :width]
    return patch


def capture(n: int, cache: Path, seed: int = 20261124) -> tuple[Path, dict, dict[str, set]]:
    """The pcap (written once into ``cache``, 256 bytes captured per packet), the arrays and
    what each application must find."""
    cache.mkdir(parents=True, exist_ok=True)
    p, want = generate(n, seed)
    path = cache / f"telemetry-{n}-{seed}-{VERSION}.pcap"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        write_pcap(tmp, p, 256, patch=patch_dns(p))
        tmp.replace(path)
    return path, p, want


# ------------------------------------------------------------------------------------ truth
def _text(addrs: np.ndarray, ipv: np.ndarray) -> np.ndarray:
    """16-byte addresses as text (Python's ipaddress, once per distinct address)."""
    import ipaddress
    rows = np.ascontiguousarray(addrs).view(np.dtype((np.void, 16))).reshape(-1)
    uniq, inv = np.unique(rows, return_inverse=True)
    text = np.array([str(ipaddress.ip_address(bytes(u)[12:] if bytes(u)[:12] == b"\0" * 10 +
                                              b"\xff\xff" else bytes(u))) for u in uniq],
                    dtype=object)
    return text[inv.reshape(-1)]


def frame(p: dict) -> pd.DataFrame:
    """The generator's packets as DESIGN's fields (addresses as 32-bit integers for IPv4, as
    bytes for IPv6; DNS answers from the generator's own tables)."""
    ports = np.isin(p["proto"], (6, 17))  # ICMP has none (-1)
    df = pd.DataFrame({
        "window": (p["ts_us"] // 1_000_000 - T0) // PERIOD, "src": _text(p["src"], p["ipv"]),
        "dst": _text(p["dst"], p["ipv"]), "proto": p["proto"],
        "sport": np.where(ports, p["sport"], -1), "dport": np.where(ports, p["dport"], -1),
        "tcp_flags": np.where(p["proto"] == 6, p["flags"], -1),
        "ip_len": p["wirelen"] - 14, "dns_qr": p["dns_qr"]})
    # DNS answers: the background's responses answer A with TTL 3600 (bench.traces)
    resp = (p["dns_qr"] == 1) & (p["qname"] >= 0)
    an_type = np.where(resp, 1, -1)
    an_ttl = np.where(resp, 3600, -1)
    names = np.array([None] * len(df), dtype=object)
    from bench.traces import DNS_NAMES
    names[resp] = np.array(DNS_NAMES, dtype=object)[p["qname"][resp]]
    v = p["dnsv"] >= 0
    an_type[v] = np.array([x[1] for x in VARIANTS])[p["dnsv"][v]]
    an_ttl[v] = np.array([x[2] for x in VARIANTS])[p["dnsv"][v]]
    names[v] = np.array([x[0] for x in VARIANTS], dtype=object)[p["dnsv"][v]]
    df["an_type"], df["an_ttl"], df["an_name"] = an_type, an_ttl, names
    return df


def _pairs(s: pd.Series) -> dict:
    return {k if isinstance(k, tuple) else (k,): v for k, v in s.items()}


def truth(df: pd.DataFrame) -> dict[str, dict[tuple, tuple]]:
    """Every application's answer (apps.sql) computed with pandas: (t, key…) → values."""
    df = df.assign(t=df["window"] + T0 // PERIOD)
    tcp = df[df["proto"] == 6]
    udp = df[df["proto"] == 17]
    flags = tcp["tcp_flags"]
    syn = tcp[(flags & 18) == 2].groupby(["t", "dst"]).size()
    synack = tcp[(flags & 18) == 18].groupby(["t", "src"]).size().rename_axis(["t", "dst"])
    fin = tcp[(flags & 1) != 0].groupby(["t", "dst"]).size()
    out = {}
    out["new_tcp"] = syn[syn > 1000]
    b = df.groupby(["t", "src"])["ip_len"].sum()
    out["heavy_hitters"] = b[b > 10_000_000]
    d = df.groupby(["t", "src"])["dst"].nunique()
    out["superspreader"] = d[d > 2500]
    ports = tcp.groupby(["t", "src"])["dport"].nunique()
    out["port_scan"] = ports[ports > 2000]
    half = syn.sub(synack.reindex(syn.index, fill_value=0))
    out["syn_flood"] = half[half > 1000]
    still = syn.sub(fin.reindex(syn.index, fill_value=0))
    out["completed_flows"] = still[still > 1000]
    conns = tcp.groupby(["t", "dst"])["sport"].nunique()
    per = tcp.groupby(["t", "dst"])["ip_len"].sum() / conns
    keep = (conns > 1000) & (per < 500)
    out["slowloris"] = pd.Series(list(zip(conns[keep], per[keep], strict=True)),
                                 index=conns[keep].index, dtype=object)
    i = udp.groupby(["t", "dst"]).size()
    o = udp.groupby(["t", "src"]).size().rename_axis(["t", "dst"])
    excess = i.sub(o.reindex(i.index, fill_value=0))
    out["udp_asym"] = excess[excess > 5000]
    refl = udp[(udp["sport"] == 53) & (df.loc[udp.index, "dns_qr"] == 1)
               & (df.loc[udp.index, "an_type"] == 16)].groupby(["t", "dst"])["src"].nunique()
    out["dns_reflection"] = refl[refl > 100]
    ttl = df[(df["dns_qr"] == 1) & df["an_name"].notna()].groupby(["t", "an_name"])[
        "an_ttl"].nunique()
    out["dns_ttl"] = ttl[ttl > 4]
    ssh = tcp[tcp["dport"] == 22].groupby(["t", "dst", "ip_len"])["src"].nunique()
    out["ssh_brute"] = ssh[ssh > 100]
    return {app: {k: v if isinstance(v, tuple) else (v,) for k, v in _pairs(s).items()}
            for app, s in out.items()}


# each application's output columns: its key, then its values (apps.sql)
COLUMNS = {
    "new_tcp": (("t", "dst_ip"), ("syns",)), "heavy_hitters": (("t", "src_ip"), ("bytes",)),
    "superspreader": (("t", "src_ip"), ("dsts",)), "port_scan": (("t", "src_ip"), ("ports",)),
    "syn_flood": (("t", "host"), ("half_open",)), "completed_flows": (("t", "host"), ("open",)),
    "slowloris": (("t", "host"), ("conns", "per_conn")), "udp_asym": (("t", "host"), ("excess",)),
    "dns_reflection": (("t", "dst_ip"), ("resolvers",)),
    "dns_ttl": (("t", "dns_an_name"), ("ttls",)),
    "ssh_brute": (("t", "dst_ip", "ip_len"), ("srcs",)),
}


def expected_keys(want: dict[str, set]) -> dict[str, set]:
    """The injected attacks as the applications' keys: (minute, host text or name, …)."""
    import ipaddress
    out = {}
    for app, keys in want.items():
        out[app] = {(T0 // PERIOD + k[0], *(str(ipaddress.ip_address(x)) if i == 0 and
                                            isinstance(x, int) else x
                                            for i, x in enumerate(k[1:]))) for k in keys}
    return out
