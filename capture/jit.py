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
"""

from __future__ import annotations

import numba as nb

kernel = nb.njit(cache=True, nogil=True, _nrt=False)
kernel_inline = nb.njit(cache=True, nogil=True, _nrt=False, inline="always")
allocating = nb.njit(cache=True, nogil=True)
allocating_inline = nb.njit(cache=True, nogil=True, inline="always")
