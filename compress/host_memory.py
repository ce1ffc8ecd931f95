"""Host memory of a compression, flat in depth: the pages glibc keeps after a layer go back to the system.

Every layer allocates and frees the same large buffers (weights in fp32, Hessians, the solver's
blocks, the layer's activations) between many small ones. glibc keeps freed chunks in its heap for
reuse, and with the sizes interleaving the holes add up: the anonymous memory of a 2048/5632 synthetic
Llama's compression (4-bit 2:4, 16 x 128 calibration tokens) peaked at 2.8 GiB at 4 layers and 4.4 GiB
at 16. ``malloc_trim(0)`` after each layer returns every free page of every arena (the holes too, by
madvise): 0.7 GiB per layer there, in 35 ms; the 16-layer peak is then 3.0 GiB, 1% above the 4-layer
one plus the artifact's extra bytes. The next layer faults those pages back in: at 4 layers, the
medians of 4 alternating runs on 2 CPU cores were 79.6 s against 79.8 s without the trim in one
measurement and 80.5 s against 77.6 s in another (bench/compress_memory.py --repeats 4 --tree). The alternatives cost more: a low mmap threshold (``MALLOC_MMAP_THRESHOLD_=65536``, every
buffer its own mapping) made one 5632x2048 OBS solve 1.26x slower; the writer's parts held outside the
heap, or one malloc arena, left the growth as it was.
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
