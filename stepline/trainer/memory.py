"""CPU training: keep freed tensor memory in the process instead of handing it back to the kernel.

glibc's malloc serves large blocks with mmap and unmaps them on free, and trims the heap once enough
of its top is free. A training step allocates and frees gigabytes of activations, gradients and
A × vocab logits, so under the default settings every step faults all of those pages back in, zero-filled
by the kernel: measured on SmolLM2-135M, 0.7–1.0 million minor page faults and 3–7 s of system time per
update of 4 sessions × ~565 tokens (docs/reference.md, Trainer), against 0.2–30 thousand faults and 0.1 s
once freed memory stays in the heap. The cost is that the resident size stays at its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_LARGEST = 2**31 - 1  # mallopt takes an int: blocks up to 2 GiB come from the heap


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where malloc is not glibc's."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_MMAP_THRESHOLD, _LARGEST), (_M_TRIM_THRESHOLD, _LARGEST), (_M_TOP_PAD, 64 * 2**20)))
