"""The ``mma`` layout: a compressed delta laid out once, at load, in the register order of the CUDA
SBMM kernel (``kernels/cuda/sbmm.cu``, ``deltazip.kernels.cuda_sbmm``). Pure torch; no GPU needed.

The canonical layout (``deltazip.kernels.packed``, docs/format.md) is unchanged: this is a
device-side copy made by :meth:`StackedDeltas.write`, and :func:`unpack_codes` turns it back.

Why a second layout
-------------------
The kernel computes ``y^T = W x^T`` ("swap AB"): the weight tile is the *A* operand of the tensor
core instruction and lives in registers (``mma.sync`` m16n8k16 on sm_80 and newer), so a
dequantized tile never goes through shared memory. Each thread then owns a fixed set of
``(row, column)`` elements of every ``64 x 128`` weight tile (the hardware fragment layout). This
layout stores, for every thread, exactly the codes of its elements in one contiguous run of
``bits`` int32 words per row and tile, arranged so that one 32-bit logic op turns a word into a
*pair* of fp16 (or bf16) values that is already the register the tensor core reads.

Dequantization by bit tricks (the "magic number" trick): OR-ing a code ``q < 2**10`` into the
mantissa of fp16 1024.0 (0x6400) gives the fp16 number ``1024 + q`` exactly; two codes in the two
16-bit halves of a word give two values with one ``LOP3`` (``(w >> s) & mask | 0x64006400``).
Subtracting ``1024 + zero_point`` (one packed ``HADD2`` per pair) gives ``q - z`` exactly, the
integer weight the kernel feeds to the tensor core; the fp32 group scale multiplies the fp32
partial product afterwards, so the result is exact up to fp32 summation order, as in the
reference. bf16 uses 128.0 (0x4300) and its 7-bit mantissa (codes up to 7 bits; 8-bit codes go
through fp16 and are converted, exact because ``|q - z| <= 255``).

Index map (one slot)
--------------------
Rows are padded to ``OUTP = ceil(out / 64) * 64`` (padded rows hold code 0 with scale 0) and
columns to ``INP = ceil(in / 128) * 128`` (padded columns hold code 0; their groups, where a group is
narrower than a tile, scale 0; the kernel zero-fills the activations past ``in``, so they add exactly
0). ``in`` must be a multiple of 8 (the kernel copies activations in 16-byte pieces). Row ``n`` and
column ``k`` decompose as::

    n = 64 * nb + 16 * w + 8 * rr + l          (w: warp, rr: row half, l: lane // 4)
    k = 128 * kb + kk
    kk = 32 * c + 16 * b + 8 * h + 2 * q + e

(``q = lane % 4``, ``e`` = which 16-bit half of a pair). This is the A-operand fragment of a 16-bit
``m16n8k16`` MMA (zero points are kept as fp16 so that the subtraction is one packed ``HSUB2``). With ``j = 4 * c + 2 * b + h`` (16 pairs per thread, row and 128-column tile),
``PPW = 16 // bits`` pairs per word and ``bits`` words per thread-row, a thread's word ``iw = j //
PPW`` holds the code of ``(n, k)`` at bit ``16 * e + bits * (j % PPW)``. Words are stored per
``64 x 128`` tile (``KB = INP / 128`` tiles per row block, one contiguous block of ``1024 * bits``
bytes each) in the order ``[hv, rr, w, l, q, v]`` with ``iw = hv * V + v`` and ``V = min(bits,
4)``: a thread's words of a row half are runs of at most four (one 16-byte load each), and a warp's
load of one run is 512 contiguous bytes.

3-bit codes do not split into 16-bit halves evenly; they are stored as two bit planes per tile: the
codes' low two bits in the 2-bit layout (512 words), then their high bits as a 1-bit layout (256
words, ``PPW`` 16: pair ``j`` at bit ``16 * e + j`` of the thread-row's one word), ``3 * 256`` words per
tile in all. The kernel ORs a pair's high bit into bit 2 of its two low bits with a second ``LOP3``.

2:4 sparsity
------------
By default the kernel runs the dense MMA, so 2:4 deltas are expanded once, here:
a pruned position gets the zero-point code (``z``, which dequantizes to exactly 0). The kernel is
then the dense one; the layout holds ``bits`` bits per weight, against ``bits / 2 + 1`` for the
canonical 2:4 form (equal at 2 bits, +33% at 4 bits, +60% at 8 bits). docs/kernels.md weighs this
against expanding in registers. The ``sparse-mma`` preview keeps 4- and 8-bit 2:4 deltas compact for the
sparse MMA instead (``deltazip.kernels.mma_sparse``).
"""

