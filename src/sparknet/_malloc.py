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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap (glibc's largest allowed value)."""
TRIM_THRESHOLD = 128 << 20
"""Free memory at the heap's top up to this size is kept, not returned."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's malloc thresholds once per process; whether they are set (``False``: not glibc)."""
    global _done
    if _done is None:
        _done = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                mallopt = libc.mallopt
            except (OSError, AttributeError):  # musl has no mallopt
                return False
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                       TRIM_THRESHOLD))
    return _done
