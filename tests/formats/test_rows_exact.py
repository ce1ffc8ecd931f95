"""Format v2 kinds: ``rows`` (embedding deltas row by row, with an error bound), ``xor`` (exact in any
dtype), ``alias``; and the exact-kind choice of compress/rows_and_exact.py."""

import pytest
import torch

from deltazip.compress.rows_and_exact import exact_candidates, new_stats, record_embedding, record_exact
from deltazip.formats.artifact import FORMAT_VERSION, Artifact, ArtifactWriter
from deltazip.formats.codecs.rows import (
    changed_rows,
    dequantize_rows,
    effective_group,
    error_bound,
    pack_bitmap,
    quantize_rows,
    unpack_bitmap,
)
from deltazip.formats.codecs.xor import bitwise_equal
from deltazip.formats.verify import verify_artifact

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _pair(dtype, shape=(40, 64), seed=0, scale=1e-2, unchanged=()):
    g = torch.Generator().manual_seed(seed)
    b = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    f = (b.float() + scale * torch.randn(shape, generator=g) * b.float().abs()).to(dtype)
    for r in unchanged:
        f[r] = b[r]
    return b, f


def _roundtrip(tmp_path, write, lossless="none"):
    out = tmp_path / f"art-{lossless}"
    with ArtifactWriter(out, lossless=lossless) as w:
        write(w)
        w.finalize(lineage={}, config={})
    return Artifact(out)


def test_bitmap_roundtrip():
    for r in (1, 7, 8, 9, 63, 64, 65):
        m = torch.rand(r, generator=torch.Generator().manual_seed(r)) > 0.5
        bm = pack_bitmap(m)
        assert bm.dtype == torch.uint8 and bm.numel() == (r + 7) // 8
        assert torch.equal(unpack_bitmap(bm, r), m)
    # row r is bit r % 8 of byte r // 8, least significant first
    assert pack_bitmap(torch.tensor([True, False, False, True, False, False, False, False, True])).tolist() == [9, 1]


@pytest.mark.parametrize("bits", (2, 3, 4, 8))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_keep_the_stated_bound(bits, dtype):
    b, f = _pair(dtype, unchanged=(0, 5, 6, 39))
    delta = f.float() - b.float()
    ch = changed_rows(b, f)
    assert ch.tolist().count(False) == 4
    group = effective_group(64, 16)
    parts = quantize_rows(delta, ch, bits, group)
    dh = dequantize_rows(parts, (40, 64), bits, group)
    bound = error_bound(parts, (40, 64), group)
    err = (dh - delta).abs()
    # |Δ̂ − Δ| ≤ scale/2 (plus float32 arithmetic), exactly zero on unchanged rows
    assert bool((err <= bound * (1 + 1e-5) + 1e-9).all())
    assert float(err[~ch].max()) == 0.0
    assert float(bound[ch].min()) > 0
    # the bound is tight-ish: more bits, smaller error
    assert float(err.max()) <= float(delta.abs().max())
    rec = (b.float() + dh).to(dtype)
    assert bitwise_equal(rec[~ch], f[~ch])


def test_rows_constant_and_extreme_groups():
    delta = torch.zeros(3, 8)
    delta[0] = 3e-3  # constant group: the offset carries it
    delta[1, :4] = torch.tensor([-5.0, 5.0, 0.0, 1e-8])
    delta[2] = torch.linspace(-1e-6, 1e-6, 8)
    ch = torch.tensor([True, True, True])
    parts = quantize_rows(delta, ch, 2, 4)
    dh = dequantize_rows(parts, (3, 8), 2, 4)
    assert bool(((dh - delta).abs() <= error_bound(parts, (3, 8), 4) * (1 + 1e-5) + 1e-9).all())


