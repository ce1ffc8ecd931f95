"""IPC weight sharing: one owner process holds the base weights, server workers map them.

The owner (``python -m deltazip.runtime.share.weight_share``, started by ``deltazip serve --workers K``
through :mod:`deltazip.runtime.cluster.workers`) reads the base checkpoint one tensor at a time, converts
floating tensors to the served dtype, and lays them out back to back (64-byte aligned; the
members of a q/k/v or gate/up group with no gap, in the order the runtime stacks them) in ONE
buffer. Workers attach over a local socket, get the buffer and the metadata (name, dtype, shape,
offset of every tensor), and build their model over views of it instead of loading the checkpoint.

CPU: the buffer is an anonymous ``memfd`` (``memfd_create``), not a named file in ``/dev/shm``:

- it has no name, so nothing can leak: the kernel frees it when the last descriptor and the last
  mapping are gone, however the processes end (SIGKILL included);
- after writing, the owner *seals* it (``F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL``):
  from then on no process can map it writable or change its size, so the bytes are immutable
  for the life of the buffer (read-only is enforced by the kernel, not by convention);
- the descriptor travels to workers over an abstract unix socket with ``SCM_RIGHTS`` (peer uid
  checked); metadata goes as JSON on the same connection (no pickles);
- workers map it ``MAP_SHARED, PROT_READ``: every worker reads the same physical pages. Tensors
  are views of that mapping wrapped as :class:`~deltazip.runtime.share.dedup_registry.ReadOnlyTensor`,
  so an in-place op raises ``SharedTensorWriteError`` with a readable message, and a write that
  bypasses the guard (``untyped_storage()``, ctypes) hits a read-only page and faults (SIGSEGV)
  instead of corrupting other workers' weights.

The owner also maps the buffer read-only and hashes it once (``checksum`` in the metadata), which
touches every page: summing PSS over owner + workers then counts the weights exactly once.

CUDA: the owner allocates one slab (``torch.empty`` of the total size on the device), copies the
tensors into it and exports the slab's CUDA IPC handle with torch's own reduction data
(``UntypedStorage._share_cuda_()``: device, handle bytes, size, offset, ref-counter and event
handles); workers open it with ``UntypedStorage._new_shared_cuda`` and view into it. Legacy CUDA
IPC (``cudaIpcGetMemHandle``) does not work on memory from expandable segments, so the owner's
``PYTORCH_CUDA_ALLOC_CONF`` is stripped of ``expandable_segments`` before CUDA initialises. The
handle bytes travel as hex in the JSON metadata; nothing is pickled. The owner must stay alive while
workers use the slab (CUDA frees the memory with the exporting process), which the supervisor
guarantees: it stops workers first, then the owner.

Checkpoint names are placed by transformers' own renaming; parameters that transformers assembles on
load from several checkpoint tensors (per-expert tensors fused into ``[E, ., .]`` experts) are one view
of a run of them the owner laid out back to back in the parameter's row order (:func:`fused_runs`,
computed by the supervisor, which has torch, and handed to the owner on its stdin). Limits: any other
conversion (a transpose, a split) is refused with a message pointing at ``--workers 1``; so are
modules that transformers keeps in fp32 under another dtype.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import socket
import struct
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deltazip.formats.dtypes import COMPUTE, ST_FLOATS, ST_OF_NAME, ST_SIZES, dtype_name
from deltazip.formats.errors import DeltazipError, InputError

ALIGN = 64  # bytes; every tensor starts on a cache-line boundary (and any dtype's alignment)
FLOAT_DTYPES = ST_FLOATS  # safetensors names; served dtypes are F32/F16/BF16
_LEN = struct.Struct("<Q")


class WeightShareError(DeltazipError, RuntimeError):
    """The owner could not be reached, or what it exported does not fit the model."""


def st_dtype(dtype) -> str:
    """The safetensors name (``F32``...) of a torch dtype or of a name like ``float32``."""
    name = dtype_name(dtype)
    if name not in ("float64", *COMPUTE):
        raise InputError(f"dtype {name!r} cannot be a served dtype; use float32, float16 or bfloat16")
    return ST_OF_NAME[name]


# --------------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------------


@dataclass
class TensorMeta:
    """One tensor inside the shared buffer: ``buffer[offset : offset + nbytes]`` viewed as
    ``dtype`` (safetensors name) with ``shape`` (row-major, contiguous)."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


