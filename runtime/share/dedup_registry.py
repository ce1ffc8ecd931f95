"""Process-wide tensor deduplication: identical tensors of different models share one storage.

Loading several checkpoints through a :class:`TensorDedupRegistry` returns, for every tensor whose
fingerprint ``(dtype, shape, hash of raw bytes)`` was seen before on the same device, the tensor
already held: same storage, same ``data_ptr()``. The lookup happens BEFORE the copy to the device,
so a reused tensor never allocates device memory at all.

Shared storage must not change under another model's feet, so every tensor the registry hands
out is a :class:`ReadOnlyTensor`: a ``torch.Tensor`` subclass whose ``__torch_function__`` raises
:class:`SharedTensorWriteError` on in-place ops (``add_``, ``copy_``, ``mul_``, ``zero_``,
``x[i] = v``, ``+=``, ``out=``, ``inplace=True``, ``nn.init.*_``, ``load_state_dict`` into it),
also through views (``t[0]``, ``t.view(...)``, ``t.data``, ``t.detach()``) and under
``torch.no_grad()``. Results of computations (``x @ w``) are ordinary tensors. ``t.numpy()`` gives
a non-writeable array. Deliberate escape hatches (``untyped_storage()``, DLPack, ``as_subclass``)
are not policed.

The cost of the guard is one Python call per torch op that touches a shared tensor (a few
microseconds: ~5 us per ``F.linear`` on the 2-core bench box); bench/dedup.py reports its share of
a forward pass.

Fingerprints are computed exactly as ``deltazip dedup-scan`` computes them (same hashers over the
same bytes), so a scan's manifest predicts what the registry will share.
"""

from __future__ import annotations

import copy
import inspect
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch._C import DisableTorchFunctionSubclass

from deltazip.formats.dedup_scan import TensorFingerprint, hash_bytes, hash_name
from deltazip.formats.dtypes import ST_TO_TORCH, TORCH_TO_ST
from deltazip.formats.errors import DeltazipError, InputError


class SharedTensorWriteError(DeltazipError, RuntimeError):
    """An in-place write to a tensor that the dedup registry shares between models."""


# ------------------------------------------------------------------------------- read-only guard

_INPLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
})
# Trailing-underscore methods that change metadata or autograd flags, never the data.
_NON_WRITING = frozenset({"requires_grad_", "retain_grad", "share_memory_", "detach_", "rename_",
                          "names_", "record_stream", "align_to_"})
_MUTATES = 1
_INPLACE_ARG = 2
_ALIASES = 4  # returns a tensor sharing storage with an input without being a view (detach, .data)
_ALIAS_NAMES = frozenset({"detach", "__get__", "alias"})
_classify_cache: dict[object, tuple[int, int]] = {}


def _classify(func) -> tuple[int, int]:
    """(flags, position of an ``inplace`` parameter or -1) of a torch function, cached."""
    try:
        hit = _classify_cache.get(func)
    except TypeError:  # an unhashable callable: classify it every time
        hit = None
    if hit is not None:
        return hit
    name = getattr(func, "__name__", "")
    flags = 0
    if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_") and name not in _NON_WRITING):
        flags |= _MUTATES
    elif name.startswith("_foreach_") and name.endswith("_"):  # optimizers' fused in-place updates
        flags |= _MUTATES
    if name in _ALIAS_NAMES:
        flags |= _ALIASES
    pos = -1
    try:
        params = list(inspect.signature(func).parameters)
        if "inplace" in params:
            flags |= _INPLACE_ARG
            pos = params.index("inplace")
    except (TypeError, ValueError):  # builtins without a signature have no ``inplace`` parameter
        pass
    try:
        _classify_cache[func] = (flags, pos)
    except TypeError:
        pass
    return flags, pos


def _first_arg(args, kwargs):
    """The tensor an in-place op writes: ``self`` / the first argument, positional or keyword
    (``nn.init.normal_`` dispatches with ``tensor=`` as a keyword)."""
    if args:
        return args[0]
    if kwargs:
        for key in ("input", "tensor", "self"):
            if key in kwargs:
                return kwargs[key]
    return None


def _is_shared(x) -> bool:
    if isinstance(x, ReadOnlyTensor):
        return True
    if isinstance(x, (list, tuple)):
        return any(isinstance(y, ReadOnlyTensor) for y in x)
    return False


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # meta / sparse tensors have no plain storage
        return -1


