"""Triton kernels of ``deltazip.kernels.triton_sbmm`` (imported lazily from there; needs triton).

Kept apart so that ``deltazip.kernels.triton_sbmm`` imports without Triton, and so that the kernels
are decorated only when first needed: ``triton.jit`` decides between compiled and interpreted
(``TRITON_INTERPRET=1``) at decoration time.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gather_fields(base, kidx, offs_n, OUT, mask, BITS: tl.constexpr, PER: tl.constexpr):
    """Fields ``kidx`` (``BITS`` wide, ``PER`` per word) of output rows ``offs_n`` from a transposed
    ``[Kw, OUT]`` int32 part: one (cached) word load per element. Used when ``PER`` is not a power
    of two (3-bit codes: 10 per word)."""
    words = tl.load(base + (kidx // PER)[:, None] * OUT + offs_n[None, :], mask=mask, other=0)
    shift = ((kidx % PER) * BITS)[:, None]
    return (words >> shift) & ((1 << BITS) - 1)


@triton.jit
def _split_words(base, w0, offs_n, n_mask, OUT, NWORDS, FIELD: tl.constexpr, PER_WORD: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """``ROWS`` consecutive ``FIELD``-bit fields starting at word row ``w0`` of a transposed
    ``[NWORDS, OUT]`` int32 part, for output rows ``offs_n``: int32 ``[ROWS, BLOCK_N]``.

    Loads each word once (``ROWS / PER_WORD`` coalesced rows of ``BLOCK_N`` words) and splits it in
    registers; ``PER_WORD`` and ``ROWS / PER_WORD`` are powers of two."""
    offs_w = w0 + tl.arange(0, ROWS // PER_WORD)
    words = tl.load(base + offs_w[:, None] * OUT + offs_n[None, :],
                    mask=(offs_w < NWORDS)[:, None] & n_mask[None, :], other=0)
    shifts = tl.arange(0, PER_WORD) * FIELD
    fields = (words[:, None, :] >> shifts[None, :, None]) & ((1 << FIELD) - 1)
    return tl.reshape(fields, (ROWS, BLOCK_N))


@triton.jit
def _code_tile(qw_base, pos_base, k0, offs_k, k_mask, offs_n, n_mask, OUT, KW, KP,
               BITS: tl.constexpr, PER: tl.constexpr, SPARSE: tl.constexpr, POW2: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Codes of dense input columns ``k0 .. k0 + BLOCK_K`` for output rows ``offs_n``: int32
    ``[BLOCK_K, BLOCK_N]``, -1 at pruned 2:4 positions (codes themselves are >= 0)."""
    if SPARSE:
        if POW2:
            # The two kept codes of group-of-four g are adjacent (codes 2g, 2g+1), so with an even
            # number of codes per word they form one 2*BITS-bit field; their two 2-bit positions
            # likewise form one 4-bit field of the positions part (8 per word).
            pairs = _split_words(qw_base, k0 // (2 * PER), offs_n, n_mask, OUT, KW,
                                 2 * BITS, PER // 2, BLOCK_K // 4, BLOCK_N)
            nibs = _split_words(pos_base, k0 // 32, offs_n, n_mask, OUT, KP, 4, 8, BLOCK_K // 4, BLOCK_N)
            ca = (pairs & ((1 << BITS) - 1))[:, None, :]
            cb = (pairs >> BITS)[:, None, :]
            pa = (nibs & 3)[:, None, :]
            pb = (nibs >> 2)[:, None, :]
            j = tl.arange(0, 4)[None, :, None]
            code3 = tl.where(pa == j, ca, tl.where(pb == j, cb, -1))
            code = tl.reshape(code3, (BLOCK_K, BLOCK_N))
        else:
            # Dense column c keeps stored codes 2*(c//4) and 2*(c//4)+1; c takes the one whose
            # position equals c % 4, or is pruned.
            w_mask = k_mask[:, None] & n_mask[None, :]
            kept0 = (offs_k // 4) * 2
            c0 = _gather_fields(qw_base, kept0, offs_n, OUT, w_mask, BITS, PER)
            c1 = _gather_fields(qw_base, kept0 + 1, offs_n, OUT, w_mask, BITS, PER)
            p0 = _gather_fields(pos_base, kept0, offs_n, OUT, w_mask, 2, 16)
            p1 = _gather_fields(pos_base, kept0 + 1, offs_n, OUT, w_mask, 2, 16)
            j = (offs_k % 4)[:, None]
            code = tl.where(p0 == j, c0, tl.where(p1 == j, c1, -1))
    else:
        if POW2:
            code = _split_words(qw_base, k0 // PER, offs_n, n_mask, OUT, KW, BITS, PER, BLOCK_K, BLOCK_N)
        else:
            w_mask = k_mask[:, None] & n_mask[None, :]
            code = _gather_fields(qw_base, offs_k, offs_n, OUT, w_mask, BITS, PER)
    return code


@triton.jit
def sbmm_kernel(
    x_ptr, y_ptr, perm_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
    qw_ptr, pos_ptr, sc_ptr, zr_ptr,
    IN, OUT, GROUP, KW, KP, stride_xm, stride_ym,
    qw_slot_stride, pos_slot_stride, sc_slot_stride,
    BITS: tl.constexpr, PER: tl.constexpr, POW2: tl.constexpr, SPARSE: tl.constexpr,
    ASYM: tl.constexpr, TILE_SCALE: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: the rows of row tile ``program_id(0)`` (all of one slot) times output columns
    ``program_id(1) * BLOCK_N ...`` of that slot's delta, over K split ``program_id(2)``.

    ``y[rows] = x[rows] @ W_slot.T`` with ``W_slot`` dequantized from the stacked layout
    (``deltazip.kernels.stacked``); rows are gathered from / scattered to their original positions
    through the plan's permutation. ``SPLIT_K > 1`` accumulates into fp32 ``y`` with atomics."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    slot = tl.load(tile_slot_ptr + t)
    if slot >= 0:
        start = tl.load(tile_start_ptr + t)
        end = tl.load(tile_end_ptr + t)
        offs_m = start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        rows = tl.load(perm_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < OUT
        s64 = slot.to(tl.int64)
        qw_base = qw_ptr + s64 * qw_slot_stride
        pos_base = pos_ptr + s64 * pos_slot_stride
        sc_base = sc_ptr + s64 * sc_slot_stride
        zr_base = zr_ptr + s64 * sc_slot_stride
        # K range of this split, whole BLOCK_K tiles (plain arithmetic: the jit'd tl.cdiv cannot be
        # called from interpreted kernels when triton was imported before TRITON_INTERPRET was set).
        k_tiles = (IN + BLOCK_K - 1) // BLOCK_K
        k_span = (k_tiles + SPLIT_K - 1) // SPLIT_K * BLOCK_K
        k_begin = pid_k * k_span
        k_stop = tl.minimum(IN, k_begin + k_span)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, k_stop, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < IN
            a = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            code = _code_tile(qw_base, pos_base, k0, offs_k, k_mask, offs_n, n_mask, OUT, KW, KP,
                              BITS, PER, SPARSE, POW2, BLOCK_N, BLOCK_K)
            if TILE_SCALE:
                # The whole K tile lies in one group: integer weights into the dot (exact in
                # fp16/bf16, |q| < 256), the fp32 scale applied to the partial product.
                g = k0 // GROUP
                s = tl.load(sc_base + g * OUT + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                if ASYM:
                    z = tl.load(zr_base + g * OUT + offs_n, mask=n_mask, other=0).to(tl.int32)[None, :]
                else:
                    z = 1 << (BITS - 1)
                w = tl.where(code >= 0, code - z, 0).to(a.dtype)
                if IEEE:
                    part = tl.dot(a, w, input_precision="ieee")
                else:
                    part = tl.dot(a, w)
                acc += part * s[None, :]
            else:
                w_mask = k_mask[:, None] & n_mask[None, :]
                g2 = (offs_k // GROUP)[:, None] * OUT + offs_n[None, :]
                s = tl.load(sc_base + g2, mask=w_mask, other=0.0).to(tl.float32)
                if ASYM:
                    z = tl.load(zr_base + g2, mask=w_mask, other=0).to(tl.int32)
                else:
                    z = 1 << (BITS - 1)
                w = tl.where(code >= 0, (code - z).to(tl.float32) * s, 0.0).to(a.dtype)
                if IEEE:
                    acc += tl.dot(a, w, input_precision="ieee")
                else:
                    acc += tl.dot(a, w)
        y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
        y_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
        else:
            tl.atomic_add(y_ptrs, acc, mask=y_mask)


@triton.jit
def lora_shrink_kernel(
    x_ptr, h_ptr, perm_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, a_ptr,
    IN, RANK, stride_xm, stride_hm,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # h[rows, r] = sum_k x[rows, k] * A[slot, r, k]   (A is [L, RANK, IN] contiguous)
    t = tl.program_id(0)
    pid_r = tl.program_id(1)
    slot = tl.load(tile_slot_ptr + t)
    if slot >= 0:
        start = tl.load(tile_start_ptr + t)
        end = tl.load(tile_end_ptr + t)
        offs_m = start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        rows = tl.load(perm_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        r_mask = offs_r < RANK
        a_base = a_ptr + slot.to(tl.int64) * RANK * IN
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, IN, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < IN
            xa = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_base + offs_r[None, :] * IN + offs_k[:, None],
                         mask=k_mask[:, None] & r_mask[None, :], other=0.0).to(xa.dtype)
            if IEEE:
                acc += tl.dot(xa, at, input_precision="ieee")
            else:
                acc += tl.dot(xa, at)
        tl.store(h_ptr + rows[:, None] * stride_hm + offs_r[None, :], acc,
                 mask=m_mask[:, None] & r_mask[None, :])

@triton.jit
def lora_expand_kernel(
    h_ptr, y_ptr, perm_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, b_ptr, scale_ptr,
    RANK, OUT, stride_hm, stride_ym,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # y[rows, n] = scale[slot] * sum_r h[rows, r] * B[slot, n, r]   (B is [L, OUT, RANK])
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(tile_slot_ptr + t)
    if slot >= 0:
        start = tl.load(tile_start_ptr + t)
        end = tl.load(tile_end_ptr + t)
        offs_m = start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        rows = tl.load(perm_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < OUT
        b_base = b_ptr + slot.to(tl.int64) * OUT * RANK
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, RANK, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_mask = offs_r < RANK
            # Both operands in the activation (= output) dtype; h is kept in fp32 between launches.
            bt = tl.load(b_base + offs_n[None, :] * RANK + offs_r[:, None],
                         mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(y_ptr.dtype.element_ty)
            hv = tl.load(h_ptr + rows[:, None] * stride_hm + offs_r[None, :],
                         mask=m_mask[:, None] & r_mask[None, :], other=0.0).to(y_ptr.dtype.element_ty)
            if IEEE:
                acc += tl.dot(hv, bt, input_precision="ieee")
            else:
                acc += tl.dot(hv, bt)
        acc = acc * tl.load(scale_ptr + slot)
        tl.store(y_ptr + rows[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])
