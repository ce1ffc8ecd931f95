"""What the CUDA kernel's builds read from an ``mma`` stack, emulated on CPU (pure torch, no GPU).

The kernel's own arithmetic, transcribed from ``kernels/cuda/sbmm.cu``:

- how ``load_w`` fills a pipeline stage for each launch config (``RB``, ``KT``, ``MT``: which thread copies
  which 16-byte piece of codes and which 8 scales and zero points, zero-filled past the matrix);
- where each thread reads its code words in a stage (``w_rd``, the ``RUN``/``HV`` runs, the 3-bit high
  plane at ``wb_rd``; the ``SP24`` builds' words and metadata at ``e_rd``) and which A-fragment element a
  pair of codes becomes (dense ``mma`` m16n8k16: pair ``j`` of row half ``rr`` is row ``8 rr + lane / 4``,
  columns ``16 (j / 2) + 8 (j % 2) + 2 (lane % 4) + e``; ``mma.sp`` m16n8k32: the column its metadata names);
- the "magic number" dequantization bit for bit (``dequant_pair``, ``dequant_pair3``: the shift, the
  LOP3 mask, ``pow2_neg``, ``neg_int2`` and the packed FMA in fp16 or bf16);
- which zero point each pair takes (``word_zeros``) and which scale each step's partial sum is flushed
  with (``flush`` after every ``GK16`` k16 steps, or at a group's last tile or a split's, with
  ``TILE_GROUP``/``GROUP_ENDS`` and the ``GDIV`` builds);
- what ``dz_dequant`` (the prefill path's dequantize) writes;
- how ``load_x`` stages a tile's activation rows (zero-filled from ``KCOLS`` on) and which activation each
  lane's ``ldmatrix`` hands the MMA as its B operand (dense x4 and x2, the SP24 builds' k32 steps).

The weight they add up to, column by column, must be the reference's ``scale * (code - zero)`` exactly,
for every scheme the kernel serves: the validated 2-, 4- and 8-bit dense builds, and those only preview
builds serve (3-bit planes, groups of 16 and 2-bit groups of 32, split and wide groups, a padded last K
tile, the compact 2:4 layout on the sparse MMA), whose GPU parity has not run yet. What this cannot see
(the instructions themselves, whose fragment layouts it takes from the PTX ISA, the epilogue, the
split-K reduction, the compiler, timing) is what a GPU's parity tests check: tests/kernels/test_cuda_sbmm.py
runs the same builds there.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import NamedTuple

import pytest
import torch
from _sbmm import make_delta

from deltazip.kernels import cuda_sbmm, mma_layout, mma_sparse, reference
from deltazip.kernels.stacked import repack

SOURCE = resources.files("deltazip.kernels").joinpath("cuda/sbmm.cu").read_text()
U32 = 0xFFFFFFFF


def _defines(name: str) -> list[str]:
    return re.findall(rf"^#define {name} (\S+)", SOURCE, flags=re.M)


def test_the_transcribed_constants_are_the_kernels():
    """The magic numbers below are the source's (bf16 128.0 and fp16 1024.0, twice)."""
    assert _defines("MAGIC") == ["0x43004300u", "0x64006400u"]
    assert _defines("MANT") == ["7", "10"] and _defines("MVAL") == ["128", "1024"]


def _magic(bits: int, bf16: bool) -> tuple[bool, int, int, int]:
    """``(bf16 arithmetic, MANT, MVAL, MAGIC)`` of a build: bf16 magic below 8 bits, else fp16's."""
    b = bf16 and bits < 8
    return (b, 7, 128, 0x43004300) if b else (b, 10, 1024, 0x64006400)


