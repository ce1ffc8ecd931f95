"""Paged KV cache: fixed-size blocks in one pool per layer, a block table per sequence.

- :class:`BlockPool`: per layer ``k`` and ``v`` of shape ``[num_blocks, H_kv, block_size, D]``
  and a free list (head-major inside a block: a block's keys of one head are one contiguous
  ``[block_size, D]`` matrix, so a range of blocks is a batch of matrices BLAS takes as it is). Blocks are handed out lowest index first, so a sequence's blocks tend to form
  contiguous runs (the attention reads a span of the pool, see ``deltazip.runtime.serve.attention``).
  When no block is held the tensors are dropped: an idle server holds no KV memory.
- :class:`SeqBlocks`: one sequence's block table and length; blocks are taken on demand as the
  sequence grows, given back when it finishes, and copied to host memory while it is preempted.
  :meth:`SeqBlocks.fork` makes a second sequence from the same prefix (the samples of a request with
  ``n > 1``): the full blocks are shared, counted by reference in the pool (a block is free again
  when its last holder lets it go), and only the partial last block is copied, since both
  sequences write their next tokens into it. A shared block is never written: positions below a
  sequence's length are read only.
- :class:`PagedStep`: the ``past_key_values`` object of one forward. Its ``update`` writes the
  step's new keys/values into their blocks (one indexed store per layer) and returns the layer's
  pool tensors as they are: nothing of the past is gathered or concatenated. The step's layout
  (which pool slot holds which position of which batch row) is built once and shared by all layers.

Bytes the cache moves beyond appending new tokens (pool growth, preemption copies) are counted in
``BlockPool.copied_bytes``; ``bench/step.py`` reports them per decode step.
"""

from __future__ import annotations

import heapq
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from deltazip.runtime.serve.masks import allowed_keys
from deltazip.runtime.serve.recurrent_state import RecurrentStep, SeqState, StatePool

DEFAULT_BLOCK_SIZE = 16
# The step whose forward is running (read by the attention function, which transformers calls
# without the cache object).
CURRENT_STEP: ContextVar[PagedStep | None] = ContextVar("deltazip_paged_step", default=None)


class BlockPool:
    """Blocks of ``block_size`` token positions, per layer ``[num_blocks, H_kv, block_size, D]``.

    The pool grows by doubling its block count when the free list runs dry (a copy, counted in
    ``copied_bytes``; steady decoding does not grow it). Layers are created on first write (their
    ``H_kv``, ``D`` and dtype come from the model).
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self.num_blocks = 0
        self._free: list[int] = []  # a heap: lowest index first
        self._refs: dict[int, int] = {}  # holders of each block held by more than one sequence
        self.copied_bytes = 0
        self.generation = 0  # bumped whenever the layer tensors are replaced (CUDA graphs re-capture)
        self.states = StatePool()  # recurrent layers' per-sequence states (hybrid models)

    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """``n`` free blocks (lowest indices first); the pool grows when short."""
        if n > len(self._free):
            self._grow(max(2 * self.num_blocks, self.num_blocks + n - len(self._free), 8))
        return [heapq.heappop(self._free) for _ in range(n)]

    def share(self, blocks: list[int]) -> None:
        """One more sequence holds ``blocks``."""
        for b in blocks:
            self._refs[b] = self._refs.get(b, 1) + 1

    def free(self, blocks: list[int]) -> None:
        """A sequence lets ``blocks`` go; each is free once no other sequence holds it."""
        for b in blocks:
            held = self._refs.get(b, 1)
            if held > 2:
                self._refs[b] = held - 1
            elif held == 2:
                del self._refs[b]
            else:
                heapq.heappush(self._free, b)
        if self._free and len(self._free) == self.num_blocks:  # nothing cached: give the memory back
            self.k, self.v, self.num_blocks, self._free = [], [], 0, []
            self.generation += 1

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """Block ``dst`` of every layer becomes a copy of block ``src``."""
        for k, v in zip(self.k, self.v):
            if k is not None:
                k[dst].copy_(k[src])
                v[dst].copy_(v[src])
                self.copied_bytes += 2 * k[src].numel() * k.element_size()

    @torch.inference_mode()  # the layers are inference tensors (made in the forward): update them as such
    def _grow(self, blocks: int) -> None:
        def grown(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            # Zeros, not empty: masked slots are multiplied by 0 in attention, and 0 * NaN is NaN.
            out = t.new_zeros(blocks, *t.shape[1:])
            out[: t.shape[0]] = t
            self.copied_bytes += t.numel() * t.element_size()
            return out

        self.k = [grown(t) for t in self.k]
        self.v = [grown(t) for t in self.v]
        for b in range(self.num_blocks, blocks):
            heapq.heappush(self._free, b)
        self.num_blocks = blocks
        self.generation += 1

    def layer(self, idx: int, heads: int, dim: int, like: torch.Tensor, dim_v: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``idx``'s ``(k, v)``, created with ``heads`` KV heads of ``dim`` (``dim_v`` for values,
        default ``dim``; dtype and device of ``like``) if new."""
        while len(self.k) <= idx:
            self.k.append(None)
            self.v.append(None)
        if self.k[idx] is None:
            self.k[idx] = like.new_zeros(self.num_blocks, heads, self.block_size, dim)
            self.v[idx] = like.new_zeros(self.num_blocks, heads, self.block_size, dim_v or dim)
        return self.k[idx], self.v[idx]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


