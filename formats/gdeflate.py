"""GDeflate, one bitstream with two backends: nvCOMP's CPU library and nvCOMP's GPU decoder.

A buffer is cut into chunks of at most ``PAGE_BYTES`` (64 KiB) and every chunk is compressed on its
own as one GDeflate page: the RAW bitstream that nvCOMP's batched GPU decoder takes, one chunk per
batch item (no nvCOMP header). Chunk framing (sizes, offsets, checksums) lives outside this module,
in ``deltazip.formats.chunked``.

CPU backend: ``libnvcomp_cpu.so.6`` from the PyPI package ``nvidia-libnvcomp-cu12`` or
``nvidia-libnvcomp-cu13`` (both ship it at the same place and neither needs CUDA; ``deltazip[cu12]`` /
``deltazip[cu13]`` install one with nvCOMP's GPU module for that CUDA major), bound with ctypes through its libdeflate-style C symbols
``libdeflate_gdeflate_compress / _decompress / _compress_bound``. The C++ entry points
``nvcomp::gdeflate::compressCPU / decompressCPU`` report errors by throwing C++ exceptions, which
must never cross a ctypes frame (the process would abort), so they are not used for real work.
ctypes releases the GIL for the duration of each call, so chunks are compressed and decompressed in
parallel threads, one compressor/decompressor object per thread (they hold mutable state).

Why the decoder is fed through a zero-padded scratch buffer: the reference GDeflate decoder refills
its 32 bit streams 4 bytes at a time without checking the end of the input page. On a well-formed
page that never reads past the end; on a malformed page it can. Callers must check sizes and
checksums before bytes get here (``chunked`` does); as a second line of defence each chunk is copied
into a per-thread buffer followed by ``READ_SLACK`` zero bytes, which bounds what a malformed page can
make the decoder read to memory we own. Output writes are bounded by the output size we pass.

GPU backend: ``nvidia.nvcomp.Codec(algorithm="GDeflate", bitstream_kind=RAW)``, imported lazily (the
module imports without a GPU; constructing a Codec needs CUDA). It decodes the chunks that the CPU
backend wrote straight into device memory.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from deltazip.formats.errors import ArtifactError

PAGE_BYTES = 1 << 16
"""Largest chunk (uncompressed bytes) one GDeflate page may hold; nvCOMP's GPU limit too."""
MAX_CHUNK_STORED = PAGE_BYTES + PAGE_BYTES // 8 + 1024
"""Largest compressed chunk this module writes or accepts (the library's own bound is 65,708)."""
MIN_LEVEL, MAX_LEVEL = 0, 12
# 12, the smallest: against 9 it saved 1.7% more of a 2-bit bf16 SmolLM2 artifact (27.14 -> 26.68 MB)
# for an encode of seconds inside a compression of minutes; decoding speed does not depend on it.
DEFAULT_LEVEL = 12
LIB_NAME = "libnvcomp_cpu.so.6"
ENV_LIB = "DELTAZIP_NVCOMP_CPU_LIB"
# Zero bytes after each chunk handed to the CPU decoder. A published audit of the reference decoder
# bounds its read-ahead past a page followed by zeros at 4 * (63 + ceil((20*O + 928 + 292416 +
# 2109) / 32)) bytes for O output bytes: 201,024 bytes for a 64 KiB page. 256 KiB covers it.
READ_SLACK = 256 * 1024

_SUCCESS, _BAD_DATA, _SHORT_OUTPUT, _INSUFFICIENT_SPACE = 0, 1, 2, 3
_RESULTS = {_BAD_DATA: "bad data", _SHORT_OUTPUT: "short output", _INSUFFICIENT_SPACE: "output too small"}


class CodecUnavailableError(ArtifactError):
    """The GDeflate library (CPU) or nvCOMP's GPU module cannot be loaded."""


class ChunkDecodeError(ValueError):
    """A chunk did not decode to its expected size; carries the chunk index and the reason."""

    def __init__(self, index: int, reason: str):
        # index -1: the batch failed as a whole (nvCOMP does not say which chunk)
        super().__init__(f"chunk {index}: {reason}" if index >= 0 else reason)
        self.index = index
        self.reason = reason


