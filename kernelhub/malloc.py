"""Process-wide allocator tuning for processes that relay kernel output (the gateway)."""

from __future__ import annotations

import contextlib
import ctypes

_M_MMAP_THRESHOLD = -3


def pin_mmap_threshold(size: int = 256 * 1024) -> None:
    """Outputs arrive from kernels in messages of up to 1 MiB. glibc raises its mmap
    threshold after such blocks are freed, after which they come from heap arenas that
    fragment and never shrink: RSS would keep the high-water mark of the largest output.
    A fixed threshold keeps big blocks mmapped, so freeing them returns the memory."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to tune
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, size)
