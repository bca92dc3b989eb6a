"""Keep freed memory in the process for the next training step, instead of handing it back to the OS.

glibc's malloc serves a block of more than its ``mmap`` threshold (128 KiB, raised as such
blocks are freed) with a fresh ``mmap`` and trims the heap back past another threshold: a
training step's activations and gradients (LeNet's first convolution alone is 2.9 MB at batch
64) are then mapped, touched page by page and unmapped again every step. For LeNet on one
thread that is about 2,000 minor page faults a step and a fifth of the step's time
(``benchmarks/malloc_steps.py``).
:func:`keep_freed_memory` sets both thresholds so such blocks come from the heap and stay there
(the process keeps its peak heap: what it needed once, it needs again next step). It is called
where sparknet trains: its executors' Python workers, the daemon that forks them, its command
line and a fit's driver. Where the C library is not glibc it is a no-op.

A sharded replica's rank needs the opposite (:func:`large_blocks_mapped`): FSDP2 gathers each layer's whole weights
and gradients into fresh blocks of megabytes every step, and a heap that keeps every freed block grows with them
(bare FSDP2 over gloo, 16 layers of 2,048: a rank's resident memory 1.45 GiB, 12 copies of the half it holds, where
a fixed threshold of 128 KiB gives 0.66 GiB; ``benchmarks/worker_memory.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import ctypes.util
import sys

__all__ = ["keep_freed_memory", "large_blocks_mapped", "with_huge_pages", "MMAP_THRESHOLD", "TRIM_THRESHOLD",
           "MAPPED_THRESHOLD", "TUNABLES_ENV"]

MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap (glibc's largest allowed value)."""
TRIM_THRESHOLD = 128 << 20
"""Free memory at the heap's top up to this size is kept, not returned."""
MAPPED_THRESHOLD = 128 << 10
"""Blocks over this size are mapped on their own and unmapped when freed (glibc's default threshold, held fixed:
glibc raises its own as such blocks are freed, and the heap then keeps them)."""
TUNABLES_ENV, _HUGE_PAGES = "GLIBC_TUNABLES", "glibc.malloc.hugetlb"
"""glibc reads its malloc tunables from this variable as a process starts; ``glibc.malloc.hugetlb=1`` asks the kernel
for transparent huge pages for what malloc maps (``madvise``; glibc 2.35 on, ignored before)."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_done: bool | None = None


@functools.cache
def _libc():
    """glibc's ``mallopt`` and ``malloc_trim``, or ``None`` where the C library is not glibc (looked up once a
    process, not at every sharded rank's task)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):  # musl has no mallopt
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return mallopt, trim


def keep_freed_memory() -> bool:
    """Set glibc's malloc thresholds once per process; whether they are set (``False``: not glibc)."""
    global _done
    if _done is None:
        _done = False
        if (calls := _libc()) is not None:
            mallopt, _ = calls
            _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                       TRIM_THRESHOLD))
    return _done


@contextlib.contextmanager
def large_blocks_mapped():
    """Within the block, every block over :data:`MAPPED_THRESHOLD` is mapped on its own and handed back to the OS when
    freed, and the free memory the heap kept is handed back first (``malloc_trim``); after it, the thresholds are
    :func:`keep_freed_memory`'s again where it had set them (a reused Python worker's next task). A no-op where the C
    library is not glibc."""
    calls = _libc()
    if calls is None:
        yield
        return
    mallopt, trim = calls
    keep_freed_memory()  # set first where it was not (a worker of a daemon other than sparknet's): a later call inside
    # the block then changes nothing
    mallopt(_M_MMAP_THRESHOLD, MAPPED_THRESHOLD)
    trim(0)
    try:
        yield
    finally:
        if _done:
            mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def with_huge_pages(tunables: str | None) -> str:
    """:data:`TUNABLES_ENV`'s value with ``glibc.malloc.hugetlb=1`` added, for the processes Spark starts for
    sparknet's Python workers: each block a sharded rank maps (:func:`large_blocks_mapped`) is then faulted in 2 MiB
    at a time, not 4 KiB (bare FSDP2 over gloo, 16 layers of 2,048: a step 1.71 s with the blocks mapped, 1.19 s with
    huge pages, 0.99 s with the blocks kept). A value the user gave for it is kept."""
    parts = [t for t in (tunables or "").split(":") if t]
    if not any(t.split("=", 1)[0] == _HUGE_PAGES for t in parts):
        parts.append(f"{_HUGE_PAGES}=1")
    return ":".join(parts)