class _Page(ctypes.Structure):
    # struct libdeflate_gdeflate_{in,out}_page { void *data; size_t nbytes; }
    _fields_ = [("data", ctypes.c_void_p), ("nbytes", ctypes.c_size_t)]


def find_cpu_library() -> Path:
    """Path of ``libnvcomp_cpu.so.6``: ``$DELTAZIP_NVCOMP_CPU_LIB`` or the installed PyPI package.

    Raises:
        CodecUnavailableError: neither is there, with the install command that fixes it.
    """
    env = os.environ.get(ENV_LIB)
    if env:
        if not Path(env).is_file():
            raise CodecUnavailableError(f"${ENV_LIB} points to {env}, which does not exist")
        return Path(env)
    try:
        spec = importlib.util.find_spec("nvidia.libnvcomp")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            for sub in ("lib64", "lib", "bin"):
                p = Path(root) / sub / LIB_NAME
                if p.is_file():
                    return p
    raise CodecUnavailableError(
        f"GDeflate needs nvCOMP's CPU library {LIB_NAME}, shipped by the PyPI packages nvidia-libnvcomp-cu12 and "
        f"-cu13; {install_hint()} (or point ${ENV_LIB} at the file)")


class _Lib:
    """The ctypes view of the library's C symbols, loaded once and self-tested."""

    def __init__(self, path: Path):
        try:
            lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
        except OSError as e:
            raise CodecUnavailableError(f"cannot load {path}: {e}") from e
        self.path = path
        try:
            self.alloc_c = lib.libdeflate_alloc_gdeflate_compressor
            self.free_c = lib.libdeflate_free_gdeflate_compressor
            self.compress = lib.libdeflate_gdeflate_compress
            self.bound = lib.libdeflate_gdeflate_compress_bound
            self.alloc_d = lib.libdeflate_alloc_gdeflate_decompressor
            self.free_d = lib.libdeflate_free_gdeflate_decompressor
            self.decompress = lib.libdeflate_gdeflate_decompress
        except AttributeError as e:
            raise CodecUnavailableError(f"{path} lacks the GDeflate C symbols ({e}); reinstall it: "
                                        f"{install_hint()}") from e
        self.alloc_c.argtypes, self.alloc_c.restype = [ctypes.c_int], ctypes.c_void_p
        self.free_c.argtypes, self.free_c.restype = [ctypes.c_void_p], None
        self.compress.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(_Page),
                                  ctypes.c_size_t]
        self.compress.restype = ctypes.c_size_t
        self.bound.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
        self.bound.restype = ctypes.c_size_t
        self.alloc_d.argtypes, self.alloc_d.restype = [], ctypes.c_void_p
        self.free_d.argtypes, self.free_d.restype = [ctypes.c_void_p], None
        self.decompress.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Page), ctypes.c_size_t, ctypes.c_void_p,
                                    ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
        self.decompress.restype = ctypes.c_int
        npages = ctypes.c_size_t(0)
        # A NULL compressor is allowed: the bound does not depend on the level.
        self.page_bound = int(self.bound(None, PAGE_BYTES, ctypes.byref(npages)))
        if npages.value != 1 or not PAGE_BYTES <= self.page_bound <= MAX_CHUNK_STORED:
            raise CodecUnavailableError(f"{path}: unexpected GDeflate page bound {self.page_bound} "
                                        f"({npages.value} pages for {PAGE_BYTES} bytes)")
        # Room the compressor may write into per page. More than the library's own bound: an
        # incompressible page has been seen to overrun that bound slightly in other integrations.
        self.out_capacity = MAX_CHUNK_STORED


_lib: _Lib | None = None
_lib_lock = threading.Lock()


