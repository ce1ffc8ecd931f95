"""Per-sequence states of recurrent layers (linear attention, short convolutions) in the serving engine.

Hybrid models (Qwen3.5, Qwen3-Next, Granite 4, LFM2; Falcon-H1, whose ``hybrid`` layers hold an
attention and a Mamba-2 mixer side by side) mix attention with recurrent layers whose past is a
fixed-size state per sequence, not a key per token: a convolution window ``[C, K]`` and, for linear
attention and state-space mixers, a recurrent state (``[H, d_k, d_v]`` for a gated delta rule). transformers reads and writes them through the cache object (``get_conv_state``,
``update_conv_state``, ``get_recurrent_state``, ``update_recurrent_state``).

- :class:`StatePool`: per (layer, kind, index) one tensor ``[R, *state]``, a row per live sequence
  (zeroed when taken, so a new sequence starts from the zero state; dropped when no sequence holds a
  row). Rows are taken the first time a step of a recurrent model asks for its rows' states.
- :class:`RecurrentStep`: the cache-object methods, mixed into the engine's step objects
  (``PagedStep``, ``StepKV``). A layer's states are gathered for the step's rows once (a row
  without a state yet reads zeros), updated by the model (in place in a decode step, by the update
  calls otherwise) and written back to the pool after the forward (:meth:`RecurrentStep.commit_states`).
- :class:`SeqState`: the per-sequence side (``SeqBlocks``, ``SeqKV``): a row, copied to a fork,
  moved to host memory with a preempted sequence and back.

Left padding: a padding token of a new sequence leaves the zero state unchanged (its hidden state is
zeroed by the 2-D mask the step passes for recurrent layers, and a convolution over zeros then a
delta rule on zero keys give zeros). A padding token before the new tokens of a sequence that has a
state would decay it, so the step runner never pads those rows (``forward_step`` splits the batch).

Chunks after a past: Mamba-1 style mixers (Jamba, Mamba, Falcon-Mamba) read their recurrent state
only in a one-token step; a step of several tokens scans from a zero state, as transformers'
``generate`` never continues a state with more than one token. The model loader finds such models by
running the step both ways (``deltazip.runtime.serve.model``) and marks their config
(:func:`mark_tokenwise`): the step runner then feeds a sequence that has a state its new tokens one
per forward.
"""

from __future__ import annotations

import weakref

import torch

from deltazip.models.loader import text_config

RECURRENT_LAYER_TYPES = ("linear_attention", "conv", "hybrid")  # "hybrid": attention and a state in one layer
_TOKENWISE: set[int] = set()  # id() of the configs of models whose recurrent state continues one token at a time


def mark_tokenwise(config) -> None:
    """Record that the model with ``config`` continues a recurrent state one token per forward only."""
    if id(config) not in _TOKENWISE:
        _TOKENWISE.add(id(config))
        weakref.finalize(config, _TOKENWISE.discard, id(config))


def tokenwise(config) -> bool:
    """Whether :func:`mark_tokenwise` marked ``config``."""
    return id(config) in _TOKENWISE


def recurrent_layer_types(config) -> list[str]:
    """The recurrent layer types among the config's ``layer_types``."""
    text = text_config(config)
    return sorted(set(getattr(text, "layer_types", None) or ()) & set(RECURRENT_LAYER_TYPES))


class StatePool:
    """States of recurrent layers, one row per sequence (module docstring)."""

    def __init__(self):
        self.t: dict[tuple, torch.Tensor] = {}  # (layer, "conv"/"recurrent", index) -> [R, *state]
        self.rows = 0
        self._free: list[int] = []
        self.device: torch.device | None = None  # where the model keeps its states (kept when idle)

    @torch.inference_mode()  # the tensors are made in forwards: inference tensors
    def alloc(self) -> int:
        """A free row, zeroed (the tensors grow by doubling when none is left)."""
        if not self._free:
            grow = max(8, self.rows)
            self.t = {k: torch.cat([v, v.new_zeros(grow, *v.shape[1:])]) for k, v in self.t.items()}
            self._free = list(range(self.rows + grow - 1, self.rows - 1, -1))
            self.rows += grow
        row = self._free.pop()
        for v in self.t.values():
            v[row].zero_()
        return row

    def release(self, row: int) -> None:
        self._free.append(row)
        if len(self._free) == self.rows:  # no live sequence: give the memory back
            self.t, self.rows, self._free = {}, 0, []

    def row_bytes(self) -> int:
        """Bytes one sequence's states take (0 before a recurrent model's first forward)."""
        return sum(v[0].numel() * v.element_size() for v in self.t.values() if v.shape[0])

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.t.values())

    def gather(self, key: tuple, rows: torch.Tensor) -> torch.Tensor | None:
        t = self.t.get(key)
        return None if t is None else t.index_select(0, rows.to(t.device))

    @torch.inference_mode()  # the tensors are made in forwards: inference tensors
    def scatter(self, key: tuple, rows: torch.Tensor, values: torch.Tensor) -> None:
        t = self.t.get(key)
        if t is None:
            t = self.t[key] = values.new_zeros(self.rows, *values.shape[1:])
            self.device = values.device
        t.index_copy_(0, rows.to(t.device), values.to(t.dtype))

    @torch.inference_mode()  # the tensors are made in forwards: inference tensors
    def copy_row(self, src: int, dst: int) -> None:
        for v in self.t.values():
            v[dst].copy_(v[src])

    def read_row(self, row: int) -> dict[tuple, torch.Tensor]:
        return {k: v[row].to("cpu", copy=True) for k, v in self.t.items()}

    @torch.inference_mode()  # the tensors are made in forwards: inference tensors
    def write_row(self, row: int, saved: dict[tuple, torch.Tensor]) -> None:
        for k, s in saved.items():  # host copies: back on the model's device
            t = self.t.get(k)
            if t is None:
                t = self.t[k] = torch.zeros(self.rows, *s.shape, dtype=s.dtype, device=self.device or s.device)
            t[row].copy_(s.to(t.device))