@dataclass
class ExportMeta:
    """What a worker needs to map the owner's weights (sent as JSON).

    kind: ``memfd`` (CPU) or ``cuda_ipc``; base: the checkpoint directory the tensors came from;
    dtype: the served dtype (safetensors name) floating tensors were converted to; device: where
    the buffer lives; nbytes: buffer size; checksum: xxh3-128 of the whole buffer (CPU only);
    cuda: the IPC handle fields of ``_share_cuda_()`` (bytes as hex) for ``cuda_ipc``.
    """

    kind: str
    base: str
    dtype: str
    device: str
    nbytes: int
    tensors: list[TensorMeta]
    checksum: str | None = None
    owner_pid: int = 0
    seconds: float = 0.0
    cuda: dict[str, Any] | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ExportMeta:
        d = json.loads(raw)
        d["tensors"] = [TensorMeta(**t) for t in d["tensors"]]
        return cls(**d)


# --------------------------------------------------------------------------------------------------
# Owner side (CPU path imports no torch: a torch import alone costs ~200 MiB of private memory,
# which would eat most of what sharing saves on a small model)
# --------------------------------------------------------------------------------------------------


def _checkpoint_tables(base_dir: Path) -> list[tuple[Path, dict]]:
    from deltazip.formats.checkpoint_files import resolve_checkpoint
    from deltazip.formats.safetensors_raw import read_table

    ck = resolve_checkpoint(base_dir)
    if ck.kind not in ("hf-dir", "hf-sharded"):
        raise InputError(f"{base_dir}: weight sharing needs a Hugging Face model directory with safetensors "
                         f"weights, got a {ck.kind} checkpoint; serve it with --workers 1")
    return [(wf.path, read_table(wf.path)[0]) for wf in ck.files]


def plan_layout(base_dir: Path, dtype: str, runs: list[list[str]] | None = None) -> list[TensorMeta]:
    """Offsets of every checkpoint tensor (floating ones in ``dtype``), 64-byte aligned, except that
    the members of a projection group (``deltazip.models.projection_groups``: q/k/v, gate/up) of one
    dtype follow each other with no gap, in group order: a worker stacks them by a view, no copy.
    ``runs``: more names to lay out so, each list in its order at the place of its first member (the
    checkpoint tensors that make one parameter transformers assembles on load, :func:`fused_runs`).

    Raises:
        InputError: a run names a tensor the checkpoint does not hold.
    """
    from deltazip.models.projection_groups import layout_runs

    entries = {}  # name -> (dtype, shape, nbytes), in file order
    for path, table in _checkpoint_tables(base_dir):
        for name, e in table.items():
            if name in entries:
                raise InputError(f"{base_dir}: tensor {name!r} appears in two weight files ({path})")
            dt = dtype if e.dtype in FLOAT_DTYPES else e.dtype
            numel = 1
            for s in e.shape:
                numel *= int(s)
            entries[name] = (dt, [int(s) for s in e.shape], numel * ST_SIZES[dt])
    given = {name for run in runs or [] for name in run}
    missing = [n for n in given if n not in entries]
    if missing:
        raise InputError(f"{base_dir}: the layout names {missing[0]!r}, which is not in the checkpoint")
    order = {name: i for i, name in enumerate(entries)}
    planned = layout_runs(n for n in entries if n not in given) + [list(r) for r in runs or [] if r]
    out, off = [], 0
    for run in sorted(planned, key=lambda r: order[r[0]]):
        packed = len({entries[n][0] for n in run}) == 1
        for name in run:
            dt, shape, nbytes = entries[name]
            out.append(TensorMeta(name, dt, shape, off, nbytes))
            off += nbytes
            if not packed:
                off = (off + ALIGN - 1) // ALIGN * ALIGN
        off = (off + ALIGN - 1) // ALIGN * ALIGN
    return out


def fused_runs(base_dir: Path) -> list[list[str]]:
    """The checkpoint names that make each parameter transformers assembles on load (Mixtral's
    per-expert ``w1``/``w3`` rows of one fused ``gate_up_proj``), in the parameter's row order: laid
    out back to back by the owner, the parameter is one view of the buffer in a worker. Torch side
    (the supervisor runs it; the owner takes the result on its stdin)."""
    import torch

    from deltazip.models.checkpoint import Checkpoint
    from deltazip.models.layer_map import converted_params
    from deltazip.models.model_walk import empty_model

    ck = Checkpoint(base_dir)
    skeleton = empty_model(base_dir, torch.float32)
    try:
        fused = converted_params(skeleton, ck.names, ck.shape)
    except InputError:  # no decoder layer list found: nothing fused that a worker could view
        return []
    return [[name for name, _ in pieces] for pieces in fused.values() if len(pieces) > 1]