def cpu_library() -> _Lib:
    """The loaded CPU library; the first call loads it and runs a single-threaded self-test.

    The self-test also runs the library's lazy CPU-feature dispatch once, before any concurrent
    use: that dispatch writes process-wide globals without atomics.
    """
    global _lib
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is None:
            lib = _Lib(find_cpu_library())
            sample = np.frombuffer((b"deltazip gdeflate self-test " * 300)[:7000], dtype=np.uint8)
            try:
                blob, sizes = _compress_range(lib, sample, 0, 1, DEFAULT_LEVEL, PAGE_BYTES)
                out = np.empty_like(sample)
                _decompress_range(lib, np.frombuffer(blob, dtype=np.uint8), np.zeros(1, dtype=np.int64), sizes,
                                  out, 0, 1, PAGE_BYTES)
            except Exception as e:
                raise CodecUnavailableError(f"{lib.path}: GDeflate self-test failed ({e})") from e
            if not np.array_equal(out, sample):
                raise CodecUnavailableError(f"{lib.path}: GDeflate self-test did not round-trip")
            _lib = lib
    return _lib


# -- per-thread native objects -------------------------------------------------------------------

class _Native:
    """A native compressor/decompressor freed when its owner (a thread-local slot) goes away."""

    def __init__(self, ptr: int, free):
        if not ptr:
            raise MemoryError("GDeflate: allocating a (de)compressor failed")
        self.ptr, self._free = ptr, free

    def __del__(self):
        if self.ptr:
            self._free(self.ptr)
            self.ptr = 0


_tls = threading.local()


def _compressor(lib: _Lib, level: int) -> int:
    cache = getattr(_tls, "compressors", None)
    if cache is None:
        cache = _tls.compressors = {}
    if level not in cache:
        cache[level] = _Native(lib.alloc_c(level), lib.free_c)
    return cache[level].ptr


def _decoder_state(lib: _Lib) -> tuple[int, np.ndarray]:
    """This thread's decompressor and its zeroed scratch input buffer (chunk + READ_SLACK)."""
    st = getattr(_tls, "decoder", None)
    if st is None:
        scratch = np.zeros(lib.out_capacity + READ_SLACK, dtype=np.uint8)
        st = _tls.decoder = [_Native(lib.alloc_d(), lib.free_d), scratch, 0]
    return st[0].ptr, st


# -- worker functions (one contiguous range of chunks each) --------------------------------------

def _compress_range(lib: _Lib, data: np.ndarray, first: int, last: int, level: int,
                    chunk: int) -> tuple[bytes, np.ndarray]:
    """Compress chunks ``[first, last)`` of ``data``; returns their bytes back to back and sizes."""
    comp = _compressor(lib, level)
    out = np.empty(lib.out_capacity, dtype=np.uint8)
    page = _Page(out.ctypes.data, lib.out_capacity)
    base = data.ctypes.data
    parts, sizes = [], np.empty(last - first, dtype=np.int64)
    for i in range(first, last):
        lo = i * chunk
        n = min(chunk, data.size - lo)
        page.nbytes = lib.out_capacity
        total = lib.compress(comp, base + lo, n, ctypes.byref(page), 1)
        if total == 0 and level > 0:
            # Seen on real data (byte-grouped mantissas of an fp16 embedding delta): at levels >= 1
            # the library gives up on some incompressible chunks (nvCOMP's own compressCPU throws
            # there). Level 0 (stored blocks) always succeeds and any decoder reads it.
            page.nbytes = lib.out_capacity
            total = lib.compress(_compressor(lib, 0), base + lo, n, ctypes.byref(page), 1)
        if total == 0 or page.nbytes != total or total > lib.out_capacity:
            raise RuntimeError(f"GDeflate compression of chunk {i} failed (returned {total}, page {page.nbytes})")
        parts.append(out[:total].tobytes())
        sizes[i - first] = total
    return b"".join(parts), sizes


