"""Live capture on a Linux interface: an AF_PACKET socket with a TPACKET_V3 ring.

The kernel fills blocks of the memory-mapped ring with packets that passed the attached BPF
filter (the plan's kernel filter, see ``capture/bpf.py``); a numba kernel copies each ready
block's packets into a batch buffer, putting back VLAN tags the NIC or veth stripped (as libpcap
does), and hands the block back to the kernel. ``PACKET_STATISTICS`` gives the packets that
passed the filter and those dropped because the ring was full; the collector exports both.
"""

from __future__ import annotations

import ctypes
import mmap
import select
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from capture.bpf import DLT_EN10MB, compile_filter, detach
from capture.jit import kernel, kernel_inline
from capture.records import RawBatch, batch_arrays

SOL_PACKET = 263
PACKET_RX_RING = 5
PACKET_STATISTICS = 6
PACKET_VERSION = 10
TPACKET_V3 = 2
ETH_P_ALL = 0x0003
TP_STATUS_KERNEL, TP_STATUS_USER = 0, 1
TP_STATUS_VLAN_VALID = 1 << 4
TP_STATUS_VLAN_TPID_VALID = 1 << 6
PACKET_OUTGOING = 4
# ARPHRD (/sys/class/net/IF/type) -> DLT, for what AF_PACKET SOCK_RAW delivers
ARPHRD_TO_DLT = {1: DLT_EN10MB, 772: DLT_EN10MB, 65534: 101, 776: 101, 778: 101}


@dataclass
class RingConfig:
    block_size: int = 1 << 22  # 4 MiB blocks
    blocks: int = 64  # 256 MiB ring
    frame_size: int = 1 << 11  # a hint for the kernel; V3 packs packets of any size
    block_timeout_ms: int = 50  # a block is handed over when full or after this


@dataclass
class KernelStats:
    packets: int = 0  # passed the filter (delivered or dropped)
    drops: int = 0  # dropped: ring full
    freezes: int = 0  # times the queue froze


@kernel
def copy_block(ring, blk, out, fill, skip_outgoing, offset, caplen, wirelen, ts_ns, n0):
    """Copy the packets of the ring block at ``blk`` into ``out`` from ``fill``; return
    (records, new fill). Outgoing packets are skipped when asked. Stops early (records <
    block's) when out is full."""
    num = np.int64(ring[blk + 12]) | (np.int64(ring[blk + 13]) << 8) | \
        (np.int64(ring[blk + 14]) << 16) | (np.int64(ring[blk + 15]) << 24)
    first = np.int64(ring[blk + 16]) | (np.int64(ring[blk + 17]) << 8) | \
        (np.int64(ring[blk + 18]) << 16) | (np.int64(ring[blk + 19]) << 24)
    p = blk + first
    n = n0
    for _ in range(num):
        nxt = _le32(ring, p)
        sec = _le32(ring, p + 4)
        nsec = _le32(ring, p + 8)
        snap = _le32(ring, p + 12)
        ln = _le32(ring, p + 16)
        status = _le32(ring, p + 20)
        mac = np.int64(ring[p + 24]) | (np.int64(ring[p + 25]) << 8)
        tci = _le32(ring, p + 32)
        tpid = np.int64(ring[p + 36]) | (np.int64(ring[p + 37]) << 8)
        # struct sockaddr_ll follows the 48-byte header: sll_pkttype at byte 10 of it
        pkttype = ring[p + 48 + 10]
        if not (skip_outgoing and pkttype == PACKET_OUTGOING):
            vlan = (status & TP_STATUS_VLAN_VALID) != 0 and snap >= 12
            extra = 4 if vlan else 0
            src = p + mac
            if vlan:
                for k in range(12):
                    out[fill + k] = ring[src + k]
                if (status & TP_STATUS_VLAN_TPID_VALID) == 0 or tpid == 0:
                    tpid = 0x8100
                out[fill + 12] = (tpid >> 8) & 0xFF
                out[fill + 13] = tpid & 0xFF
                out[fill + 14] = (tci >> 8) & 0xFF
                out[fill + 15] = tci & 0xFF
                for k in range(12, snap):
                    out[fill + 4 + k] = ring[src + k]
            else:
                for k in range(snap):
                    out[fill + k] = ring[src + k]
            offset[n] = fill
            caplen[n] = snap + extra
            wirelen[n] = ln + extra
            ts_ns[n] = sec * 1_000_000_000 + nsec
            fill += snap + extra
            n += 1
        if nxt == 0:
            break
        p += nxt
    return n, fill


@kernel_inline
def _le32(b, p):
    return np.int64(b[p]) | (np.int64(b[p + 1]) << 8) | (np.int64(b[p + 2]) << 16) | \
        (np.int64(b[p + 3]) << 24)


def interface_linktype(iface: str) -> int:
    try:
        with open(f"/sys/class/net/{iface}/type") as fh:
            arphrd = int(fh.read())
    except OSError as e:
        raise OSError(f"interface {iface!r} does not exist") from e
    if arphrd not in ARPHRD_TO_DLT:
        raise OSError(f"interface {iface!r} has link type ARPHRD {arphrd}, which flowsieve "
                      "does not decode")
    return ARPHRD_TO_DLT[arphrd]