class SeqBlocks(SeqState):
    """One sequence's KV cache: its block table in a :class:`BlockPool` (or, while preempted, host
    copies of its blocks), and its recurrent layers' states where the model has some. Same interface
    as the contiguous pool's ``SeqKV``."""

    def __init__(self):
        self.pool: BlockPool | None = None
        self.blocks: list[int] = []
        self.length = 0
        self.host: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def reserve(self, pool: BlockPool, n: int) -> None:
        """Make the table cover ``n`` positions (new blocks on demand)."""
        self.pool = pool
        need = -(-n // pool.block_size) - len(self.blocks)
        if need > 0:
            self.blocks += pool.alloc(need)

    @torch.inference_mode()
    def attach(self, pool: BlockPool) -> None:
        """Take blocks of ``pool`` for the cached positions; a cache moved to the host comes back."""
        if self.host is None:
            self.pool = pool
            return
        self.reserve(pool, self.length)
        idx = torch.tensor(self.blocks, dtype=torch.long)
        for i, (k, v) in enumerate(self.host):
            if k is None:  # a layer without a cache (recurrent, or reusing another layer's keys)
                continue
            pk, pv = pool.layer(i, k.shape[1], k.shape[3], k, v.shape[3])
            pk.index_copy_(0, idx.to(pk.device), k.to(pk.device))
            pv.index_copy_(0, idx.to(pv.device), v.to(pv.device))
            pool.copied_bytes += 2 * k.numel() * k.element_size()
        self.host = None

    def fork(self) -> SeqBlocks:
        """A new sequence with this one's cached positions: full blocks shared, the partial last one
        copied (see the module docstring)."""
        child = SeqBlocks()
        child.pool, child.length = self.pool, self.length
        if self.pool is None or not self.blocks:
            return child
        self.fork_state(child, self.pool.states)
        full = self.length // self.pool.block_size
        shared = self.blocks[:full]
        self.pool.share(shared)
        child.blocks = list(shared)
        if self.length % self.pool.block_size:
            (new,) = self.pool.alloc(1)  # may grow the pool: the source index stays valid
            self.pool.copy_block(self.blocks[full], new)
            child.blocks.append(new)
        return child

    def offload(self) -> None:
        """Copy the sequence's blocks (and states) to host memory and give them back (a preempted sequence)."""
        if not self.blocks:
            return
        pool = self.pool
        self.offload_state(pool.states)
        idx = torch.tensor(self.blocks, dtype=torch.long)
        host = []
        for k, v in zip(pool.k, pool.v):
            if k is None:  # kept in place: a layer's host copy goes back to the same layer
                host.append((None, None))
                continue
            i = idx.to(k.device)
            # index_select copies; .to("cpu") of a CPU tensor would not, and the blocks are given away.
            host.append((k.index_select(0, i).to("cpu"), v.index_select(0, i).to("cpu")))
            pool.copied_bytes += 2 * host[-1][0].numel() * k.element_size()
        self.host = host
        self.free()

    def free(self) -> None:
        if self.blocks and self.pool is not None:
            self.pool.free(self.blocks)
        self.blocks = []
        self.free_state(self.pool.states if self.pool is not None else None)

    def nbytes(self) -> int:
        if self.host is not None:
            return sum((k.numel() + v.numel()) * k.element_size() for k, v in self.host if k is not None)
        if not self.blocks or self.pool is None:
            return 0
        return sum((k[0].numel() + v[0].numel()) * k.element_size() * len(self.blocks)
                   for k, v in zip(self.pool.k, self.pool.v) if k is not None)


class PagedStep(RecurrentStep):
    """The ``past_key_values`` object of one forward over a :class:`BlockPool`.

    Batch row ``b`` has ``P_b`` cached positions and ``T_b`` new tokens, right-aligned in the
    ``Tm = max T`` query positions (left padding). Attributes used by the attention function
    (``deltazip.runtime.serve.attention``), all on the model's device and shared by every layer:

    - ``q_pos`` ``[B, Tm]`` int64: the position of every query (a padding query gets its row's
      first new position, so it sees at least that token and no softmax row is empty);
    - ``see`` ``[B, Tm]`` int64 or None: the last position each query sees, where an image's tokens
      see their whole image (``prompt_media``); None: its own position;
    - ``spans``: list of ``(rows, lo, hi, meta, extra)``: batch rows ``rows`` (a slice) attend over
      pool blocks ``[lo, hi)``. A decode step (``Tm == 1``) is one span for the whole batch; a prefill
      step one span per row (its own blocks). ``meta`` is int64 ``[3, hi - lo + E]``: per block the
      span row owning it (``n_rows`` for a block of no row of the span), the same clamped to a
      valid row (to gather queries), and the block's index in its owner's table (the positions it
      holds are ``index * block_size + offset``). A block that several rows of the span hold (the
      shared prefix of forked samples) belongs to the first in ``[lo, hi)`` and comes once more per
      other holder among the ``E`` entries after it, whose pool indices are ``extra`` (int64 ``[E]``,
      None when no block is shared).

    Args:
        pool: the engine's :class:`BlockPool`.
        caches: one :class:`SeqBlocks` per batch row.
        past, new: ``P_b`` and ``T_b`` per row.
        device: where the model runs.
    """

    logits_to_keep = 1  # 0: the forward returns every position's logits (prompt log probabilities)
    see: torch.Tensor | None = None  # [B, Tm]: the last position each query sees, set where not its own
    cross = None  # the step's cross-attention inputs (cross_attention.CrossStep), set where a row has images

    def __init__(self, pool: BlockPool, caches: list[SeqBlocks], past: list[int], new: list[int],
                 device: torch.device | str):
        self.pool, self.past, self.new = pool, past, new
        self.caches = caches  # which sequence each row extends (tensor-parallel ranks mirror their caches)
        self.tm = max(new)
        self.block_size = pool.block_size
        for c, p, n in zip(caches, past, new):
            c.attach(pool)
            c.reserve(pool, p + n)
        self.tables = [list(c.blocks) for c in caches]
        self.device = torch.device(device)
        self._write: tuple[torch.Tensor, ...] | None = None
        self.q_pos = self._query_positions()
        self.spans = self._spans()
        self._masks: dict = {}

    # -- layout (Python over blocks, then one tensor each: a step's set-up is a handful of ops) --
    def _query_positions(self) -> torch.Tensor:
        pos = [[max(p, p + t - (self.tm - n)) for t in range(self.tm)] for p, n in zip(self.past, self.new)]
        return torch.tensor(pos, dtype=torch.long, device=self.device)

    def _spans(self) -> list[tuple[slice, int, int, torch.Tensor, torch.Tensor | None]]:
        rows_of = [[b] for b in range(len(self.new))] if self.tm > 1 else [list(range(len(self.new)))]
        out = []
        for rows in rows_of:
            lo = min(min(self.tables[b]) for b in rows)
            hi = max(max(self.tables[b]) for b in rows) + 1
            n = len(rows)
            owner, index = [n] * (hi - lo), [0] * (hi - lo)
            extra, x_owner, x_index = [], [], []  # blocks a second row of the span holds too (forks)
            for i, b in enumerate(rows):
                for j, blk in enumerate(self.tables[b]):
                    if owner[blk - lo] == n:
                        owner[blk - lo], index[blk - lo] = i, j
                    else:
                        extra.append(blk)
                        x_owner.append(i)
                        x_index.append(j)
            owner, index = owner + x_owner, index + x_index
            meta = torch.tensor([owner, [min(o, n - 1) for o in owner], index], dtype=torch.long, device=self.device)
            more = torch.tensor(extra, dtype=torch.long, device=self.device) if extra else None
            out.append((slice(rows[0], rows[-1] + 1), lo, hi, meta, more))
        return out

    def blocked(self, span: int, window: int | None, chunk: int | None = None) -> torch.Tensor:
        """Bool ``[nb, 1, 1, Tm, block_size]``, True where a query of a block's owner may NOT attend,
        for span ``span``: a query sees its own row's positions up to its own (and, with a sliding
        ``window``, after ``q - window``; with a ``chunk``, in its own chunk). Built once per step,
        window and chunk, shared by the layers."""
        key = (span, window, chunk)
        if key not in self._masks:
            rows, _, _, meta, _ = self.spans[span]
            q = self.q_pos[rows].index_select(0, meta[1]).unsqueeze(-1)  # [nb, Tm, 1]
            see = None if self.see is None else self.see[rows].index_select(0, meta[1]).unsqueeze(-1)
            k = (meta[2] * self.block_size).view(-1, 1, 1) + torch.arange(self.block_size, device=q.device)
            ok = allowed_keys(k, q, window, chunk, see)  # [nb, Tm, bs]
            self._masks[key] = (~ok).view(ok.shape[0], 1, 1, *ok.shape[1:])
        return self._masks[key]

    def _write_index(self) -> tuple[torch.Tensor, ...]:
        """Batch row, token index, pool block and offset in it of every real new token."""
        if self._write is None:
            b, t, blk, off = [], [], [], []
            bs = self.block_size
            for i, (p, n) in enumerate(zip(self.past, self.new)):
                b += [i] * n
                t += range(self.tm - n, self.tm)
                blk += [self.tables[i][x // bs] for x in range(p, p + n)]
                off += [x % bs for x in range(p, p + n)]
            self._write = torch.tensor([b, t, blk, off], dtype=torch.long, device=self.device).unbind(0)
        return self._write

    # -- the Cache interface transformers calls ---------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store ``[B, H_kv, Tm, D]`` new keys/values in their blocks; returns the layer's pool
        ``(k, v)``, each ``[num_blocks, H_kv, block_size, D]`` (the attention reads it in place)."""
        pk, pv = self.pool.layer(layer_idx, key_states.shape[1], key_states.shape[3], key_states,
                                 value_states.shape[3])
        b, t, blk, off = self._write_index()
        pk[blk, :, off] = key_states[b, :, t]
        pv[blk, :, off] = value_states[b, :, t]
        return pk, pv

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.past)

    @contextmanager
    def bound(self):
        """The step is visible to the attention function while the forward runs."""
        token = CURRENT_STEP.set(self)
        try:
            yield self
        finally:
            CURRENT_STEP.reset(token)