def convert_bytes(raw, src: str, dst: str):
    """Raw tensor bytes of dtype ``src`` converted to ``dst`` (safetensors names), as torch's
    ``Tensor.to`` converts them: widening is exact, narrowing rounds to nearest even through fp32
    (NaN cannot become bf16: InputError). Returns a bytes-like object (``raw`` itself when nothing changes)."""
    import numpy as np

    if src == dst or src not in FLOAT_DTYPES:
        return raw
    np_of = {"F16": np.float16, "F32": np.float32, "F64": np.float64}
    if src == "BF16":
        f32 = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        f32 = np.frombuffer(raw, dtype=np_of[src]).astype(np.float32)
    if dst == "F32":
        return f32
    if dst == "BF16":
        if np.isnan(f32).any():
            # torch's kernels disagree on NaN payloads; a NaN weight is broken anyway.
            raise InputError("a weight tensor contains NaN values; it cannot be converted to bfloat16")
        u = f32.view(np.uint32)
        return ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    with np.errstate(over="ignore"):  # out-of-range values become inf, as in torch
        return f32.astype(np_of[dst])


def _fill(write, base_dir: Path, tensors: list[TensorMeta]) -> None:
    """Call ``write(offset, bytes)`` for every tensor, converted, one tensor in memory at a time."""
    from deltazip.formats.safetensors_raw import RawFile

    by_name = {t.name: t for t in tensors}
    for path, _ in _checkpoint_tables(base_dir):
        with RawFile(path) as rf:
            for name, e in rf.entries.items():
                tm = by_name[name]
                data = memoryview(convert_bytes(rf.view(name), e.dtype, tm.dtype)).cast("B")
                if data.nbytes != tm.nbytes:
                    raise InputError(f"{path}: tensor {name} has {data.nbytes} bytes, expected {tm.nbytes}")
                write(tm.offset, data)
                data.release()