def _decompress_range(lib: _Lib, stored: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, out: np.ndarray,
                      first: int, last: int, chunk: int) -> None:
    """Decode chunks ``[first, last)`` into ``out`` (chunk ``i`` -> ``out[i*chunk : ...]``).

    Each chunk goes through this thread's scratch buffer, whose bytes past the chunk are zero.
    Raises ChunkDecodeError on the first chunk that fails or decodes to the wrong size.
    """
    dec, st = _decoder_state(lib)
    scratch: np.ndarray = st[1]
    cap = lib.out_capacity
    page = _Page(scratch.ctypes.data, 0)
    actual = ctypes.c_size_t(0)
    obase = out.ctypes.data
    for i in range(first, last):
        off, n = int(offsets[i]), int(sizes[i])
        want = min(chunk, out.size - i * chunk)
        if n <= 0 or n > cap:
            raise ChunkDecodeError(i, f"compressed size {n} outside 1..{cap}")
        scratch[:n] = stored[off:off + n]
        dirty = st[2]
        if dirty > n:  # bytes of a longer previous chunk: zero them so the slack stays zero
            scratch[n:dirty] = 0
        st[2] = n
        page.nbytes = n
        actual.value = 0  # the library adds to it instead of assigning
        res = lib.decompress(dec, ctypes.byref(page), 1, obase + i * chunk, want, ctypes.byref(actual))
        if res != _SUCCESS:
            raise ChunkDecodeError(i, f"GDeflate decoder reports {_RESULTS.get(res, f'error {res}')}")
        if actual.value != want:
            raise ChunkDecodeError(i, f"decoded {actual.value} bytes, expected {want}")


