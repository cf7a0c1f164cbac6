"""Compile a filter expression to classic BPF with libpcap and attach it to a socket.

libpcap (``libpcap0.8`` on Debian, a system library) compiles the expression for a link type
with ``pcap_compile`` on a dead handle; the instructions are attached with ``SO_ATTACH_FILTER``,
which replaces a running filter atomically. ``matches`` runs a compiled program on packet bytes
with libpcap's own interpreter (``bpf_filter``), for tests and for ``flowsieve plan``.

For Ethernet the expression is widened by a clause that passes frames whose EtherType is a VLAN
tag or MPLS label: BPF reads fixed offsets of untagged frames, the unpack kernel walks tags.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import socket
from functools import lru_cache

from capture.errors import FilterError

SO_ATTACH_FILTER = 26
SO_DETACH_FILTER = 27
BPF_MAXINSNS = 4096
DLT_EN10MB = 1
TAGGED_ETHERTYPES = (0x8100, 0x88A8, 0x9100, 0x8847, 0x8848)


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("bf_len", ctypes.c_uint), ("bf_insns", ctypes.POINTER(_Insn))]


@lru_cache(maxsize=1)
def _libpcap():
    name = ctypes.util.find_library("pcap") or "libpcap.so.0.8"
    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        raise FilterError("libpcap is needed to compile kernel filters (apt-get install -y "
                          "libpcap0.8), or turn the source's bpf option off",
                          kind="no_libpcap") from e
    lib.pcap_open_dead.restype = ctypes.c_void_p
    lib.pcap_open_dead.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.pcap_compile.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Program), ctypes.c_char_p,
                                 ctypes.c_int, ctypes.c_uint32]
    lib.pcap_geterr.restype = ctypes.c_char_p
    lib.pcap_geterr.argtypes = [ctypes.c_void_p]
    lib.pcap_freecode.argtypes = [ctypes.POINTER(_Program)]
    lib.pcap_close.argtypes = [ctypes.c_void_p]
    lib.bpf_filter.restype = ctypes.c_uint
    lib.bpf_filter.argtypes = [ctypes.POINTER(_Insn), ctypes.c_char_p, ctypes.c_uint,
                               ctypes.c_uint]
    return lib


def link_expression(expr: str, linktype: int) -> str:
    """The plan's expression as compiled for a link type ('' = no filter)."""
    if not expr:
        return ""
    if linktype == DLT_EN10MB:
        tags = " or ".join(f"ether proto 0x{t:04x}" for t in TAGGED_ETHERTYPES)
        return f"({expr}) or {tags}"
    return expr


class Filter:
    """A compiled classic BPF program (a copy owned by Python)."""

    def __init__(self, expr: str, linktype: int = DLT_EN10MB, snaplen: int = 262144):
        self.expr = expr
        self.linktype = linktype
        lib = _libpcap()
        handle = lib.pcap_open_dead(linktype, snaplen)
        prog = _Program()
        try:
            if lib.pcap_compile(handle, ctypes.byref(prog), expr.encode(), 1, 0xFFFFFFFF) != 0:
                raise FilterError(f"bad filter expression {expr!r}: "
                                  f"{lib.pcap_geterr(handle).decode(errors='replace')}",
                                  kind="bad_filter")
            n = prog.bf_len
            if n > BPF_MAXINSNS:
                lib.pcap_freecode(ctypes.byref(prog))
                raise FilterError(f"filter has {n} instructions, the kernel takes at most "
                                  f"{BPF_MAXINSNS}", kind="filter_too_long")
            self.insns = (_Insn * n)(*[prog.bf_insns[i] for i in range(n)])
            lib.pcap_freecode(ctypes.byref(prog))
        finally:
            lib.pcap_close(handle)

    def __len__(self) -> int:
        return len(self.insns)

    def matches(self, packet: bytes, wirelen: int | None = None) -> bool:
        """libpcap's interpreter on one packet."""
        return _libpcap().bpf_filter(self.insns, packet, wirelen or len(packet),
                                     len(packet)) != 0

    def attach(self, sock: socket.socket) -> None:
        """Attach to (or replace on) a socket; the kernel copies the program."""

        class _Fprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]

        fprog = _Fprog(len(self.insns), self.insns)
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(fprog))


def compile_filter(expr: str, linktype: int = DLT_EN10MB) -> Filter | None:
    """The plan's expression, widened for the link type and compiled (None = no filter)."""
    full = link_expression(expr, linktype)
    return Filter(full, linktype) if full else None


def detach(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
    except OSError:
        pass  # no filter attached
