"""verify and the loader: sound artifacts pass, every corruption is named, the fuzz finds no gap."""

import hashlib
import json
import random
import shutil

import pytest
import torch
from _factories import calib_file, edit_json, make_pair
from safetensors.torch import load_file, save_file

from deltazip.compress.config import CompressConfig
from deltazip.compress.pipeline import compress_delta
from deltazip.formats.artifact import FORMAT_VERSION, MANIFEST, MANIFEST_SUM, Artifact, ArtifactWriter, repack
from deltazip.formats.checksum import sha256_file
from deltazip.formats.errors import ArtifactError, DeltazipError
from deltazip.formats.packing import pack_int32
from deltazip.formats.verify import verify_artifact
from deltazip.kernels.packed import PackedDelta
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """(base, plain artifact, lossless artifact) of one tiny 2-bit compression."""
    tmp = tmp_path_factory.mktemp("verify")
    # Wide enough that the lossless stage pays for some parts (tiny parts are stored raw).
    base, ft = make_pair(tmp, hidden_size=128, intermediate_size=256)
    edit_json(ft / "config.json", finetuning_task="tiny")  # stored in hf/; the tokenizer is referenced
    cfg = CompressConfig(scheme=DeltaScheme(bits=2, group_size=32), nsamples=8, seqlen=32)
    plain, packed = tmp / "plain", tmp / "packed"
    compress_delta(base, ft, calib_file(tmp), plain, cfg, lossless="none")
    compress_delta(base, ft, calib_file(tmp), packed, cfg, lossless="gdeflate", lossless_level=9)
    return base, plain, packed


def _copy(src, tmp_path, name="a"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _load_all(path):
    """What a loader does: open, read every tensor, check the side files."""
    art = Artifact(path)
    out = {n: art.parts(n) for n in art.tensors}
    art.hf_dir()
    return out


def _rewrite_manifest(path, edit):
    """Edit manifest.json and keep manifest.sha256 consistent, so only the edit is wrong."""
    m = json.loads((path / MANIFEST).read_text())
    edit(m)
    text = json.dumps(m, indent=1).encode()
    (path / MANIFEST).write_bytes(text)
    (path / MANIFEST_SUM).write_text(f"sha256:{hashlib.sha256(text).hexdigest()}\n")


def _resave_container(path, edit):
    """Rewrite the container with ``edit(dict)`` applied and fix its files entry."""
    f = path / "deltas-00001.safetensors"
    sd = load_file(f)
    edit(sd)
    save_file(sd, f, metadata={"format": "deltazip", "format_version": "1"})

    def fix(m):
        m["files"]["deltas-00001.safetensors"] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}

    _rewrite_manifest(path, fix)


def test_sound_artifacts_verify(arts):
    base, plain, packed = arts
    fp = Checkpoint(base).fingerprint()
    for a in (plain, packed):
        r = verify_artifact(a, fp)
        assert r["ok"], r["problems"]
        assert r["checked"]["tensors"] == len(Artifact(a).tensors)
    assert verify_artifact(packed)["checked"]["lossless_parts"] > 0
    bad = verify_artifact(plain, "xxh3-128:" + "0" * 32)
    assert not bad["ok"] and "fingerprint" in bad["problems"][0]


def test_lossless_loads_identically(arts):
    base, plain, packed = arts
    a, b = Artifact(plain), Artifact(packed)
    assert b.lossless == "gdeflate" and a.lossless == "none"
    assert any(e.get("codec") == "gdeflate" for e in b.tensors.values())
    ck = Checkpoint(base)
    for name in a.tensors:
        pa, pb = a.parts(name), b.parts(name)
        assert pa.keys() == pb.keys()
        for k in pa:
            assert pa[k].dtype == pb[k].dtype and torch.equal(pa[k], pb[k]), (name, k)
        assert a.tensors[name].get("checksum") == b.tensors[name].get("checksum")
        w = ck.get(name)
        assert torch.equal(a.reconstruct(name, w), b.reconstruct(name, w))


def test_pack_unpack_roundtrip_restores_every_tensor(arts, tmp_path):
    _, plain, packed = arts
    p = repack(plain, tmp_path / "p", lossless="gdeflate", level=9)
    assert p["changed"] and p["lossless_parts"] > 0
    assert verify_artifact(tmp_path / "p")["ok"]
    u = repack(tmp_path / "p", lossless="none")  # in place
    assert u["changed"] and Artifact(tmp_path / "p").lossless == "none"
    a, b = load_file(tmp_path / "p" / "deltas-00001.safetensors"), load_file(plain / "deltas-00001.safetensors")
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert not list(tmp_path.glob(".p.*")), "no temporary directories left behind"
    again = repack(tmp_path / "p", lossless="none")
    assert not again["changed"]


