"""Decoupled embeddings: each row of a batch gathers from its own variant's table.

Token tables (``nn.Embedding``), scaled token embeddings (Gemma's ``…ScaledWordEmbedding``: the
gathered row times ``embed_scale``) and learned position tables (GPT-2's ``wpe``, OPT's
``OPTLearnedPositionalEmbedding``, which looks up ``position + 2``) are all ``nn.Embedding``s whose
subclass ``forward`` transforms the ids or the output around ``nn.Embedding.forward``. Rather than
re-implementing each subclass, :func:`decouple_embedding` slots :class:`DeltaEmbedding` in the
module's class hierarchy right above ``nn.Embedding``: the subclass's own ``forward`` still runs
(scale, position offset, whatever it does) and its ``super().forward(ids)`` becomes the per-row
gather. The module object stays the same one (its buffers, such as Gemma's ``embed_scale``, and
any tying stay as loaded).

Per slot either the variant's whole ``[V, H]`` table is referenced (no copy; slots holding the same
deduplicated table share it), or only the rows it replaces are held (a PEFT adapter's trainable
tokens: ``token_ids [n]``, ``token_rows [n, H]``, with a ``[V]`` map from token id to row); a slot
whose variant keeps the table "same" reads the base table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltazip.runtime.serve.delta_linear import DeltaContext


class DeltaEmbedding(nn.Embedding):
    """``nn.Embedding.forward`` with per-row tables. Made by :func:`decouple_embedding`, not constructed.

    ``forward(ids)``: ``ids [B, T]`` (or ``[1, T]`` shared by the whole batch, as GPT-2 and
    GPTBigCode pass their default position ids) -> ``[B, T, H]``: row ``b`` reads its slot's table
    where that slot changed it, else the base table.
    """

    ctx: DeltaContext
    _tables: dict[int, torch.Tensor]
    _rows: dict[int, tuple[torch.Tensor, torch.Tensor]]
    _reached: bool

    def _init_slots(self, ctx: DeltaContext) -> None:
        self.ctx = ctx
        self._tables = {}  # slot -> [V, H] (a reference)
        self._rows = {}  # slot -> (row of each token id, -1 for the base's [V] int32; the rows [n, H])
        self._reached = False

    def clear_slot(self, slot: int) -> None:
        self._tables.pop(slot, None)
        self._rows.pop(slot, None)

    def load_slot(self, slot: int, weight: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
                  token_rows: torch.Tensor | None = None) -> None:
        """The variant's table ``weight [V, H]`` for ``slot`` (referenced, not copied), or the rows
        ``token_rows [n, H]`` it gives token ids ``token_ids [n]`` (the base's rows elsewhere)."""
        self.clear_slot(slot)
        if weight is not None:
            if tuple(weight.shape) != tuple(self.weight.shape):
                raise ValueError(f"embedding {tuple(weight.shape)} != base {tuple(self.weight.shape)}")
            self._tables[slot] = weight.to(device=self.weight.device, dtype=self.weight.dtype)
            return
        if token_ids is None or token_rows is None or token_rows.shape != (token_ids.shape[0], self.weight.shape[1]):
            raise ValueError("an embedding slot takes a whole table, or token ids [n] with their rows [n, H]")
        where = torch.full((self.weight.shape[0],), -1, dtype=torch.int32, device=self.weight.device)
        where[token_ids.to(self.weight.device)] = torch.arange(token_ids.shape[0], dtype=torch.int32,
                                                                device=self.weight.device)
        self._rows[slot] = (where, token_rows.to(device=self.weight.device, dtype=self.weight.dtype))

    def resident_bytes(self, slot: int) -> int:
        if slot in self._rows:
            where, rows = self._rows[slot]
            return where.numel() * where.element_size() + rows.numel() * rows.element_size()
        return 0 if slot not in self._tables else self.weight.numel() * self.weight.element_size()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._reached = True
        out = F.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                          self.scale_grad_by_freq, self.sparse)
        present = (self._tables.keys() | self._rows.keys()) & self.ctx.active
        if not present:
            return out
        b = self.ctx.row_slot.shape[0]
        if ids.dim() == 0 and b > 1:  # one id looked up for no row of the batch (Gemma 4 tests which
            return out  # input embeddings are its image token's): the base's row
        if ids.dim() >= 2 and ids.shape[0] == 1 and b > 1:
            # ids shared by every row (default position ids [1, T]): each row gathers its own copy
            ids = ids.expand(b, *ids.shape[1:])
            out = out.expand(b, *out.shape[1:])
        idx = self.ctx.token_index(ids.unsqueeze(-1)).view(ids.shape).unsqueeze(-1)  # [B, T, 1]
        for s in sorted(present):
            if s in self._tables:
                out = torch.where(idx == s, F.embedding(ids, self._tables[s], self.padding_idx), out)
                continue
            where, rows = self._rows[s]
            row = where[ids].long()  # [B, T]: the slot's row of each token, -1 for the base's
            out = torch.where((idx == s) & (row >= 0).unsqueeze(-1), rows[row.clamp(min=0)], out)
        return out


_CLASSES: dict[type, type] = {}


def _guarded_forward(cls: type):
    """``cls.forward``, checked to have gone through ``DeltaEmbedding.forward`` (else its rows would
    silently read the base table)."""

    def forward(self, *args, **kwargs):
        self._reached = False
        out = cls.forward(self, *args, **kwargs)
        if not self._reached:
            raise RuntimeError(f"{cls.__name__}.forward did not call nn.Embedding.forward; its rows cannot be "
                               "decoupled")
        return out

    return forward


def can_decouple(module: nn.Module) -> bool:
    """True for an ``nn.Embedding`` whose class's every ``forward`` between it and ``nn.Embedding`` hands
    on to ``super().forward`` (so the per-row gather is reached): plain tables, Gemma's scaled
    embeddings, OPT's learned positions. Checked on the code, and again on every forward."""
    if not isinstance(module, nn.Embedding):
        return False
    if isinstance(module, DeltaEmbedding):
        return True
    for c in type(module).__mro__:
        if c is nn.Embedding:
            return True
        fwd = c.__dict__.get("forward")
        if fwd is not None and "super" not in getattr(getattr(fwd, "__code__", None), "co_names", ()):
            return False
    return False


def decouple_embedding(module: nn.Embedding, ctx: DeltaContext) -> DeltaEmbedding:
    """Make ``module`` (an ``nn.Embedding`` or subclass, see :func:`can_decouple`) per-row, in place.

    Its class becomes ``DeltaEmbedding`` (plain tables) or ``Delta<Class>`` with bases
    ``(Class, DeltaEmbedding)``, so ``Class.forward`` runs unchanged and its call of
    ``nn.Embedding.forward`` lands on :meth:`DeltaEmbedding.forward`. Returns the same object.
    """
    if isinstance(module, DeltaEmbedding):
        return module
    if not can_decouple(module):
        raise ValueError(f"{type(module).__name__} does not look its rows up through nn.Embedding.forward")
    cls = type(module)
    new = DeltaEmbedding if cls is nn.Embedding else _CLASSES.get(cls)
    if new is None:
        new = type(f"Delta{cls.__name__}", (cls, DeltaEmbedding),
                   {"forward": _guarded_forward(cls), "__module__": __name__,
                    "__doc__": f"{cls.__name__} with per-row tables (see DeltaEmbedding)."})
        _CLASSES[cls] = new
    module.__class__ = new
    module._init_slots(ctx)
    return module
