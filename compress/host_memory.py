"""Host memory of a compression, flat in depth: the pages glibc keeps after a layer go back to the system.

Every layer allocates and frees the same large buffers (weights in fp32, Hessians, the solver's
blocks, packed parts) between many small ones. glibc keeps freed chunks in its heaps for reuse; with
sizes interleaving, the holes add up, and the resident memory of a 2048/5632 synthetic Llama's
compression grew by 0.16 GB per layer (anonymous memory 2.8 GiB at 4 layers, 4.7 at 16).
``malloc_trim(0)`` after each layer returns every free page of every arena (the holes too, by
madvise), so the peak stays that of one layer. A low mmap threshold (every buffer its own mapping,
``MALLOC_MMAP_THRESHOLD_=65536``) was as flat but made the OBS solve of a 5632x2048 matrix 1.6-1.9x
slower on 2 cores (33 s against 58 s, two runs each; every temporary then costs a mapping and its page
faults); the trim runs once per layer and costs milliseconds.
"""

from __future__ import annotations

import ctypes
import sys

_trim = None


def release_freed_memory() -> bool:
    """``malloc_trim(0)``: hand every free page of the C heap back to the system (glibc on Linux; a
    no-op returning False elsewhere). Returns whether glibc released any memory."""
    global _trim
    if _trim is None:
        _trim = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
                fn = None
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
                _trim = fn
    return bool(_trim(0)) if _trim else False
