"""Export datagrams inside packet captures: the UDP payloads sent to the flow ports, found with
the one link-layer walk of capture/unpack.py (``decode --stream flows``, ``replay``)."""

from __future__ import annotations

import numpy as np

from capture.jit import kernel, readonly
from capture.netflow.batch import Datagrams
from capture.netflow.decoder import Decoder
from capture.unpack import _be16, link_walk

# UDP ports flow exporters send to by default (NetFlow 2055, 9995, 9996; IPFIX 4739)
DEFAULT_FLOW_PORTS: tuple[int, ...] = (2055, 4739, 9995, 9996)


@kernel
def _udp_payloads(buf, offset, caplen, linktype, ports, out_off, out_len, out_addr, out_rec):
    """UDP payloads sent to one of ``ports``, behind any link layer unpack knows (tags, labels,
    cooked, raw IP, loopback); IP fragments are skipped. Returns the number found."""
    n = 0
    for r in range(offset.shape[0]):
        e = offset[r] + caplen[r]
        et, p, _, _, _ = link_walk(buf, offset[r], e, linktype[r])
        if p < 0:
            continue
        if et == 0x0800:
            if e - p < 20 or (buf[p] >> 4) != 4:
                continue
            ihl = (np.int64(buf[p]) & 0xF) * 4
            if ihl < 20 or buf[p + 9] != 17 or (_be16(buf, p + 6) & 0x3FFF) != 0 or \
                    e - p < ihl + 8:
                continue
            for b in range(10):
                out_addr[n, b] = 0
            out_addr[n, 10] = 0xFF
            out_addr[n, 11] = 0xFF
            for b in range(4):
                out_addr[n, 12 + b] = buf[p + 12 + b]
            u = p + ihl
        elif et == 0x86DD:
            if e - p < 48 or (buf[p] >> 4) != 6:
                continue
            nh = buf[p + 6]
            u = p + 40
            while (nh == 0 or nh == 43 or nh == 60) and e - u >= 8:
                nh = buf[u]
                u += (np.int64(buf[u + 1]) + 1) * 8
            if nh != 17 or e - u < 8:
                continue
            for b in range(16):
                out_addr[n, b] = buf[p + 8 + b]
        else:
            continue
        dport = _be16(buf, u + 2)
        hit = False
        for k in range(ports.shape[0]):
            if ports[k] == dport:
                hit = True
        if not hit:
            continue
        ulen = _be16(buf, u + 4) - 8
        avail = e - (u + 8)
        out_off[n] = u + 8
        out_len[n] = min(ulen, avail) if ulen >= 0 else avail
        out_rec[n] = r
        n += 1
    return n


def export_datagrams(raw, ports) -> Datagrams:
    """The export datagrams of a batch of captured packets (UDP to the flow ports)."""
    m = len(raw)
    off, ln = np.empty(m, np.int64), np.empty(m, np.int32)
    addr, rec = np.zeros((m, 16), np.uint8), np.empty(m, np.int64)
    n = _udp_payloads(readonly(raw.buf), raw.offset, raw.caplen, raw.linktype,
                      np.array(list(ports), np.int64), off, ln, addr, rec)
    return Datagrams(raw.buf, off[:n], ln[:n], addr[:n], raw.ts_ns[rec[:n]])


def capture_flows(source, ports, decoder: Decoder | None = None, batch_size: int = 4096):
    """Flow records of a capture of export datagrams, batch by batch (``decode --stream flows``
    and ``replay``): the same decoder as the listener. ``source`` is what ``open_capture``
    takes, or a reader it returned."""
    from capture.pcap import open_capture
    decoder = decoder or Decoder()
    reader = source if hasattr(source, "stats") else open_capture(source, batch_size)
    for raw in reader:
        fb = decoder.decode(export_datagrams(raw, ports))
        if len(fb):
            yield fb
    decoder.finish()
