"""Triton kernel of ``deltazip.kernels.triton_fast`` (imported lazily from there; needs triton).

One program computes a ``64 x BLOCK_M`` tile of ``y^T``: 64 output features of one slot's delta
times the ``BLOCK_M`` activation rows of one row tile (swap AB: the weight tile is the A operand, so
it stays in registers). Per K step a thread loads its ``BITS * BLOCK_K / 128`` words per row half in
16-byte vector loads, turns every word into fp16/bf16 pairs with one logic op per pair (plus a
shift whenever the next field no longer fits the mantissa), turns ``magic + code`` into ``code -
zero`` with one packed FMA per pair, and the tensor core multiplies. The weights are in the register
order of the MMA fragment (``deltazip.kernels.fast_layout``), so the ``join``/``permute``/``reshape``
below only rename registers: no layout conversion, no shared memory for the dequantized tile. Two K
steps per loop iteration (``UNROLL``) halve the loop's bookkeeping per weight.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pair(words, zf, FIELD, SH: tl.constexpr, OFF: tl.constexpr, BITS: tl.constexpr, MAGIC: tl.constexpr,
          MAGF: tl.constexpr, MT: tl.constexpr, USE_ASM: tl.constexpr):
    """One pair of weights per word of ``words``: the codes at bits ``SH + OFF`` and
    ``16 + SH + OFF``, as ``[..., 2]`` values ``code - zero`` in ``MT`` (fp16 or bf16), exactly.

    ``(words >> SH) & (mask << OFF) | MAGIC`` puts ``code << OFF`` into the mantissa of the magic
    number in both 16-bit halves (one ``LOP3``; the shift is shared by the pairs of one ``SH``);
    ``v * 2**-OFF - (magic * 2**-OFF + zero)`` is then ``code - zero`` with no rounding, one packed
    ``HFMA2`` for the pair (inline PTX on the GPU, so that it stays one instruction whatever LLVM's
    vectorizer decides; plain fp16/bf16 arithmetic with the same exact result in the interpreter).
    ``zf`` is ``magic + zero`` (a constant or a per-row tensor)."""
    # FIELD (= (2**BITS - 1) * 0x10001) is a kernel argument rather than a literal: with the mask in a
    # register and the magic number as the immediate, a pair is one LOP3 (two literals make ptxas
    # rematerialize the mask with an extra move per pair).
    if SH == 0:
        p = (words & (FIELD << OFF)) | MAGIC
    else:
        p = ((words >> SH) & (FIELD << OFF)) | MAGIC
    zs = zf - (MAGF - MAGF / (1 << OFF))  # magic * 2**-OFF + zero, exact
    if USE_ASM:
        if MT == tl.bfloat16:
            mul_bits: tl.constexpr = (127 - OFF) << 7  # bf16 2**-OFF
            asm: tl.constexpr = "fma.rn.bf16x2 $0, $1, $2, $3;"
        else:
            mul_bits: tl.constexpr = (15 - OFF) << 10  # fp16 2**-OFF
            asm: tl.constexpr = "fma.rn.f16x2 $0, $1, $2, $3;"
        neg = (0.0 - zs).to(MT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        d = tl.inline_asm_elementwise(asm, "=r,r,r,r", [p, mul_bits * 0x10001, neg * 0x10001],
                                      dtype=tl.int32, is_pure=True, pack=1)
        lo = d.to(tl.int16).to(MT, bitcast=True)
        hi = (d >> 16).to(tl.int16).to(MT, bitcast=True)
    else:
        lo = p.to(tl.int16).to(MT, bitcast=True)
        hi = (p >> 16).to(tl.int16).to(MT, bitcast=True)
        if OFF == 0:
            lo = lo - zs
            hi = hi - zs
        else:
            lo = lo * (1.0 / (1 << OFF)) - zs
            hi = hi * (1.0 / (1 << OFF)) - zs
    return tl.join(lo, hi)


@triton.jit
def _dequant(words, zf, FIELD, BITS: tl.constexpr, BF16_MAGIC: tl.constexpr, MAGIC: tl.constexpr, MAGF: tl.constexpr,
             MT: tl.constexpr, USE_ASM: tl.constexpr):
    """int32 ``[..., NW]`` words -> ``[..., NW, <pairs per word as 1-3 dims of 2>, 2]`` weights.

    The trailing dims count the pair index ``i`` of a word row-major, then the half ``e``. Shifts are
    shared: a field whose ``code << OFF`` still fits the mantissa (10 bits fp16, 7 bf16) reuses the
    previous shift."""
    if BITS == 8:
        p0 = _pair(words, zf, FIELD, 0, 0, BITS, MAGIC, MAGF, MT, USE_ASM)
        p1 = _pair(words, zf, FIELD, 8, 0, BITS, MAGIC, MAGF, MT, USE_ASM)
        return tl.join(p0, p1).permute(0, 1, 2, 3, 4, 6, 5)  # [..., i, e]
    elif BITS == 4:
        if BF16_MAGIC:
            p0 = _pair(words, zf, FIELD, 0, 0, BITS, MAGIC, MAGF, MT, USE_ASM)
            p1 = _pair(words, zf, FIELD, 4, 0, BITS, MAGIC, MAGF, MT, USE_ASM)
            p2 = _pair(words, zf, FIELD, 8, 0, BITS, MAGIC, MAGF, MT, USE_ASM)
            p3 = _pair(words, zf, FIELD, 12, 0, BITS, MAGIC, MAGF, MT, USE_ASM)
        else:
            p0 = _pair(words, zf, FIELD, 0, 0, BITS, MAGIC, MAGF, MT, USE_ASM)
            p1 = _pair(words, zf, FIELD, 0, 4, BITS, MAGIC, MAGF, MT, USE_ASM)
            p2 = _pair(words, zf, FIELD, 8, 0, BITS, MAGIC, MAGF, MT, USE_ASM)
            p3 = _pair(words, zf, FIELD, 8, 4, BITS, MAGIC, MAGF, MT, USE_ASM)
        v = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [..., e, a, b] = p[2a + b][e]
        return v.permute(0, 1, 2, 3, 4, 6, 7, 5)
    else:
        if BF16_MAGIC:
            p0 = _pair(words, zf, FIELD, 0, 0, BITS, MAGIC, MAGF, MT, USE_ASM)
            p1 = _pair(words, zf, FIELD, 0, 2, BITS, MAGIC, MAGF, MT, USE_ASM)
            p2 = _pair(words, zf, FIELD, 0, 4, BITS, MAGIC, MAGF, MT, USE_ASM)
            p3 = _pair(words, zf, FIELD, 6, 0, BITS, MAGIC, MAGF, MT, USE_ASM)
            p4 = _pair(words, zf, FIELD, 6, 2, BITS, MAGIC, MAGF, MT, USE_ASM)
            p5 = _pair(words, zf, FIELD, 6, 4, BITS, MAGIC, MAGF, MT, USE_ASM)
            p6 = _pair(words, zf, FIELD, 12, 0, BITS, MAGIC, MAGF, MT, USE_ASM)
            p7 = _pair(words, zf, FIELD, 12, 2, BITS, MAGIC, MAGF, MT, USE_ASM)
        else:
            p0 = _pair(words, zf, FIELD, 0, 0, BITS, MAGIC, MAGF, MT, USE_ASM)
            p1 = _pair(words, zf, FIELD, 0, 2, BITS, MAGIC, MAGF, MT, USE_ASM)
            p2 = _pair(words, zf, FIELD, 0, 4, BITS, MAGIC, MAGF, MT, USE_ASM)
            p3 = _pair(words, zf, FIELD, 0, 6, BITS, MAGIC, MAGF, MT, USE_ASM)
            p4 = _pair(words, zf, FIELD, 0, 8, BITS, MAGIC, MAGF, MT, USE_ASM)
            p5 = _pair(words, zf, FIELD, 10, 0, BITS, MAGIC, MAGF, MT, USE_ASM)
            p6 = _pair(words, zf, FIELD, 10, 2, BITS, MAGIC, MAGF, MT, USE_ASM)
            p7 = _pair(words, zf, FIELD, 10, 4, BITS, MAGIC, MAGF, MT, USE_ASM)
        y0 = tl.join(tl.join(p0, p4), tl.join(p2, p6))  # [..., e, a, b] = p[4a + 2b][e]
        y1 = tl.join(tl.join(p1, p5), tl.join(p3, p7))
        v = tl.join(y0, y1)  # [..., e, a, b, c] = p[4a + 2b + c][e]
        return v.permute(0, 1, 2, 3, 4, 6, 7, 8, 5)


@triton.jit
def sbmm_fast_kernel(
    x_ptr, y_ptr, perm_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
    qw_ptr, sc_ptr, zr_ptr,
    IN, OUT, OUTP, GROUP, stride_xm, stride_ym, qw_slot_stride, sc_slot_stride, FIELD,
    BITS: tl.constexpr, ASYM: tl.constexpr, BF16: tl.constexpr, IEEE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, G_SHIFT: tl.constexpr, USE_ASM: tl.constexpr, UNROLL: tl.constexpr = 1,
    ACC: tl.constexpr = False,
):
    """``y[rows] = x[rows] @ W_slot.T`` for the rows of row tile ``program_id(0)`` (one slot), 64
    output features from ``program_id(1) * 64``, K split ``program_id(2)`` (``SPLIT_K > 1``
    accumulates fp32 ``y`` with atomics). ``W_slot`` is read from the ``mma`` layout; every K step
    lies inside one quantization group (``GROUP % BLOCK_K == 0``). Activations are fp16, bf16
    (``BF16``) or fp32 (``IEEE``: a correct but slow path, for fp32 models on a GPU). ``ACC`` (with
    ``SPLIT_K == 1``): add the tile onto what ``y`` holds (``y += x W^T``, the base GEMM's output)
    instead of overwriting it; rows of other slots and of index -1 are never touched either way."""
    BLOCK_N: tl.constexpr = 64
    NC: tl.constexpr = BLOCK_K // 32  # 32-column chunks per K step
    NWK: tl.constexpr = NC * BITS // 4  # words per thread and row half per K step
    V: tl.constexpr = 4 if BITS > 4 else BITS  # words per contiguous run in the layout
    VK: tl.constexpr = V if NWK > V else NWK  # words per run read in one K step
    HVK: tl.constexpr = NWK // VK  # runs read per K step
    TILE_WORDS: tl.constexpr = BLOCK_N * 128 * BITS // 32  # one 64 x 128 layout tile
    # Magic numbers: fp16 1024.0 (10-bit mantissa) or bf16 128.0 (7-bit mantissa; 8-bit codes go
    # through fp16 and are converted after the subtraction, exactly).
    BF16_MAGIC: tl.constexpr = BF16 and BITS < 8
    MAGIC: tl.constexpr = 0x43004300 if BF16_MAGIC else 0x64006400
    MAGF: tl.constexpr = 128.0 if BF16_MAGIC else 1024.0
    MT: tl.constexpr = tl.bfloat16 if BF16_MAGIC else tl.float16

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
        qw_base = qw_ptr + s64 * qw_slot_stride + pid_n.to(tl.int64) * (IN // 128) * TILE_WORDS
        sc_base = sc_ptr + s64 * sc_slot_stride
        zr_base = zr_ptr + s64 * sc_slot_stride
        # Fragment coordinates of a thread's words (fast_layout docstring): [hv, rr, w, l, q, v]; a
        # thread's words of one row half are runs of at most 4 (one 16-byte load each).
        hv = tl.arange(0, HVK)[:, None, None, None, None, None]
        rr = tl.arange(0, 2)[None, :, None, None, None, None]
        w = tl.arange(0, 4)[None, None, :, None, None, None]
        lane = tl.arange(0, 8)[None, None, None, :, None, None]
        q = tl.arange(0, 4)[None, None, None, None, :, None]
        vk = tl.arange(0, VK)[None, None, None, None, None, :]
        woff = hv * (256 * V) + (((rr * 4 + w) * 8 + lane) * 4 + q) * V + vk
        # Row of the A tile held by (rr, w, l), shaped to broadcast over the words [rr, w, l, q, word].
        zrow = (16 * tl.arange(0, 4)[None, :, None, None, None] + 8 * tl.arange(0, 2)[:, None, None, None, None]
                + tl.arange(0, 8)[None, None, :, None, None])
        k_tiles = IN // BLOCK_K
        k_span = (k_tiles + SPLIT_K - 1) // SPLIT_K * BLOCK_K
        k_begin = pid_k * k_span
        k_stop = tl.minimum(IN, k_begin + k_span)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in tl.range(k_begin, k_stop, BLOCK_K, loop_unroll_factor=UNROLL):
            c0 = (k0 % 128) // 32
            iw0 = c0 * BITS // 4  # first word of this K step in a thread's run of BITS words
            if BLOCK_K == 128:  # iw0 is 0: an address Triton 3.6 can prove 16-byte aligned (16-byte copies)
                words = tl.load(qw_base + (k0 // 128) * TILE_WORDS + woff)
            else:
                words = tl.load(qw_base + (k0 // 128) * TILE_WORDS + (iw0 // V) * (256 * V) + iw0 % V + woff)
            words = tl.reshape(tl.permute(words, (1, 2, 3, 4, 0, 5)), (2, 4, 8, 4, NWK))
            if G_SHIFT >= 0:  # K steps per group a power of two (31: one group per row)
                g = (k0 // BLOCK_K) >> G_SHIFT
            else:
                g = k0 // GROUP
            if ASYM:
                z = tl.load(zr_base + g * OUTP + pid_n * BLOCK_N + zrow).to(tl.float32)
                zf = (z + MAGF).to(MT)
            else:
                zf = tl.full((1, 1, 1, 1, 1), MAGF + (1 << (BITS - 1)), MT)
            v = _dequant(words, zf, FIELD, BITS, BF16_MAGIC, MAGIC, MAGF, MT, USE_ASM)
            if BF16 and not BF16_MAGIC:
                v = v.to(tl.bfloat16)
            v = tl.reshape(v, (2, 4, 8, 4, NC, 2, 2, 2))  # rr w l q c b h e
            v = tl.permute(v, (1, 0, 2, 4, 5, 6, 3, 7))  # w rr l c b h q e: [64, BLOCK_K] row-major
            a = tl.reshape(v, (BLOCK_N, BLOCK_K))
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + rows[None, :] * stride_xm + offs_k[:, None], mask=m_mask[None, :], other=0.0)
            if IEEE:  # fp32 activations: exact integer weights in fp32, fp32 FMA (no tensor cores)
                part = tl.dot(a.to(tl.float32), xt, input_precision="ieee")
            else:
                part = tl.dot(a, xt)
            s = tl.load(sc_base + g * OUTP + offs_n).to(tl.float32)
            acc += part * s[:, None]
        y_ptrs = y_ptr + rows[None, :] * stride_ym + offs_n[:, None]
        y_mask = n_mask[:, None] & m_mask[None, :]
        if SPLIT_K == 1:
            if ACC:  # epilogue add onto the base output: one read of the tile, no separate add kernel
                acc += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
        else:
            tl.atomic_add(y_ptrs, acc, mask=y_mask)
