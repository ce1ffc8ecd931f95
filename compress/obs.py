"""The OBS solver: joint 2:4 pruning + GPTQ quantization of one matrix from its Hessian.

Columns are processed left to right (SparseGPT/GPTQ). Every 4 columns the 2:4 mask is chosen from
``w**2 / diag(Hinv)**2``; each column is quantized on its group's grid, pruned entries are set to
exactly zero, and the rounding error is spread onto the not-yet-processed columns through the
Cholesky factor of ``H**-1``. Work is done in lazy blocks of one quantization group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltazip.compress.quantizer import Bits, dequantize_codes, find_params, max_code, quantize_codes
from deltazip.formats.errors import CompressionError
from deltazip.kernels.scheme import DeltaScheme

_MAX_DAMP_TRIES = 6


@dataclass
class SolveResult:
    """Solver output for a ``[R, C]`` matrix with ``G`` groups.

    ``codes`` int64 ``[R, C]`` (values at pruned positions are irrelevant), ``scales`` fp32 ``[R, G]``
    (fp16-exact), ``zeros`` fp32 ``[R, G]`` (integers), ``mask`` bool ``[R, C]`` keep-mask or None,
    ``values`` fp32 ``[R, C]`` the compressed matrix ``Q ⊙ M`` exactly as stored, ``loss`` fp32 ``[R]``
    each row's output error ``e H eᵀ`` (``e = w - q`` the row's error, ``H`` with its dead columns),
    from the column loop: ``Σ_j err_j²`` (``err_j = (w_j - q_j) / U_jj``, with ``U`` the Cholesky factor
    of the damped ``(H + λI)**-1``) is ``e (H + λI) eᵀ`` in exact arithmetic over the live columns, and
    ``λ ||e||²`` is taken off (equal to the product to 1e-4 relative in the tests). The probe scores its
    candidate settings with it instead of a ``[R, C] x [C, C]`` product per matrix.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    mask: torch.Tensor | None
    values: torch.Tensor
    stats: dict = field(default_factory=dict)
    loss: torch.Tensor | None = None


def _inverse_cholesky(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, float, int]:
    """Upper Cholesky factor of ``(H + λI)**-1``, retrying with 10x more damping on failure.

    Returns (factor, relative damping used, retries).
    """
    mean_diag = float(torch.mean(torch.diag(H)))
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    d = damp
    for attempt in range(_MAX_DAMP_TRIES):
        Hd = H + (d * mean_diag) * eye
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info2 = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info2) == 0 and bool(torch.isfinite(U).all()):
                return U, d, attempt
        d *= 10
    raise CompressionError(f"Hessian stays singular after damping up to {d / 10:g} x mean(diag); the "
                           f"calibration data may be too small or degenerate: add more samples")


def obs_compress(W: torch.Tensor, H: torch.Tensor, scheme: DeltaScheme, damp: float = 0.01) -> SolveResult:
    """Compress ``W`` minimising ``||(W - Q⊙M) X||²`` where ``H = 2 X Xᵀ / n``.

    Args:
        W: fp32 ``[R, C]`` matrix (the delta, or full weights for the SparseGPT baseline).
        H: fp32 ``[C, C]`` Hessian of the layer input.
        scheme: the grid (bits, symmetry, group size; -1 = one group per row) and whether a 2:4 mask
            is chosen along the columns.
        damp: dampening relative to ``mean(diag(H))``.
    """
    assert scheme.shape_problem(W.shape[1]) is None, scheme.shape_problem(W.shape[1])
    return obs_solve(W, H, scheme.bits, scheme.sparse, scheme.effective_group(W.shape[1]), scheme.sym, damp)


