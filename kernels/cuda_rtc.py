"""Compile CUDA C++ at first use with NVRTC and launch it on torch's current stream.

Why by hand (docs/kernels.md): the delta matmul needs a kernel whose speed does not depend on a
compiler's layout inference, built for the GPU it runs on without asking users for nvcc. NVRTC (the
``nvidia-cuda-nvrtc`` wheel, which CUDA builds of torch already install) compiles the source; the CUDA
driver loads the cubin. ``cuda-python`` would pin one more CUDA-major-specific package beside torch,
and ``torch.cuda._compile_kernel`` is private and changes between releases; the two C entry points per
library used here have been stable for a decade, so ctypes calls them directly.

- :func:`compile_cubin` works without a GPU (offline checks, CI): NVRTC only needs the target arch.
- :func:`load` needs a CUDA device and the driver; kernels are cached per (source hash, macros,
  device) in the process, cubins on disk under ``$DELTAZIP_CUDA_CACHE`` (default
  ``~/.cache/deltazip/cuda``), so a second process pays no compile.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import sys
import threading
from pathlib import Path

_CACHE_ENV = "DELTAZIP_CUDA_CACHE"


class CudaCompileError(RuntimeError):
    """NVRTC refused the source (the message holds its log) or is not installed."""


def _nvrtc_candidates() -> list[str]:
    names = [f"libnvrtc.so.{m}" for m in (13, 12)] + ["libnvrtc.so"]
    found = []
    for site in sys.path:  # the pip wheels: nvidia/cu13/lib (CUDA 13) or nvidia/cuda_nvrtc/lib (CUDA 12)
        for pattern in ("nvidia/cu1*/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*"):
            found += [p for p in sorted(glob.glob(os.path.join(site, pattern))) if "builtins" not in p
                      and ".alt." not in p]
    return names + found


_NVRTC: ctypes.CDLL | None = None


def nvrtc() -> ctypes.CDLL:
    """The NVRTC library (raises :class:`CudaCompileError` naming the package when it is missing)."""
    global _NVRTC
    if _NVRTC is None:
        for name in _nvrtc_candidates():
            try:
                if os.path.isabs(name):  # a wheel's copy: its builtins library sits beside it, off the
                    for b in glob.glob(os.path.join(os.path.dirname(name), "libnvrtc-builtins.so.*")):
                        if ".alt." not in b:  # loader's path, so load it first
                            ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            _NVRTC = lib
            break
        else:
            raise CudaCompileError("NVRTC (libnvrtc) not found: install the nvidia-cuda-nvrtc wheel matching "
                                   "your CUDA major version (CUDA builds of torch bring it)")
    return _NVRTC


def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        raise CudaCompileError(f"NVRTC {what} failed: {lib.nvrtcGetErrorString(rc).decode()}")


def compile_cubin(source: str, macros: dict[str, int], arch: int, *, name: str = "kernel.cu") -> bytes:
    """Compile ``source`` for ``sm_<arch>`` (e.g. 90) with ``-D`` ``macros``; returns the cubin.

    Raises:
        CudaCompileError: with NVRTC's log when the source does not compile.
    """
    lib = nvrtc()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None), "create")
    opts = [f"--gpu-architecture=sm_{arch}", "--std=c++17", "-lineinfo"] + [f"-D{k}={v}" for k, v in macros.items()]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    try:
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if rc != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise CudaCompileError(f"NVRTC could not compile {name} with {macros}:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, buf), "cubin")
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def user_cache(env: str, name: str) -> Path:
    """``$env`` when set, else ``$XDG_CACHE_HOME/deltazip/<name>`` (``~/.cache`` by default)."""
    value = os.environ.get(env, "").strip()
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deltazip" / name


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling of this process and thread, then one rename
    (precompile's threads, or the tuner's and the start-up's, may write the same file at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def cache_dir() -> Path:
    return user_cache(_CACHE_ENV, "cuda")


@functools.lru_cache(maxsize=8)
def source_digest(source: str) -> str:
    """SHA-256 of a kernel source, hashed once per source (``load`` runs per launch outside CUDA graphs)."""
    return hashlib.sha256(source.encode()).hexdigest()


_CUBINS: dict[str, bytes] = {}  # compiled in this process (a read-only disk cache still compiles once)


def _cubin_key(source: str, macros: dict[str, int], arch: int) -> str:
    # the source by its digest (hashed once per source): the key is computed per launch config at tuning
    return hashlib.sha256(repr((source_digest(source), sorted(macros.items()), arch, nvrtc_version())).encode()
                          ).hexdigest()[:32]


def cubin_for(source: str, macros: dict[str, int], arch: int) -> bytes:
    """:func:`compile_cubin`, through the on-disk cache (keyed by source, macros, arch and NVRTC version)."""
    key = _cubin_key(source, macros, arch)
    if key in _CUBINS:
        return _CUBINS[key]
    path = cache_dir() / f"{key}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    cubin = _CUBINS[key] = compile_cubin(source, macros, arch)
    try:
        write_atomic(path, cubin)  # a concurrent process reads a whole cubin or none
    except OSError:
        pass  # a read-only cache only costs the next process a compile
    return cubin


def precompile(source: str, macro_sets: list[dict[str, int]], arch: int, workers: int | None = None) -> int:
    """Compile every macro set not cached yet, in parallel threads (NVRTC runs outside the GIL: ctypes
    releases it, and NVRTC compiles separate programs concurrently; the cubins are byte-identical to
    serial compiles, ``tests/kernels/test_cuda_sbmm.py``); returns how many were compiled. A server's
    tuning needs a few dozen variants, about half a second each: serially that was most of its start-up
    on a fresh machine. A set that fails to compile is left for :func:`load` to report."""
    todo, seen = [], set()
    for m in macro_sets:
        key = _cubin_key(source, m, arch)
        if key in seen or key in _CUBINS or (cache_dir() / f"{key}.cubin").is_file():
            continue
        seen.add(key)
        todo.append(m)
    if not todo:
        return 0
    from concurrent.futures import ThreadPoolExecutor

    def one(m: dict[str, int]) -> bool:
        try:
            cubin_for(source, m, arch)
            return True
        except CudaCompileError:
            return False

    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), workers or os.cpu_count() or 1))) as ex:
        return sum(ex.map(one, todo))


# --------------------------------------------------------------------------------------------------
# Driver side (needs a GPU)
# --------------------------------------------------------------------------------------------------

_CUDA: ctypes.CDLL | None = None
_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def driver() -> ctypes.CDLL:
    global _CUDA
    if _CUDA is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _CUDA = lib
    return _CUDA


def _cu(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        driver().cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"CUDA {what} failed: {(msg.value or b'?').decode()} ({rc})")


class Kernel:
    """One ``extern "C"`` kernel of a loaded cubin; called with ctypes-typed arguments."""

    def __init__(self, module: ctypes.c_void_p, name: str):
        self.module, self.name = module, name
        self.func = ctypes.c_void_p()
        _cu(driver().cuModuleGetFunction(ctypes.byref(self.func), module, name.encode()), f"getting {name}")
        self.smem = 0

    def allow_smem(self, nbytes: int) -> None:
        """Opt in to ``nbytes`` of dynamic shared memory (needed above 48 KiB)."""
        if nbytes > self.smem:
            _cu(driver().cuFuncSetAttribute(self.func, _FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
                f"allowing {nbytes} B of shared memory for {self.name}")
            self.smem = nbytes

    def __call__(self, grid: tuple[int, int, int], block: int, smem: int, stream: int, args: list,
                 pdl: bool = False) -> None:
        """Launch on ``stream`` (a ``cudaStream_t`` as int; torch's ``current_stream().cuda_stream``);
        ``pdl``: as a programmatic dependent launch (sm_90+; the kernel must ``griddepcontrol.wait``
        before it reads what the previous kernel wrote)."""
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        if pdl:
            cfg = LaunchConfig(grid[0], grid[1], grid[2], block, 1, 1, smem, stream, _PDL_ATTR, 1)
            rc = driver().cuLaunchKernelEx(ctypes.byref(cfg), self.func, params, None)
        else:
            rc = driver().cuLaunchKernel(self.func, grid[0], grid[1], grid[2], block, 1, 1, smem,
                                         ctypes.c_void_p(stream), params, None)
        _cu(rc, f"launching {self.name}")


# cuLaunchKernelEx's arguments (cuda.h, CUDA 12+): tests/kernels/test_launch_options.py checks these layouts and
# the attribute's number against the header.
LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union (8-byte aligned)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint64 * 8)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def _pdl_attribute() -> ctypes.Array:
    attr = (LaunchAttribute * 1)()
    attr[0].id = LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr[0].value[0] = 1  # programmaticStreamSerializationAllowed (an int in the union's first bytes)
    return attr


_PDL_ARRAY = _pdl_attribute()
_PDL_ATTR = ctypes.cast(_PDL_ARRAY, ctypes.POINTER(LaunchAttribute))


_MODULES: dict[tuple, ctypes.c_void_p] = {}
_KERNELS: dict[tuple, Kernel] = {}


def load(source: str, macros: dict[str, int], name: str, device_index: int) -> Kernel:
    """Kernel ``name`` of ``source`` compiled with ``macros`` for the GPU ``device_index`` (cached)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    arch = 10 * major + minor
    key = (source_digest(source), tuple(sorted(macros.items())), device_index)
    kernel = _KERNELS.get((key, name))
    if kernel is not None:
        return kernel
    module = _MODULES.get(key)
    if module is None:
        cubin = cubin_for(source, macros, arch)
        with torch.cuda.device(device_index):
            torch.cuda.current_stream()  # makes torch's primary context current for the driver call
            module = ctypes.c_void_p()
            _cu(driver().cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(cubin)), "loading a cubin")
        _MODULES[key] = module
    kernel = _KERNELS[(key, name)] = Kernel(module, name)
    return kernel
