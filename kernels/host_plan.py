"""Row plans built on the host from the slot list the runtime already has (no GPU sort, no sync).

A decode step's rows are grouped by slot once, here, with numpy, and copied to the device as one int32
tensor; every linear of the step reads the same plan (the CUDA kernel takes the packed tensor, the
Triton kernels its views). ``deltazip.kernels.triton_sbmm.group_rows`` builds the same plan on the
device, for callers that only hold a device index.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from deltazip.kernels.triton_sbmm import RowPlan

BLOCK_M = 16  # activation rows per tile: the CUDA kernel's two n8 mma tiles


def plan_rows(row_slots: Sequence[int] | np.ndarray, num_slots: int, device: torch.device | str,
              block_m: int = BLOCK_M) -> RowPlan:
    """Group the rows of a batch by slot on the host and copy the plan to ``device`` once.

    Args:
        row_slots: ``[N]`` slot of each row, ``-1`` for rows without a delta, else in ``[0, num_slots)``.
        num_slots: ``D``, slots of the stacks the plan is for.
        device: where the kernels run.
        block_m: rows per tile.
    Returns:
        A :class:`RowPlan` whose tiles are exactly the used ones (``num_tiles`` may be 0), with
        ``packed`` = int32 ``[N + 3T]``: ``perm ++ tile_slot ++ tile_start ++ tile_end`` (the other
        fields are views of it, or of host copies) and ``slot_rows``: ``{slot: row ids}`` on the host.
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
    packed_host = np.concatenate([perm, tile_slot, tile_start, tile_end]).astype(np.int32)
    host = torch.from_numpy(packed_host)
    device = torch.device(device)
    if device.type == "cuda":
        packed = host.pin_memory().to(device, non_blocking=True)
    else:
        packed = host.to(device)
    t = tile_slot.shape[0]
    views = packed.split([n, t, t, t])
    plan = RowPlan(perm=views[0], counts=torch.from_numpy(counts.astype(np.int32)),
                   offsets=torch.from_numpy(offsets.astype(np.int32)), tile_slot=views[1], tile_start=views[2],
                   tile_end=views[3], block_m=block_m, num_rows=n, num_slots=num_slots, packed=packed)
    used = np.nonzero(counts)[0]
    plan.slot_rows = {int(s): perm[offsets[s]:offsets[s] + counts[s]] for s in used}
    return plan