def obs_solve(W: torch.Tensor, H: torch.Tensor, bits: Bits, sparse: bool | torch.Tensor, group: int, sym: bool,
              damp: float = 0.01) -> SolveResult:
    """The OBS column loop of :func:`obs_compress`, with the code width and the 2:4 choice given per row.

    Rows are independent given ``H`` (each row's error goes to its own later columns), so the rows of
    several candidate settings of one matrix, stacked, are solved in one loop exactly as each would be
    alone (compress/sensitivity.py).

    Args:
        W: fp32 ``[R, C]``; H: fp32 ``[C, C]``.
        bits: an int, or int64 ``[R]`` (one width per row).
        sparse: a bool, or bool ``[R]``: rows that get a 2:4 mask (``mask`` is all True elsewhere).
        group: input columns per group (already resolved: divides ``C``).
        sym, damp: as :func:`obs_compress`.
    Returns:
        The :class:`SolveResult` of all ``R`` rows (``mask`` None when no row is 2:4).
    """
    factor = _factor(H, damp)
    return _solve_rows(W, factor, bits, sparse, group, sym)


@dataclass
class _Factor:
    """What every row's solve shares: ``Hinv`` the upper Cholesky factor of ``(H + λI)**-1`` ``[C, C]``,
    ``dead`` bool ``[C]`` the columns no calibration token reached, and the damping stats."""

    Hinv: torch.Tensor
    dead: torch.Tensor
    stats: dict
    lam: float = 0.0
    """The absolute damping ``λ`` added to ``H``'s diagonal."""


def _factor(H: torch.Tensor, damp: float) -> _Factor:
    H = H.clone().float()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    Hinv, damp_used, retries = _inverse_cholesky(H, damp)
    return _Factor(Hinv, dead, {"damp": damp_used, "damp_retries": retries, "dead_columns": int(dead.sum())},
                   damp_used * float(torch.mean(torch.diag(H))))