from __future__ import annotations

import math

import torch

from deltazip.kernels.packed import PackedDelta
from deltazip.kernels.reference import expand_24, unpack_int32

# Bit widths the layout holds (3-bit codes as two bit planes, module docstring).
MMA_BITS = (2, 3, 4, 8)
ROW_BLOCK = 64  # rows per weight tile (one warpgroup's wgmma M)
K_BLOCK = 128  # columns per layout tile


def layout_group(group_size: int, in_features: int) -> int | None:
    """Columns per scale group of the ``mma`` layout, or None when the kernel reads no such group.

    The delta's own group where the kernel reads it: 16, 32 or 64 columns (a tile holds whole groups), whole
    128-column tiles, or the row. A group that is a multiple of 16 columns but neither divides a tile nor is
    made of whole tiles (48, 96, 160, 192, ...) is held as sub-groups of ``16 * gcd(group / 16, 8)`` columns
    (32 for 96, 64 for 192), each with its group's scale and zero point (:func:`layout_scales`): every
    sub-group lies inside one group and tiles hold whole sub-groups, so the kernel reads them as narrow
    groups and the result is the delta's, up to fp32 summation order. Other groups (8, 24, 200 columns: an
    mma step of 16 columns would span two groups) are None."""
    g = in_features if group_size == -1 else group_size
    if g <= 0 or in_features % g:
        return None
    if g in (16, 32, 64) or g == in_features or g % K_BLOCK == 0:
        return g
    if g % 16:
        return None
    return 16 * math.gcd(g // 16, 8)


def split_groups(group_size: int, in_features: int) -> int:
    """Sub-groups per group in the ``mma`` layout (:func:`layout_group`; 1: the delta's own groups)."""
    g, lg = (in_features if group_size == -1 else group_size), layout_group(group_size, in_features)
    return 1 if lg is None else g // lg


def layout_scales(t: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """Per-group values ``[out, G]`` (scales, zero points) as the ``mma`` layout's ``[out, G * split]``:
    each group's value repeated over its sub-groups (:func:`layout_group`)."""
    rep = split_groups(group_size, in_features)
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def group_params(group_size: int, in_features: int) -> tuple[int, int] | None:
    """``(GK16, group_shift)`` of a group size (``-1``: the whole row) in the CUDA kernel, or None when it
    has no variant for it. The kernel reads the layout's groups (:func:`layout_group`): those narrower than
    a 128-column tile take ``GK16 = group / 16`` mma steps each (16, 32 or 64 columns: a tile holds whole
    groups); wider ones span whole tiles (``group_shift`` their log2, or for a count that is not a power of
    two the count itself, :func:`divided_groups`) or the whole row (``group_shift`` 30)."""
    g = layout_group(group_size, in_features)
    if g is None:
        return None
    if g in (16, 32, 64):
        return g // 16, 0
    if g == in_features:
        return 8, 30
    if divided_groups(group_size, in_features):  # 384 columns: the kernel divides (``GDIV`` builds)
        return 8, g // K_BLOCK
    return 8, (g // K_BLOCK).bit_length() - 1


def divided_groups(group_size: int, in_features: int) -> bool:
    """Groups of whole tiles that are not a power of two of them (384, 640, 768 columns, but not the whole
    row): the kernel's ``GDIV`` builds, whose ``group_shift`` argument is the tiles per group."""
    g = in_features if group_size == -1 else group_size
    tiles = g // K_BLOCK
    return g != in_features and g % K_BLOCK == 0 and tiles & (tiles - 1) != 0


def supported(bits: int, group_size: int, in_features: int) -> bool:
    """Whether a configuration has an ``mma`` layout (else the ``canonical`` one): the code widths it
    holds, ``in_features`` a multiple of 8 (not of 128: padded, module docstring), and a group the kernel
    reads (:func:`group_params`)."""
    if bits not in MMA_BITS or in_features % 8 or in_features <= 0:
        return False
    g = in_features if group_size == -1 else group_size
    if g <= 0 or in_features % g:
        return False
    return group_params(group_size, in_features) is not None


def padded_rows(out_features: int) -> int:
    return -(-out_features // ROW_BLOCK) * ROW_BLOCK


def padded_cols(in_features: int) -> int:
    """Columns of the layout: ``in_features`` rounded up to whole 128-column tiles."""
    return -(-in_features // K_BLOCK) * K_BLOCK


def k_tiles(in_features: int) -> int:
    """128-column K tiles of a row in the layout (the last one padded when ``in_features % 128``)."""
    return padded_cols(in_features) // K_BLOCK


def scale_groups(in_features: int, group_size: int) -> int:
    """Groups per row of an ``mma`` stack's scales (and zero points), those of :func:`layout_group`: a
    group narrower than a tile (dividing 128) is counted over the padded columns, so the padded tile's
    groups exist (scale 0); wider groups (the whole row, whole tiles) are the delta's own."""
    g = layout_group(group_size, in_features)
    return padded_cols(in_features) // g if K_BLOCK % g == 0 else in_features // g


def slot_words(out_features: int, in_features: int, bits: int) -> int:
    """int32 words of one slot in the ``mma`` layout."""
    return padded_rows(out_features) * padded_cols(in_features) * bits // 32


def zero_points(delta: PackedDelta) -> torch.Tensor:
    """Integer zero point of every ``[out, G]`` group (the implicit ``2**(bits-1)`` when symmetric)."""
    if delta.zeros is not None:
        return delta.zeros.to(torch.int64)
    return torch.full(tuple(delta.scales.shape), 1 << (delta.bits - 1), dtype=torch.int64, device=delta.scales.device)


def dense_codes(delta: PackedDelta) -> torch.Tensor:
    """int64 ``[out, in]`` codes of every column; 2:4-pruned columns get their group's zero point.

    ``scale * (code - zero)`` of the result is :func:`deltazip.kernels.reference.delta_weight`.
    """
    codes = unpack_int32(delta.qweight, delta.bits, delta.kept_per_row).to(torch.int64)
    if not delta.sparse:
        return codes
    pos = unpack_int32(delta.positions, 2, delta.kept_per_row)
    zp = zero_points(delta).repeat_interleave(delta.effective_group, dim=1)
    # Shift codes by +1 so that 0 marks "pruned" after the scatter, then fill in the zero points.
    dense = expand_24(codes + 1, pos, delta.in_features)
    return torch.where(dense == 0, zp, dense - 1)


def _to_fragment_order(codes: torch.Tensor) -> torch.Tensor:
    """``[OUTP, in]`` -> ``[NB, KB, rr, w, l, q, j, e]`` (j = 4c + 2b + h)."""
    outp, in_f = codes.shape
    nb, kb = outp // ROW_BLOCK, in_f // K_BLOCK
    # dims: 0 nb, 1 w, 2 rr, 3 l, 4 kb, 5 c, 6 b, 7 h, 8 q, 9 e
    v = codes.reshape(nb, 4, 2, 8, kb, 4, 2, 2, 4, 2).permute(0, 4, 2, 1, 3, 8, 5, 6, 7, 9)
    return v.reshape(nb, kb, 2, 4, 8, 4, 16, 2)


def _from_fragment_order(frag: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_to_fragment_order`: ``[NB, KB, rr, w, l, q, j, e]`` -> ``[OUTP, in]``."""
    nb, kb = frag.shape[:2]
    # dims: 0 nb, 1 kb, 2 rr, 3 w, 4 l, 5 q, 6 c, 7 b, 8 h, 9 e -> nb w rr l kb c b h q e
    v = frag.reshape(nb, kb, 2, 4, 8, 4, 4, 2, 2, 2).permute(0, 3, 2, 4, 1, 6, 7, 8, 5, 9)
    return v.reshape(nb * ROW_BLOCK, kb * K_BLOCK)


def _pack_tiles(full: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[OUTP, INP]`` of ``bits`` in (1, 2, 4, 8) -> int64 words ``[NB, KB, 256 * bits]`` per tile."""
    frag = _to_fragment_order(full)  # [..., j(16), e(2)]
    ppw = 16 // bits
    frag = frag.reshape(*frag.shape[:-2], bits, ppw, 2)  # j -> (word, pair in word)
    ip = torch.arange(ppw, device=full.device, dtype=torch.int64)
    shifts = ip[:, None] * bits + torch.tensor([0, 16], device=full.device, dtype=torch.int64)[None, :]
    words = (frag << shifts).sum(dim=(-1, -2))  # disjoint bit fields: the sum is an OR; [NB, KB, rr, w, l, q, bits]
    # A thread's ``bits`` words of a row half are split into runs of at most 4 (16-byte loads),
    # the run index outermost in a tile: [NB, KB, hv, rr, w, l, q, v].
    run = min(bits, 4)
    words = words.reshape(*words.shape[:-1], bits // run, run).permute(0, 1, 6, 2, 3, 4, 5, 7)
    return words.reshape(words.shape[0], words.shape[1], -1)


def _unpack_tiles(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`_pack_tiles`: int64 words ``[NB, KB, 256 * bits]`` -> codes ``[OUTP, INP]``."""
    nb, kb, ppw, run = words.shape[0], words.shape[1], 16 // bits, min(bits, 4)
    w = words.reshape(nb, kb, bits // run, 2, 4, 8, 4, run).permute(0, 1, 3, 4, 5, 6, 2, 7)
    w = w.reshape(nb, kb, 2, 4, 8, 4, bits, 1, 1)
    ip = torch.arange(ppw, device=words.device, dtype=torch.int64)
    shifts = ip[:, None] * bits + torch.tensor([0, 16], device=words.device, dtype=torch.int64)[None, :]
    frag = (w >> shifts) & ((1 << bits) - 1)  # [..., bits, ppw, 2]
    return _from_fragment_order(frag.reshape(nb, kb, 2, 4, 8, 4, 16, 2))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack dense codes ``[out, in]`` (values in ``[0, 2**bits)``) into the ``mma`` layout.

    Returns:
        int32 ``[slot_words(out, in, bits)]`` (rows padded to a multiple of 64, columns to one of 128,
        with code 0).
    """
    if bits not in MMA_BITS:
        raise ValueError(f"the mma layout holds {MMA_BITS}-bit codes, not {bits}")
    out_f, in_f = codes.shape
    if in_f % 8:
        raise ValueError(f"the mma layout needs in_features divisible by 8, got {in_f}")
    outp = padded_rows(out_f)
    full = torch.zeros(outp, padded_cols(in_f), dtype=torch.int64, device=codes.device)
    full[:out_f, :in_f] = codes.to(torch.int64)
    if bits == 3:  # bit planes: the low two bits as the 2-bit layout, then the high bit as a 1-bit one
        words = torch.cat([_pack_tiles(full & 3, 2), _pack_tiles(full >> 2, 1)], dim=-1)
    else:
        words = _pack_tiles(full, bits)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).reshape(-1)


def unpack_codes(words: torch.Tensor, bits: int, out_features: int, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int64 codes ``[out, in]``."""
    nb, kb = padded_rows(out_features) // ROW_BLOCK, k_tiles(in_features)
    w = words.to(torch.int64).reshape(nb, kb, 256 * bits) & 0xFFFFFFFF
    if bits == 3:
        codes = _unpack_tiles(w[..., :512], 2) | (_unpack_tiles(w[..., 512:], 1) << 2)
    else:
        codes = _unpack_tiles(w, bits)
    return codes[:out_features, :in_features]


def resparsify(codes: torch.Tensor, zeros: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense codes of a 2:4 delta back to (kept codes ``[out, in/2]``, positions ``[out, in/2]``).

    In every group of four columns the positions whose code differs from the zero point are kept;
    when fewer than two do, the lowest-indexed others fill up (their code is the zero point, so the
    delta's value is the same). Raises when a group has more than two non-zero codes.
    """
    out_f, in_f = codes.shape
    zp = zeros.to(torch.int64).repeat_interleave(group, dim=1)
    nz = (codes != zp).reshape(out_f, in_f // 4, 4)
    if bool((nz.sum(-1) > 2).any()):
        raise ValueError("codes are not 2:4: a group of four columns has more than two non-zero values")
    # Rank positions: non-zero first (stable, so ascending), keep two, then restore ascending order.
    order = torch.sort((~nz).to(torch.int8), dim=-1, stable=True).indices[..., :2]
    order = torch.sort(order, dim=-1).values
    kept = torch.gather(codes.reshape(out_f, in_f // 4, 4), -1, order)
    return kept.reshape(out_f, in_f // 2), order.reshape(out_f, in_f // 2)


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Canonical packing (``32 // bits`` codes per word, code ``k`` at bit ``(k % per) * bits``)."""
    per = 32 // bits
    rows, n = codes.shape
    words = -(-n // per)
    padded = torch.zeros(rows, words * per, dtype=torch.int64, device=codes.device)
    padded[:, :n] = codes.to(torch.int64)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int64) * bits
    acc = (padded.reshape(rows, words, per) << shifts).sum(dim=-1)
    return torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)
