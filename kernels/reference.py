"""Pure-torch reference math of compressed deltas: the semantics every fast path must match.

Shapes follow ``deltazip.kernels.packed``: a delta of a ``[out, in]`` weight, codes along ``in``.
"""

from __future__ import annotations

import torch

from deltazip.kernels.packed import PackedDelta, codes_per_word


def unpack_int32(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Unpack ``bits``-wide codes from int32 words.

    Args:
        packed: int32 ``[R, W]``; code ``k`` sits in word ``k // per`` at bit ``(k % per) * bits``.
        bits: code width (2, 3, 4 or 8).
        n: codes per row to return (drops the padding of the last word).
    Returns:
        int32 ``[R, n]`` codes in ``[0, 2**bits)``.
    """
    per = codes_per_word(bits)
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    # Arithmetic shift of a negative int32 drags the sign bit along; the mask removes it.
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0], -1)[:, :n]


def group_params(delta: PackedDelta) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-stored-value scale and zero point, fp32 ``[out, K]`` each (``K`` stored values per row)."""
    per_group = delta.effective_group // 2 if delta.sparse else delta.effective_group
    scales = delta.scales.float().repeat_interleave(per_group, dim=1)
    if delta.zeros is None:
        zeros = torch.full_like(scales, float(2 ** (delta.bits - 1)))
    else:
        zeros = delta.zeros.float().repeat_interleave(per_group, dim=1)
    return scales, zeros


def dequantize(delta: PackedDelta) -> torch.Tensor:
    """Stored values of a delta, fp32 ``[out, K]``: ``scale * (code - zero)``."""
    codes = unpack_int32(delta.qweight, delta.bits, delta.kept_per_row).float()
    scales, zeros = group_params(delta)
    return scales * (codes - zeros)


def expand_24(values: torch.Tensor, positions: torch.Tensor, in_features: int) -> torch.Tensor:
    """Scatter 2:4 kept values back to a dense matrix.

    Args:
        values: ``[R, in/2]`` kept values, two per group of four columns.
        positions: integer ``[R, in/2]`` index (0..3) of each value inside its group.
        in_features: dense row length (divisible by 4).
    Returns:
        ``[R, in]`` with zeros at pruned positions, dtype of ``values``.
    """
    rows = values.shape[0]
    base = torch.arange(in_features // 4, device=values.device).repeat_interleave(2) * 4
    cols = base.unsqueeze(0) + positions.long()
    out = torch.zeros(rows, in_features, dtype=values.dtype, device=values.device)
    return out.scatter_(1, cols, values)


def delta_weight(delta: PackedDelta) -> torch.Tensor:
    """The dense fp32 delta ``[out, in]`` that a packed delta stands for."""
    values = dequantize(delta)
    if not delta.sparse:
        return values
    pos = unpack_int32(delta.positions, 2, delta.kept_per_row)
    return expand_24(values, pos, delta.in_features)


def _check_index(index: torch.Tensor, rows: int, count: int, what: str) -> torch.Tensor:
    """Validate a per-row slot index (int ``[rows]``, values in ``[-1, count)``); returns it as int64."""
    if index.dim() != 1 or index.shape[0] != rows:
        raise ValueError(f"{what} must be 1-D with one entry per row of x ({rows}), got {tuple(index.shape)}")
    if index.dtype.is_floating_point or index.dtype == torch.bool:
        raise ValueError(f"{what} must be an integer tensor, got {index.dtype}")
    index = index.to(torch.int64)
    if rows and (int(index.min()) < -1 or int(index.max()) >= count):
        raise ValueError(f"{what} values must lie in [-1, {count}), got [{int(index.min())}, {int(index.max())}]")
    return index


def sbmm(x: torch.Tensor, delta_index: torch.Tensor, deltas) -> torch.Tensor:
    """Selective batched matmul: every row of ``x`` times the transpose of its own delta.

    ``y[r] = x[r] @ delta_weight(deltas[delta_index[r]]).T``, and ``y[r] = 0`` where the index is -1
    (the row is served by the base model alone). Implemented as a loop over the distinct deltas in
    the batch, each delta dequantized to a dense fp32 matrix; the product is computed in fp32.

    Args:
        x: ``[N, in]`` activations (fp16, bf16 or fp32).
        delta_index: integer ``[N]`` with values in ``[-1, D)``.
        deltas: a list of ``D >= 1`` ``PackedDelta`` with the same ``in``/``out`` features, or a
            ``deltazip.kernels.stacked.StackedDeltas`` holding ``D`` slots (read through its
            ``delta_weight``, so the stacked layout is checked against the same math).
    Returns:
        ``[N, out]`` in ``x.dtype``.
    """
    if isinstance(deltas, (list, tuple)):
        if not deltas:
            raise ValueError("sbmm needs at least one delta")
        in_f, out_f = deltas[0].in_features, deltas[0].out_features
        for i, d in enumerate(deltas):
            if (d.in_features, d.out_features) != (in_f, out_f):
                raise ValueError(f"delta {i} is [{d.out_features}, {d.in_features}], delta 0 is [{out_f}, {in_f}]")

        def weight(i: int) -> torch.Tensor:
            return delta_weight(deltas[i])

        count = len(deltas)
    else:  # StackedDeltas (duck-typed so this module does not import the stacked layout)
        in_f, out_f, count = deltas.in_features, deltas.out_features, deltas.num_deltas
        weight = deltas.delta_weight
    if x.dim() != 2 or x.shape[1] != in_f:
        raise ValueError(f"x must be [N, {in_f}], got {tuple(x.shape)}")
    index = _check_index(delta_index, x.shape[0], count, "delta_index")
    y = torch.zeros(x.shape[0], out_f, dtype=torch.float32, device=x.device)
    for d in torch.unique(index).tolist():
        if d < 0:
            continue
        rows = (index == d).nonzero(as_tuple=True)[0]
        w = weight(d).to(x.device)
        y[rows] = x[rows].float() @ w.T
    return y.to(x.dtype)


def check_lora_shapes(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor) -> None:
    """Raise ValueError naming the mismatch unless ``x [N, in]``, ``A [L, rank, in]``, ``B [L, out, rank]``
    and ``scale [L]`` fit together."""
    if A.dim() != 3 or B.dim() != 3 or A.shape[0] != B.shape[0] or A.shape[1] != B.shape[2]:
        raise ValueError(f"A must be [L, rank, in] and B [L, out, rank], got {tuple(A.shape)} and {tuple(B.shape)}")
    num, _, in_f = A.shape
    if scale.shape != (num,):
        raise ValueError(f"scale must be [{num}], got {tuple(scale.shape)}")
    if x.dim() != 2 or x.shape[1] != in_f:
        raise ValueError(f"x must be [N, {in_f}], got {tuple(x.shape)}")


def lora_shrink_expand(
    x: torch.Tensor, lora_index: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """Grouped LoRA: every row of ``x`` through its own adapter, ``(x @ A[i].T) @ B[i].T * scale[i]``.

    Rows whose index is -1 get zeros. Computed in fp32 as a loop over the distinct adapters.

    Args:
        x: ``[N, in]`` activations.
        lora_index: integer ``[N]`` with values in ``[-1, L)``.
        A: ``[L, rank, in]`` shrink (down) projections.
        B: ``[L, out, rank]`` expand (up) projections.
        scale: ``[L]`` per-adapter scaling (``alpha / rank``).
    Returns:
        ``[N, out]`` in ``x.dtype``.
    """
    check_lora_shapes(x, A, B, scale)
    num = A.shape[0]
    index = _check_index(lora_index, x.shape[0], num, "lora_index")
    y = torch.zeros(x.shape[0], B.shape[1], dtype=torch.float32, device=x.device)
    for i in torch.unique(index).tolist():
        if i < 0:
            continue
        rows = (index == i).nonzero(as_tuple=True)[0]
        h = x[rows].float() @ A[i].float().T
        y[rows] = (h @ B[i].float().T) * scale[i].float()
    return y.to(x.dtype)


def expert_groups(slot_index: torch.Tensor, expert_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Group of each routed (token, expert) pair: ``slot * num_experts + expert``, -1 for base pairs.

    A mixture-of-experts delta is one matrix per (variant slot, expert); stacking them ``slot``-major
    (``D = slots * num_experts`` entries) makes a pair's group its entry of the stack, so SBMM runs
    the pairs of every (slot, expert) in one call.

    Args:
        slot_index: integer ``[P]``, the slot of the pair's token (``-1``: base, no delta).
        expert_index: integer ``[P]`` in ``[0, num_experts)``, the expert the router chose.
        num_experts: ``E``.
    Returns:
        int64 ``[P]``.
    """
    if slot_index.shape != expert_index.shape or slot_index.dim() != 1:
        raise ValueError(f"slot_index {tuple(slot_index.shape)} and expert_index {tuple(expert_index.shape)} "
                         "must be 1-D of the same length")
    slot, expert = slot_index.to(torch.int64), expert_index.to(torch.int64)
    return torch.where(slot >= 0, slot * num_experts + expert, torch.full_like(slot, -1))


def sbmm_experts(x: torch.Tensor, slot_index: torch.Tensor, expert_index: torch.Tensor, deltas,
                 num_experts: int) -> torch.Tensor:
    """Grouped expert deltas: ``y[p] = x[p] @ Δ(slot[p], expert[p]).T``; zeros where the slot is -1.

    ``deltas`` holds ``slots * num_experts`` entries, entry ``s * num_experts + e`` being expert ``e``
    of the variant in slot ``s`` (a list of ``PackedDelta`` or a ``StackedDeltas``, as for
    :func:`sbmm`). Rows of ``x`` are routed pairs, not tokens: a token sent to ``k`` experts has ``k``
    rows.

    Args:
        x: ``[P, in]``; slot_index, expert_index: integer ``[P]``; num_experts: ``E``.
    Returns:
        ``[P, out]`` in ``x.dtype``.
    """
    return sbmm(x, expert_groups(slot_index, expert_index, num_experts), deltas)
