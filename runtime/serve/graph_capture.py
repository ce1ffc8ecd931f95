"""One CUDA graph capture at a time in the process, on a stream of its own, checking only its own thread.

A server captures from two threads: the engine's decode graphs (``cuda_graphs``) and the kernel tuner's
timing graphs (``kernel_tuning.graph_timer``), while the cache's loader thread pins host memory and copies
variants to the device. ``torch.cuda.graph`` as it comes does not allow that:

- all its users share one capture stream, and torch documents that only one capture may be underway
  in a process at a time;
- by default (``capture_error_mode="global"``) a capture makes the other threads' potentially unsafe
  CUDA calls fail while it lasts: a ``cudaMalloc``, a pinned host allocation, a device synchronisation;
- when ``capture_end`` raises (an invalidated capture), its exit never restores the thread's stream,
  and the thread's later work runs on the capture stream;
- every capture synchronises the device and empties both allocator caches, so the steps after it
  allocate device and pinned memory afresh (a server with many batch compositions captures often).

:func:`capture` serialises captures with a process-wide lock, gives each device one capture stream,
checks only the capturing thread's calls (``thread_local``), always restores the thread's stream and
ends the capture, and leaves the caches alone. Each graph gets its own memory pool, as with
``torch.cuda.graph``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_LOCK = threading.Lock()
_STREAMS: dict[int, torch.cuda.Stream] = {}


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph) -> Iterator[None]:
    """Capture the CUDA work of the ``with`` body on the current device into ``graph`` (module docstring).

    The body's kernels run at replay, on the stream that replays; tensors it allocates live in the
    graph's private pool. An exception in the body ends the capture and propagates.
    """
    dev = torch.cuda.current_device()
    with _LOCK:
        stream = _STREAMS.get(dev)
        if stream is None:
            stream = _STREAMS[dev] = torch.cuda.Stream(dev)
        prev = torch.cuda.current_stream(dev)
        torch.cuda.set_stream(stream)
        try:
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                yield
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the body's error is the one to report
                    graph.capture_end()
                raise
            graph.capture_end()
        finally:
            torch.cuda.set_stream(prev)
