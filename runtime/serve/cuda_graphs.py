"""CUDA graphs of the paged decode step (CUDA only; the engine runs eagerly elsewhere).

A decode step of ``B`` rows runs as the replay of a graph captured for its batch-size bucket
(the next power of two); rows beyond ``B`` are padding that writes its key/value into a free block
and attends nowhere. Everything the step varies lives in static device buffers filled before each
replay (token ids, positions, where the new tokens go, which blocks the rows own), so the captured
region makes no host synchronisation and allocates nothing new. The captured attention spans the
whole pool (its shape must not change while the graph lives), so it also scores the blocks of
sequences outside the batch and discards them: the price of a fixed shape.

A step while some KV block is shared (the samples of a request with ``n > 1``) runs eagerly: the
captured layout gives each block one owner.

A graph bakes in what the host decided while it was captured, so it is keyed by everything those
decisions read: the bucket, the padded rows' delta slots (the decoupled modules route rows by slot
on the host), the KV pool's generation (its tensors are replaced when it grows or empties) and the
resident variants (loading a slot may replace the tensors the graph reads). A step whose key has
no graph runs eagerly the first time the key is met and captures one the second time (at most
``max_graphs``, least recently used dropped): with many variants, continuous batching meets many
compositions of slots that last one step, and a capture costs about two eager steps. A capture that
fails (a module that syncs with the host, say) marks its key eager for good, and the step runs eagerly.
Captures go through ``graph_capture.capture``: the loader and tuner threads use the device meanwhile.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from deltazip.kernels import dispatch
from deltazip.runtime.serve.graph_capture import capture
from deltazip.runtime.serve.kv_cache import BlockPool, PagedStep, SeqBlocks
from deltazip.runtime.serve.model_runner import run_model

log = logging.getLogger("deltazip.serve")
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class StaticDecodeStep(PagedStep):
    """A :class:`PagedStep` of one token per row over the whole pool, its tensors static buffers
    (one span: blocks ``[0, num_blocks)``) refilled by :meth:`fill` before every replay."""

    def __init__(self, pool: BlockPool, rows: int, device: torch.device):
        self.pool, self.tm, self.block_size, self.device = pool, 1, pool.block_size, device
        self.rows = rows
        self.past = [0] * rows
        self.q_pos = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.meta = torch.zeros(3, pool.num_blocks, dtype=torch.long, device=device)
        self.spans = [(slice(0, rows), 0, pool.num_blocks, self.meta, None)]
        self.write = torch.zeros(4, rows, dtype=torch.long, device=device)
        self.write[0] = torch.arange(rows, device=device)
        self._write = tuple(self.write.unbind(0))
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.mask = torch.ones(rows, 1, 1, 1, dtype=torch.bool, device=device)
        self._masks: dict = {}

    def fill(self, caches: list[SeqBlocks], tokens: list[int], past: list[int], scratch: int) -> None:
        """Host-side layout of the real rows, one copy per buffer (non-blocking from pinned memory)."""
        n, nb, bs = self.rows, self.pool.num_blocks, self.block_size
        owner, index = [n] * nb, [0] * nb
        for i, c in enumerate(caches):
            for j, blk in enumerate(c.blocks):
                owner[blk], index[blk] = i, j
        pad = n - len(caches)
        meta = torch.tensor([owner, [min(o, n - 1) for o in owner], index], dtype=torch.long)
        q = torch.tensor(past + [0] * pad, dtype=torch.long).view(n, 1)
        blk = [c.blocks[p // bs] for c, p in zip(caches, past)] + [scratch] * pad
        off = [p % bs for p in past] + [0] * pad
        wr = torch.tensor([blk, off], dtype=torch.long)
        ids = torch.tensor(tokens + [0] * pad, dtype=torch.long).view(n, 1)
        pin = torch.cuda.is_available()
        for dst, src in ((self.meta, meta), (self.q_pos, q), (self.write[2:], wr), (self.ids, ids)):
            dst.copy_(src.pin_memory() if pin else src, non_blocking=pin)


class _Graph:
    def __init__(self, step: StaticDecodeStep):
        self.step = step
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.keep: list = []  # device tensors the captured kernels read (the bound slot routing)


class DecodeGraphs:
    """Captured decode steps of a ``DeltaModel`` over a :class:`BlockPool` (see module docstring)."""

    def __init__(self, backend, pool: BlockPool, max_graphs: int = 16):
        self.backend, self.pool, self.max_graphs = backend, pool, max_graphs
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.failed: set[tuple] = set()
        self.launches = 0  # replays
        self.captures = 0
        self._seen: OrderedDict[tuple, None] = OrderedDict()  # keys met once, not captured (the last 256)
        self._generation = pool.generation

    def run(self, caches: list[SeqBlocks], row_slots: list[int], tokens: list[int], weights_key) -> torch.Tensor | None:
        """Logits ``[B, V]`` of a decode step (each cache grows by one), or None: run it eagerly."""
        b = len(caches)
        bucket = next((x for x in BUCKETS if x >= b), None)
        if bucket is None or self.pool._refs:
            return None  # too many rows, or blocks shared by forked samples (a block has one owner here)
        past = [c.length for c in caches]
        for c, p in zip(caches, past):  # may grow the pool: before the key is taken
            c.attach(self.pool)
            c.reserve(self.pool, p + 1)
        if not self.pool._free:
            return None  # no block for the padding rows to write into
        if self.pool.generation != self._generation:
            self.graphs.clear()  # they read the pool's old tensors
            self.failed.clear()
            self._generation = self.pool.generation
        slots = tuple(row_slots) + (-1,) * (bucket - b)
        key = (bucket, slots, weights_key)
        if key in self.failed:
            return None
        g = self.graphs.get(key)
        if g is None and not self._met_before(key):
            return None
        step = g.step if g is not None else StaticDecodeStep(self.pool, bucket, self.backend.device)
        step.fill(caches, tokens, past, self.pool._free[0])
        if g is None:
            g = self._capture(key, step, list(slots))
            if g is None:
                return None
        self.graphs.move_to_end(key)
        g.graph.replay()
        self.launches += 1
        for c in caches:
            c.length += 1
        return g.logits[:b].clone()

    def _met_before(self, key: tuple) -> bool:
        """Whether ``key`` was met before (and is now forgotten as such); else it is remembered."""
        if key in self._seen:
            del self._seen[key]
            return True
        self._seen[key] = None
        while len(self._seen) > 256:
            self._seen.popitem(last=False)
        return False

    def _capture(self, key: tuple, step: StaticDecodeStep, slots: list[int]) -> _Graph | None:
        model, ctx = self.backend.model, self.backend.ctx
        g = _Graph(step)
        try:
            # choices_held: a change of the kernel table meanwhile (the tuner's thread) waits until the
            # capture ends, so the captured forward launches what the warm-up resolved
            with torch.inference_mode(), dispatch.choices_held():
                ctx.bind(slots, self.backend.device)
                # Warm-up (lazy initialisations, the split-K workspace) outside the capture, on this
                # thread's stream: the kernels' split-K workspace is one per device, and launches on
                # one stream never overlap (a side stream's could overlap the tuner thread's).
                run_model(model, step.ids, step.q_pos, step.mask, step)
                # Everything the captured kernels read must outlive the capture: the slot routing is
                # bound afresh (its host-to-device copy outside the captured region) and kept, and the
                # per-forward caches (routing, masks) are rebuilt inside it, in the graph's own memory
                # pool (one per graph: graphs replay in any order, so they share no memory).
                ctx.unbind()
                ctx.bind(slots, self.backend.device)
                g.keep = ctx.device_tensors()
                step._masks.clear()
                graph = torch.cuda.CUDAGraph()
                with capture(graph):  # the loader and the tuner threads use the device meanwhile
                    g.logits = run_model(model, step.ids, step.q_pos, step.mask, step)
            self.captures += 1
            g.graph = graph
        except Exception as e:  # e.g. a module that reads a device value on the host: stay eager
            log.warning("decode step not capturable as a CUDA graph (%s: %s); running it eagerly",
                        type(e).__name__, e)
            self.failed.add(key)
            return None
        finally:
            ctx.unbind()
        self.graphs[key] = g
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return g
