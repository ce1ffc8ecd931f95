"""Rows of a batch grouped by slot: the plan the CUDA kernel (``deltazip.kernels.cuda_sbmm``) reads.

A plan sorts the rows of a batch by slot (rows of slot ``-1``, the base, last and never touched) and
cuts each slot's rows into tiles of ``block_m`` rows; the kernel runs one CTA row per tile. Two builders
give the same plan:

- :func:`plan_rows`, on the host from the slot list the runtime already has (numpy, one host-to-device
  copy, no GPU sort, no sync): exactly the used tiles; a decode step's plan, shared by every linear;
- :func:`group_rows`, on the device from a device index (MoE routing, where the slots of the routed
  pairs are only on the device): a static bound of tiles, unused ones with slot ``-1`` (their CTAs
  exit at once).

Both fill :attr:`RowPlan.packed`, int32 ``[N + 3T]``: ``perm ++ tile_slot ++ tile_start ++ tile_end``,
the one tensor the kernel reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

BLOCK_M = 16  # activation rows per tile: the CUDA kernel's two n8 mma tiles


@dataclass
class RowPlan:
    """Rows of a batch grouped by slot (module docstring).

    Attributes:
        perm: int32 ``[N]``: row ids sorted by slot (stable); rows with index -1 come last.
        counts, offsets: int32 ``[D]``: rows per slot, and where each slot's rows start in ``perm``.
        tile_slot: int32 ``[T]``: slot of each row tile, -1 for unused tiles.
        tile_start, tile_end: int32 ``[T]``: ``[start, end)`` of each tile in ``perm``.
        block_m: rows per tile; num_rows, num_slots: ``N`` and ``D``.
        packed: int32 ``[N + 3T]``, the four device parts in one tensor (the others are views of it).
        slot_rows: host plans only: ``{slot: numpy row ids}`` of the slots used.
        num_tiles: ``T``; slots_used: slots with rows (host plans), else the bound ``min(N, D)``.
        key: ``(rows, slots used)``, each rounded up to a power of two: the bucket of the dispatcher's
            choice (a step's linears share the plan).
    """

    perm: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    tile_slot: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor
    block_m: int
    num_rows: int
    num_slots: int
    packed: torch.Tensor | None = None
    slot_rows: dict | None = None

    def __post_init__(self):
        # Plain attributes, set once: a launch reads them on the hot path (no call into this module).
        self.num_tiles = self.tile_slot.shape[0]
        self.slots_used = len(self.slot_rows) if self.slot_rows is not None else min(self.num_rows, self.num_slots)
        self.key = (rows_bucket(self.num_rows), rows_bucket(min(self.slots_used, self.num_rows)))


def rows_bucket(rows: int) -> int:
    """The bucket of ``rows`` (token rows, or slots): the next power of two (1 for 0 or 1)."""
    return 1 if rows <= 1 else 1 << (rows - 1).bit_length()


def max_tiles(num_rows: int, num_slots: int, block_m: int) -> int:
    """Static bound on row tiles: ``sum_d ceil(c_d / BM) <= N // BM + min(D, N)``."""
    return num_rows // block_m + min(num_slots, num_rows)


def plan_rows(row_slots: Sequence[int] | np.ndarray, num_slots: int, device: torch.device | str,
              block_m: int = BLOCK_M) -> RowPlan:
    """Group the rows of a batch by slot on the host and copy the plan to ``device`` once.

    Args:
        row_slots: ``[N]`` slot of each row, ``-1`` for rows without a delta, else in ``[0, num_slots)``.
        num_slots: ``D``, slots of the stacks the plan is for.
        device: where the kernels run.
        block_m: rows per tile.
    Returns:
        A :class:`RowPlan` whose tiles are exactly the used ones (``num_tiles`` may be 0).
    """
    slots = np.asarray(row_slots, dtype=np.int64).reshape(-1)
    n = slots.shape[0]
    if n and (slots.min() < -1 or slots.max() >= num_slots):
        raise ValueError(f"row slots must lie in [-1, {num_slots}), got [{slots.min()}, {slots.max()}]")
    key = np.where(slots < 0, num_slots, slots)
    perm = np.argsort(key, kind="stable")
    counts = np.bincount(key, minlength=num_slots + 1)[:num_slots]
    offsets = np.cumsum(counts) - counts
    tiles = -(-counts // block_m)
    tile_slot = np.repeat(np.arange(num_slots), tiles)
    first_tile = np.cumsum(tiles) - tiles
    tile_start = offsets[tile_slot] + (np.arange(tile_slot.shape[0]) - first_tile[tile_slot]) * block_m
    tile_end = (offsets + counts)[tile_slot]
    host = torch.from_numpy(np.concatenate([perm, tile_slot, tile_start, tile_end]).astype(np.int32))
    device = torch.device(device)
    packed = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    t = tile_slot.shape[0]
    views = packed.split([n, t, t, t])
    used = np.nonzero(counts)[0]
    return RowPlan(perm=views[0], counts=torch.from_numpy(counts.astype(np.int32)),
                   offsets=torch.from_numpy(offsets.astype(np.int32)), tile_slot=views[1], tile_start=views[2],
                   tile_end=views[3], block_m=block_m, num_rows=n, num_slots=num_slots, packed=packed,
                   slot_rows={int(s): perm[offsets[s]:offsets[s] + counts[s]] for s in used})


def group_rows(index: torch.Tensor, num_slots: int, block_m: int = BLOCK_M) -> RowPlan:
    """Group the rows of a batch by slot, entirely on ``index.device`` (no host sync).

    Args:
        index: integer ``[N]``, values in ``[-1, num_slots)``; -1 means "no delta". Other negative
            or too large values raise (on CUDA as a device-side assert: checking them on the host
            would need a sync).
        num_slots: ``D``, the number of slots of the stack (not the number in use).
        block_m: rows per tile.
    Returns:
        A :class:`RowPlan` of :func:`max_tiles` tiles (unused ones: slot -1); its tensor sizes depend
        only on ``N``, ``D`` and ``block_m``.
    """
    if index.dim() != 1:
        raise ValueError(f"index must be 1-D, got {tuple(index.shape)}")
    if index.dtype.is_floating_point or index.dtype == torch.bool:
        raise ValueError(f"index must be an integer tensor, got {index.dtype}")
    if num_slots < 1 or block_m < 1:
        raise ValueError(f"num_slots ({num_slots}) and block_m ({block_m}) must be positive")
    dev, n = index.device, index.shape[0]
    idx = index.to(torch.int64)
    # Sort key: slot, with -1 as slot D (sorts last). Out-of-range values get keys outside [0, D]
    # so that the scatter below rejects them (too large ones are shifted past the -1 bucket).
    key = torch.where(idx == -1, torch.full_like(idx, num_slots), torch.where(idx >= num_slots, idx + 1, idx))
    perm = torch.argsort(key, stable=True)
    counts_all = torch.zeros(num_slots + 1, dtype=torch.int64, device=dev)
    counts_all.scatter_add_(0, key, torch.ones_like(key))  # out-of-range index raises here
    counts = counts_all[:num_slots]
    offsets = torch.cumsum(counts, 0) - counts
    tiles = (counts + block_m - 1) // block_m
    tile_hi = torch.cumsum(tiles, 0)
    tile_lo = tile_hi - tiles
    t = torch.arange(max_tiles(n, num_slots, block_m), device=dev, dtype=torch.int64)
    slot = torch.searchsorted(tile_hi, t, right=True)  # first slot whose tiles end after t
    valid = slot < num_slots
    s = slot.clamp(max=num_slots - 1)
    start = offsets[s] + (t - tile_lo[s]) * block_m
    end = offsets[s] + counts[s]
    parts = [perm, torch.where(valid, slot, torch.full_like(slot, -1)), torch.where(valid, start, 0),
             torch.where(valid, end, 0)]
    packed = torch.cat(parts).to(torch.int32)
    views = packed.split([n, t.shape[0], t.shape[0], t.shape[0]])
    return RowPlan(perm=views[0], counts=counts.to(torch.int32), offsets=offsets.to(torch.int32), tile_slot=views[1],
                   tile_start=views[2], tile_end=views[3], block_m=block_m, num_rows=n, num_slots=num_slots,
                   packed=packed)