def _halves(v: torch.Tensor, as_bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 16-bit halves of int64 words ``v`` (< 2**32) as fp64 values of fp16 or bf16."""
    out = []
    for h in (v & 0xFFFF, (v >> 16) & 0xFFFF):
        bits16 = torch.where(h >= 1 << 15, h - (1 << 16), h).to(torch.int16)
        out.append(bits16.view(torch.bfloat16 if as_bf16 else torch.float16).double())
    return out[0], out[1]


def _neg_int2(v: torch.Tensor, as_bf16: bool) -> torch.Tensor:
    """``neg_int2``: -(v) in both halves, v > 0 an integer (int64 tensor)."""
    e = torch.floor(torch.log2(v.double())).long()  # 31 - __clz(v)
    if as_bf16:
        h = 0x8000 | ((e + 127) << 7) | ((v << (7 - e)) & 0x7F)
    else:
        h = 0x8000 | ((e + 15) << 10) | ((v << (10 - e)) & 0x3FF)
    return h * 0x10001


def _pow2_neg(p: torch.Tensor, as_bf16: bool) -> torch.Tensor:
    return ((0x3F80 - (p << 7)) if as_bf16 else (0x3C00 - (p << 10))) * 0x10001


def _hfma2_to_dtype(t, p, c, as_bf16: bool, bf16_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``hfma2(t, p, c)`` per half (the exact product and sum, one rounding to the build's half type),
    then (8-bit codes under bf16) the conversion of the fp16 result to bf16."""
    dtype = torch.bfloat16 if as_bf16 else torch.float16
    out = []
    for tt, pp, cc in zip(_halves(t, as_bf16), _halves(p, as_bf16), _halves(c, as_bf16)):
        r = (tt * pp + cc).to(dtype)
        out.append((r.to(torch.bfloat16) if bf16_out and not as_bf16 else r).double())
    return out[0], out[1]


def dequant_pair(w: torch.Tensor, j: torch.Tensor, z: torch.Tensor, bits: int, bf16: bool):
    """``dequant_pair<J>(w, z)`` for 2, 4 and 8 bits (``J = j % PPW``): the pair's two exact (q - z)."""
    as_bf16, mant, mval, magic = _magic(bits, bf16)
    off = (bits * j) % 8
    shifted = off + bits > mant
    place = torch.where(shifted, 0, off)
    v = w >> (8 * ((bits * j) // 8) + torch.where(shifted, off, 0))
    t = (v & ((((1 << bits) - 1) << place) * 0x10001)) | magic  # lop3 (a & b) | c
    return _hfma2_to_dtype(t, _pow2_neg(place, as_bf16), _neg_int2((mval >> place) + z, as_bf16), as_bf16, bf16)


def dequant_pair3(wa: torch.Tensor, wb: torch.Tensor, j: torch.Tensor, z: torch.Tensor, bf16: bool):
    """``dequant_pair3(wa, wb, j, z)``: 3-bit codes, low two bits from plane word ``wa``, high bit from ``wb``."""
    as_bf16, _, mval, magic = _magic(3, bf16)
    lo = ((wa >> (2 * (j % 8))) & 0x00030003) | magic
    hb = torch.where(j >= 2, wb >> (j - 2).clamp(min=0), (wb << (2 - j).clamp(min=0)) & U32)
    t = (hb & 0x00040004) | lo
    return _hfma2_to_dtype(t, _pow2_neg(torch.zeros_like(j), as_bf16), _neg_int2(mval + z, as_bf16), as_bf16, bf16)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("bf16", [False, True])
def test_the_magic_number_dequantization_is_exact_for_every_code_and_zero_point(bits, bf16):
    """Every pair position of a word, every two codes (the other pairs' bits set at random: the mask must
    drop them) and zero points across the range: each half is exactly (q - z) in the build's type."""
    gen = torch.Generator().manual_seed(bits + 10 * bf16)
    ppw = 8 if bits == 3 else 16 // bits
    n = 1 << bits
    q0, q1 = (a.flatten() for a in torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij"))
    zs = torch.tensor(sorted({0, 1, n // 2, n - 1, *torch.randint(0, n, (4,), generator=gen).tolist()}))
    q0, q1 = q0.repeat(len(zs)), q1.repeat(len(zs))
    z = zs.repeat_interleave(n * n)
    noise = torch.randint(0, 1 << 32, q0.shape, generator=gen, dtype=torch.int64)
    for j in range(16 if bits == 3 else ppw):
        jj = torch.full_like(q0, j)
        if bits == 3:  # low bits at 2 (j % 8) of each half of plane word j // 8, the high bit at bit j
            low_at, high_at = 2 * (j % 8), j
            low_mask, high_mask = (3 << low_at) * 0x10001, (1 << high_at) * 0x10001
            wa = (noise & ~low_mask & U32) | ((q0 & 3) << low_at) | ((q1 & 3) << (16 + low_at))
            wb = (noise.flip(0) & ~high_mask & U32) | ((q0 >> 2) << high_at) | ((q1 >> 2) << (16 + high_at))
            lo, hi = dequant_pair3(wa, wb, jj, z, bf16)
        else:
            at, mask = bits * j, ((n - 1) << (bits * j)) * 0x10001
            w = (noise & ~mask & U32) | (q0 << at) | (q1 << (16 + at))
            lo, hi = dequant_pair(w, jj, z, bits, bf16)
        assert torch.equal(lo, (q0 - z).double()) and torch.equal(hi, (q1 - z).double()), f"pair {j}"


# ------------------------------------------------------------------------------ the main loop's reads

class Build(NamedTuple):
    """Compile-time constants of a stack's build (``SP24`` for a compact stack) that its reads use."""

    gk16: int  # 16-column steps per group narrower than a tile, else 8
    shift: int  # group_shift: log2 of tiles per group, the tiles per group (GDIV), or 30 (the row)
    sg: int  # groups in one tile
    gdiv: bool
    run: int  # words of a thread-row loaded together
    ppw: int  # pairs of codes per word
    tile_words: int


def _build(stack) -> Build:
    bits = stack.bits
    gk16, shift = cuda_sbmm.group_params(stack)
    return Build(gk16, shift, 8 // gk16 if gk16 < 8 else 1,
                 mma_layout.divided_groups(stack.scheme.group_size, stack.in_features),
                 2 if bits == 3 else 4 if stack.compact else min(bits, 4), 8 if bits == 3 else 16 // bits,
                 mma_sparse.tile_words(bits) if stack.compact else 256 * bits)


def _stage(stack, slot: int, cfg, nb0: int, kt: int):
    """One pipeline stage as ``load_w`` fills it for the CTA of blocks ``nb0 ..`` at K tile ``kt``: the
    code words ``[RB * KT * TILE_WORDS]`` (each 16-byte piece ``i = tid + j NTHREADS`` from word
    ``(nb0 + r) k_tiles TILE_WORDS + kt TILE_WORDS + 4 p``, zero-filled past the matrix) and the scales and
    zero points ``[RB, KT, SG, 64]`` (thread ``tid < RB KT SG 8`` copies 8 of them); every entry is asserted
    written exactly once."""
    b = _build(stack)
    gk16, shift, sg, gdiv, tw = b.gk16, b.shift, b.sg, b.gdiv, b.tile_words
    kts, outp = mma_layout.k_tiles(stack.in_features), mma_layout.padded_rows(stack.out_features)
    nblocks, nthreads = outp // 64, cfg.threads
    words = stack.qweight[slot].to(torch.int64) & U32
    total = cfg.rb * cfg.kt * tw // 4  # WTOTAL
    wp = -(-total // nthreads)
    tid, jp = (t.flatten() for t in torch.meshgrid(torch.arange(nthreads), torch.arange(wp), indexing="ij"))
    i = tid + jp * nthreads
    i = i[(wp * nthreads == total) | (i < total)]  # the copy's guard
    assert torch.equal(i.sort().values, torch.arange(total)), f"{cfg}: stage pieces not copied exactly once"
    r, p = i // (cfg.kt * tw // 4), i % (cfg.kt * tw // 4)
    src = ((nb0 + r) * kts * tw + kt * tw + 4 * p)[:, None] + torch.arange(4)
    ok = (nb0 + r < nblocks)[:, None]
    stage = torch.zeros(total, 4, dtype=torch.int64)
    stage[i] = torch.where(ok, words[src.clamp(max=words.numel() - 1)], 0)
    stage = stage.flatten()
    n_s = min(nthreads, cfg.rb * cfg.kt * sg * 8)  # the threads with `sload`
    assert n_s == cfg.rb * cfg.kt * sg * 8, f"{cfg}: {cfg.rb * cfg.kt * sg * 8} scale pieces, {nthreads} threads"
    tid = torch.arange(n_s)
    s_r, s_u, s_g, s_p = tid // (cfg.kt * sg * 8), (tid // (sg * 8)) % cfg.kt, (tid // 8) % sg, tid % 8
    t = kt + s_u
    group = t * sg + s_g if gk16 < 8 else (t // shift if gdiv else t >> shift)
    rows = ((nb0 + s_r) * 64 + 8 * s_p)[:, None] + torch.arange(8)
    s_ok = (nb0 + s_r < nblocks)[:, None]
    rows_c = rows.clamp(max=outp - 1)
    scales = torch.where(s_ok, stack.scales[slot, group[:, None], rows_c].double(), 0.0)
    zeros = (None if stack.zeros is None else
             torch.where(s_ok, stack.zeros[slot, group[:, None], rows_c].to(torch.int64), 0))
    shape = (cfg.rb, cfg.kt, sg, 64)
    dst = ((s_r * cfg.kt + s_u) * sg + s_g) * 64 + 8 * s_p  # the pieces' places in the stage
    assert torch.equal(dst.sort().values, torch.arange(0, shape[0] * shape[1] * sg * 64, 8))
    out_s = torch.empty(n_s, 8, dtype=torch.float64)
    out_s[dst // 8] = scales
    out_z = None
    if zeros is not None:
        out_z = torch.empty(n_s, 8, dtype=torch.int64)
        out_z[dst // 8] = zeros
    return stage, out_s.reshape(shape), None if out_z is None else out_z.reshape(shape)


def _grid(pairs: int):
    """Index tensors ``(w, lane, rr, j)``, each ``[4, 32, 2, pairs]``: the 16-row weight tile (the warp's
    tile ``wi + m``: its reads are ``w_rd`` plus ``m * 32 RUN`` words), lane, row half and pair of a thread."""
    return torch.meshgrid(*(torch.arange(n) for n in (4, 32, 2, pairs)), indexing="ij")


def _zero_points(stack, zeros, g, in_block):
    return torch.full_like(in_block, 1 << (stack.bits - 1)) if zeros is None else zeros[g, in_block]


def _dense_reads(stack, tile, kt: int, zeros, bf16: bool):
    """One 64 x 128 tile of a stage as the dense loop reads it: ``(pair values (lo, hi), their columns,
    the k16 step of each pair, the flushes (after step s, with in-tile group g), each pair's row in the
    block)``. Pair ``j`` of row half ``rr`` is k16 step ``j / 2``'s a0/a2 (row half 0) or a1/a3 (1)."""
    bits = stack.bits
    b = _build(stack)
    gk16, run, ppw = b.gk16, b.run, b.ppw
    w, lane, rr, j = _grid(16)
    in_block = 16 * w + 8 * rr + lane // 4
    step = j // 2
    # word_zeros<2>: pair j covers k16 step j / 2, in-tile group (j / 2) / GK16 (GK16 8: the tile's own)
    z = _zero_points(stack, zeros, step // gk16 if gk16 < 8 else torch.zeros_like(step), in_block)
    if bits == 3:  # w_rd: RUN 2 words per row half at rr * 256; wb_rd: 512 + (w * 32 + lane) + rr * 128
        wa = tile[w * 32 * run + lane * run + rr * 4 * 32 * run + j // 8]
        pair = dequant_pair3(wa, tile[512 + w * 32 + lane + rr * 128], j, z, bf16)
    else:  # the pair's word iw: run hv = iw / RUN, word iw % RUN of it
        iw = j // ppw
        pair = dequant_pair(tile[(iw // run * 2 + rr) * 4 * 32 * run + w * 32 * run + lane * run + iw % run],
                            j % ppw, z, bits, bf16)
    cols = [kt * 128 + 16 * step + 8 * (j % 2) + 2 * (lane % 4) + e for e in (0, 1)]
    return pair, cols, step, [(s, s // gk16) for s in range(8) if (s + 1) % gk16 == 0], in_block


def _sparse_reads(stack, tile, kt: int, zeros, bf16: bool):
    """As :func:`_dense_reads` for the ``SP24`` loop: pair ``j = 2 s + h`` of k32 step ``s`` dequantized with
    the zero point of k16 step ``j`` (``word_zeros<1>``), its two codes placed at the positions that the
    metadata of lane ``4 (lane / 4) + 2 (s % 2) + h`` names (selector ``s % 2``); flushes after k32 step ``s``
    when ``(2 s + 2) % GK16 == 0``, with in-tile group ``(2 s + 1) / GK16``."""
    bits = stack.bits
    b = _build(stack)
    gk16, run, ppw = b.gk16, b.run, b.ppw
    w, lane, rr, j = _grid(8)
    in_block = 16 * w + 8 * rr + lane // 4
    ks, h, q = j // 2, j % 2, lane % 4  # k32 step, its half, the thread's group of four in the half
    z = _zero_points(stack, zeros, j // gk16 if gk16 < 8 else torch.zeros_like(j), in_block)
    if bits == 3:  # w[0], w[1]: the low plane's word of each row half; w[2]: the high plane's
        pair = dequant_pair3(tile[w * 32 * run + lane * run + rr], tile[256 + w * 32 + lane], j + 8 * rr, z, bf16)
    else:  # the thread's BITS words in runs of four, row half rr's at rr * NWA
        iw = rr * (bits // 2) + j // ppw
        pair = dequant_pair(tile[(iw // 4 * 4 + w) * 32 * run + lane * run + iw % 4], j % ppw, z, bits, bf16)
    meta = (tile[128 * bits + (w * 32 + 4 * (lane // 4) + 2 * (ks % 2) + h) * 2 + ks // 2] >> (16 * rr)) & 0xFFFF
    base = kt * 128 + 32 * ks + 16 * h + 4 * q
    pos = [base + ((meta >> (2 * (2 * q + e))) & 3) for e in (0, 1)]
    assert bool((pos[0] < pos[1]).all()), "metadata positions not ascending"
    return pair, pos, ks, [(s, (2 * s + 1) // gk16) for s in range(4) if (2 * s + 2) % gk16 == 0], in_block


def _kernel_weight(stack, slot: int, bf16: bool, cfg, splits: list[tuple[int, int]]) -> torch.Tensor:
    """fp64 ``[OUTP, INP]``: the weight ``dz_sbmm`` with launch options ``cfg`` multiplies (the ``SP24``
    build for a compact stack, whose pruned columns are 0), read from its stages (:func:`_stage`), every
    step taking the scale its partial sum is flushed with (groups narrower than a tile: at the flushes of
    the tile; else at a group's last tile or the split's, the pending tiles all take that tile's), over
    K ranges ``splits`` (the CTAs' ``[kt0, kt1)``)."""
    b = _build(stack)
    gk16, shift, gdiv, tw = b.gk16, b.shift, b.gdiv, b.tile_words
    outp, kts = mma_layout.padded_rows(stack.out_features), mma_layout.k_tiles(stack.in_features)
    reads = _sparse_reads if stack.compact else _dense_reads

    def group_ends(t):
        return (t + 1) % shift == 0 if gdiv else ((t + 1) & ((1 << shift) - 1)) == 0

    weight = torch.full((outp, kts * 128), 0.0 if stack.compact else float("nan"), dtype=torch.float64)
    for kt0, kt1 in splits:
        for nb0 in range(0, outp // 64, cfg.rb):
            pending = {rb: [] for rb in range(cfg.rb)}  # tiles whose partial sums await their flush
            for it in range((kt1 - kt0) // cfg.kt):
                stage, scales, zeros = _stage(stack, slot, cfg, nb0, kt0 + it * cfg.kt)
                for rb in range(cfg.rb):
                    if nb0 + rb >= outp // 64:
                        continue  # an inactive warp
                    for u in range(cfg.kt):
                        kt = kt0 + it * cfg.kt + u
                        pair, cols, step, flushes, in_block = reads(
                            stack, stage[(rb * cfg.kt + u) * tw:][:tw], kt, None if zeros is None else zeros[rb, u], bf16)
                        rows = (nb0 + rb) * 64 + in_block
                        if gk16 < 8:
                            done, prev = torch.zeros_like(step, dtype=torch.bool), -1
                            for s, g in flushes:
                                sel = (step > prev) & (step <= s)
                                sc = scales[rb, u, g, in_block[sel]]
                                for e in (0, 1):
                                    weight[rows[sel], cols[e][sel]] = pair[e][sel] * sc
                                done, prev = done | sel, s
                            assert bool(done.all()), "steps left unflushed at the tile's end"
                            continue
                        pending[rb].append((cols, pair))
                        if group_ends(kt) or kt + 1 == kt1:
                            sc = scales[rb, u, 0, in_block]
                            for c, p in pending[rb]:
                                for e in (0, 1):
                                    weight[rows, c[e]] = p[e] * sc
                            pending[rb] = []
            assert not any(pending.values())
    return weight


def _splits(k_tiles: int, kt: int = 1) -> list[list[tuple[int, int]]]:
    """K ranges the CTAs of a launch take: one CTA, the host's split 3 (whole stages), and every stage cut
    apart (what a stream-K launch may do to any unit)."""
    per, n = cuda_sbmm.effective_split(k_tiles, cuda_sbmm.CudaConfig(split=3, kt=kt))
    return [[(0, k_tiles)], [(i * per, min(k_tiles, (i + 1) * per)) for i in range(n)],
            [(t, t + kt) for t in range(0, k_tiles, kt)]]


def _configs(stack) -> list:
    """Launch options whose stage and warp arithmetic differ: 1 or 2 blocks per CTA, 1 or 2 K tiles per
    stage and 16-row tiles per warp where the stack allows them."""
    return [cuda_sbmm.CudaConfig(rb=rb, kt=kt, mt=mt) for rb in (1, 2) for kt in (1, 2) for mt in (1, 2)
            if cuda_sbmm.kt_ok(stack, kt) and cuda_sbmm.mt_ok(stack, mt)]


# (bits, group, in_features): validated builds first, then those only a preview build serves
SCHEMES = [(4, 128, 512), (2, 64, 512), (8, 32, 256), (4, -1, 384), (4, 256, 1024), (2, 128, 256),
           (3, 128, 512), (3, 32, 256),                    # three-bit
           (4, 16, 256), (2, 32, 256), (3, 16, 128),       # narrow-groups
           (4, 96, 384), (2, 192, 768), (8, 48, 384),      # split-groups
           (4, 384, 1536), (2, 384, 768),                  # wide-groups
           (4, 64, 576), (2, -1, 320), (3, 32, 224), (8, -1, 448)]  # padded-k


@pytest.mark.parametrize("bits,group,in_f", SCHEMES)
@pytest.mark.parametrize("sparse,asym", [(True, False), (False, True)])
def test_what_the_dense_mma_reads_is_the_delta(bits, group, in_f, sparse, asym):
    """Column for column, for each launch config's stages and warps, over every way a launch cuts K
    between CTAs, in fp16 and bf16 builds: the reference weight exactly; the padded last tile's columns
    finite (they meet zero-filled activations)."""
    gen = torch.Generator().manual_seed(bits * 101 + in_f + 7 * asym)
    out_f = 70
    delta = make_delta(out_f, in_f, bits, group, sparse, asym, gen)
    stack = repack([delta], layout="mma", compact=False)
    want = reference.delta_weight(delta).double()
    kts = mma_layout.k_tiles(in_f)
    for cfg in _configs(stack):
        for bf16 in (False, True):
            for splits in _splits(kts, cfg.kt):
                got = _kernel_weight(stack, 0, bf16, cfg, splits)
                assert torch.equal(got[:out_f, :in_f], want), f"{cfg}, bf16 {bf16}, K ranges {splits}"
                assert bool(torch.isfinite(got).all())


def _dequantize_kernel(stack, slot: int) -> torch.Tensor:
    """fp64 ``[out, in]`` as the dense ``dz_dequant`` writes it: each thread's words at
    ``wq[((iw / RUN * 2 + rr) * 4 + wi) * 32 RUN + lane RUN + iw % RUN]`` (3 bits: the plane word at
    ``512 + (rr * 4 + wi) * 32 + lane``), pair ``j``'s columns, the scale and zero point of layout group
    ``col / group``, columns past ``KCOLS`` not written."""
    bits, out_f, in_f = stack.bits, stack.out_features, stack.in_features
    b = _build(stack)
    run, ppw, tile_words = b.run, b.ppw, b.tile_words
    group = mma_layout.layout_group(stack.scheme.group_size, in_f)  # what dequantize_slot passes
    kts = mma_layout.k_tiles(in_f)
    words = stack.qweight[slot].to(torch.int64) & U32
    out = torch.full((out_f, in_f), float("nan"), dtype=torch.float64)
    wi, lane, rr, j = (t.flatten() for t in torch.meshgrid(*(torch.arange(n) for n in (4, 32, 2, 16)), indexing="ij"))
    for nb in range(mma_layout.padded_rows(out_f) // 64):
        for kt in range(kts):
            wq = words[(nb * kts + kt) * tile_words:][:tile_words]
            m = nb * 64 + 16 * wi + 8 * rr + lane // 4
            col = kt * 128 + 16 * (j // 2) + 8 * (j % 2) + 2 * (lane % 4)
            keep = (m < out_f) & (col < in_f)
            if bits == 3:
                lo = wq[((j // 8 // run * 2 + rr) * 4 + wi) * 32 * run + lane * run + (j // 8) % run]
                hi = wq[512 + (rr * 4 + wi) * 32 + lane]
                v = ((lo >> (2 * (j % 8))) & 0x00030003) | (((hi >> j) & 0x00010001) << 2)
                mask = 7
            else:
                iw = j // ppw
                v = wq[((iw // run * 2 + rr) * 4 + wi) * 32 * run + lane * run + iw % run] >> (bits * (j % ppw))
                mask = (1 << bits) - 1
            m_, col_, v_ = m[keep], col[keep], v[keep]
            s = stack.scales[slot, col_ // group, m_].double()
            z = (torch.full_like(s, 1 << (bits - 1)) if stack.zeros is None
                 else stack.zeros[slot, col_ // group, m_].double())
            out[m_, col_] = ((v_ & mask).double() - z) * s
            out[m_, col_ + 1] = (((v_ >> 16) & mask).double() - z) * s
    return out


# (bits, group, in_features) of the compact layout: groups of 32 columns or more, 3, 4 and 8 bits
SPARSE = [(4, 128, 512), (4, 32, 256), (8, 64, 256), (3, 128, 256), (3, 32, 128), (4, -1, 384), (4, 96, 384),
          (8, 384, 768), (4, 64, 576), (3, -1, 320)]


@pytest.mark.parametrize("bits,group,in_f", SPARSE)
@pytest.mark.parametrize("asym", [False, True])
def test_what_the_sparse_mma_multiplies_is_the_delta(bits, group, in_f, asym):
    """The sparse-mma preview's SP24 builds: codes, zero points, positions and scales as the loop reads
    them from its stages, for each launch config and way of cutting K, in fp16 and bf16: the reference
    weight exactly, pruned columns included."""
    gen = torch.Generator().manual_seed(bits * 37 + in_f + asym)
    out_f = 70
    delta = make_delta(out_f, in_f, bits, group, True, asym, gen)
    stack = repack([delta], layout="mma", compact=True)
    want = reference.delta_weight(delta).double()
    for cfg in _configs(stack):
        for bf16 in (False, True):
            for splits in _splits(mma_layout.k_tiles(in_f), cfg.kt):
                got = _kernel_weight(stack, 0, bf16, cfg, splits)
                assert torch.equal(got[:out_f, :in_f], want), f"{cfg}, bf16 {bf16}, K ranges {splits}"


def _sparse_dequantize_kernel(stack, slot: int) -> torch.Tensor:
    """fp64 ``[out, in]`` as the ``SP24`` ``dz_dequant`` writes it: per thread, row half and pair ``j = 2 s + h``
    the four columns of group ``32 s + 16 h + 4 q``, the two kept values at the positions of the metadata
    word of lane ``(lane & ~3) + 2 (s % 2) + h`` (word ``s / 2``) shifted by ``16 rr + 4 q``, 0 at the others."""
    bits, out_f, in_f = stack.bits, stack.out_features, stack.in_features
    b = _build(stack)
    ppw, tw = b.ppw, b.tile_words
    group = mma_layout.layout_group(stack.scheme.group_size, in_f)
    kts = mma_layout.k_tiles(in_f)
    words = stack.qweight[slot].to(torch.int64) & U32
    out = torch.full((out_f, in_f), float("nan"), dtype=torch.float64)
    wi, lane, rr, j = (t.flatten() for t in torch.meshgrid(*(torch.arange(n) for n in (4, 32, 2, 8)), indexing="ij"))
    sj, h, q = j // 2, j % 2, lane % 4
    for nb in range(mma_layout.padded_rows(out_f) // 64):
        for kt in range(kts):
            wq = words[(nb * kts + kt) * tw:][:tw]
            m = nb * 64 + 16 * wi + 8 * rr + lane // 4
            col = kt * 128 + 32 * sj + 16 * h + 4 * q
            if bits == 3:
                v = (((wq[(wi * 32 + lane) * 2 + rr] >> (2 * j)) & 0x00030003)
                     | (((wq[256 + wi * 32 + lane] >> (8 * rr + j)) & 0x00010001) << 2))
                mask = 7
            else:
                iw = rr * (bits // 2) + j // ppw
                v = wq[((iw // 4 * 4 + wi) * 32 + lane) * 4 + iw % 4] >> (bits * (j % ppw))
                mask = (1 << bits) - 1
            meta = wq[128 * bits + (wi * 32 + (lane & ~3) + 2 * (sj & 1) + h) * 2 + (sj >> 1)] >> (16 * rr + 4 * q)
            keep = (m < out_f) & (col < in_f)
            m, col, v, meta = m[keep], col[keep], v[keep], meta[keep]
            sc = stack.scales[slot, col // group, m].double()
            z = (torch.full_like(sc, 1 << (bits - 1)) if stack.zeros is None
                 else stack.zeros[slot, col // group, m].double())
            v0, v1 = ((v & mask).double() - z) * sc, (((v >> 16) & mask).double() - z) * sc
            p0, p1 = meta & 3, (meta >> 2) & 3
            for c in range(4):
                out[m, col + c] = torch.where(p0 == c, v0, torch.where(p1 == c, v1, torch.zeros_like(v0)))
    return out


@pytest.mark.parametrize("bits,group,in_f,compact", [(*sc, False) for sc in SCHEMES] + [(*sc, True) for sc in SPARSE])
def test_what_the_dequantize_kernel_writes_is_the_delta(bits, group, in_f, compact):
    """``dz_dequant`` (the prefill path dequantizes each used slot with it, then calls cuBLAS): every column
    of every row, the padded tile's left out, is the reference weight exactly (dense and SP24 builds)."""
    gen = torch.Generator().manual_seed(bits * 13 + in_f + compact)
    delta = make_delta(70, in_f, bits, group, True, True, gen)
    stack = repack([delta], layout="mma", compact=compact)
    view = _sparse_dequantize_kernel if compact else _dequantize_kernel
    assert torch.equal(view(stack, 0), reference.delta_weight(delta).double())


# ------------------------------------------------------------------------------ the activations' side

def _stage_x(x: torch.Tensor, xrow: list[int], cfg, kt0: int, it: int, kcols: int | None) -> torch.Tensor:
    """A stage's activations ``[BM, XS]`` as ``load_x`` copies them: piece ``i = tid + j NTHREADS`` is row
    ``i / (16 KT)``, columns ``8 (i % (16 KT))`` + 8 of the stage's ``128 KT``; rows past the tile's count
    are not copied (-1 here: whatever the stage held), columns from ``KCOLS`` on zero-filled."""
    xs, nthreads = 128 * cfg.kt + 8, cfg.threads
    xp = 16 * 16 * cfg.kt // nthreads
    assert xp * nthreads == 16 * 16 * cfg.kt
    stage = torch.full((16, xs), -1, dtype=torch.int64)
    for tid in range(nthreads):
        for j in range(xp):
            i = tid + j * nthreads
            r, p = i // (16 * cfg.kt), i % (16 * cfg.kt)
            if r >= len(xrow):
                continue
            col = kt0 * 128 + p * 8 + it * 128 * cfg.kt
            stage[r, p * 8:p * 8 + 8] = 0 if kcols is not None and col >= kcols else x[xrow[r], col:col + 8]
    return stage


def _ldmatrix(addr_of_lane, matrices: int) -> list[list[tuple[int, int]]]:
    """``ldmatrix.m8n8.x{matrices}`` (not transposed) from halves offsets ``addr_of_lane(lane)``: lane
    ``8 i + r`` gives row ``r`` of matrix ``i``; per lane, per register ``i``, the two halves it receives
    (row ``lane / 4``, columns ``2 (lane % 4)`` and + 1 of matrix ``i``) as their stage offsets."""
    rows = [addr_of_lane(lane) for lane in range(8 * matrices)]
    return [[(rows[8 * i + lane // 4] + 2 * (lane % 4), rows[8 * i + lane // 4] + 2 * (lane % 4) + 1)
             for i in range(matrices)] for lane in range(32)]


@pytest.mark.parametrize("sp24", [False, True])
@pytest.mark.parametrize("in_f,cnt", [(512, 16), (576, 5), (200, 9), (1024, 1)])
def test_each_thread_loads_the_activations_its_mma_multiplies(sp24, in_f, cnt):
    """For each launch config's stages: the B fragments each lane's ldmatrix loads (dense: x4 for tiles of
    more than 8 rows, x2 for the rest; SP24: x4 per k32 step, a second x4 8 rows on) hold activation
    ``(row n, column k)`` where the MMA reads it (m16n8k16: register ``i`` is ``k = 8 i + 2 (lane % 4) + e``,
    ``n = lane / 4``; m16n8k32 the same over four registers), columns past ``in_features`` (``KCOLS``) zero,
    for every row of the tile (rows past its count are never stored)."""
    gen = torch.Generator().manual_seed(in_f + cnt)
    kts = mma_layout.k_tiles(in_f)
    n_rows = 40
    x = torch.arange(n_rows)[:, None] * 100_000 + torch.arange(kts * 128)[None, :] + 1  # each value names its place
    x[:, in_f:] = -5  # past the row: whatever memory follows it, never to reach an MMA
    xrow = torch.randperm(n_rows, generator=gen)[:cnt].tolist()
    kcols = in_f if in_f % 128 else None
    for cfg in [cuda_sbmm.CudaConfig(rb=rb, kt=kt, mt=mt) for rb in (1, 2) for kt in (1, 2) for mt in (1, 2)]:
        if kts % cfg.kt:
            continue
        xs = 128 * cfg.kt + 8
        for it in range(kts // cfg.kt):
            stage = _stage_x(x, xrow, cfg, 0, it, kcols).flatten()
            for u in range(cfg.kt):
                kt = it * cfg.kt + u
                if sp24:
                    steps, k_step = 4, 32
                    loads = [(lambda lane, n0=n0, s=s, u=u, xs=xs: ((lane & 7) + n0) * xs + 8 * (lane >> 3) + u * 128 + 32 * s, 4, n0)
                             for s in range(steps) for n0 in (0, 8)]
                else:  # x4 for tiles of more than 8 rows (matrices 2, 3: rows 8-15), x2 for the rest
                    steps, k_step = 8, 16
                    loads = [(lambda lane, s=s, u=u, xs=xs: ((lane & 7) + 8 * (lane >> 4)) * xs + 8 * ((lane >> 3) & 1) + u * 128
                              + 16 * s, 4 if cnt > 8 else 2, None) for s in range(steps)]
                for li, (addr, matrices, n0) in enumerate(loads):
                    s = li // 2 if sp24 else li
                    got = _ldmatrix(addr, matrices)
                    for lane in range(32):
                        g, q = lane // 4, lane % 4
                        for i in range(matrices):
                            if sp24:
                                n, k = n0 + g, 8 * i + 2 * q
                            else:  # b0, b1: n8 tile 0's k 0-7 and 8-15; b2, b3: tile 1's
                                n, k = 8 * (i // 2) + g, 8 * (i % 2) + 2 * q
                            if n >= cnt:
                                continue
                            for e in (0, 1):
                                col = kt * 128 + s * k_step + k + e
                                want = 0 if col >= in_f else int(x[xrow[n], col])
                                assert int(stage[got[lane][i][e]]) == want, (cfg, kt, s, lane, i, e)
