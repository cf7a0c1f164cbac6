"""The UDP listener of flow exports: sockets on IPv4 and IPv6 addresses, drained into batches.

Each datagram is received straight into the batch buffer (``recvmsg_into``), with its exporter
address and arrival time. ``SO_RXQ_OVFL`` makes the kernel attach its per-socket drop counter to
every datagram, and ``/proc/net/udp`` holds the same counter per socket (read whenever the
sockets are idle), so receive-buffer overflows are counted (``stats``). The receive buffer is made
large (``SO_RCVBUFFORCE`` when permitted, else ``SO_RCVBUF`` up to ``net.core.rmem_max``).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from capture.fields import ip_bytes
from capture.netflow import Datagrams

log = logging.getLogger("flowsieve.capture")

SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
MAX_DATAGRAM = 65535


def parse_address(text: str) -> tuple[int, str, int]:
    """'0.0.0.0:2055', '[::]:4739', ':2055' (all IPv4) -> (family, host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"listen address {text!r} is not HOST:PORT (e.g. 0.0.0.0:2055, "
                         "[::]:4739)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        family = socket.AF_INET6
    else:
        host = host or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.inet_pton(family, host)
    except OSError:
        raise ValueError(f"listen address {text!r}: {host!r} is not an IP address") from None
    return family, host, int(port)


@dataclass
class ListenerStats:
    datagrams: int = 0
    bytes: int = 0
    kernel_drops: int = 0  # receive-buffer overflows (SO_RXQ_OVFL), all sockets
    # receive failures by reason: "truncated" (a datagram larger than its 64 KiB slot) or the
    # errno name of a failed recvmsg (ECONNREFUSED after an ICMP error, ENOMEM, …)
    errors: dict[str, int] = field(default_factory=dict)

    def count(self, reason: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1


class FlowListener:
    """UDP sockets bound to ``addresses``; ``batches`` yields Datagrams (None as a tick)."""

    def __init__(self, addresses: list[str], rcvbuf: int = 32 << 20,
                 batch_bytes: int = 4 << 20, batch_datagrams: int = 4096):
        self.specs = [parse_address(a) for a in addresses]
        self.rcvbuf = rcvbuf
        self.batch_bytes = max(batch_bytes, 2 * MAX_DATAGRAM)
        self.batch_datagrams = batch_datagrams
        self.socks: list[socket.socket] = []
        self.bound: list[tuple[str, int]] = []
        self.stats = ListenerStats()
        self._drops: dict[int, int] = {}
        self._addr_cache: dict[str, bytes] = {}

    def open(self) -> None:
        for family, host, port in self.specs:
            s = socket.socket(family, socket.SOCK_DGRAM)
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, self.rcvbuf)
                except OSError:  # without CAP_NET_ADMIN: capped by net.core.rmem_max
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
                    self._clamped(s, host, port)
                s.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
                s.bind((host, port))
                s.setblocking(False)
            except OSError as e:
                s.close()
                self.close()
                raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from e
            self.socks.append(s)
            self.bound.append(s.getsockname()[:2])

    def _clamped(self, s: socket.socket, host: str, port: int) -> None:
        """Say so when the kernel gave a smaller receive buffer than asked for (Linux reports
        twice what it granted): a burst of exports overflows it sooner, counted as
        ``socket_overflow``."""
        got = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 2
        if got < self.rcvbuf:
            log.warning("listening on %s:%d: the receive buffer is %d bytes, not the %d asked "
                        "for (net.core.rmem_max caps it without CAP_NET_ADMIN): raise "
                        "net.core.rmem_max or grant CAP_NET_ADMIN (README, \"Live capture "
                        "without root\")", host, port, got, self.rcvbuf)

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks = []

    def proc_drops(self) -> dict[int, int]:
        """Per socket fd, the kernel's drop counter from /proc/net/udp{,6} (it also counts
        drops that no later datagram reported through SO_RXQ_OVFL)."""
        inodes = {os.fstat(s.fileno()).st_ino: s.fileno() for s in self.socks}
        out: dict[int, int] = {}
        for name in ("/proc/net/udp", "/proc/net/udp6"):
            try:
                with open(name) as f:
                    next(f, None)
                    for line in f:
                        cols = line.split()
                        if len(cols) >= 13 and int(cols[9]) in inodes:
                            out[inodes[int(cols[9])]] = int(cols[-1])
            except OSError:
                continue
        return out

    def update_drops(self) -> int:
        for fd, v in self.proc_drops().items():
            self._drops[fd] = max(self._drops.get(fd, 0), v)
        self.stats.kernel_drops = sum(self._drops.values())
        return self.stats.kernel_drops

    def receive_buffer(self) -> int:
        """The kernel's receive buffer of the first socket (bytes, as getsockopt reports)."""
        return self.socks[0].getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) if self.socks \
            else 0

    def _exporter(self, host: str) -> bytes:
        b = self._addr_cache.get(host)
        if b is None:
            b = ip_bytes(host)
            if len(self._addr_cache) > 65536:
                self._addr_cache.clear()
            self._addr_cache[host] = b
        return b

    def batches(self, stop: threading.Event, poll_s: float = 0.2,
                linger_s: float = 0.05) -> Iterator[Datagrams | None]:
        """Batches of datagrams as they arrive: a batch closes when full, or ``linger_s`` after
        its first datagram once the sockets are drained."""
        if not self.socks:
            self.open()
        poller = select.poll()
        by_fd = {s.fileno(): s for s in self.socks}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        cmsg_size = socket.CMSG_SPACE(4)
        buf = bytearray(self.batch_bytes)
        view = memoryview(buf)
        while not stop.is_set():
            offs: list[int] = []
            lens: list[int] = []
            addrs: list[bytes] = []
            stamps: list[int] = []
            pos = 0
            first = 0.0
            while True:
                ready = poller.poll(int((poll_s if not offs else linger_s) * 1000))
                if not ready:
                    break
                for fd, _ in ready:
                    s = by_fd[fd]
                    now = time.time_ns()
                    while (pos + MAX_DATAGRAM <= len(buf)
                           and len(offs) < self.batch_datagrams):
                        try:
                            nbytes, anc, flags, addr = s.recvmsg_into(
                                [view[pos:pos + MAX_DATAGRAM]], cmsg_size)
                        except BlockingIOError:
                            break
                        except OSError as e:  # counted, never swallowed; the socket lives on
                            self.stats.count(errno.errorcode.get(e.errno, f"errno_{e.errno}"))
                            break
                        for level, kind, data in anc:
                            if level == socket.SOL_SOCKET and kind == SO_RXQ_OVFL and \
                                    len(data) >= 4:
                                self._drops[fd] = struct.unpack("=I", data[:4])[0]
                        if flags & socket.MSG_TRUNC:
                            self.stats.count("truncated")
                            continue
                        offs.append(pos)
                        lens.append(nbytes)
                        addrs.append(self._exporter(addr[0]))
                        stamps.append(now)
                        pos += nbytes
                if not first and offs:
                    first = time.monotonic()
                if (pos + MAX_DATAGRAM > len(buf) or len(offs) >= self.batch_datagrams
                        or (offs and time.monotonic() - first >= linger_s)
                        or stop.is_set()):
                    break
            self.stats.kernel_drops = sum(self._drops.values())
            if not offs:
                self.update_drops()
                yield None
                continue
            self.stats.datagrams += len(offs)
            self.stats.bytes += pos
            yield Datagrams(np.frombuffer(bytes(view[:pos]), np.uint8),
                            np.array(offs, np.int64), np.array(lens, np.int32),
                            np.frombuffer(b"".join(addrs), np.uint8).reshape(-1, 16),
                            np.array(stamps, np.int64))
