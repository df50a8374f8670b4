"""`return_freed_heap()`: hand the heap pages that an open's transient buffers left free back
to the operating system.

Why: opening a large store reads its index into large temporary buffers (the journal, the
image, sort permutations). glibc's malloc raises its mmap threshold after the first large
free, so later large buffers come from the heap, and it keeps their pages when they are freed.
A no-op where there is no glibc.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def return_freed_heap() -> None:
    """Release free heap pages to the operating system (glibc `malloc_trim(0)`); the call
    takes the allocator's locks, so it is safe with other threads running."""
    fn = _malloc_trim()
    if fn is not None:
        fn(0)