class ReadOnlyTensor(torch.Tensor):
    """A tensor whose storage is shared through the dedup registry: in-place writes raise.

    Views of it (indexing, ``view``, ``detach``, ``.data``, ``split``...) are ReadOnlyTensors too,
    decided by storage identity; anything computed from it is a plain tensor.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # This runs for every torch op that touches a shared weight (F.linear in every forward),
        # so the common path is: one cached dict lookup, the call, one C-level _is_view() check.
        flags, pos = _classify(func)
        if flags & (_MUTATES | _INPLACE_ARG):
            target = None
            if flags & _MUTATES:
                target = _first_arg(args, kwargs)
            elif flags & _INPLACE_ARG and ((kwargs and kwargs.get("inplace")) or (0 <= pos < len(args) and args[pos] is True)):
                target = _first_arg(args, kwargs)
            if target is not None and _is_shared(target):
                raise SharedTensorWriteError(
                    f"in-place {getattr(func, '__name__', func)} on a tensor shared by the dedup registry; "
                    "shared weights are read-only (clone() it to get a private, writable copy)")
        if kwargs:
            out = kwargs.get("out")
            if out is not None and _is_shared(out):
                raise SharedTensorWriteError(f"{getattr(func, '__name__', func)}(out=...) into a tensor shared by "
                                             "the dedup registry; shared weights are read-only")
            with DisableTorchFunctionSubclass():
                ret = func(*args, **kwargs)
        else:
            with DisableTorchFunctionSubclass():
                ret = func(*args)
        if type(ret) is torch.Tensor:
            if not (flags & _ALIASES) and not ret._is_view():
                return ret  # a fresh result (x @ w): private memory, writable
            return _wrap(ret) if _any_shared_storage(ret, args) else ret
        return _rewrap(ret, args)

    def numpy(self, *args, **kwargs):
        """A numpy view that cannot be written through."""
        with DisableTorchFunctionSubclass():
            arr = torch.Tensor.numpy(self, *args, **kwargs)
        arr.flags.writeable = False
        return arr

    def __deepcopy__(self, memo):
        # A deep copy is private memory: give back a plain, writable tensor (a Parameter if this
        # was one) instead of torch's subclass path, which insists that clone() keep the type.
        with DisableTorchFunctionSubclass():
            data = torch.Tensor.clone(self)
        out = torch.nn.Parameter(data, requires_grad=self.requires_grad) if getattr(self, "_is_param", False) else data
        memo[id(self)] = out
        return out


def _rewrap(ret, args):
    """Mark outputs that alias a shared input's storage (views) as ReadOnlyTensor."""
    if isinstance(ret, torch.Tensor):
        if isinstance(ret, ReadOnlyTensor) or not _any_shared_storage(ret, args):
            return ret
        return _wrap(ret)
    if isinstance(ret, (tuple, list)) and ret and all(isinstance(r, torch.Tensor) for r in ret):
        wrapped = [_rewrap(r, args) for r in ret]
        return type(ret)(wrapped) if isinstance(ret, list) else tuple(wrapped)
    return ret


def _any_shared_storage(t: torch.Tensor, args) -> bool:
    ptr = None
    for a in args:
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(x, ReadOnlyTensor):
                if ptr is None:
                    ptr = _storage_ptr(t)
                    if ptr in (-1, 0):
                        return False
                if _storage_ptr(x) == ptr:
                    return True
    return False


def read_only(t: torch.Tensor) -> ReadOnlyTensor:
    """The same storage as ``t`` (no copy), as a ReadOnlyTensor."""
    if isinstance(t, ReadOnlyTensor):
        return t
    return _wrap(t)


def _wrap(t: torch.Tensor) -> ReadOnlyTensor:
    # A detached alias of ``t`` (same storage, offset and strides) typed ReadOnlyTensor, as
    # nn.Parameter makes its own. Not ``as_subclass``: that makes a view, and a view holds its base
    # alive, so a parameter whose storage is later replaced (``.data = ...``, merged projections)
    # would keep the memory it replaced.
    with DisableTorchFunctionSubclass():
        return torch.Tensor._make_subclass(ReadOnlyTensor, t, False)


# -------------------------------------------------------------------------------------- registry