def _solve_rows(W: torch.Tensor, f: _Factor, bits: Bits, sparse: bool | torch.Tensor, group: int,
                sym: bool) -> SolveResult:
    R, C = W.shape
    given, W = W, W.clone().float()
    W[:, f.dead] = 0
    rows24 = None if isinstance(sparse, bool) else sparse.to(W.device)
    any24 = sparse if rows24 is None else bool(rows24.any())
    out = _Outputs(R, C, C // group, any24, W.device)
    for i1 in range(0, C, group):
        _solve_block(W, f.Hinv, i1, i1 + group, bits, sym, any24, rows24, out)
    e = given.float() - out.values  # the error over the live columns (the loop zeroed the dead ones)
    e[:, f.dead] = 0
    out.loss -= f.lam * e.pow_(2).sum(1)  # the damping's share: e (λI) eᵀ
    return SolveResult(out.codes, out.scales, out.zeros, out.keep, out.values, dict(f.stats), out.loss)


SPLIT_MIN_ROWS = 512
"""Fewest rows per part of :func:`obs_solve_split` (fewer parts, or one, for smaller matrices)."""


def obs_solve_split(W: torch.Tensor, H: torch.Tensor, bits: Bits, sparse: bool | torch.Tensor, group: int,
                    sym: bool, damp: float = 0.01, pool=None, workers: int = 2) -> SolveResult:
    """:func:`obs_solve` with the rows cut into ``workers`` contiguous parts, each part's column loop run
    in a thread of ``pool`` (a ``ThreadPoolExecutor`` of at least ``workers`` threads) on one intra-op
    thread, the Cholesky factor computed once. Arguments and result as :func:`obs_solve`.

    Why: the column loop is thousands of small ops per block. On CPU, one op split over two OpenMP
    threads pays a wake-up each time (``OMP_WAIT_POLICY=PASSIVE``, which the CLI sets so that busy
    cores are not spun on) and gains little; two loops side by side, one thread each, keep both cores
    on arithmetic (the ops release the GIL). 4096 stacked rows x 576 columns on 2 cores: 0.157 s in one
    loop, 0.079 s in two (docs/compress.md). Rows are independent given ``H``; a part's rows come out
    as the whole's up to the summation order of the block updates' matrix products (which a different
    row count or thread count may change in the last bit).
    """
    R = W.shape[0]
    workers = min(workers, R // SPLIT_MIN_ROWS)
    if pool is None or W.device.type != "cpu" or workers < 2:
        return obs_solve(W, H, bits, sparse, group, sym, damp)
    factor = _factor(H, damp)
    cuts = [R * k // workers for k in range(workers + 1)]
    parts = [slice(a, b) for a, b in zip(cuts, cuts[1:])]

    def part(rows: slice) -> SolveResult:
        torch.set_num_threads(1)  # this thread's ops (the caller restores its own count after)
        return _solve_rows(W[rows], factor,
                           bits if isinstance(bits, int) else bits[rows],
                           sparse if isinstance(sparse, bool) else sparse[rows], group, sym)

    threads = torch.get_num_threads()
    try:
        res = list(pool.map(part, parts))
    finally:
        torch.set_num_threads(threads)
    keep = None if res[0].mask is None else torch.cat([r.mask for r in res])
    return SolveResult(torch.cat([r.codes for r in res]), torch.cat([r.scales for r in res]),
                       torch.cat([r.zeros for r in res]), keep, torch.cat([r.values for r in res]),
                       dict(factor.stats), torch.cat([r.loss for r in res]))


class _Outputs:
    """The solver's outputs, filled block by block (shapes as :class:`SolveResult`)."""

    def __init__(self, R: int, C: int, G: int, sparse: bool, device):
        self.scales = torch.zeros(R, G, device=device)
        self.zeros = torch.zeros(R, G, device=device)
        self.codes = torch.zeros(R, C, dtype=torch.int64, device=device)
        self.values = torch.zeros(R, C, device=device)
        self.keep = torch.ones(R, C, dtype=torch.bool, device=device) if sparse else None
        self.loss = torch.zeros(R, device=device)


def _two_smallest(score: torch.Tensor) -> torch.Tensor:
    """bool ``[4, R]``: the two smallest of each column's four scores, exactly the positions
    ``torch.topk(score, 2, dim=0, largest=False)`` picks, ties included.

    On CPU that topk walks the R columns one by one (about 100 us for R = 4096, a quarter of the
    probe's column loop); counting each score's smaller neighbours decides every column whose two
    smallest are unambiguous, and topk only the columns where equal scores straddle the cut (0.2% of
    them in a SmolLM2 compression). On other devices topk runs alone: the check would wait on the device."""
    if score.device.type != "cpu":
        return _topk_two(score)
    keep_out = (score.unsqueeze(0) < score.unsqueeze(1)).sum(1) < 2  # [j, R]: fewer than two scores below s_j
    tied = keep_out.sum(0) != 2
    if bool(tied.any()):
        cols = tied.nonzero().squeeze(1)
        keep_out[:, cols] = _topk_two(score[:, cols])
    return keep_out


def _topk_two(score: torch.Tensor) -> torch.Tensor:
    """bool ``[4, R]``: the positions of ``torch.topk(score, 2, dim=0, largest=False)``."""
    return torch.zeros_like(score, dtype=torch.bool).scatter_(0, torch.topk(score, 2, dim=0, largest=False).indices, True)


def _solve_block(W: torch.Tensor, Hinv: torch.Tensor, i1: int, i2: int, bits: Bits, sym: bool, any24: bool,
                 rows24: torch.Tensor | None, out: _Outputs) -> None:
    """One lazy block (one quantization group, columns ``i1:i2``): quantize column by column, spread each
    column's error onto the block's later columns, then the block's error onto every later column.

    Each column runs the arithmetic of ``quantize_codes``/``dequantize_codes`` in the same order, into
    preallocated rows (``out=`` and in-place ops): the probe solves thousands of stacked rows this way,
    column by column, where each op's dispatch and allocation cost as much as its arithmetic. The
    results are bit-identical to the two functions' (``tests/compress/test_obs.py``)."""
    block, g = i2 - i1, i1 // (i2 - i1)
    # The block is walked column by column: keep it transposed ([block, R]) so that each column
    # and each rank-1 error update touches contiguous memory.
    W1t = W[:, i1:i2].t().contiguous()
    Err1t = torch.empty_like(W1t)
    Q1t = torch.empty_like(W1t)
    C1t = torch.empty_like(W1t)
    Hinv1 = Hinv[i1:i2, i1:i2]
    hdiag = torch.diag(Hinv1)
    scale, zero = find_params(W1t.t(), bits, sym)
    out.scales[:, g], out.zeros[:, g] = scale, zero
    maxq = max_code(bits, scale)  # an int, or float [R]: one per row
    if any24:
        pruned1t = torch.zeros_like(W1t, dtype=torch.bool)
    for i in range(block):
        w, c, q, err = W1t[i], C1t[i], Q1t[i], Err1t[i]
        if any24 and i % 4 == 0:
            score = W1t[i:i + 4] ** 2 / hdiag[i:i + 4].unsqueeze(1) ** 2
            pruned1t[i:i + 4] = _two_smallest(score)
            if rows24 is not None:
                pruned1t[i:i + 4] &= rows24
        torch.div(w, scale, out=c)  # c = clamp(round(w / scale) + zero, 0, maxq)
        c.round_().add_(zero)
        if isinstance(maxq, int):
            c.clamp_(0, maxq)
        else:
            torch.minimum(c.clamp_(min=0), maxq, out=c)
        torch.sub(c, zero, out=q).mul_(scale)  # q = scale * (c - zero): the product is commutative
        if any24:
            q.masked_fill_(pruned1t[i], 0.0)
        torch.sub(w, q, out=err).div_(Hinv1[i, i])
        W1t[i:].addr_(Hinv1[i, i:], err, alpha=-1.0)
    out.codes[:, i1:i2] = C1t.t().long()
    out.values[:, i1:i2] = Q1t.t()
    out.loss += Err1t.pow(2).sum(0)
    if any24:
        out.keep[:, i1:i2] = ~pruned1t.t()
    W[:, i2:] -= Err1t.t() @ Hinv[i1:i2, i2:]


def rtn_compress(W: torch.Tensor, scheme: DeltaScheme) -> SolveResult:
    """Round-to-nearest baseline: magnitude 2:4 mask, then per-group min/max grid, no calibration.

    Args/returns as ``obs_compress`` (no Hessian).
    """
    R, C = W.shape
    bits, sym, gs = scheme.bits, scheme.sym, scheme.effective_group(C)
    W = W.float()
    keep = None
    if scheme.sparse:
        top = torch.topk(W.abs().reshape(R, C // 4, 4), 2, dim=-1).indices
        keep = torch.zeros(R, C // 4, 4, dtype=torch.bool, device=W.device)
        keep.scatter_(-1, top, True)
        keep = keep.reshape(R, C)
        W = torch.where(keep, W, torch.zeros_like(W))
    Wg = W.reshape(R * (C // gs), gs)
    scale, zero = find_params(Wg, bits, sym)
    codes = quantize_codes(Wg, scale, zero, bits)
    values = dequantize_codes(codes, scale, zero).reshape(R, C)
    if keep is not None:
        values = torch.where(keep, values, torch.zeros_like(values))
    return SolveResult(codes.reshape(R, C).long(), scale.reshape(R, C // gs), zero.reshape(R, C // gs), keep,
                       values, {})


def output_error(E: torch.Tensor, W: torch.Tensor, H: torch.Tensor) -> float:
    """Relative output error ``tr(E H Eᵀ) / tr(W H Wᵀ)`` = ``||E X||² / ||W X||²`` on the calibration inputs."""
    num = float(torch.sum((E @ H) * E))
    den = float(torch.sum((W @ H) * W))
    return num / den if den > 0 else 0.0
