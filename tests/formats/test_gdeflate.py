"""GDeflate backends: bit-exact round trips, nvCOMP's own CPU API agrees, bad chunks fail cleanly."""

import ctypes

import numpy as np
import pytest
import torch

from deltazip.formats import gdeflate
from deltazip.formats.chunked import chunk_offsets
from deltazip.formats.packing import pack_delta

PAGE = gdeflate.PAGE_BYTES


def _roundtrip(data: np.ndarray, level: int, threads: int | None = None, chunk: int = PAGE) -> tuple[np.ndarray, np.ndarray]:
    blobs, sizes = gdeflate.compress_chunks(data, level, chunk, threads=threads)
    stored = np.frombuffer(b"".join(blobs), dtype=np.uint8)
    offsets = chunk_offsets(sizes, 1)
    out = gdeflate.decompress_chunks(stored, offsets, sizes, data.size, chunk, threads=threads)
    return out, sizes


@pytest.mark.parametrize("n", [0, 1, 2, 100, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 7])
def test_random_bytes_roundtrip(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    out, sizes = _roundtrip(data, 6)
    assert np.array_equal(out, data)
    assert len(sizes) == -(-n // PAGE)
    assert all(1 <= s <= gdeflate.MAX_CHUNK_STORED for s in sizes)


@pytest.mark.parametrize("level", [0, 1, 9, 12])
def test_levels_roundtrip_and_compress(level):
    # Skewed bytes (like packed low-bit codes) compress at every level except 0 (stored blocks).
    data = np.random.default_rng(1).choice(4, 200_000, p=[0.6, 0.2, 0.1, 0.1]).astype(np.uint8) * 17
    out, sizes = _roundtrip(data, level)
    assert np.array_equal(out, data)
    if level > 0:
        assert sizes.sum() < 0.8 * data.size


def test_small_chunks_and_threads_agree():
    data = np.random.default_rng(2).integers(0, 8, 150_001, dtype=np.uint8)
    one, s1 = _roundtrip(data, 9, threads=1, chunk=4096)
    many, s4 = _roundtrip(data, 9, threads=4, chunk=4096)
    assert np.array_equal(one, data) and np.array_equal(many, data)
    assert np.array_equal(s1, s4), "the bitstream must not depend on the thread count"


def test_real_packed_delta_roundtrip():
    g = torch.Generator().manual_seed(0)
    out_f, in_f, bits, gs = 96, 256, 2, 64
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=g)
    scales = (torch.rand(out_f, in_f // gs, generator=g) * 1e-3).half()
    top = torch.topk(torch.rand(out_f, in_f // 4, 4, generator=g), 2, dim=-1).indices
    mask = torch.zeros(out_f, in_f // 4, 4, dtype=torch.bool).scatter_(-1, top, True).reshape(out_f, in_f)
    d = pack_delta(codes, scales, None, mask, bits, gs)
    for t in (d.qweight, d.positions, d.scales):
        raw = t.contiguous().view(torch.uint8).reshape(-1).numpy()
        out, _ = _roundtrip(raw, 9)
        assert torch.equal(torch.from_numpy(out).view(t.dtype).reshape(t.shape), t)


def _nvcomp_cpu_compress(lib, data: np.ndarray, level: int) -> tuple[bytes, list[int]]:
    """The same data through nvCOMP's own C++ batch API (valid input only: it throws on errors)."""
    fn = ctypes.CDLL(str(lib.path))._ZN6nvcomp8gdeflate11compressCPUEPKPKvPKmmmPKPvPmi
    P, S = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)
    fn.argtypes = [P, S, ctypes.c_size_t, ctypes.c_size_t, P, S, ctypes.c_int]
    fn.restype = None
    n = -(-data.size // PAGE)
    ins = (ctypes.c_void_p * n)(*[data.ctypes.data + i * PAGE for i in range(n)])
    inb = (ctypes.c_size_t * n)(*[min(PAGE, data.size - i * PAGE) for i in range(n)])
    bufs = [np.zeros(gdeflate.MAX_CHUNK_STORED, np.uint8) for _ in range(n)]
    outs = (ctypes.c_void_p * n)(*[b.ctypes.data for b in bufs])
    outb = (ctypes.c_size_t * n)()
    fn(ins, inb, PAGE, n, outs, outb, level)
    return b"".join(bufs[i][: outb[i]].tobytes() for i in range(n)), list(outb)


def test_bitstream_matches_nvcomp_compress_cpu():
    lib = gdeflate.cpu_library()
    data = (np.random.default_rng(3).normal(size=300_000) * 3).astype(np.int8).view(np.uint8)
    for level in (1, 9):
        blobs, sizes = gdeflate.compress_chunks(data, level)
        theirs, their_sizes = _nvcomp_cpu_compress(lib, data, level)
        assert b"".join(blobs) == theirs and list(sizes) == their_sizes


def test_garbage_chunks_are_refused_without_crashing():
    """Defence in depth: even bytes that skipped validation only ever produce a ChunkDecodeError."""
    rng = np.random.default_rng(4)
    good = rng.integers(0, 4, 50_000, dtype=np.uint8)
    blobs, sizes = gdeflate.compress_chunks(good, 9)
    page = np.frombuffer(b"".join(blobs), dtype=np.uint8)
    cases = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 4, 19, 160, 4000, gdeflate.MAX_CHUNK_STORED)]
    cases += [np.zeros(64, np.uint8), page[: len(page) // 2].copy()]
    for _ in range(40):  # single-byte flips of a real page
        bad = page.copy()
        bad[rng.integers(0, len(bad))] ^= rng.integers(1, 256)
        cases.append(bad)
    refused = 0
    for bad in cases:
        try:
            out = gdeflate.decompress_chunks(bad, [0], [bad.size], good.size)
        except gdeflate.ChunkDecodeError:
            refused += 1
            continue
        # A flip the format cannot see (GDeflate has no checksum) decodes to the right size; the
        # container's checksums are what catch it.
        assert out.size == good.size
    assert refused >= len(cases) - 40


def test_wrong_expected_size_is_refused():
    data = np.arange(1000, dtype=np.uint8)
    blobs, sizes = gdeflate.compress_chunks(data, 9)
    stored = b"".join(blobs)
    with pytest.raises(gdeflate.ChunkDecodeError, match="chunk 0"):
        gdeflate.decompress_chunks(stored, [0], sizes, 999)
    with pytest.raises(gdeflate.ChunkDecodeError, match="chunk 0"):
        gdeflate.decompress_chunks(stored, [0], sizes, 1001)
    with pytest.raises(ValueError, match="outside the stored bytes"):
        gdeflate.decompress_chunks(stored, [1], sizes, 1000)


def test_level_and_missing_library_errors(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="0..12"):
        gdeflate.compress_chunks(b"x", 13)
    monkeypatch.setenv(gdeflate.ENV_LIB, str(tmp_path / "nope.so"))
    with pytest.raises(gdeflate.CodecUnavailableError, match="does not exist"):
        gdeflate.find_cpu_library()
    monkeypatch.delenv(gdeflate.ENV_LIB)
    monkeypatch.setattr(gdeflate.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(gdeflate.CodecUnavailableError, match=r"pip install 'deltazip\[cu1[23]\]'"):
        gdeflate.find_cpu_library()


def test_install_hint_follows_torchs_cuda_major(monkeypatch):
    """The hint names the extra of torch's CUDA major (cu12 for a CPU build: its CPU library needs no
    CUDA); an nvCOMP module built for another major is named as the problem."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert gdeflate.install_hint() == "pip install 'deltazip[cu13]' (nvidia-nvcomp-cu13)"
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert gdeflate.install_hint() == "pip install 'deltazip[cu12]' (nvidia-nvcomp-cu12)"
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "deltazip[cu12]" in gdeflate.install_hint()
    assert [gdeflate.nvcomp_cuda_major(v) for v in (12090, 13000, "13.0", None, "x")] == [12, 13, 13, None, None]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gdeflate.gpu_problem() == "no CUDA device"


def test_gpu_problem_names_a_cuda_major_mismatch(monkeypatch):
    nvcomp = pytest.importorskip("nvidia.nvcomp")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(nvcomp, "__cuda_version__", 12090, raising=False)
    problem = gdeflate.gpu_problem()
    assert problem is not None and "built for CUDA 12" in problem and "deltazip[cu13]" in problem
    monkeypatch.setattr(nvcomp, "__cuda_version__", 13000, raising=False)
    assert gdeflate.gpu_problem() is None


@pytest.mark.gpu
@pytest.mark.nvcomp
@pytest.mark.parametrize("n", [1, PAGE, 5 * PAGE + 123])
def test_gpu_decodes_cpu_chunks_bit_exact(n):
    data = np.random.default_rng(n).choice(16, n, p=np.linspace(1, 0.1, 16) / np.linspace(1, 0.1, 16).sum())
    data = data.astype(np.uint8)
    blobs, sizes = gdeflate.compress_chunks(data, 9)
    offsets = chunk_offsets(sizes, 16)
    stored = np.zeros(int(offsets[-1] + sizes[-1]), np.uint8)
    flat = np.frombuffer(b"".join(blobs), np.uint8)
    pos = 0
    for o, s in zip(offsets, sizes):
        stored[o:o + s] = flat[pos:pos + s]
        pos += s
    out = gdeflate.gpu_decompress_chunks(stored, offsets, sizes, n, device="cuda")
    assert out.is_cuda and np.array_equal(out.cpu().numpy(), data)
    # Unaligned offsets (alignment 1) go through the on-device re-layout.
    out1 = gdeflate.gpu_decompress_chunks(flat, chunk_offsets(sizes, 1), sizes, n, device="cuda")
    assert np.array_equal(out1.cpu().numpy(), data)


def test_chunk_the_library_gives_up_on_is_stored(monkeypatch):
    """libdeflate_gdeflate_compress returns 0 for some incompressible chunks at levels >= 1 (seen on
    byte-grouped fp16 mantissas); such a chunk is stored with level 0 and still round-trips."""
    lib = gdeflate.cpu_library()
    stored_ptr = gdeflate._compressor(lib, 0)
    real = lib.compress
    calls = []

    def flaky(comp, src, n, page, npages):
        calls.append(comp)
        return 0 if comp != stored_ptr and len(calls) == 2 else real(comp, src, n, page, npages)

    monkeypatch.setattr(lib, "compress", flaky)
    data = np.random.default_rng(5).integers(0, 256, 3 * PAGE, dtype=np.uint8)
    out, sizes = _roundtrip(data, 9, threads=1)
    assert np.array_equal(out, data) and stored_ptr in calls
    assert sizes[1] > PAGE, "the second chunk went out as stored blocks"