@pytest.mark.parametrize("which", ["plain", "packed"])
def test_missing_container_file(arts, tmp_path, which):
    a = _copy(arts[1 if which == "plain" else 2], tmp_path)
    (a / "deltas-00001.safetensors").unlink()
    r = verify_artifact(a)
    assert not r["ok"] and any("deltas-00001.safetensors: missing" in p for p in r["problems"])
    with pytest.raises(ArtifactError, match="container file deltas-00001.safetensors is missing"):
        _load_all(a)
    # Issue 25: one line for one cause (it was one line per tensor in the container, 41 on a SmolLM2).
    stored = [n for n, e in Artifact(arts[1 if which == "plain" else 2]).tensors.items() if e.get("file")]
    assert len(stored) > 3 and len(r["problems"]) == 1, r["problems"]
    assert r["problems"][0].endswith(f"deltas-00001.safetensors: missing; {len(stored)} tensors in it cannot be "
                                     f"checked ({', '.join(repr(n) for n in stored[:3])} and {len(stored) - 3} more)")


def test_manifest_lists_tensor_not_in_container_and_the_reverse(arts, tmp_path):
    a = _copy(arts[2], tmp_path)
    art = Artifact(a)
    victim = next(n for n, e in art.tensors.items() if e.get("codec"))
    key = f"{victim}::{next(iter(art.tensors[victim]['lossless']))}.gdeflate"

    def edit(sd):
        sd["stray::tensor"] = sd.pop(key)

    _resave_container(a, edit)
    r = verify_artifact(a)
    probs = "\n".join(r["problems"])
    assert f"lists tensor {victim!r}" in probs and "'stray::tensor', which the manifest does not list" in probs
    assert "deltas-00001.safetensors" in probs
    with pytest.raises(ArtifactError, match="lists tensor|does not list"):
        _load_all(a)


def test_unknown_version_and_codec(arts, tmp_path):
    a = _copy(arts[2], tmp_path)
    _rewrite_manifest(a, lambda m: m.update(format_version=FORMAT_VERSION + 1))
    r = verify_artifact(a)
    assert not r["ok"] and "newer than this deltazip" in r["problems"][0]
    with pytest.raises(ArtifactError, match="upgrade deltazip"):
        Artifact(a)
    b = _copy(arts[2], tmp_path, "b")
    victim = next(n for n, e in Artifact(b).tensors.items() if e.get("codec"))
    _rewrite_manifest(b, lambda m: m["tensors"][victim].update(codec="zstd"))
    r = verify_artifact(b)
    assert any(victim in p and "'zstd' is unknown" in p for p in r["problems"])
    with pytest.raises(ArtifactError, match=f"{victim}.*zstd"):
        Artifact(b)


def test_every_problem_is_reported_not_just_the_first(arts, tmp_path):
    a = _copy(arts[2], tmp_path)
    (a / "hf" / "config.json").write_text("{}")
    tensors = Artifact(a).tensors
    lossy = [n for n, e in tensors.items() if e.get("codec")][:2]

    def edit(m):
        for n in lossy:  # wrong chunk tables of two tensors
            part = next(iter(m["tensors"][n]["lossless"]))
            m["tensors"][n]["lossless"][part]["chunks"][0] += 1
        m["tensors"][next(n for n, e in tensors.items() if e["kind"] == "packed" and not e.get("codec"))][
            "checksum"] = "sha256:" + "0" * 64

    _rewrite_manifest(a, edit)
    r = verify_artifact(a)
    probs = "\n".join(r["problems"])
    assert len(r["problems"]) >= 4, probs
    assert "hf/config.json" in probs and all(n in probs for n in lossy) and "checksum mismatch" in probs


def test_truncated_chunk_named(arts, tmp_path):
    a = _copy(arts[2], tmp_path)
    art = Artifact(a)
    victim = next(n for n, e in art.tensors.items() if e.get("codec"))
    part = next(iter(art.tensors[victim]["lossless"]))
    key = f"{victim}::{part}.gdeflate"
    _resave_container(a, lambda sd: sd.update({key: sd[key][:-3].clone()}))
    r = verify_artifact(a)
    assert any(victim in p and part in p and "truncated" in p for p in r["problems"]), r["problems"]
    with pytest.raises(ArtifactError, match=f"{victim}.*{part}.*truncated"):
        _load_all(a)


