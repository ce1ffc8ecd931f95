"""The compact 2:4 ``mma`` layout: a 2:4 delta laid out for the sparse tensor-core MMA (``mma.sp``
m16n8k32) of the CUDA kernel's ``SP24`` builds. Pure torch; no GPU needed.

The dense ``mma`` layout (``deltazip.kernels.mma_layout``) expands a 2:4 delta to every column (a
pruned position holds the zero point): ``bits`` bits per weight. Here only the two kept codes of every
four columns are stored, with the 2-bit position of each (the instruction's metadata): ``bits / 2 + 1``
bits per weight, 3 at 4 bits (25% fewer bytes than expanded), 5 at 8 bits (37.5% fewer) and 2.5 at 3
bits (17% fewer). The
kernel dequantizes the kept codes exactly as the dense build does and the sparse MMA multiplies each
by the activation at its position.

Fragment of ``mma.sp.sync.aligned.m16n8k32`` with 16-bit A (PTX ISA, "sparse mma metadata 16832
f16/bf16"): A is 16 rows by 32 columns, stored compressed as 16 x 16 (two values per group of four
columns); the compressed matrix has the A fragment of a dense m16n8k16, so compressed column ``c`` is
group-of-four ``c // 2`` of the step, its kept value ``c % 2``. The metadata is one 2-bit position per
compressed value; a 32-bit register per thread holds those of compressed columns ``8 j .. 8 j + 7`` of
rows ``l`` (low 16 bits, column ``8 j + i`` at bit ``2 i``) and ``l + 8`` (high 16 bits), and the
sparsity selector ``F`` (0 or 1) names which two threads of each four supply it: lane ``4 l + 2 F + j``.

Index map (one slot)
--------------------
Rows and columns are padded as in the dense layout (64-row blocks, 128-column tiles; padded columns
hold kept code 0 at positions 0 and 1, zero-filled activations make them add 0). In a ``64 x 128``
tile row ``n`` and group of four columns ``ch`` (32 per tile row, kept value ``e``) decompose as::

    n  = 16 * w + 8 * rr + l            (w: warp, rr: row half, l: lane // 4)
    ch = 8 * s + 4 * h + q              (s: k32 step, h: half of the step, q = lane % 4)

A thread's pair ``j = 2 s + h`` (8 per thread-row and tile) holds the two kept codes of group ``ch``
(``e`` = the 16-bit half); as in the dense layout a word holds ``PPW = 16 // bits`` pairs, pair ``j`` at
bit ``16 * e + bits * (j % PPW)`` of word ``j // PPW``. A thread's ``bits`` words of a tile (``bits / 2``
per row half, row half outermost) are stored in runs of four (one 16-byte load), ``[hv, w, l, q, v]``:
``128 * bits`` words. 3-bit codes are two bit planes, as in the dense layout: the low two bits of a row
half's 8 pairs in one word (pair ``j`` at bit ``16 * e + 2 * j``), ``[w, l, q, rr]`` (256 words), then the
high bits of both row halves in one word (pair ``j`` of row half ``rr`` at bit ``16 * e + 8 * rr + j``),
``[w, l, q]`` (128 words). Then ``256`` metadata words, ``[w, l, q, mw]``: word ``mw`` of lane ``q`` is the
register of k32 step ``s = 2 mw + q // 2`` (selector ``F = q // 2``) for compressed columns ``8 (q % 2)
.. 8 (q % 2) + 7``, i.e. the positions of groups ``ch = 8 s + 4 (q % 2) + (0..3)``. The two positions of a
group are distinct and ascending (the instruction's ordered metadata).
"""

from __future__ import annotations

import torch

from deltazip.kernels.mma_layout import K_BLOCK, ROW_BLOCK, padded_cols, padded_rows

# Code widths held compactly: at 2 bits the compact form (1 + 1 bits per weight) saves nothing over the
# expanded one.
SPARSE_BITS = (3, 4, 8)