# -- thread pool ----------------------------------------------------------------------------------

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def num_threads() -> int:
    """Worker threads: ``$DELTAZIP_THREADS`` or the CPUs this process may run on."""
    env = os.environ.get("DELTAZIP_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=num_threads(), thread_name_prefix="deltazip-gdeflate")
        return _pool


def _ranges(n: int, workers: int) -> list[tuple[int, int]]:
    """Split ``n`` chunks into at most ``workers`` contiguous, nearly equal ranges."""
    workers = max(1, min(workers, n))
    step, extra = divmod(n, workers)
    out, lo = [], 0
    for w in range(workers):
        hi = lo + step + (1 if w < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def _as_u8(data) -> np.ndarray:
    """A 1-D contiguous uint8 numpy view of bytes-like ``data`` (no copy when possible)."""
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if arr.dtype != np.uint8 or arr.ndim != 1:
        arr = arr.reshape(-1).view(np.uint8)
    return np.ascontiguousarray(arr)


# -- public CPU API -------------------------------------------------------------------------------

def check_level(level: int) -> int:
    """``level`` if it is an int in ``[MIN_LEVEL, MAX_LEVEL]``; ValueError naming the range otherwise."""
    if isinstance(level, bool) or not isinstance(level, int) or not MIN_LEVEL <= level <= MAX_LEVEL:
        raise ValueError(f"GDeflate level must be an integer {MIN_LEVEL}..{MAX_LEVEL}, got {level!r}")
    return level


def compress_chunks(data, level: int = DEFAULT_LEVEL, chunk_bytes: int = PAGE_BYTES,
                    threads: int | None = None) -> tuple[list[bytes], np.ndarray]:
    """Compress ``data`` in independent chunks of ``chunk_bytes`` (the last one may be shorter).

    Args:
        data: bytes-like or numpy array; its raw bytes are compressed.
        level: 0 (stored blocks, fastest) .. 12 (smallest).
        chunk_bytes: 1 .. PAGE_BYTES.
        threads: worker threads (default ``num_threads()``).
    Returns:
        (one ``bytes`` object per worker range, concatenated in chunk order, int64 ``[n_chunks]``
        compressed sizes). ``b"".join(blobs)`` is the chunks back to back.
    """
    check_level(level)
    if not 1 <= chunk_bytes <= PAGE_BYTES:
        raise ValueError(f"chunk_bytes must be 1..{PAGE_BYTES}, got {chunk_bytes}")
    lib = cpu_library()
    arr = _as_u8(data)
    n = -(-arr.size // chunk_bytes)
    if n == 0:
        return [], np.zeros(0, dtype=np.int64)
    ranges = _ranges(n, threads or num_threads())
    if len(ranges) == 1:
        blob, sizes = _compress_range(lib, arr, 0, n, level, chunk_bytes)
        return [blob], sizes
    futs = [_executor().submit(_compress_range, lib, arr, lo, hi, level, chunk_bytes) for lo, hi in ranges]
    res = [f.result() for f in futs]
    return [b for b, _ in res], np.concatenate([s for _, s in res])


def decompress_chunks(stored, offsets: np.ndarray, sizes: np.ndarray, nbytes: int,
                      chunk_bytes: int = PAGE_BYTES, out: np.ndarray | None = None,
                      threads: int | None = None) -> np.ndarray:
    """Decode chunk ``i`` (``stored[offsets[i] : offsets[i] + sizes[i]]``) into ``out[i*chunk_bytes:]``.

    The caller must have validated the chunk table against ``stored`` and ``nbytes`` (see
    ``chunked.ChunkTable.validate``); this function re-checks only what guards memory.

    Returns:
        ``out`` (uint8 ``[nbytes]``, allocated when not given).
    Raises:
        ChunkDecodeError: a chunk failed to decode or decoded to the wrong size.
    """
    lib = cpu_library()
    stored = _as_u8(stored)
    offsets, sizes = np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
    n = -(-nbytes // chunk_bytes) if nbytes else 0
    if len(offsets) != n or len(sizes) != n:
        raise ValueError(f"{n} chunks expected for {nbytes} bytes, table has {len(offsets)}/{len(sizes)}")
    if n and (int((offsets + sizes).max()) > stored.size or int(offsets.min()) < 0):
        raise ValueError("chunk table points outside the stored bytes")
    if out is None:
        out = np.empty(nbytes, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.ndim != 1 or out.size != nbytes or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous uint8 array of {nbytes} bytes")
    if n == 0:
        return out
    ranges = _ranges(n, threads or num_threads())
    if len(ranges) == 1:
        _decompress_range(lib, stored, offsets, sizes, out, 0, n, chunk_bytes)
        return out
    futs = [_executor().submit(_decompress_range, lib, stored, offsets, sizes, out, lo, hi, chunk_bytes)
            for lo, hi in ranges]
    errors = []
    for f in futs:
        try:
            f.result()
        except ChunkDecodeError as e:
            errors.append(e)
    if errors:
        raise min(errors, key=lambda e: e.index)
    return out


# -- GPU backend (nvCOMP) -------------------------------------------------------------------------

_gpu_codecs: dict[tuple[int, int], object] = {}


def cuda_major() -> int | None:
    """The CUDA major version torch was built with (None: a CPU build)."""
    import torch

    return int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None


def install_hint() -> str:
    """The install command of the nvCOMP extra matching torch's CUDA major (cu12 on a CPU build)."""
    major = cuda_major()
    cu = f"cu{major}" if major in (12, 13) else "cu12"
    return f"pip install 'deltazip[{cu}]' (nvidia-nvcomp-{cu})"


def gpu_problem() -> str | None:
    """Why nvCOMP's GPU decoder cannot run beside this torch (None when it can): no CUDA device, no
    CPU library (the GPU path decodes what it wrote), no ``nvidia.nvcomp`` module, or one built for
    another CUDA major than torch's; each with the install command that fixes it."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        cpu_library()
    except CodecUnavailableError as e:
        return str(e)
    try:
        from nvidia import nvcomp
    except ImportError:
        return f"nvCOMP's GPU module (nvidia.nvcomp) is not installed: {install_hint()}"
    theirs = nvcomp_cuda_major(getattr(nvcomp, "__cuda_version__", None))
    if theirs is not None and theirs != cuda_major():
        return (f"nvidia.nvcomp is built for CUDA {theirs}, torch for CUDA {torch.version.cuda}: {install_hint()} "
                f"instead")
    return None


def nvcomp_cuda_major(version) -> int | None:
    """The CUDA major of ``nvidia.nvcomp.__cuda_version__`` (an int such as 12090 for 12.9, or a
    "12.9" string); None when it says nothing readable."""
    if isinstance(version, int) and not isinstance(version, bool):
        return version // 1000
    head = str(version or "").split(".")[0]
    return int(head) if head.isdigit() else None


def _gpu_codec(device_index: int, stream: int):
    try:
        from nvidia import nvcomp
    except ImportError as e:
        raise CodecUnavailableError(f"GPU GDeflate needs nvCOMP's Python module: {install_hint()}") from e
    key = (device_index, stream)
    if key not in _gpu_codecs:
        _gpu_codecs[key] = nvcomp.Codec(algorithm="GDeflate", bitstream_kind=nvcomp.BitstreamKind.RAW,
                                        device_id=device_index, cuda_stream=stream,
                                        uncomp_chunk_size=PAGE_BYTES)
    return _gpu_codecs[key]


def gpu_decompress_chunks(stored, offsets: np.ndarray, sizes: np.ndarray, nbytes: int,
                          chunk_bytes: int = PAGE_BYTES, device=None):
    """Decode validated chunks with nvCOMP on a CUDA device, straight into device memory.

    Args:
        stored: the chunks back to back (host bytes-like / numpy, or a uint8 CUDA tensor).
        offsets, sizes: the chunk table (int64 ``[n]``), already validated against ``stored``.
        nbytes: uncompressed size; chunk ``i`` decodes to ``out[i*chunk_bytes : ...]``.
        device: target CUDA device (default: the current one).
    Returns:
        uint8 CUDA tensor ``[nbytes]``.
    Raises:
        ChunkDecodeError: nvCOMP reports a decoded size other than the expected one.
    """
    import torch
    from nvidia import nvcomp

    dev = torch.device(device if device is not None else "cuda")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    offsets, sizes = np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
    n = len(sizes)
    out = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    if n == 0:
        return out
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev)
        codec = _gpu_codec(dev.index, stream.cuda_stream)
        align = max(1, int(codec.get_required_decompression_alignment()))
        if isinstance(stored, torch.Tensor) and stored.is_cuda:
            src = stored.to(dev)
        else:
            src = torch.from_numpy(_as_u8(stored).copy()).pin_memory().to(dev, non_blocking=True)
        if any(int(o) % align for o in offsets):
            # Re-lay the chunks at aligned offsets on the device (one gather), so nvCOMP's
            # alignment rule holds whatever the container's own alignment.
            new_off = np.zeros(n, dtype=np.int64)
            pos = 0
            for i in range(n):
                new_off[i] = pos
                pos = -(-(pos + int(sizes[i])) // align) * align
            idx = np.concatenate([np.arange(o, o + s) for o, s in zip(offsets, sizes)])
            dst = torch.zeros(pos, dtype=torch.uint8, device=dev)
            dst_idx = np.concatenate([np.arange(o, o + s) for o, s in zip(new_off, sizes)])
            dst[torch.from_numpy(dst_idx).to(dev)] = src[torch.from_numpy(idx).to(dev)]
            src, offsets = dst, new_off
        out_sizes = [min(chunk_bytes, nbytes - i * chunk_bytes) for i in range(n)]
        s = stream.cuda_stream
        src_b = nvcomp.as_arrays(src, [int(o) for o in offsets], [int(x) for x in sizes], s)
        out_b = nvcomp.as_arrays(out, [i * chunk_bytes for i in range(n)], out_sizes, s)
        try:
            res = codec.decode(src_b, out=out_b)
            stream.synchronize()
        except (RuntimeError, ValueError) as e:  # nvCOMP reports failed batches as exceptions
            raise ChunkDecodeError(-1, f"nvCOMP GPU decode failed ({e})") from e
        got = list(res.buffer_sizes) if hasattr(res, "buffer_sizes") else out_sizes
        for i, (g, w) in enumerate(zip(got, out_sizes)):
            if int(g) != w:
                raise ChunkDecodeError(i, f"nvCOMP decoded {int(g)} bytes, expected {w}")
    return out