def export_cpu(base_dir: str | Path, dtype: str, runs: list[list[str]] | None = None) -> tuple[int, ExportMeta, mmap.mmap]:
    """Write the checkpoint's tensors into a sealed memfd.

    Args:
        base_dir: Hugging Face model directory (safetensors, single or sharded).
        dtype: served dtype (``F32``/``F16``/``BF16``); floating tensors are converted to it, as
            ``from_pretrained(dtype=...)`` does.
        runs: names laid out back to back (:func:`plan_layout`).
    Returns:
        (fd, metadata, a read-only mapping the owner keeps; all its pages have been touched).
    """
    t0 = time.perf_counter()
    base_dir = Path(base_dir)
    tensors = plan_layout(base_dir, dtype, runs)
    total = _total(tensors)
    fd = _new_buffer("deltazip-weights")
    try:
        os.ftruncate(fd, max(total, 1))

        def write(offset: int, data: memoryview) -> None:
            done = 0
            while done < data.nbytes:
                done += os.pwrite(fd, data[done:], offset + done)

        _fill(write, base_dir, tensors)
        _seal(fd)
        view = mmap.mmap(fd, max(total, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except BaseException:
        os.close(fd)
        raise
    checksum = _hash(view, total)
    meta = ExportMeta("memfd", str(base_dir), dtype, "cpu", total, tensors, checksum, os.getpid(),
                      time.perf_counter() - t0)
    return fd, meta, view


def _total(tensors: list[TensorMeta]) -> int:
    return max((t.offset + t.nbytes for t in tensors), default=0)


def _hash(view: mmap.mmap, total: int) -> str:
    """xxh3-128 of the first ``total`` bytes, read in place (no copy of the buffer)."""
    import xxhash

    h = xxhash.xxh3_128()
    mv = memoryview(view)
    try:
        step = 1 << 26
        for i in range(0, total, step):
            h.update(mv[i:min(total, i + step)])
    finally:
        mv.release()
    return h.hexdigest()


def _new_buffer(name: str) -> int:
    """An anonymous, sealable memory file (Linux memfd); elsewhere an unlinked temp file."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    import tempfile

    # No memfd: an unlinked file still has no name to leak (it cannot be sealed, though).
    fd, path = tempfile.mkstemp(prefix=name, dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.unlink(path)
    return fd


def _seal(fd: int) -> None:
    import fcntl

    if not hasattr(fcntl, "F_ADD_SEALS"):
        return
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)


# The environment of the processes a memory comparison measures (tests, bench/share.py). glibc
# keeps what a thread frees in that thread's arena, resident and counted in USS and PSS, by an
# amount that follows thread timing and allocation order, not what the process holds: 150-280 MiB
# per worker of tests/runtime/cluster's 126 MB model, 60 MiB apart between two identical workers.
# With a fixed mmap threshold every block of 128 KiB or more (every weight, cache and activation
# buffer) is a mapping of its own, unmapped when freed, so the figures compare held memory.
MEASURE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def smaps_rollup(pid: int) -> dict[str, int]:
    """Memory of a process in bytes, from ``/proc/PID/smaps_rollup`` (``Rss``, ``Pss``, ...), plus
    ``USS`` = private clean + private dirty: how benches and tests show what sharing saves."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[-1] == "kB":
            out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    out["USS"] = out["Private_Clean"] + out["Private_Dirty"]
    return out


def seals(fd: int) -> set[str]:
    """Names of the seals on a memfd (empty where sealing is not supported)."""
    import fcntl

    if not hasattr(fcntl, "F_GET_SEALS"):
        return set()
    got = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    return {n for n in ("F_SEAL_WRITE", "F_SEAL_GROW", "F_SEAL_SHRINK", "F_SEAL_SEAL") if got & getattr(fcntl, n)}


def export_cuda(base_dir: str | Path, dtype: str, device, runs: list[list[str]] | None = None) -> tuple[Any, ExportMeta]:
    """Copy the checkpoint's tensors into one device slab (laid out as :func:`plan_layout`, ``runs``
    back to back) and describe its CUDA IPC handle.

    Returns:
        (slab: uint8 ``[nbytes]`` tensor on ``device`` — keep it alive while workers use it, metadata).
    """
    import numpy as np
    import torch

    t0 = time.perf_counter()
    base_dir = Path(base_dir)
    device = torch.device(device)
    tensors = plan_layout(base_dir, dtype, runs)
    total = _total(tensors)
    # One allocation: the IPC handle covers the whole slab, every tensor is an offset into it.
    slab = torch.empty(max(total, 1), dtype=torch.uint8, device=device)

    def write(offset: int, data: memoryview) -> None:
        src = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
        slab[offset:offset + data.nbytes].copy_(src)

    _fill(write, base_dir, tensors)
    torch.cuda.synchronize(device)
    (dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = slab.untyped_storage()._share_cuda_()
    cuda = {"device": int(dev), "handle": handle.hex(), "size": int(size), "offset": int(offset),
            "ref_counter_handle": rc_handle.hex(), "ref_counter_offset": int(rc_offset),
            "event_handle": ev_handle.hex() if ev_handle else "", "event_sync_required": bool(ev_sync)}
    meta = ExportMeta("cuda_ipc", str(base_dir), dtype, str(device), total, tensors, None, os.getpid(),
                      time.perf_counter() - t0, cuda)
    return slab, meta


def strip_expandable_segments(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``expandable_segments`` removed from ``PYTORCH_CUDA_ALLOC_CONF`` (legacy CUDA IPC
    cannot export memory from expandable segments)."""
    env = dict(env)
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = env.get(key)
        if conf:
            kept = [p for p in conf.split(",") if p.strip() and not p.strip().startswith("expandable_segments")]
            env[key] = ",".join(kept + ["expandable_segments:False"])
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    return env


class WeightOwner:
    """Serves the exported weights to workers on an abstract unix socket until :meth:`close`.

    Protocol (one connection per attach): the client sends one JSON line ``{"op": "attach"}``; the
    owner answers an 8-byte little-endian length (with the memfd attached as ``SCM_RIGHTS`` on CPU)
    followed by that many bytes of :class:`ExportMeta` JSON. Peers of another uid are refused.
    """

    def __init__(self, meta: ExportMeta, address: str, fd: int | None = None, keep: Any = None):
        self.meta, self.address, self.fd, self._keep = meta, address, fd, keep
        self._body = meta.to_json()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(_abstract(address))
        self.sock.listen(64)
        self.attached = 0
        self._closed = threading.Event()

    def serve_forever(self) -> None:
        self.sock.settimeout(0.2)
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                raise
            with conn:
                with contextlib.suppress(OSError):
                    self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():
            return  # another user's process: no weights for it
        line = conn.makefile("rb").readline(4096)
        try:
            op = json.loads(line).get("op")
        except (json.JSONDecodeError, AttributeError):
            return
        if op != "attach":
            return
        head = _LEN.pack(len(self._body))
        if self.fd is not None:
            socket.send_fds(conn, [head], [self.fd])
        else:
            conn.sendall(head)
        conn.sendall(self._body)
        self.attached += 1

    def close(self) -> None:
        self._closed.set()
        self.sock.close()
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
        if isinstance(self._keep, mmap.mmap):
            self._keep.close()
        self._keep = None


def _abstract(address: str) -> str:
    # Linux abstract namespace: no socket file on disk to clean up or leak.
    return "\0" + address


# --------------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------------


@dataclass
class SharedWeights:
    """The owner's tensors mapped into this process (read-only views, no copies).

    tensors: checkpoint name -> ReadOnlyTensor over the shared buffer; buffer: the whole buffer as
    uint8 ``[nbytes]``; attach_seconds: connect + map time.
    """

    meta: ExportMeta
    tensors: dict[str, Any]  # name -> torch.Tensor (ReadOnlyTensor)
    buffer: Any  # torch.Tensor, uint8 [nbytes]
    attach_seconds: float = 0.0
    _keep: list[Any] = field(default_factory=list, repr=False)

    @property
    def base(self) -> Path:
        return Path(self.meta.base)

    def build_model(self, dtype, device, attn_implementation: str = "sdpa"):
        """The base causal LM (eval mode, attention ``attn_implementation``) with every weight a view
        of the buffer.

        The skeleton is built on the meta device (no memory, no random init); non-persistent
        buffers (rotary tables) are computed as ``from_pretrained`` computes them; tied weights are
        re-tied. Raises WeightShareError when a tensor has no place in the model or another
        shape/dtype than the model's.
        """
        import torch
        from accelerate import init_empty_weights
        from transformers import AutoConfig

        from deltazip.models.loader import causal_lm_class

        device = torch.device(device)
        if self.meta.dtype != st_dtype(dtype) or torch.device(self.meta.device).type != device.type:
            raise WeightShareError(f"the weight owner exported {self.meta.dtype} on {self.meta.device}, this worker "
                                   f"serves {st_dtype(dtype)} on {device}")
        config = AutoConfig.from_pretrained(self.base)
        from deltazip.runtime.share.dedup_loader import _no_init_weights

        with init_empty_weights(include_buffers=False), _no_init_weights():
            model = causal_lm_class(config)._from_config(config, dtype=dtype, attn_implementation=attn_implementation)
        from deltazip.models.param_names import module_names
        from deltazip.runtime.share.dedup_loader import state_slots  # torch-side; the owner never imports it

        slots = state_slots(model)
        # checkpoint names that transformers renames on load (image-text models' legacy layouts, EXAONE 3,
        # a router's bias buffer)
        renamed = module_names(model, [n for n in self.tensors if n not in slots], buffers=True)
        placed = {renamed.get(n, n): t for n, t in self.tensors.items() if renamed.get(n, n) in slots}
        placed.update(self._fused(model, [n for n in self.tensors if renamed.get(n, n) not in slots], slots))
        for name, t in placed.items():
            mod, attr, cur = slots[name]
            if tuple(cur.shape) != tuple(t.shape) or cur.dtype != t.dtype:
                raise WeightShareError(f"shared tensor {name} is {t.dtype} {list(t.shape)}, the model expects "
                                       f"{cur.dtype} {list(cur.shape)}; serve this model with --workers 1")
            if attr in mod._parameters:
                mod._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
            else:
                mod._buffers[attr] = t
        model.tie_weights()
        missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
        if missing:
            raise WeightShareError(f"{self.base}: {len(missing)} tensors missing from the shared weights, e.g. "
                                   f"{missing[:3]}")
        for mod in model.modules():  # rotary tables etc. were computed on the host
            for bname, b in list(mod._buffers.items()):
                if b is not None and b.device != device:
                    mod._buffers[bname] = b.to(device)
        return model.eval()

    def _fused(self, model, names: list[str], slots: dict) -> dict[str, Any]:
        """Parameters transformers assembles on load from the checkpoint tensors ``names`` (fused
        experts), each one view of the buffer: the owner laid their pieces out back to back in row
        order (:func:`fused_runs`). Raises WeightShareError for a name that lands in no such view."""
        if not names:
            return {}
        from deltazip.models.layer_map import converted_params
        from deltazip.runtime.share.dedup_registry import ST_TO_TORCH, read_only

        where = {tm.name: tm for tm in self.meta.tensors}
        out, used = {}, set()
        for param, pieces in converted_params(model, list(self.tensors), lambda n: tuple(self.tensors[n].shape)).items():
            if any(n not in where for n, _ in pieces):
                continue
            tms = [where[n] for n, _ in pieces]
            if len({tm.dtype for tm in tms}) != 1 or any(b.offset != a.offset + a.nbytes for a, b in zip(tms, tms[1:])):
                continue  # not laid out as one run: refused below
            dt, nbytes = ST_TO_TORCH[tms[0].dtype], sum(tm.nbytes for tm in tms)
            cur = slots[param][2] if param in slots else None
            if cur is None or nbytes != cur.numel() * dt.itemsize:
                continue
            raw = self.buffer[tms[0].offset:tms[0].offset + nbytes]
            out[param] = read_only(raw.view(dt).reshape(cur.shape))
            used.update(n for n, _ in pieces)
        left = [n for n in names if n not in used]
        if left:
            raise WeightShareError(f"shared tensor {left[0]!r} is not a parameter of {type(model).__name__} and is "
                                   "not laid out as a piece of one (this architecture converts checkpoint keys on "
                                   "load in a way the weight owner does not follow); serve it with --workers 1")
        return out


def request_export(address: str, timeout: float = 30.0) -> tuple[ExportMeta, int | None]:
    """Ask the owner at ``address`` for its metadata (and, on CPU, the memfd descriptor)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    fd = None
    try:
        try:
            sock.connect(_abstract(address))
        except OSError as e:
            raise WeightShareError(f"cannot reach the weight owner at @{address} ({e}); is it running?") from e
        sock.sendall(b'{"op": "attach"}\n')
        head, fds, _, _ = socket.recv_fds(sock, _LEN.size, 1)
        fd = fds[0] if fds else None
        while len(head) < _LEN.size:
            more = sock.recv(_LEN.size - len(head))
            if not more:
                raise WeightShareError(f"the weight owner at @{address} closed the connection")
            head += more
        (n,) = _LEN.unpack(head)
        body = bytearray()
        while len(body) < n:
            chunk = sock.recv(min(1 << 20, n - len(body)))
            if not chunk:
                raise WeightShareError(f"the weight owner at @{address} closed the connection mid-answer")
            body += chunk
        return ExportMeta.from_json(bytes(body)), fd
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    finally:
        sock.close()


def attach(address: str, timeout: float = 30.0) -> SharedWeights:
    """Map the owner's weights into this process.

    CPU: ``mmap(MAP_SHARED, PROT_READ)`` of the sealed memfd (then the descriptor is closed; the
    mapping keeps the buffer alive). CUDA: open the slab's IPC handle. Every tensor is a
    :class:`~deltazip.runtime.share.dedup_registry.ReadOnlyTensor` view of the buffer.
    """
    import torch

    from deltazip.runtime.share.dedup_registry import ST_TO_TORCH, read_only

    t0 = time.perf_counter()
    meta, fd = request_export(address, timeout)
    keep: list[Any] = []
    if meta.kind == "memfd":
        if fd is None:
            raise WeightShareError("the weight owner sent no memory descriptor")
        try:
            mm = mmap.mmap(fd, max(meta.nbytes, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        keep.append(mm)
        with warnings.catch_warnings():
            # torch warns that it cannot make the tensor read-only; the mapping itself is (PROT_READ).
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            buffer = torch.frombuffer(mm, dtype=torch.uint8, count=meta.nbytes) if meta.nbytes else \
                torch.empty(0, dtype=torch.uint8)
    elif meta.kind == "cuda_ipc":
        buffer = _open_cuda(meta)
    else:
        raise WeightShareError(f"unknown export kind {meta.kind!r} (owner and worker versions differ?)")
    tensors = {}
    for tm in meta.tensors:
        raw = buffer[tm.offset:tm.offset + tm.nbytes]
        dt = ST_TO_TORCH[tm.dtype]
        t = raw.view(dt).reshape(tm.shape) if tm.nbytes else torch.empty(tm.shape, dtype=dt, device=buffer.device)
        tensors[tm.name] = read_only(t)
    return SharedWeights(meta, tensors, buffer, time.perf_counter() - t0, keep)


def _open_cuda(meta: ExportMeta):
    import torch

    c = meta.cuda or {}
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        c["device"], bytes.fromhex(c["handle"]), c["size"], c["offset"], bytes.fromhex(c["ref_counter_handle"]),
        c["ref_counter_offset"], bytes.fromhex(c["event_handle"]) if c["event_handle"] else None,
        c["event_sync_required"])
    dev = torch.device("cuda", c["device"])
    return torch.empty(0, dtype=torch.uint8, device=dev).set_(storage, 0, (meta.nbytes,), (1,))


# --------------------------------------------------------------------------------------------------
# The hook used by deltazip.runtime.serve.model.load_base_model
# --------------------------------------------------------------------------------------------------

_ATTACHED: SharedWeights | None = None


def install(shared: SharedWeights | None) -> None:
    """Make :func:`attached_model` build models of ``shared.base`` over the shared weights in this
    process (a worker is one process serving one base; ``None`` uninstalls)."""
    global _ATTACHED
    _ATTACHED = shared


def attached_model(base_path: Path, dtype, device, attn_implementation: str = "sdpa"):
    """The base model over the installed shared weights, or None when none are installed here.

    Raises WeightShareError when the installed weights belong to another base, dtype or device
    (a worker must never silently load a private copy: that defeats the sharing unseen).
    """
    shared = _ATTACHED
    if shared is None:
        return None
    if Path(base_path).resolve() != shared.base.resolve():
        raise WeightShareError(f"this worker maps the weights of {shared.base}, not {base_path}")
    return shared.build_model(dtype, device, attn_implementation)


# --------------------------------------------------------------------------------------------------
# Owner process entry point
# --------------------------------------------------------------------------------------------------


def owner_main(argv: list[str] | None = None) -> int:
    """``python -m deltazip.runtime.share.weight_share --base DIR --dtype F32 --device cpu --address NAME
    [--runs-on-stdin]``

    Reads the layout's runs (:func:`fused_runs`, one JSON line) from stdin when asked, exports, prints one JSON line ``{"ready": ...}`` on stdout, serves attaches until stdin closes
    (the supervisor holds the other end: if it dies, so does the owner) or SIGTERM.
    """
    ap = argparse.ArgumentParser(description="deltazip weight owner")
    ap.add_argument("--base", required=True)
    ap.add_argument("--dtype", required=True, choices=("F32", "F16", "BF16"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--address", required=True)
    ap.add_argument("--runs-on-stdin", action="store_true",
                    help="read one JSON line from stdin first: lists of names to lay out back to back")
    a = ap.parse_args(argv)
    cuda = a.device.startswith("cuda")
    if cuda:  # before torch initialises CUDA in this process
        os.environ.update(strip_expandable_segments(dict(os.environ)))
    try:
        runs = json.loads(sys.stdin.buffer.readline() or b"[]") if a.runs_on_stdin else None
        if cuda:
            keep, meta = export_cuda(a.base, a.dtype, a.device, runs)
            owner = WeightOwner(meta, a.address, keep=keep)
        else:
            fd, meta, view = export_cpu(a.base, a.dtype, runs)
            owner = WeightOwner(meta, a.address, fd=fd, keep=view)
    except (InputError, OSError, ValueError) as e:
        print(json.dumps({"ready": False, "error": str(e)}), flush=True)
        return 1

    def watch_stdin():
        with contextlib.suppress(Exception):
            while sys.stdin.buffer.read(4096):
                pass
        owner.close()

    import signal

    signal.signal(signal.SIGTERM, lambda *_: owner.close())
    threading.Thread(target=watch_stdin, daemon=True, name="owner-stdin").start()
    print(json.dumps({"ready": True, "pid": os.getpid(), "nbytes": meta.nbytes, "tensors": len(meta.tensors),
                      "seconds": round(meta.seconds, 3), "kind": meta.kind}), flush=True)
    owner.serve_forever()
    owner.close()
    return 0


if __name__ == "__main__":
    sys.exit(owner_main())
