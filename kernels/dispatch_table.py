"""Dispatch by measurement: which delta-matmul path serves a call, per GPU, shape, bits, dtype and batch.

For a stack in the ``mma`` layout on a GPU with the CUDA kernel, a key's choice is the CUDA SBMM kernel
under one of its launch configurations (``deltazip.kernels.cuda_sbmm.CudaConfig``) or the prefill path
that dequantizes each used slot once and calls cuBLAS (``dequant_mm``), whichever measured fastest on
this GPU (``deltazip.runtime.serve.kernel_tuning`` fills the table).

Key: the stack's configuration (bits, group, 2:4, zero points, ``in x out``), the activation dtype, the
batch's row count and the number of slots it uses, each rounded up to a power of two. Results live
in one JSON file per GPU model, torch / NVRTC versions and kernel source hash
(``$DELTAZIP_AUTOTUNE_DIR``, default ``~/.cache/deltazip/autotune``), written atomically.
:func:`lookup` is a dict access on the host, made when a prepared launch (``deltazip.kernels.dispatch``)
first meets a bucket; tuning runs when a server starts (before ``/health`` reports ready), or on a
background thread, never on the request path: an untuned key gets :func:`default_choice`.
"""

from __future__ import annotations

import json
import os
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from deltazip.kernels import cuda_sbmm, preview
from deltazip.kernels.row_plan import rows_bucket
from deltazip.kernels.stacked import StackedDeltas

FORMAT_VERSION = 1
PATHS = ("cuda", "dequant_mm")
_DIR_ENV = "DELTAZIP_AUTOTUNE_DIR"


def cache_dir() -> Path:
    """``$DELTAZIP_AUTOTUNE_DIR``, else ``$XDG_CACHE_HOME/deltazip/autotune`` (``~/.cache`` by default)."""
    from deltazip.kernels.cuda_rtc import user_cache

    return user_cache(_DIR_ENV, "autotune")


