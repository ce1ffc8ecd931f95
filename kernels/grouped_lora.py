"""Grouped LoRA, ``y[r] = scale[i] * (x[r] @ A[i]^T) @ B[i]^T`` with ``i = index[r]`` (-1: zeros), on
the fastest of four implementations, chosen by measuring them.

- ``loop``: one shrink and one expand GEMM per adapter the batch uses (``reference.lora_shrink_expand``,
  in fp32); reads only those adapters, but lists them on the host (a device sync) and cannot be
  captured in a CUDA graph.
- ``stacked``: two GEMMs against every adapter at once, each row's shrink product masked to its own
  adapter's rank block: no sync, graph-safe, but it reads every adapter of the stack.
- ``gathered``: each row's own factors gathered, then two batched matmuls (``torch.bmm``) of one row
  each: no sync, graph-safe, reads only the adapters the batch uses (once per row: a copy that grows with
  the rows).
- ``grouped``: rows sorted by adapter on the device, then torch's grouped GEMM (``torch._grouped_mm``)
  for the shrink and the expand: no sync; only where this torch, device and dtype run it.

:func:`lora` measures every candidate at the first call of a key (device, dtype, stack shape, rows
bucket), on the call's own adapters with the rows spread over as many of them as there are rows (the
loop's worst case: it cannot see how many a batch uses without a sync), checks each against the loop
(a candidate that raises or differs is not chosen) and keeps the fastest for the process. A server
measures nothing on its request path: its calls pass ``defer``, which receives the :class:`Shape` of
an unmeasured key once (the server's tuner measures it off the engine thread, :func:`measure_shape`,
on random factors of that shape) while :func:`default_path` serves it. Inside CUDA graph capture
nothing is measured: a measured graph-safe choice runs, else ``stacked``.
"""

from __future__ import annotations

import statistics
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltazip.kernels import dispatch_table, reference
from deltazip.kernels.row_plan import rows_bucket

CANDIDATES = ("loop", "stacked", "gathered", "grouped")