class SeqState:
    """A sequence's row of its pool's :class:`StatePool` (``state_row``), or host copies while preempted.
    Mixed into ``SeqBlocks`` and ``SeqKV``, whose ``pool`` has a ``states`` pool."""

    state_row: int | None = None
    host_state: dict | None = None

    def state_row_in(self, states: StatePool) -> int:
        """This sequence's row (taken on first use; a preempted sequence's states come back into it)."""
        if self.state_row is None:
            self.state_row = states.alloc()
            if self.host_state is not None:
                states.write_row(self.state_row, self.host_state)
                self.host_state = None
        return self.state_row

    def fork_state(self, child: SeqState, states: StatePool) -> None:
        if self.state_row is not None:
            states.copy_row(self.state_row, child.state_row_in(states))

    def offload_state(self, states: StatePool | None) -> None:
        if self.state_row is not None and states is not None:
            self.host_state = states.read_row(self.state_row)
        self.free_state(states)

    def free_state(self, states: StatePool | None) -> None:
        if self.state_row is not None and states is not None:
            states.release(self.state_row)
        self.state_row = None


class RecurrentStep:
    """transformers' linear-attention cache methods over a :class:`StatePool` (module docstring).

    The step object provides ``caches`` (its rows' :class:`SeqState`), ``pool.states`` and ``past``.
    """

    _rows_t: torch.Tensor | None = None
    _live: dict | None = None
    # What image-text models ask a cache on a text-only forward: its per-layer objects (Mllama skips
    # a cross-attention layer when its layer holds no image states; the engine keeps keys in its pool,
    # never in per-layer objects) and whether it holds a past (PaliGemma's prefix mask).
    layers = ()

    @property
    def is_initialized(self) -> bool:
        return any(p > 0 for p in self.past)

    def _state_rows(self) -> torch.Tensor:
        if self._rows_t is None:
            states = self.pool.states
            self._rows_t = torch.tensor([c.state_row_in(states) for c in self.caches], dtype=torch.long)
            self._live = {}
        return self._rows_t

    def _get(self, kind: str, layer_idx: int, state_idx: int) -> torch.Tensor | None:
        key = (layer_idx, kind, state_idx)
        rows = self._state_rows()
        if key not in self._live:
            got = self.pool.states.gather(key, rows)
            if got is None:
                return None
            self._live[key] = got
        return self._live[key]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """``[B, C, K]`` of the step's rows (updated in place by a decode step), or None before the
        model's first forward (no state anywhere yet)."""
        return self._get("conv", layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._get("recurrent", layer_idx, state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """New columns ``[B, C, T]`` appended to each row's window: returns the window and the new
        columns (what the causal convolution reads); the last ``K`` columns are the new state. Before
        any state exists the window is the new columns alone, zero-padded to ``K`` (transformers')."""
        prev = self._get("conv", layer_idx, state_idx)
        if prev is None:
            k = conv_kernel_size or conv_states.shape[-1]
            full = conv_states
            if full.shape[-1] < k:
                full = torch.nn.functional.pad(full, (k - full.shape[-1], 0), value=0)
        else:
            k = prev.shape[-1]
            full = torch.cat([prev, conv_states.to(prev.dtype)], dim=-1)
        self._live[(layer_idx, "conv", state_idx)] = full[..., -k:]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self._state_rows()
        self._live[(layer_idx, "recurrent", state_idx)] = recurrent_states
        return recurrent_states

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether the step's rows continue from a state (all of them: a step mixing new and continuing
        rows reads zero states for the new ones, which is the same)."""
        return bool(self.pool.states.t) and any(p > 0 for p in self.past)

    def rows_view(self, rows: list[int]) -> RowsView:
        """The states of rows ``rows`` of this step, for a layer run on those rows alone."""
        return RowsView(self, rows)

    def commit_states(self) -> None:
        """Write the step's states back to the pool (after the forward)."""
        if not self._live:
            return
        rows = self._rows_t
        for key, value in self._live.items():
            self.pool.states.scatter(key, rows, value)
        self._live = {}


class RowsView(RecurrentStep):
    """Some rows of a step's recurrent states (``deltazip.runtime.serve.delta_mixer`` runs a layer per
    group of rows): reads are the step's current states of those rows, updates go back into the
    step's (which writes them to the pool after the forward). Anything else is the step's."""

    def __init__(self, step: RecurrentStep, rows: list[int]):
        self._step, self._rows = step, rows
        self._idx = torch.tensor(rows, dtype=torch.long)
        self._live = {}

    def __getattr__(self, name):
        return getattr(self.__dict__["_step"], name)

    def _get(self, kind: str, layer_idx: int, state_idx: int) -> torch.Tensor | None:
        key = (layer_idx, kind, state_idx)
        if key not in self._live:
            full = self._step._get(kind, layer_idx, state_idx)
            if full is None:
                return None
            self._live[key] = full.index_select(0, self._idx.to(full.device))
        return self._live[key]

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self._live[(layer_idx, "recurrent", state_idx)] = recurrent_states
        return recurrent_states

    def commit_states(self) -> None:
        """Into the step's states of these rows (a state not there yet starts as zeros for all rows)."""
        step = self._step
        step._state_rows()
        for key, value in self._live.items():
            full = step._live.get(key)
            if full is None or full.shape[1:] != value.shape[1:]:
                full = step._live[key] = value.new_zeros(len(step.caches), *value.shape[1:])
            full[self._idx.to(full.device)] = value.to(full.dtype)
        self._live = {}