def enabled() -> bool:
    """``DELTAZIP_AUTOTUNE=0`` turns tuned launch choices (and tuning) off."""
    return os.environ.get("DELTAZIP_AUTOTUNE", "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Choice:
    """The path a key runs: ``cuda`` with its launch config, or ``dequant_mm``; ``us``: measured time."""

    path: str
    config: cuda_sbmm.CudaConfig | None = None
    us: float | None = None

    def to_json(self) -> dict:
        d = {"path": self.path, "us": self.us}
        if self.config is not None:
            d.update(asdict(self.config))
        return d

    @classmethod
    def from_json(cls, d: dict) -> Choice:
        if not isinstance(d, dict) or d.get("path") not in PATHS:
            raise ValueError(f"not a dispatch choice: {d!r}")
        cfg = None
        if d["path"] == "cuda":
            cfg = cuda_sbmm.CudaConfig(**{k: int(d[k]) for k in ("rb", "stages", "split", "kt")},
                                       mt=int(d.get("mt", 1)),  # tables written before two-tile warps lack it
                                       **{k: bool(d.get(k, False)) for k in ("stream_k", "pdl", "evict")})
        us = d.get("us")
        return cls(d["path"], cfg, float(us) if us is not None else None)


def deltas_bucket(deltas: int) -> int:
    return rows_bucket(max(1, deltas))


def key(stack: StackedDeltas, dtype: torch.dtype, rows: int, deltas: int) -> str:
    return (f"{stack.layout}{'-compact' if stack.compact else ''}/b{stack.bits}/g{stack.effective_group}/"
            f"{'24' if stack.sparse else 'dense'}/"
            f"{'asym' if stack.asymmetric else 'sym'}/{stack.in_features}x{stack.out_features}/"
            f"{str(dtype).removeprefix('torch.')}/r{rows_bucket(rows)}/d{deltas_bucket(min(deltas, rows))}")


def kernel_version() -> str:
    """First 8 hex digits of the SHA-256 of the CUDA kernel's source: a choice timed on one build of the
    kernel says nothing about another, so an upgrade that changes the kernel retunes instead of reading
    the old table."""
    from deltazip.kernels.cuda_rtc import source_digest

    return source_digest(cuda_sbmm.source())[:8]


def device_tag(device: torch.device) -> str:
    """``<gpu>-torch-<v>-nvrtc-<v>-kernel-<hash>``, reduced to file-safe characters."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    try:
        from deltazip.kernels.cuda_rtc import nvrtc_version

        nv = "{}.{}".format(*nvrtc_version())
    except Exception:  # noqa: BLE001
        nv = "none"
    tag = f"dispatch-{name}-torch-{torch.__version__}-nvrtc-{nv}-kernel-{kernel_version()}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", tag).strip("-")


class Table:
    """The measured choices of one GPU model and software stack (one JSON file)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries: dict[str, Choice] = {}
        self.skipped: dict[str, list[str]] = {}

    def load(self) -> Table:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return self
        except (OSError, ValueError) as e:
            warnings.warn(f"dispatch table {self.path} is unreadable ({e}); it will be rewritten", stacklevel=2)
            return self
        if not isinstance(raw, dict) or raw.get("version") != FORMAT_VERSION:
            warnings.warn(f"dispatch table {self.path} is not a version-{FORMAT_VERSION} table; ignoring it",
                          stacklevel=2)
            return self
        for k, v in (raw.get("entries") or {}).items():
            try:
                self.entries[k] = Choice.from_json(v)
            except (ValueError, TypeError, KeyError):
                continue  # a malformed entry is retuned, not fatal
        self.skipped = {k: list(v) for k, v in (raw.get("skipped") or {}).items() if isinstance(v, list)}
        return self

    def save(self) -> None:
        """Write the table atomically (``cuda_rtc.write_atomic``)."""
        from deltazip.kernels.cuda_rtc import write_atomic

        entries, skipped = dict(self.entries), dict(self.skipped)  # copies made in one step each (the GIL)
        doc = {"version": FORMAT_VERSION, "entries": {k: c.to_json() for k, c in sorted(entries.items())},
               "skipped": dict(sorted(skipped.items()))}
        write_atomic(self.path, json.dumps(doc, indent=1).encode())


_TABLES: dict[tuple[str, str], Table] = {}
_TABLES_LOCK = threading.Lock()


def table_for(device: torch.device) -> Table:
    """The table of ``device``, loaded once per process and cache directory: every thread gets the same
    object (a choice recorded into a second copy would be neither looked up nor saved)."""
    memo = (str(device), str(cache_dir()))
    t = _TABLES.get(memo)
    if t is None:
        with _TABLES_LOCK:
            t = _TABLES.get(memo)
            if t is None:
                t = _TABLES[memo] = Table(cache_dir() / f"{device_tag(device)}.json").load()
    return t


def forget_loaded() -> None:
    _TABLES.clear()
    changed()


LISTENERS: list[Callable[[], None]] = []  # told when a choice is added or a configuration distrusted


def changed() -> None:
    """Tell the prepared launches (``deltazip.kernels.dispatch``) that choices changed: they resolve
    their buckets again at their next call."""
    for fn in LISTENERS:
        fn()


def lookup(stack: StackedDeltas, dtype: torch.dtype, rows: int, deltas: int) -> Choice | None:
    """The measured choice of a key; None when untuned, tuning is off, or the choice uses a preview launch
    option that is not switched on now (it was tuned with ``DELTAZIP_CUDA_PREVIEW`` naming it)."""
    if not enabled():
        return None
    c = table_for(stack.device).entries.get(key(stack, dtype, rows, deltas))
    if c is not None and c.config is not None and not preview.config_options(c.config) <= preview.launch_options():
        return None
    return c


def default_choice(stack: StackedDeltas, rows: int, deltas: int) -> Choice:
    """Untuned: the CUDA kernel while weights are read a few times at most, the cuBLAS path beyond."""
    if rows // max(1, min(deltas, rows)) >= 128:
        return Choice("dequant_mm")
    return Choice("cuda")


_DISTRUSTED: set[tuple] = set()  # stack configurations whose CUDA launches all computed something else


def _config_key(stack: StackedDeltas, dtype: torch.dtype) -> tuple:
    return (str(stack.device), stack.bits, stack.effective_group, stack.sparse, stack.asymmetric, stack.in_features,
            stack.out_features, dtype, stack.compact)


def distrusted(stack: StackedDeltas, dtype: torch.dtype) -> bool:
    """Whether every CUDA launch config of this stack configuration failed the tuner's check
    (``kernel_tuning.agrees``) in this process: the dispatcher then sends its calls to the reference
    path, which is slower and right. (A set lookup per call; nothing is built while the set is empty.)"""
    return bool(_DISTRUSTED) and _config_key(stack, dtype) in _DISTRUSTED


def distrust(stack: StackedDeltas, dtype: torch.dtype) -> None:
    """Send every call of this stack configuration to the reference path from now on, in this process
    (the tuner found every CUDA launch config of it wrong on this GPU), and tell the prepared launches."""
    _DISTRUSTED.add(_config_key(stack, dtype))
    changed()