def loop(x: torch.Tensor, index: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference: ``[N, out]`` in ``x.dtype`` (shapes as :func:`lora`)."""
    return reference.lora_shrink_expand(x, index, A, B, scale)


_B_ROWS: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
_B_ROWS_LOCK = threading.Lock()  # the engine's forwards and the tuner's measurements both sweep it


def _b_by_rank_rows(B: torch.Tensor) -> torch.Tensor:
    """``B [L, out, R]`` as ``[L * R, out]`` (contiguous), kept while ``B`` lives unchanged (its version:
    a slot loaded in place changes it), so a step does not copy the expand factors again."""
    hit = _B_ROWS.get(id(B))
    if hit is not None and hit[0]() is B and hit[1] == B._version:
        return hit[2]
    rows = B.transpose(1, 2).reshape(-1, B.shape[1])
    with _B_ROWS_LOCK:
        for k in [k for k, v in _B_ROWS.items() if v[0]() is None]:
            del _B_ROWS[k]
        _B_ROWS[id(B)] = (weakref.ref(B), B._version, rows)
    return rows


def stacked(x: torch.Tensor, index: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
            scale: torch.Tensor) -> torch.Tensor:
    """Two dense GEMMs: ``h = x @ [A_0; ...; A_{L-1}]^T`` (``[N, L * R]``), every block but the row's own
    zeroed and its own scaled, then ``h @ [B_0^T; ...]`` (shapes as :func:`lora`)."""
    n, (num, rank, _) = x.shape[0], A.shape
    h = (x @ A.reshape(num * rank, -1).T).view(n, num, rank)
    own = index[:, None] == torch.arange(num, device=x.device)[None, :]  # [N, L]; -1 rows own nothing
    w = torch.where(own, scale.to(h.dtype)[None, :], 0.0)
    return (h * w[:, :, None]).view(n, num * rank) @ _b_by_rank_rows(B)


def grouped(x: torch.Tensor, index: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
            scale: torch.Tensor) -> torch.Tensor:
    """Rows sorted by adapter (-1 rows last, in no group), ``torch._grouped_mm`` for the shrink and the
    expand, back in row order (shapes as :func:`lora`)."""
    num = A.shape[0]
    key = torch.where(index >= 0, index, num)
    order = torch.argsort(key, stable=True)
    offs = torch.cumsum(torch.bincount(key, minlength=num + 1)[:num], 0).to(torch.int32)
    sorted_key = key.index_select(0, order)
    h = torch._grouped_mm(x.index_select(0, order), A.transpose(1, 2), offs=offs)  # [N, R]; rows past the groups: undefined
    s = torch.cat([scale, scale.new_zeros(1)]).index_select(0, sorted_key)
    y = torch._grouped_mm((h.float() * s[:, None]).to(x.dtype), B.transpose(1, 2), offs=offs)
    y = torch.where((sorted_key < num)[:, None], y, 0.0)
    return torch.empty_like(y).index_copy_(0, order, y)


def gathered(x: torch.Tensor, index: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             scale: torch.Tensor) -> torch.Tensor:
    """Each row's own factors gathered (``[N, R, in]`` and ``[N, out, R]``), then two batched matmuls of one
    row each: no sync, graph-safe, and it reads only the adapters the rows use, once per row (shapes as
    :func:`lora`)."""
    own = index.clamp(min=0)
    h = torch.bmm(A.index_select(0, own), x[:, :, None])  # [N, R, 1]
    s = torch.where(index >= 0, scale.index_select(0, own).to(h.dtype), 0.0)
    return torch.bmm(B.index_select(0, own), h * s[:, None, None])[:, :, 0]


_IMPL = {"loop": loop, "stacked": stacked, "gathered": gathered, "grouped": grouped}
CHOICES: dict[tuple, str] = {}  # key -> the measured path, for the process
MEASURED: dict[tuple, dict[str, float | str]] = {}  # key -> {path: median seconds, or why it was not chosen}


def key(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> tuple:
    """What a choice is kept for: device, dtype, adapters, rank, in, out and the rows bucket."""
    return (x.device.type, x.device.index, x.dtype, *A.shape, B.shape[1], rows_bucket(x.shape[0]))


def _sync(device: torch.device) -> None:
    # the measuring thread's stream only: a device-wide synchronisation is invalid while the engine
    # captures a decode graph on another stream
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _time(fn, device: torch.device, reps: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def measure(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor, reps: int = 5) -> dict:
    """``{path: median seconds, or why not}`` of every candidate on probe rows of ``x``'s bucket over this
    stack's adapters (each checked against the loop first)."""
    n = rows_bucket(x.shape[0])
    gen = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(n, A.shape[2], generator=gen).to(device=x.device, dtype=x.dtype)
    index = (torch.arange(n) % min(n, A.shape[0])).to(x.device)
    want = loop(probe, index, A, B, scale).float()
    norm = want.norm().clamp_min(1e-12)
    out: dict[str, float | str] = {}
    for path in CANDIDATES:
        fn = _IMPL[path]
        try:
            err = ((fn(probe, index, A, B, scale).float() - want).norm() / norm).item()
        except (RuntimeError, NotImplementedError, TypeError, AttributeError) as e:
            out[path] = f"fails: {str(e).splitlines()[0][:160]}"
            continue
        if not err <= _tolerance(x.dtype):
            out[path] = f"differs from the loop by {err:.3g} (relative)"
            continue
        out[path] = _time(lambda fn=fn: fn(probe, index, A, B, scale), x.device, reps)
    return out


@dataclass(frozen=True)
class Shape:
    """What a key's measurement needs: the device, the activations' and the factors' dtypes, the stack's
    ``L`` adapters of rank ``R`` over ``in -> out``, and the rows bucket."""

    device: torch.device
    dtype: torch.dtype
    factor_dtype: torch.dtype
    num: int
    rank: int
    in_features: int
    out_features: int
    rows: int

    @property
    def key(self) -> tuple:
        """:func:`key` of a call of this shape."""
        return (self.device.type, self.device.index, self.dtype, self.num, self.rank, self.in_features,
                self.out_features, self.rows)


def default_path(device: torch.device) -> str:
    """What serves an unmeasured key whose measurement is deferred: on a GPU the stacked GEMMs (no sync,
    graph-safe), on a CPU the loop (the reference)."""
    return "stacked" if device.type == "cuda" else "loop"


def _keep(k: tuple, times: dict) -> str:
    MEASURED[k] = times
    ok = {p: t for p, t in times.items() if isinstance(t, float)}
    CHOICES[k] = min(ok, key=ok.get) if ok else "loop"
    return CHOICES[k]


def measure_shape(shape: Shape, reps: int = 5) -> str:
    """Measure a deferred key on random factors of its shape (a server's tuner, off the engine thread)
    and keep the fastest path for the process; returns it."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    n, r, i, o = shape.num, shape.rank, shape.in_features, shape.out_features
    a = (torch.randn(n, r, i, generator=gen) / i**0.5).to(device=shape.device, dtype=shape.factor_dtype)
    b = (torch.randn(n, o, r, generator=gen) / max(r, 1)**0.5).to(device=shape.device, dtype=shape.factor_dtype)
    scale = torch.ones(n, device=shape.device)
    x = torch.empty(shape.rows, i, device=shape.device, dtype=shape.dtype)  # measure reads its rows bucket only
    return _keep(shape.key, measure(x, a, b, scale, reps))


QUEUED: set[tuple] = set()  # deferred keys handed to a ``defer`` already


def choose(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor,
           defer: Callable[[Shape], None] | None = None) -> str:
    """The path of this call's key: measured at its first call outside graph capture (with ``defer``:
    handed to it once, :func:`default_path` serving until it is measured), kept after."""
    k = key(x, A, B)
    path = CHOICES.get(k)
    if path is not None:
        return path
    if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "stacked"
    if not dispatch_table.enabled():  # DELTAZIP_AUTOTUNE=0: nothing measured, the reference serves
        return "loop"
    if defer is not None:
        if k not in QUEUED:
            QUEUED.add(k)
            defer(Shape(x.device, x.dtype, A.dtype, *A.shape, B.shape[1], rows_bucket(x.shape[0])))
        return default_path(x.device)
    return _keep(k, measure(x, A, B, scale))


def lora(x: torch.Tensor, index: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor,
         defer: Callable[[Shape], None] | None = None) -> tuple:
    """``(y, path)``: grouped LoRA on the measured fastest path.

    Args:
        x: ``[N, in]``; index: integer ``[N]`` in ``[-1, L)``; A: ``[L, R, in]``; B: ``[L, out, R]``
            (ranks below ``R`` zero-padded); scale: ``[L]``.
        defer: called once with the :class:`Shape` of an unmeasured key instead of measuring it now
            (a server's request path); :func:`default_path` serves the call.
    Returns:
        ``[N, out]`` in ``x.dtype``, and the path that ran.
    """
    path = choose(x, A, B, scale, defer)
    if path == "loop" and x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        path = "stacked"  # the loop lists adapters on the host: not capturable
    return _IMPL[path](x, index, A, B, scale), path