def supported(bits: int, sparse: bool, layout_group: int | None) -> bool:
    """Whether a 2:4 configuration has a compact layout: 3, 4 or 8 bits, and groups (the ``mma`` layout's,
    ``mma_layout.layout_group``) of at least 32 columns, so that a k32 step lies in one group."""
    return sparse and bits in SPARSE_BITS and layout_group is not None and layout_group >= 32


def tile_words(bits: int) -> int:
    """int32 words of one ``64 x 128`` tile: the kept codes, then the metadata."""
    return 128 * bits + 256


def slot_words(out_features: int, in_features: int, bits: int) -> int:
    """int32 words of one slot in the compact layout."""
    return padded_rows(out_features) // ROW_BLOCK * (padded_cols(in_features) // K_BLOCK) * tile_words(bits)


def _tile_dims(t: torch.Tensor) -> torch.Tensor:
    """``[OUTP, INP / 2]`` per kept value -> ``[nb, w, rr, l, kb, s, h, q, e]``."""
    outp, kept = t.shape
    return t.reshape(outp // ROW_BLOCK, 4, 2, 8, kept // 64, 4, 2, 4, 2)


def pack(kept: torch.Tensor, positions: torch.Tensor, bits: int) -> torch.Tensor:
    """Kept codes and their positions (each ``[out, in / 2]``: group ``k // 2``'s ``k % 2``-th kept value,
    positions distinct and ascending in each group) -> int32 ``[slot_words(out, in, bits)]``."""
    if bits not in SPARSE_BITS:
        raise ValueError(f"the compact 2:4 layout holds {SPARSE_BITS}-bit codes, not {bits}")
    out_f, half = kept.shape
    outp, inp = padded_rows(out_f), padded_cols(2 * half)
    dev = kept.device
    full_k = torch.zeros(outp, inp // 2, dtype=torch.int64, device=dev)
    full_p = torch.arange(inp // 2, device=dev, dtype=torch.int64).remainder(2).expand(outp, -1).clone()
    full_k[:out_f, :half] = kept.to(torch.int64)
    full_p[:out_f, :half] = positions.to(torch.int64)
    # codes: [nb, w, rr, l, kb, s, h, q, e] -> [nb, kb, w, l, q, rr, j(8), e]
    c = _tile_dims(full_k).permute(0, 4, 1, 3, 7, 2, 5, 6, 8).reshape(outp // ROW_BLOCK, inp // K_BLOCK, 4, 8, 4, 2,
                                                                       8, 2)
    nb, kb = c.shape[:2]
    half_bit = torch.tensor([0, 16], device=dev, dtype=torch.int64)
    j = torch.arange(8, device=dev, dtype=torch.int64)[:, None]
    if bits == 3:  # the low-bit plane per row half, then the high-bit plane of both
        low = ((c & 3) << (2 * j + half_bit)).sum(dim=(-1, -2))  # [nb, kb, w, l, q, rr]
        rr = torch.arange(2, device=dev, dtype=torch.int64)[:, None, None]
        high = ((c >> 2) << (8 * rr + j + half_bit)).sum(dim=(-1, -2, -3))  # [nb, kb, w, l, q]
        words = torch.cat([low.reshape(nb, kb, 256), high.reshape(nb, kb, 128)], dim=-1)
    else:
        ppw = 16 // bits
        c = c.reshape(*c.shape[:6], 8 // ppw, ppw, 2)  # j -> (word, pair in word)
        shifts = j[:ppw] * bits + half_bit
        words = (c << shifts).sum(dim=(-1, -2))  # [nb, kb, w, l, q, rr, bits/2]: disjoint fields, the sum is an OR
        words = words.reshape(nb, kb, 4, 8, 4, bits // 4, 4).permute(0, 1, 5, 2, 3, 4, 6).reshape(nb, kb, -1)
    # metadata: [nb, w, rr, l, kb, s=(mw, F), h, q, e] -> [nb, kb, w, l, F, h, mw, rr, q, e]
    p = _tile_dims(full_p).reshape(nb, 4, 2, 8, kb, 2, 2, 2, 4, 2).permute(0, 4, 1, 3, 6, 7, 5, 2, 8, 9)
    rr, qq, ee = torch.meshgrid(*(torch.arange(n, device=dev, dtype=torch.int64) for n in (2, 4, 2)), indexing="ij")
    meta = (p << (16 * rr + 4 * qq + 2 * ee)).sum(dim=(-1, -2, -3))  # [nb, kb, w, l, F, h, mw]
    meta = meta.reshape(nb, kb, 256)  # lane q = 2 F + h, then mw
    out = torch.cat([words, meta], dim=-1)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32).reshape(-1)


def unpack(words: torch.Tensor, bits: int, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack`: int64 (kept codes, positions), each ``[out, in / 2]``."""
    nb, kb = padded_rows(out_features) // ROW_BLOCK, padded_cols(in_features) // K_BLOCK
    dev = words.device
    w = words.to(torch.int64).reshape(nb, kb, tile_words(bits)) & 0xFFFFFFFF
    half_bit = torch.tensor([0, 16], dtype=torch.int64, device=dev)
    j = torch.arange(8, dtype=torch.int64, device=dev)[:, None]
    if bits == 3:
        low = w[..., :256].reshape(nb, kb, 4, 8, 4, 2, 1, 1)  # [nb, kb, w, l, q, rr, -, -]
        high = w[..., 256:384].reshape(nb, kb, 4, 8, 4, 1, 1, 1)
        rr = torch.arange(2, dtype=torch.int64, device=dev)[:, None, None]
        c = ((low >> (2 * j + half_bit)) & 3) | (((high >> (8 * rr + j + half_bit)) & 1) << 2)
    else:
        ppw = 16 // bits
        codes = w[..., :128 * bits].reshape(nb, kb, bits // 4, 4, 8, 4, 4).permute(0, 1, 3, 4, 5, 2, 6)
        codes = codes.reshape(nb, kb, 4, 8, 4, 2, 8 // ppw, 1, 1)  # [nb, kb, w, l, q, rr, word, -, -]
        c = (codes >> (j[:ppw] * bits + half_bit)) & ((1 << bits) - 1)  # [nb, kb, w, l, q, rr, word, pair, e]
    c = c.reshape(nb, kb, 4, 8, 4, 2, 4, 2, 2)  # [nb, kb, w, l, q, rr, s, h, e]: j = 2 s + h
    kept = c.permute(0, 2, 5, 3, 1, 6, 7, 4, 8).reshape(nb * ROW_BLOCK, kb * 64)
    meta = w[..., 128 * bits:].reshape(nb, kb, 4, 8, 2, 2, 2, 1, 1, 1)  # [nb, kb, w, l, F, h, mw, -, -, -]
    rr, qq, ee = torch.meshgrid(*(torch.arange(n, dtype=torch.int64, device=dev) for n in (2, 4, 2)), indexing="ij")
    p = (meta >> (16 * rr + 4 * qq + 2 * ee)) & 3  # [nb, kb, w, l, F, h, mw, rr, q, e]
    pos = p.permute(0, 2, 7, 3, 1, 6, 4, 5, 8, 9).reshape(nb * ROW_BLOCK, kb * 64)
    half = in_features // 2
    return kept[:out_features, :half], pos[:out_features, :half]


def random_positions(rows: int, in_features: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random valid positions ``[rows, in / 2]``: two distinct ascending columns of every four (on the
    generator's device)."""
    dev = generator.device if generator is not None else "cpu"
    pick = torch.rand(rows, in_features // 4, 4, generator=generator, device=dev).argsort(-1)[..., :2]
    return pick.sort(-1).values.reshape(rows, in_features // 2)


def random_slot(bits: int, out_features: int, in_features: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """One slot of random codes at random valid positions, packed (for timing and launch checks, where
    random words would be invalid metadata)."""
    dev = generator.device if generator is not None else "cpu"
    kept = torch.randint(0, 1 << bits, (out_features, in_features // 2), generator=generator, device=dev)
    return pack(kept, random_positions(out_features, in_features, generator), bits)