def _bad_delta(kind):
    out_f, in_f, bits, gs = 4, 32, 2, 16
    k = in_f // 2
    codes = torch.randint(0, 4, (out_f, k), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 1] * (k // 2)).repeat(out_f, 1)
    scales = torch.full((out_f, in_f // gs), 1e-3).half()
    zeros = None
    if kind == "positions":
        pos[1, 4:6] = torch.tensor([2, 2])  # two kept values at the same column
    if kind == "scales":
        scales[2, 1] = float("inf")
    if kind == "zeros":
        zeros = torch.full((out_f, in_f // gs), 2, dtype=torch.uint8)
        zeros[0, 0] = 4  # 2-bit grid: zero points 0..3
    return PackedDelta(pack_int32(codes, bits), scales, zeros, pack_int32(pos, 2),
                       DeltaScheme(bits=bits, group_size=gs, sym=zeros is None), in_f, out_f)


@pytest.mark.parametrize("kind,match", [
    ("positions", "not distinct and ascending"),
    ("scales", "not finite"),
    ("zeros", "zero points outside"),
])
def test_packing_invariants(tmp_path, kind, match):
    with ArtifactWriter(tmp_path / "a") as w:
        w.add_packed("layer.weight", _bad_delta(kind), torch.float32, additive=True, sym=kind != "zeros")
        w.finalize(lineage={}, config={})
    r = verify_artifact(tmp_path / "a")
    assert not r["ok"] and any("layer.weight" in p and match in p for p in r["problems"]), r["problems"]


def test_unused_bits_are_found(tmp_path):
    d = _bad_delta("none")
    d = PackedDelta(d.qweight, d.scales, None, d.positions, DeltaScheme(bits=3, group_size=16), 32, 4)
    d.qweight = pack_int32(torch.zeros(4, 16, dtype=torch.int64), 3)
    d.qweight[1, 0] |= 1 << 31  # 3-bit words leave the top 2 bits zero
    with ArtifactWriter(tmp_path / "a") as w:
        w.add_packed("x.weight", d, torch.float32, additive=True, sym=True)
        w.finalize(lineage={}, config={})
    r = verify_artifact(tmp_path / "a")
    assert any("qweight: 1 rows" in p for p in r["problems"]), r["problems"]


def _mutate(root, rng):
    """One random single-byte flip or truncation of one file of the artifact; returns a label."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    f = rng.choice(files)
    data = bytearray(f.read_bytes())
    if rng.random() < 0.7 and data:
        i = rng.randrange(len(data))
        data[i] ^= rng.randrange(1, 256)
        label = f"flip {f.name}@{i}"
    else:
        n = rng.randrange(len(data)) if data else 0
        data = data[:n]
        label = f"truncate {f.name} to {n}"
    f.write_bytes(bytes(data))
    return label


@pytest.mark.parametrize("which,cases", [("packed", 300), ("plain", 100)])
def test_fuzz_flips_and_truncations(arts, tmp_path, which, cases):
    """Every single-byte flip or truncation is reported by verify and refused by the loader;
    nothing else ever escapes (no native crash, no wrong weights)."""
    src = arts[2] if which == "packed" else arts[1]
    reference = _load_all(src)
    rng = random.Random(1234 if which == "packed" else 99)
    work = tmp_path / "w"
    for case in range(cases):
        if work.exists():
            shutil.rmtree(work)
        shutil.copytree(src, work)
        label = _mutate(work, rng)
        r = verify_artifact(work)
        assert not r["ok"], f"case {case} ({label}): verify found nothing"
        try:
            loaded = _load_all(work)
        except DeltazipError as e:
            assert "\n" not in str(e), f"case {case} ({label}): error is not one line"
            continue
        # Should not be reached; if it is, the weights must at least be right.
        for n, parts in reference.items():
            assert all(torch.equal(parts[k], loaded[n][k]) for k in parts), f"case {case} ({label}): wrong weights"
        pytest.fail(f"case {case} ({label}): the loader accepted a corrupted artifact")


@pytest.mark.gpu
@pytest.mark.nvcomp
def test_gpu_load_matches_cpu_load(arts):
    """nvCOMP decodes the CPU-written containers straight into device memory, bit-exactly."""
    base, plain, packed = arts
    cpu, gpu = Artifact(plain), Artifact(packed, device="cuda")
    ck = Checkpoint(base)
    for name in cpu.tensors:
        pc, pg = cpu.parts(name), gpu.parts(name)
        for k in pc:
            assert pg[k].is_cuda and torch.equal(pg[k].cpu(), pc[k]), (name, k)
        w = ck.get(name)
        assert torch.equal(gpu.reconstruct(name, w.cuda()).cpu(), cpu.reconstruct(name, w))


def test_safetensors_metadata_is_written_in_one_order(tmp_path):
    """safetensors writes its metadata from a hash map (a new order per map); the writer sorts it after
    each save, so equal inputs give equal bytes. Eight saves of one table: one set of bytes."""
    from deltazip.formats.safetensors_raw import read_table, sort_metadata

    meta = {"format": "deltazip", "format_version": str(FORMAT_VERSION), "z": "1", "a": "2"}
    seen, unsorted = set(), set()
    for i in range(8):
        p = tmp_path / f"{i}.safetensors"
        save_file({"w": torch.arange(6.0).reshape(2, 3)}, str(p), metadata=meta)
        unsorted.add(p.read_bytes())
        sort_metadata(p)
        seen.add(p.read_bytes())
        assert read_table(p)[1] == meta and torch.equal(load_file(p)["w"], torch.arange(6.0).reshape(2, 3))
    assert len(seen) == 1 and len(unsorted) > 1  # 4 keys: 8 saves in one order by chance is (1/24)**7


def test_compressing_twice_writes_the_same_bytes(arts, tmp_path):
    base, plain, _ = arts
    again = tmp_path / "again"
    ft = base.with_name(base.name.replace("-base", "-ft"))
    compress_delta(base, ft, calib_file(tmp_path), again,
                   CompressConfig(scheme=DeltaScheme(bits=2, group_size=32), nsamples=8, seqlen=32), lossless="none")
    files = sorted(p.relative_to(plain) for p in plain.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for f in files:
        if f.name.endswith(".safetensors"):
            assert (plain / f).read_bytes() == (again / f).read_bytes(), f