@dataclass
class DedupStats:
    """Counters of a registry.

    registered: unique tensors held; reused: lookups answered with a held tensor;
    skipped_small: tensors below ``min_tensor_bytes`` (returned private, never shared);
    bytes_registered: bytes held; bytes_saved: bytes of the reused lookups (memory not allocated);
    collisions: same fingerprint, different bytes (only detectable with ``verify_bytes``).
    """

    registered: int = 0
    reused: int = 0
    skipped_small: int = 0
    bytes_registered: int = 0
    bytes_saved: int = 0
    collisions: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _device_key(device: torch.device | str | None) -> torch.device:
    d = torch.device(device if device is not None else "cpu")
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a CPU tensor in its own dtype (no conversion), zero-copy."""
    if t.numel() == 0:
        return memoryview(b"")
    with DisableTorchFunctionSubclass():
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        return memoryview(torch.Tensor.numpy(flat)).cast("B")


class TensorDedupRegistry:
    """Content-addressed store of read-only tensors, keyed by (device, fingerprint).

    Thread-safe: hashing runs outside the lock (the hashers release the GIL), lookups and inserts
    under it; when two threads race on the same new tensor both build it, one wins and the other
    is counted as reused. The registry holds strong references: its tensors live until
    :meth:`clear` (models sharing them keep their own references too).

    Args:
        hash_algorithm: ``xxh3`` (default), ``blake3`` or ``blake2b`` - as in ``dedup-scan``.
        min_tensor_bytes: tensors smaller than this are not hashed nor shared (returned as private
            tensors on the device); the seed's default was 4 MiB, here 0 shares everything.
        verify_bytes: on a fingerprint hit, compare the bytes before sharing (copies a device
            tensor back to the host for the check); a mismatch is a counted collision and the
            new tensor is kept separately.
        weak: hold tensors by weak reference: a tensor stays shareable while some model still
            references it and is freed (and forgotten) when the last one drops it. For a server
            whose variants come and go (host LRU evictions, unloads); the default keeps strong
            references until :meth:`clear`.
    """

    def __init__(self, hash_algorithm: str = "xxh3", min_tensor_bytes: int = 0, verify_bytes: bool = False,
                 weak: bool = False):
        hash_name(hash_algorithm)  # validates
        if min_tensor_bytes < 0:
            raise InputError(f"min_tensor_bytes must be >= 0, got {min_tensor_bytes}")
        self.hash_algorithm = hash_algorithm
        self.min_tensor_bytes = int(min_tensor_bytes)
        self.verify_bytes = bool(verify_bytes)
        self.weak = bool(weak)
        self._lock = threading.Lock()
        # Entries are tensors, or weakref.ref to tensors in weak mode (see _live).
        self._store: dict[tuple[torch.device, TensorFingerprint], list] = {}
        self._stats = DedupStats()

    # ---- fingerprints
    def fingerprint_bytes(self, raw, dtype: str, shape: Sequence[int]) -> TensorFingerprint:
        """The fingerprint of raw tensor bytes (e.g. a safetensors view) with a safetensors dtype string."""
        return TensorFingerprint(dtype, tuple(int(s) for s in shape), hash_name(self.hash_algorithm),
                           hash_bytes(raw, self.hash_algorithm))

    def fingerprint(self, t: torch.Tensor) -> TensorFingerprint:
        """The fingerprint of a tensor's bytes in its own dtype; equals the scan's for the same tensor."""
        if t.dtype not in TORCH_TO_ST:
            raise InputError(f"dtype {t.dtype} has no safetensors name; cannot fingerprint it")
        cpu = t.detach().cpu() if t.device.type != "cpu" else t
        return self.fingerprint_bytes(_tensor_bytes(cpu), TORCH_TO_ST[t.dtype], t.shape)

    # ---- lookups
    def register(self, tensor: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
        """Deduplicate one tensor and return the copy to use on ``device`` (default: its own).

        The fingerprint is taken from the host bytes before any device copy; a hit returns the
        held tensor (same ``data_ptr()``) without allocating, a miss stores a copy (never an alias
        of ``tensor``). Returns a ReadOnlyTensor, or for tensors below ``min_tensor_bytes`` a
        private tensor on the device.
        """
        dev = _device_key(device if device is not None else tensor.device)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self.min_tensor_bytes:
            with self._lock:
                self._stats.skipped_small += 1
            with DisableTorchFunctionSubclass():
                return tensor.detach().to(dev)
        host = tensor.detach()
        if host.device.type != "cpu":
            host = host.cpu()
        fp = self.fingerprint(host)
        # On a miss the registry keeps its own copy: holding the caller's memory would let a later
        # write through the caller's (writable) alias change every model sharing it.
        with DisableTorchFunctionSubclass():
            build = (lambda: host.clone()) if dev.type == "cpu" else (lambda: host)
        return self._lookup_or_insert(dev, fp, build, nbytes)[0]

    def acquire_bytes(self, raw, dtype: str, shape: Sequence[int], device: torch.device | str | None = None,
                      pin_memory: bool = False, build=None) -> tuple[torch.Tensor, bool]:
        """Deduplicate a tensor given as raw bytes (a safetensors mmap view), building it only on a miss.

        Args:
            raw: bytes-like of exactly ``numel x itemsize`` bytes, e.g. ``RawFile.view(name)``.
            dtype: safetensors dtype string (``BF16``...).
            shape: the tensor's shape.
            device: where the tensor must live; the bytes are hashed on the host first.
            pin_memory: stage through pinned memory on a miss (faster host-to-GPU copies).
            build: optional ``() -> host tensor`` (dtype and shape as given) used on a miss instead
                of copying ``raw`` into fresh memory, e.g. a zero-copy view of a file-backed
                storage. Must not alias memory that anyone may write.
        Returns:
            (tensor, reused): the shared ReadOnlyTensor (a private tensor below
            ``min_tensor_bytes``) and whether it was already held (no memory allocated).
        """
        if dtype not in ST_TO_TORCH:
            raise InputError(f"dtype {dtype!r} is not supported by the dedup loader")
        dev = _device_key(device)
        nbytes = memoryview(raw).nbytes

        def copy_raw() -> torch.Tensor:
            # One memcpy out of the mapping into torch-owned memory: the file can be closed after,
            # and torch never wraps a read-only buffer (which it would warn about).
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory and dev.type == "cuda")
            if nbytes:
                torch.Tensor.numpy(host)[:] = np.frombuffer(raw, dtype=np.uint8)
            return host.view(ST_TO_TORCH[dtype]).reshape(tuple(shape))

        if build is None:
            build = copy_raw

        if nbytes < self.min_tensor_bytes:
            with self._lock:
                self._stats.skipped_small += 1
            return build().to(dev), False
        fp = self.fingerprint_bytes(raw, dtype, shape)
        return self._lookup_or_insert(dev, fp, build, nbytes)

    def _lookup_or_insert(self, dev: torch.device, fp: TensorFingerprint, build, nbytes: int) -> tuple[ReadOnlyTensor, bool]:
        key = (dev, fp)
        with self._lock:
            held = self._live(key)
        if held:
            hit = self._match(held, build) if self.verify_bytes else held[0]
            if hit is not None:
                with self._lock:
                    self._stats.reused += 1
                    self._stats.bytes_saved += nbytes
                return hit, True
        host = build()
        with DisableTorchFunctionSubclass():
            on_dev = host if host.device == dev else host.to(dev, non_blocking=False)
        new = read_only(on_dev)
        with self._lock:
            held = self._live(key)
            if held and not self.verify_bytes:
                # Lost a race against another thread building the same tensor: use the winner's.
                self._stats.reused += 1
                self._stats.bytes_saved += nbytes
                return held[0], True
            if held and self.verify_bytes:
                for t in held:
                    if _equal_bytes(t, host):
                        self._stats.reused += 1
                        self._stats.bytes_saved += nbytes
                        return t, True
                self._stats.collisions += 1
            self._store.setdefault(key, []).append(weakref.ref(new) if self.weak else new)
            self._stats.registered += 1
            self._stats.bytes_registered += nbytes
        return new, False

    def _live(self, key) -> list[ReadOnlyTensor]:
        """Held tensors of ``key`` (caller holds the lock); in weak mode dead entries are dropped."""
        entries = self._store.get(key)
        if not entries:
            return []
        if not self.weak:
            return entries
        live = [t for t in (r() for r in entries) if t is not None]
        if len(live) != len(entries):
            if live:
                self._store[key] = [weakref.ref(t) for t in live]
            else:
                del self._store[key]
        return live

    def _match(self, held: list[ReadOnlyTensor], build) -> ReadOnlyTensor | None:
        host = build()
        for t in held:
            if _equal_bytes(t, host):
                return t
        return None

    # ---- bookkeeping
    @property
    def stats(self) -> DedupStats:
        """A snapshot of the counters."""
        with self._lock:
            return copy.copy(self._stats)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(self._live(k)) for k in list(self._store))

    def held_bytes(self) -> int:
        """Bytes of the tensors held now (in weak mode only those some model still references)."""
        with self._lock:
            return sum(t.numel() * t.element_size() for k in list(self._store) for t in self._live(k))

    def clear(self) -> None:
        """Forget every held tensor and reset the counters (models keep what they reference)."""
        with self._lock:
            self._store.clear()
            self._stats = DedupStats()


def _equal_bytes(held: torch.Tensor, host: torch.Tensor) -> bool:
    """Byte equality of a held (any device) and a host tensor of the same dtype and shape."""
    with DisableTorchFunctionSubclass():
        a = held.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        b = host.detach().contiguous().reshape(-1).view(torch.uint8)
        return a.shape == b.shape and bool(torch.equal(a, b))


_default: TensorDedupRegistry | None = None
_default_lock = threading.Lock()


def get_registry() -> TensorDedupRegistry:
    """The process-wide registry (created on first use with default options)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = TensorDedupRegistry()
        return _default
