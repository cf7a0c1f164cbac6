"""The numba compile settings of every kernel in flowsieve, in one place.

Every kernel is cached on disk (``cache=True``: a process compiles a kernel once per machine,
not once per start) and releases the GIL (``nogil``: the read-ahead thread unpacks while the
engine runs the previous batch). Kernels that allocate nothing are compiled without numba's
runtime (``_nrt=False``): with it, every helper inlined into a loop that took an array counted
a reference to it and gave it back, two atomic operations per call and packet (the backbone
bench's unpacking: 127 ns per packet with it, 40 without). A helper called inside a packet
loop is inlined (``inline="always"``). So four decorators:

- ``kernel``: a loop over a batch that allocates nothing;
- ``kernel_inline``: a helper of such loops;
- ``allocating``: a kernel that makes arrays (numba's runtime on);
- ``allocating_inline``: a helper of those.

and ``prefetch``, a cache hint a kernel may give, and ``readonly``, the one type of the bytes
kernels read.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

kernel = nb.njit(cache=True, nogil=True, _nrt=False)
kernel_inline = nb.njit(cache=True, nogil=True, _nrt=False, inline="always")
allocating = nb.njit(cache=True, nogil=True)
allocating_inline = nb.njit(cache=True, nogil=True, inline="always")


def readonly(a: np.ndarray) -> np.ndarray:
    """``a`` as a read-only view (no copy). numba compiles an overload per argument type, and
    a read-only array is a type of its own: the bytes kernels only read (packets, datagrams,
    exporter addresses) are passed read-only whatever their source (a mapped file's and a
    received datagram's are; a pipe's, a live ring's copy and a held datagram's are not), so
    each such kernel has one overload, not two (a NetFlow or sFlow decoder's takes 6-9 s to
    compile; ``flowsieve prepare`` compiles them at install)."""
    if not a.flags.writeable:
        return a
    view = a.view()
    view.flags.writeable = False
    return view


@intrinsic
def prefetch(typingctx, arr, idx):
    """Ask for the cache line of ``arr[idx]`` ahead of its use (LLVM's ``prefetch``: a read,
    kept in the outer caches): a loop that will load from a large table at addresses it can
    compute some iterations before keeps more misses in flight than the processor finds by
    itself (the enrichment look-ups: 31 to 23 ns a tuple with the caches evicted between
    batches)."""
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]],
                                       wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 1),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return sig, codegen