def test_rows_entry_through_artifact(tmp_path):
    b, f = _pair(torch.bfloat16, unchanged=(1, 2))
    for lossless in ("none", "gdeflate"):
        stats = new_stats()

        def write(w, stats=stats):
            rec = record_embedding(w, "emb.weight", b, f, 4, 32, stats)
            assert rec.dtype == torch.bfloat16

        art = _roundtrip(tmp_path, write, lossless)
        e = art.tensors["emb.weight"]
        assert e["kind"] == "rows" and e["changed_rows"] == 38 and stats["rows_changed"] == 38
        assert art.manifest["format_version"] == FORMAT_VERSION == 2
        rec = art.reconstruct("emb.weight", b)
        assert bitwise_equal(rec[1:3], f[1:3])
        assert float((rec.float() - f.float()).abs().max()) <= e["max_abs_err"] + 2 ** -8 * float(f.float().abs().max())
        assert verify_artifact(art.path)["ok"]
        # 4-bit codes + two fp16 per 32 columns + a bit per row, against 16-bit rows
        assert e["stored_bytes"] < 0.4 * f.numel() * 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_exact_kind_rebuilds_bit_for_bit(tmp_path, dtype):
    b, f = _pair(dtype, shape=(3, 64), scale=1e-3)
    cands = exact_candidates(b, f)
    assert {"full", "xor"} <= set(cands)
    # a delta that a float16 delta rebuilds exactly (bf16/fp16 values on a coarse grid)
    b2 = torch.tensor([1.0, 2.0, -0.5, 0.25], dtype=dtype)
    f2 = torch.tensor([1.5, 2.0, -0.75, 0.125], dtype=dtype)
    assert "dense_delta" in exact_candidates(b2, f2)

    def write(w):
        for kind, parts in cands.items():
            name = f"t.{kind}"
            if kind == "full":
                w.add_full(name, f)
            elif kind == "xor":
                w.add_xor(name, parts["xor"], dtype)
            else:
                w.add_dense_delta(name, parts["delta"], dtype)
        w.add_dense_delta("t2.dense", exact_candidates(b2, f2)["dense_delta"]["delta"], dtype)

    art = _roundtrip(tmp_path, write)
    for kind in cands:
        assert bitwise_equal(art.reconstruct(f"t.{kind}", b), f), kind
    assert bitwise_equal(art.reconstruct("t2.dense", b2), f2)
    assert verify_artifact(art.path)["ok"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_record_exact_keeps_the_smallest(tmp_path, dtype):
    b, f = _pair(dtype, shape=(4, 4096), scale=1e-3)
    sizes = {}
    for lossless in ("none", "gdeflate"):
        stats = new_stats()
        art = _roundtrip(tmp_path, lambda w, st=stats: record_exact(w, "norm.weight", b, f, st), lossless)
        e = art.tensors["norm.weight"]
        assert bitwise_equal(art.reconstruct("norm.weight", b), f)
        sizes[lossless] = (e["kind"], e["stored_bytes"])
        same = _roundtrip(tmp_path / "s", lambda w, st=stats: record_exact(w, "x", b, b.clone(), st), lossless)
        assert same.tensors["x"]["kind"] == "same"
    # stored raw, an XOR is as large as the tensor: full wins the tie
    assert sizes["none"] == ("full", f.numel() * f.element_size())
    # through the lossless stage a delta encoding (XOR, or a float16 delta when exact) is smallest
    with ArtifactWriter(tmp_path / "probe", lossless="gdeflate") as w:
        cand_sizes = {k: w.stored_size(p) for k, p in exact_candidates(b, f).items()}
    assert sizes["gdeflate"] == (sizes["gdeflate"][0], min(cand_sizes.values()))
    assert sizes["gdeflate"][0] in ("xor", "dense_delta")
    assert sizes["gdeflate"][1] < 0.9 * f.numel() * f.element_size()


def test_alias_is_stored_once(tmp_path):
    b, f = _pair(torch.bfloat16, unchanged=(0,))

    def write(w):
        record_embedding(w, "embed.weight", b, f, 4, 32, new_stats())
        w.add_alias("lm_head.weight", "embed.weight", tuple(f.shape), f.dtype)

    art = _roundtrip(tmp_path, write)
    assert art.tensors["lm_head.weight"]["stored_bytes"] == 0 and "file" not in art.tensors["lm_head.weight"]
    assert torch.equal(art.reconstruct("lm_head.weight", b), art.reconstruct("embed.weight", b))
    assert verify_artifact(art.path)["ok"]

