"""The chunked container: exact round trips, and every inconsistency caught before native code."""

import numpy as np
import pytest
import torch

from deltazip.formats import chunked, gdeflate
from deltazip.formats.chunked import Container, ContainerError, decode, encode, xxh3


def _tensor(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 1e-2).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    return torch.randint(0, 16, shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype,shape", [
    (torch.float16, (300, 129)), (torch.bfloat16, (70_000,)), (torch.float32, (3, 5)),
    (torch.int32, (64, 1030)), (torch.uint8, (1,)), (torch.uint8, (0,)), (torch.int32, (0, 7)),
    (torch.bool, (33,)), (torch.float16, (1,)),
])
@pytest.mark.parametrize("filt", ["none", "bytegroup"])
def test_roundtrip_exact(dtype, shape, filt):
    t = _tensor(dtype, shape)
    stored, meta = encode(t, level=6, filter=filt)
    assert stored.dtype == np.uint8 and stored.size == Container.from_json(meta).stored_nbytes
    back = decode(meta, stored)
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8) if t.numel() else back, t.view(torch.uint8) if t.numel() else t)


def test_layout_alignment_and_zero_gaps():
    t = _tensor(torch.int32, (3 * gdeflate.PAGE_BYTES // 4 + 5,), seed=1)
    stored, meta = encode(t, align=16)
    c = Container.from_json(meta)
    assert len(c.sizes) == 4 and all(o % 16 == 0 for o in c.offsets)
    ends = c.offsets + c.sizes
    for e, o in zip(ends[:-1], c.offsets[1:]):
        assert o - e < 16 and not stored[e:o].any(), "gaps between chunks are short and zero"
    assert xxh3(stored) == meta["stored_checksum"]


def test_bytegroup_helps_float16():
    t = (torch.randn(512, 256) * 1e-3).half()
    plain = encode(t, filter="none")[0].size
    grouped = encode(t, filter="bytegroup")[0].size
    assert grouped < plain


@pytest.fixture(scope="module")
def sample():
    t = _tensor(torch.float16, (200, 400), seed=2)
    stored, meta = encode(t, filter="bytegroup")
    return t, stored, meta


@pytest.mark.parametrize("field,value,match", [
    ("codec", "zstd", "unknown codec"),
    ("filter", "shuffle", "unknown filter"),
    ("dtype", "complex64", "unknown dtype"),
    ("level", 13, "level"),
    ("chunk_bytes", 0, "chunk_bytes"),
    ("chunk_bytes", gdeflate.PAGE_BYTES + 1, "chunk_bytes"),
    ("align", 3, "power of two"),
    ("nbytes", 12, "nbytes"),
    ("shape", [200, -400], "shape"),
    ("checksum", "sha256:00", "checksum"),
    ("stored_checksum", 5, "stored_checksum"),
    ("chunks", [], "chunk table has 0 entries"),
    ("level", True, "level"),
])
def test_bad_metadata_is_named(sample, field, value, match):
    _, stored, meta = sample
    with pytest.raises(ContainerError, match=match):
        decode({**meta, field: value}, stored)


def test_bad_chunk_sizes(sample):
    _, stored, meta = sample
    for bad in (0, -1, gdeflate.MAX_CHUNK_STORED + 1, 1.5):
        chunks = list(meta["chunks"])
        chunks[1] = bad
        with pytest.raises(ContainerError, match="chunk 1 has compressed size"):
            decode({**meta, "chunks": chunks}, stored)
    with pytest.raises(ContainerError, match="lacks"):
        decode({k: v for k, v in meta.items() if k != "chunks"}, stored)


def test_nothing_reaches_native_code_before_validation(sample, monkeypatch):
    _, stored, meta = sample

    def boom(*a, **k):
        raise AssertionError("native decoder called on unvalidated bytes")

    monkeypatch.setattr(chunked.gdeflate, "decompress_chunks", boom)
    truncated = stored[:-1]
    with pytest.raises(ContainerError, match="truncated"):
        decode(meta, truncated)
    flipped = stored.copy()
    flipped[len(flipped) // 2] ^= 0x40
    with pytest.raises(ContainerError, match="compressed bytes"):
        decode(meta, flipped)
    longer = {**meta, "chunks": meta["chunks"][:-1] + [meta["chunks"][-1] + 1]}
    with pytest.raises(ContainerError, match="stored bytes are"):
        decode(longer, stored)


def test_corrupt_chunk_with_forged_checksum_never_gives_wrong_bytes(sample):
    """Someone rewrote both a chunk and the stored checksum: the decoder or the decoded-bytes
    checksum refuses it, nothing crashes, no wrong tensor comes back."""
    t, stored, meta = sample
    rng = np.random.default_rng(0)
    for _ in range(60):
        bad = stored.copy()
        bad[rng.integers(0, bad.size)] ^= rng.integers(1, 256)
        forged = {**meta, "stored_checksum": xxh3(bad)}
        try:
            back = decode(forged, bad)
        except ContainerError as e:
            assert "does not decode" in str(e) or "decoded bytes" in str(e)
            continue
        assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))  # a flip in a gap byte


def test_decoded_checksum_mismatch(sample):
    _, stored, meta = sample
    with pytest.raises(ContainerError, match="decoded bytes"):
        decode({**meta, "checksum": "xxh3-128:" + "0" * 32}, stored)


def test_stored_must_be_1d_uint8(sample):
    _, stored, meta = sample
    with pytest.raises(ContainerError, match="1-D uint8"):
        decode(meta, torch.from_numpy(stored).view(torch.int8))


@pytest.mark.gpu
@pytest.mark.nvcomp
def test_gpu_decode_matches_cpu(sample):
    t, stored, meta = sample
    back = decode(meta, stored, device="cuda")
    assert back.is_cuda and torch.equal(back.cpu().view(torch.uint8), t.view(torch.uint8))
