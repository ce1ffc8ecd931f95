"""Measure what a forward does with the KV cache: bytes copied out of it, bytes appended to it.

:class:`KVCopyMeter` is a ``TorchDispatchMode`` that sees every aten op of a forward. Tensors
whose storage is one of the KV pool's (or was filled by copying from one) are *KV*; an op that
copies data (``index_select``, ``cat``, ``clone``, ``copy_``, ...) out of a KV tensor into another
tensor adds the bytes it writes to ``copied`` and marks its output as KV too (so a ``cat`` of a
gathered past counts again); an op that writes into the pool from non-KV data (the new tokens)
adds to ``appended``. Reading KV in place (``matmul`` over a view of the pool) copies nothing.
Used by ``bench/step.py`` and the tests; not on the serving path.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_aten = torch.ops.aten
COPY_OPS = {
    _aten.index_select.default, _aten.cat.default, _aten.index.Tensor, _aten.clone.default,
    _aten._to_copy.default, _aten.copy_.default, _aten.gather.default, _aten.stack.default,
    _aten.repeat_interleave.self_int, _aten.repeat_interleave.self_Tensor, _aten.repeat.default,
    _aten.expand_copy.default, _aten.index_put_.default, _aten.index_put.default, _aten.index_copy_.default,
    _aten.index_copy.default, _aten.masked_select.default, _aten.take.default, _aten.constant_pad_nd.default,
    _aten.slice_scatter.default, _aten.select_scatter.default,
}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class KVCopyMeter(TorchDispatchMode):
    """Count KV bytes copied and appended, and aten ops, while active.

    Args:
        pool: the KV pool (anything with per-layer ``k`` and ``v`` lists), re-read at every op so
            that layers created or replaced during the forward count as KV.
    """

    def __init__(self, pool):
        super().__init__()
        self.pool = pool
        self.kv: set[int] = set()
        self._held: list[torch.Tensor] = []  # marked outputs stay alive: no later tensor reuses their memory
        self.copied = 0
        self.appended = 0
        self.ops = 0

    def __exit__(self, *exc):
        self._held.clear()
        return super().__exit__(*exc)

    def _refresh(self) -> None:
        for t in list(self.pool.k) + list(self.pool.v):
            if t is not None:
                self.kv.add(_storage(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        self._refresh()
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        kv_in = [t for t in tensors if _storage(t) in self.kv]
        out = func(*args, **kwargs)
        if func in COPY_OPS and kv_in:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            dest_is_kv = func in (_aten.copy_.default, _aten.index_put_.default, _aten.index_copy_.default) \
                and _storage(args[0]) in self.kv
            sources = [t for t in tensors[1:] if _storage(t) in self.kv] if dest_is_kv else kv_in
            if dest_is_kv and not sources:  # new tokens written into their place in the pool
                src = tensors[-1]
                self.appended += _nbytes(src)
            else:
                written = _nbytes(tensors[-1]) if dest_is_kv else sum(_nbytes(t) for t in outs)
                self.copied += written
                for t in outs:
                    if not dest_is_kv:
                        self.kv.add(_storage(t))
                        self._held.append(t)
        return out