class LiveCapture:
    """Packets of one interface, as RawBatches, through a TPACKET_V3 ring.

    ``bpf`` is the plan's filter expression ('' = none); ``set_filter`` swaps it while
    capturing. ``skip_outgoing`` leaves out packets this host sends (``tcpdump -Q in``).
    """

    def __init__(self, iface: str, bpf: str = "", ring: RingConfig | None = None,
                 index: int = 0, promisc: bool = True, skip_outgoing: bool = False,
                 batch_size: int = 65536):
        self.iface, self.index = iface, index
        self.ring_cfg = ring or RingConfig()
        self.promisc, self.skip_outgoing = promisc, skip_outgoing
        self.batch_size = batch_size
        self.linktype = interface_linktype(iface)
        self.expr = bpf
        self.filter = None
        self.kernel = KernelStats()
        self._lock = threading.Lock()
        self.sock: socket.socket | None = None
        self._ring = None

    # -- life cycle
    def open(self) -> LiveCapture:
        r = self.ring_cfg
        if r.block_size % mmap.PAGESIZE or r.block_size < (1 << 16):
            raise ValueError("ring block_size must be a multiple of the page size, >= 64 KiB")
        # protocol 0: the socket receives nothing until bind() names the interface and
        # ETH_P_ALL, as libpcap does; opened with ETH_P_ALL it would queue (and count in
        # PACKET_STATISTICS) frames of every interface until then
        try:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        except PermissionError as e:
            raise PermissionError(e.errno, f"capturing on {self.iface} needs CAP_NET_RAW: run "
                                  "as root, or start flowsieve with an interpreter that holds "
                                  "it (README, \"Live capture without root\")") from e
        try:
            sock.setsockopt(SOL_PACKET, PACKET_VERSION, TPACKET_V3)
            # tpacket_req3: block_size, block_nr, frame_size, frame_nr, retire_blk_tov,
            # sizeof_priv, feature_req_word
            frames = r.block_size // r.frame_size * r.blocks
            req = struct.pack("IIIIIII", r.block_size, r.blocks, r.frame_size, frames,
                              r.block_timeout_ms, 0, 0)
            # the filter goes on before the ring fills, so no unfiltered packet gets in
            self.sock = sock
            self._attach(self.expr)
            sock.setsockopt(SOL_PACKET, PACKET_RX_RING, req)
            self._ring = mmap.mmap(sock.fileno(), r.block_size * r.blocks,
                                   mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            sock.bind((self.iface, ETH_P_ALL))
            if self.promisc:
                _promisc(sock, self.iface)
        except BaseException:
            sock.close()
            self.sock = None
            raise
        self._ring_np = np.frombuffer(self._ring, np.uint8)
        self._next_block = 0
        return self

    def close(self) -> None:
        if self.sock is not None:
            self.stats()
            self.sock.close()
            self.sock = None
        self._ring_np = None
        if self._ring is not None:
            try:
                self._ring.close()
            except BufferError:
                pass
            self._ring = None

    def __enter__(self) -> LiveCapture:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- filter and statistics
    def _attach(self, expr: str) -> None:
        f = compile_filter(expr, self.linktype)
        if f is None:
            detach(self.sock)
        else:
            f.attach(self.sock)
        self.filter, self.expr = f, expr

    def set_filter(self, expr: str) -> None:
        """Replace the kernel filter (atomic in the kernel; '' removes it)."""
        with self._lock:
            if self.sock is not None and expr != self.expr:
                self._attach(expr)
            self.expr = expr

    def stats(self) -> KernelStats:
        """Cumulative PACKET_STATISTICS (the kernel resets them on each read)."""
        with self._lock:
            if self.sock is not None:
                raw = self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 12)
                p, d, f = struct.unpack("III", raw)
                self.kernel.packets += p
                self.kernel.drops += d
                self.kernel.freezes += f
            return self.kernel

    # -- packets
    def batches(self, stop: threading.Event, poll_s: float = 0.1) -> Iterator[RawBatch | None]:
        """Batches of ready blocks; None when nothing arrived within ``poll_s`` (a tick)."""
        r = self.ring_cfg
        ring = self._ring_np
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN | select.POLLERR)
        out_cap = max(r.block_size * 2, 1 << 22)
        while not stop.is_set():
            out = np.empty(out_cap, np.uint8)
            offset, caplen, wirelen, ts, link, iface = batch_arrays(self.batch_size)
            n = fill = 0
            while n < self.batch_size:
                blk = self._next_block * r.block_size
                status = int.from_bytes(self._ring[blk + 8:blk + 12], "little")
                if not status & TP_STATUS_USER:
                    break
                num = int.from_bytes(self._ring[blk + 12:blk + 16], "little")
                if n + num > self.batch_size:
                    break
                # a block's packets take at most block_size, plus a put-back VLAN tag each
                if fill + r.block_size + 4 * num > out_cap:
                    break
                n, fill = copy_block(ring, blk, out, fill, self.skip_outgoing,
                                              offset, caplen, wirelen, ts, n)
                self._ring[blk + 8:blk + 12] = TP_STATUS_KERNEL.to_bytes(4, "little")
                self._next_block = (self._next_block + 1) % r.blocks
            if n:
                link[:n] = self.linktype
                iface[:n] = self.index
                yield RawBatch(out, offset[:n], caplen[:n], wirelen[:n], ts[:n], link[:n],
                               iface[:n])
                continue
            if not poller.poll(int(poll_s * 1000)):
                yield None


class _Mreq(ctypes.Structure):
    _fields_ = [("ifindex", ctypes.c_int), ("type", ctypes.c_ushort),
                ("alen", ctypes.c_ushort), ("address", ctypes.c_ubyte * 8)]


def _promisc(sock: socket.socket, iface: str) -> None:
    """PACKET_ADD_MEMBERSHIP PACKET_MR_PROMISC: promiscuous while the socket lives."""
    mreq = _Mreq(socket.if_nametoindex(iface), 1, 0)
    sock.setsockopt(SOL_PACKET, 1, bytes(mreq))
