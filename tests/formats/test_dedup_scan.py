"""dedup-scan from file bytes: exact groups and savings, dtype/shape never matching, bad input."""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from deltazip.formats import dedup_scan as ds
from deltazip.formats.checkpoint_files import resolve_checkpoint
from deltazip.formats.dedup_scan import ScanConfig, component_of, hash_bytes, scan_checkpoints
from deltazip.formats.errors import InputError
from deltazip.formats.safetensors_raw import RawFile

CHANGED = ("model.layers.1.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight")


def _tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms start as all-ones (identical to each other): make every tensor distinct
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """A: base; B: copy with CHANGED perturbed in 8 columns; C: A's tensors in 3 shuffled shards."""
    root = tmp_path_factory.mktemp("dedup")
    a = root / "a"
    _tiny_llama().save_pretrained(a)
    sd = load_file(a / "model.safetensors")

    b = root / "b"
    b.mkdir()
    sd_b = {k: v.clone() for k, v in sd.items()}
    for k in CHANGED:
        sd_b[k][:, :8] += 0.5
    save_file(sd_b, b / "model.safetensors", metadata={"format": "pt"})

    c = root / "c"
    c.mkdir()
    names = sorted(sd)
    random.Random(0).shuffle(names)
    wmap = {}
    for s in range(3):
        shard = f"model-{s + 1:05d}-of-00003.safetensors"
        part = {n: sd[n] for n in names[s::3]}
        save_file(part, c / shard, metadata={"format": "pt"})
        wmap.update(dict.fromkeys(part, shard))
    (c / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return {"a": a, "b": b, "c": c, "sd": sd}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _reference_groups(*state_dicts) -> dict:
    """Independent ground truth: group by (dtype, shape, raw bytes) with torch only."""
    groups: dict = {}
    for ci, sd in enumerate(state_dicts):
        for n, t in sd.items():
            key = (t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
            groups.setdefault(key, []).append((ci, n))
    return groups


def test_exact_groups_and_savings(ckpts):
    sd = ckpts["sd"]
    res = scan_checkpoints([ckpts["a"], ckpts["b"], ckpts["c"]], ScanConfig(diff_stats=False))
    d = res.to_dict()
    n = len(sd)
    total_a = sum(_nbytes(t) for t in sd.values())
    changed_bytes = sum(_nbytes(sd[k]) for k in CHANGED)

    assert [c["kind"] for c in d["checkpoints"]] == ["hf-dir", "hf-dir", "hf-sharded"]
    assert [c["files"] for c in d["checkpoints"]] == [1, 1, 3]
    tot = d["totals"]
    assert tot["tensors"] == 3 * n
    assert tot["bytes"] == 3 * total_a
    assert tot["unique_tensors"] == n + len(CHANGED)
    assert tot["reused_tensors"] == (n - len(CHANGED)) + n
    assert tot["bytes_saved"] == (total_a - changed_bytes) + total_a
    assert tot["unique_bytes"] == total_a + changed_bytes
    assert tot["saved_pct"] == pytest.approx(100 * tot["bytes_saved"] / tot["bytes"], abs=1e-3)
    assert [c["reused_tensors"] for c in d["checkpoints"]] == [0, n - len(CHANGED), n]
    assert d["checkpoints"][2]["reused_bytes"] == total_a

    # Same answer as the torch-only ground truth, group by group.
    sd_b = load_file(ckpts["b"] / "model.safetensors")
    truth = sorted(sorted(v) for v in _reference_groups(sd, sd_b, sd).values() if len(v) > 1)
    found = sorted(sorted((o["checkpoint"], o["name"]) for o in g["occurrences"]) for g in d["groups"])
    assert found == truth
    for k in CHANGED:  # changed tensors are shared between A and C only
        g = next(g for g in d["groups"] if g["occurrences"][0]["name"] == k)
        assert [o["checkpoint"] for o in g["occurrences"]] == [0, 2]


def test_components_add_up(ckpts):
    d = scan_checkpoints([ckpts["a"], ckpts["b"]], ScanConfig(diff_stats=False)).to_dict()
    comps = {c["component"]: c for c in d["components"]}
    assert set(comps) == {"embed", "layer 0", "layer 1", "norms", "lm_head"}
    assert sum(c["bytes_saved"] for c in comps.values()) == d["totals"]["bytes_saved"]
    assert sum(c["bytes"] for c in comps.values()) == d["totals"]["bytes"]
    assert comps["layer 0"]["saved_pct"] == 50.0  # untouched layer: every tensor of B reused
    assert comps["layer 1"]["saved_pct"] < 50.0
    assert [c["component"] for c in d["components"]] == ["embed", "layer 0", "layer 1", "norms", "lm_head"]


@pytest.mark.parametrize("name,label", [
    ("model.embed_tokens.weight", "embed"), ("model.layers.12.mlp.up_proj.weight", "layer 12"),
    ("model.norm.weight", "norms"), ("lm_head.weight", "lm_head"), ("transformer.h.3.attn.c_attn.weight", "layer 3"),
    ("model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", "vision encoder"),
    ("text_model.encoder.layers.1.mlp.fc1.weight", "text encoder"), ("blk.7.attn_q.weight", "layer 7"),
    ("token_embd.weight", "embed"), ("output.weight", "lm_head"), ("output_norm.weight", "norms"),
    ("transformer.wte.weight", "embed"), ("score.weight", "other"),
])
def test_component_labels(name, label):
    assert component_of(name) == label


def test_dtype_and_shape_differences_never_match(ckpts, tmp_path):
    sd = ckpts["sd"]
    w = sd["model.layers.0.self_attn.q_proj.weight"]  # F32 [32, 32]
    f16 = sd["model.layers.0.mlp.up_proj.weight"].half()
    odd = {
        "same_bytes_as_int32": w.view(torch.int32).clone(),     # same bytes, other dtype
        "same_bytes_flat": w.reshape(-1).clone(),               # same bytes, other shape
        "same_bytes_transposed_shape": w.reshape(16, 64).clone(),
        "f16": f16.clone(),
        "f16_bytes_as_bf16": f16.view(torch.bfloat16).clone(),  # same bytes, F16 vs BF16
    }
    save_file(odd, tmp_path / "odd.safetensors")
    res = scan_checkpoints([ckpts["a"], tmp_path / "odd.safetensors"], ScanConfig(diff_stats=False))
    d = res.to_dict()
    assert d["groups"] == []
    assert d["totals"]["bytes_saved"] == 0
    fps = {r.name: r.fingerprint for r in res.refs}
    # Only dtype / shape keep them apart: the byte hashes are equal.
    q = fps["model.layers.0.self_attn.q_proj.weight"]
    for k in ("same_bytes_as_int32", "same_bytes_flat", "same_bytes_transposed_shape"):
        assert fps[k].digest == q.digest and fps[k] != q
    assert fps["f16"].digest == fps["f16_bytes_as_bf16"].digest and fps["f16"] != fps["f16_bytes_as_bf16"]


@pytest.mark.parametrize("algo", ["xxh3", "blake3", "blake2b"])
def test_file_hashes_equal_loaded_tensor_hashes(ckpts, algo):
    res = scan_checkpoints([ckpts["c"]], ScanConfig(hash=algo, diff_stats=False))
    sd = ckpts["sd"]
    assert len(res.refs) == len(sd)
    for r in res.refs:
        t = sd[r.name]
        assert r.fingerprint.digest == hash_bytes(t.contiguous().view(torch.uint8).numpy(), algo)
        assert r.fingerprint.shape == tuple(t.shape) and r.fingerprint.dtype == "F32"
    assert res.refs[0].fingerprint.algo == {"xxh3": "xxh3_128", "blake3": "blake3", "blake2b": "blake2b-256"}[algo]


def test_big_tensors_are_streamed_and_batched_reads_agree(tmp_path, monkeypatch):
    """Tensors above the read chunk are hashed in several reads; small ones share one read."""
    monkeypatch.setattr(ds, "_CHUNK", 1024)
    monkeypatch.setattr(ds, "_BATCH_BYTES", 1024)
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate([3, 700, 5, 1, 0, 64, 2000])}
    save_file(tensors, tmp_path / "x.safetensors")
    res = scan_checkpoints([tmp_path / "x.safetensors"], ScanConfig(diff_stats=False, threads=3))
    for r in res.refs:
        assert r.fingerprint.digest == hash_bytes(tensors[r.name].numpy().tobytes())


def test_min_bytes_skips_small_tensors(ckpts):
    sd = ckpts["sd"]
    res = scan_checkpoints([ckpts["a"], ckpts["c"]], ScanConfig(min_bytes=1024, diff_stats=False))
    d = res.to_dict()
    big = {k: v for k, v in sd.items() if _nbytes(v) >= 1024}
    assert 0 < len(big) < len(sd)
    assert d["totals"]["hashed_tensors"] == 2 * len(big)
    assert d["totals"]["reused_tensors"] == len(big)
    assert d["totals"]["bytes_saved"] == sum(_nbytes(v) for v in big.values())
    man = res.manifest()
    assert set(man["checkpoints"][0]["unhashed"]) == set(sd) - set(big)
    loc = man["checkpoints"][0]["unhashed"]["model.norm.weight"]
    assert loc["nbytes"] == _nbytes(sd["model.norm.weight"]) and loc["dtype"] == "F32"


def test_verify_bytes_splits_hash_collisions(ckpts, monkeypatch):
    class Weak:  # a deliberately terrible hash: the first 4 bytes only, so everything collides
        def __init__(self):
            self.b = b""

        def update(self, data):
            if not self.b:
                self.b = bytes(memoryview(data)[:4])

        def hexdigest(self):
            return "00"

    monkeypatch.setitem(ds.HASH_ALGORITHMS, "xxh3", ("xxh3_128", Weak))
    paths = [ckpts["a"], ckpts["b"]]
    bad = scan_checkpoints(paths, ScanConfig(diff_stats=False)).to_dict()
    good = scan_checkpoints(paths, ScanConfig(diff_stats=False, verify_bytes=True)).to_dict()
    monkeypatch.undo()
    real = scan_checkpoints(paths, ScanConfig(diff_stats=False)).to_dict()
    # Without verification, same dtype+shape means "identical": wrong savings.
    assert bad["totals"]["bytes_saved"] > real["totals"]["bytes_saved"]
    assert good["collisions"] > 0 and good["verified_pairs"] >= good["collisions"]
    assert good["totals"]["bytes_saved"] == real["totals"]["bytes_saved"]
    assert good["totals"]["unique_tensors"] == real["totals"]["unique_tensors"]


def test_diff_stats_of_changed_tensors(ckpts):
    sd = ckpts["sd"]
    d = scan_checkpoints([ckpts["a"], ckpts["b"]], ScanConfig()).to_dict()
    rows = {r["name"]: r for r in d["differing"]}
    assert set(rows) == set(CHANGED)
    for k in CHANGED:
        a = sd[k].double()
        b = a.clone()
        b[:, :8] = (sd[k][:, :8] + 0.5).double()
        r = rows[k]
        assert (r["reference"], r["checkpoint"]) == (0, 1)
        assert r["fraction_changed"] == pytest.approx(8 / sd[k].shape[1])
        assert r["rel_l2"] == pytest.approx(float((b - a).norm() / a.norm()), rel=1e-6)
        assert r["max_abs"] == pytest.approx(float((b - a).abs().max()), rel=1e-6)
    (s,) = [s for s in d["differing_summary"] if s["component"] == "layer 1"]
    assert s["tensors"] == 2 and s["numel"] == sum(sd[k].numel() for k in CHANGED)


def test_diff_stats_across_dtypes(tmp_path):
    a = {"w": torch.linspace(-1, 1, 64).reshape(8, 8)}
    b = {"w": a["w"].to(torch.bfloat16)}
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    doc = scan_checkpoints([tmp_path / "a.safetensors", tmp_path / "b.safetensors"]).to_dict()
    (r,) = doc["differing"]
    assert doc["differing_summary"][0]["dtype_changed"] == 1
    diff = b["w"].double() - a["w"].double()
    assert (r["dtype_reference"], r["dtype"]) == ("F32", "BF16")
    assert r["fraction_changed"] == pytest.approx(float((diff != 0).double().mean()))
    assert r["rel_l2"] == pytest.approx(float(diff.norm() / a["w"].double().norm()), rel=1e-6)


@pytest.mark.parametrize("dtype,st", [
    (torch.bfloat16, "BF16"), (torch.float16, "F16"), (torch.float32, "F32"), (torch.float64, "F64"),
    (torch.float8_e4m3fn, "F8_E4M3"), (torch.float8_e5m2, "F8_E5M2"), (torch.int8, "I8"), (torch.uint8, "U8"),
    (torch.int16, "I16"), (torch.int32, "I32"), (torch.int64, "I64"), (torch.bool, "BOOL"),
])
def test_numpy_decoding_matches_torch(dtype, st):
    """The diff statistics decode raw bytes with numpy; every dtype must read as torch reads it."""
    if dtype.is_floating_point:
        t = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
        if st == "F8_E4M3":  # every bit pattern, NaN included
            t = torch.arange(256, dtype=torch.uint8).view(dtype)
    elif dtype == torch.bool:
        t = torch.arange(100) % 3 == 0
    else:
        t = torch.randint(-100 if dtype.is_signed else 0, 100, (4096,), dtype=dtype)
    raw = t.view(torch.uint8).numpy() if dtype != torch.bool else t.numpy().view(np.uint8)
    acc = np.dtype(ds._DECODE[st][1])
    got = ds._decode_into(st, raw, np.empty(t.numel(), dtype=acc))
    want = t.to(torch.float64).numpy()
    np.testing.assert_array_equal(got.astype(np.float64), want)


def test_manifest_is_content_addressed(ckpts, tmp_path):
    res = scan_checkpoints([ckpts["a"], ckpts["b"], ckpts["c"]], ScanConfig(diff_stats=False))
    out = res.write_manifest(tmp_path / "m.json")
    man = json.loads(out.read_text())
    assert list(tmp_path.iterdir()) == [out]  # atomic: no temp file left behind
    assert (man["format"], man["version"], man["hash"]) == ("deltazip-dedup-manifest", 1, "xxh3_128")
    assert man["unique_tensors"] == len(man["tensors"]) == res.to_dict()["totals"]["unique_tensors"]
    for ck in man["checkpoints"]:
        assert set(ck["tensors"]) == set(ckpts["sd"]) and ck["unhashed"] == {}
        assert set(ck["tensors"].values()) <= set(man["tensors"])
    assert man["checkpoints"][0]["tensors"] == man["checkpoints"][2]["tensors"]
    for fid, ent in man["tensors"].items():  # each stored location really holds those bytes
        loc = ent["location"]
        with open(loc["file"], "rb") as f:
            f.seek(loc["offset"])
            raw = f.read(loc["nbytes"])
        assert hash_bytes(raw) == ent["hash"] and fid.startswith(f"xxh3_128:{ent['hash']}:")
        assert len(raw) == ent["nbytes"]
    with pytest.raises(InputError, match="parent directory"):
        res.write_manifest(tmp_path / "missing" / "m.json")
    assert ds.read_manifest(out) == man
    man["version"] = 99
    (tmp_path / "v99.json").write_text(json.dumps(man))
    with pytest.raises(InputError, match="version 99 is not supported"):
        ds.read_manifest(tmp_path / "v99.json")
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(InputError, match="not a dedup manifest"):
        ds.read_manifest(tmp_path / "other.json")


def test_diffusers_pipeline_and_variants(tmp_path):
    g = torch.Generator().manual_seed(0)
    enc = {"text_model.encoder.layers.0.fc1.weight": torch.randn(16, 8, generator=g)}
    pipes = []
    for i in range(2):
        p = tmp_path / f"pipe{i}"
        (p / "text_encoder").mkdir(parents=True)
        (p / "unet").mkdir()
        (p / "model_index.json").write_text("{}")
        save_file(enc, p / "text_encoder" / "model.safetensors")
        unet = {"conv.weight": torch.randn(4, 4, generator=g)}
        save_file(unet, p / "unet" / "diffusion_pytorch_model.safetensors")
        save_file({k: v.half() for k, v in unet.items()}, p / "unet" / "diffusion_pytorch_model.fp16.safetensors")
        pipes.append(p)
    ck = resolve_checkpoint(pipes[0])
    assert ck.kind == "diffusers"
    assert [(f.component, f.path.name) for f in ck.files] == [("text_encoder", "model.safetensors"),
                                                             ("unet", "diffusion_pytorch_model.safetensors")]
    assert [p.name for p in ck.skipped] == ["diffusion_pytorch_model.fp16.safetensors"]
    d = scan_checkpoints(pipes, ScanConfig(diff_stats=False)).to_dict()
    (grp,) = d["groups"]
    assert grp["occurrences"][0]["name"] == "text_encoder/text_model.encoder.layers.0.fc1.weight"
    comps = {c["component"]: c for c in d["components"]}
    assert comps["text_encoder"]["saved_pct"] == 50.0 and comps["unet"]["bytes_saved"] == 0
    assert d["totals"]["bytes_saved"] == 16 * 8 * 4


def test_gguf_tensors_match_safetensors(tmp_path):
    gguf = pytest.importorskip("gguf")
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    wr = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    wr.add_tensor("token_embd.weight", w)
    wr.add_tensor("blk.0.attn_q.weight", np.ones((6, 6), dtype=np.float16))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    save_file({"model.embed_tokens.weight": torch.from_numpy(w.copy())}, tmp_path / "m.safetensors")
    d = scan_checkpoints([tmp_path / "m.gguf", tmp_path / "m.safetensors"], ScanConfig(diff_stats=False)).to_dict()
    assert d["checkpoints"][0]["kind"] == "gguf" and d["checkpoints"][0]["tensors"] == 2
    (grp,) = d["groups"]
    assert grp["shape"] == [4, 6] and grp["dtype"] == "F32"
    assert [o["name"] for o in grp["occurrences"]] == ["token_embd.weight", "model.embed_tokens.weight"]


# ------------------------------------------------------------------------------------ bad input

def _write_raw(path: Path, header: bytes | dict, data: bytes = b"") -> Path:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


@pytest.mark.parametrize("kind,expect", [
    ("bad_json", "not valid JSON"),
    ("past_eof", "past the end of the file"),
    ("overlap", "overlapping byte ranges"),
    ("short", "shorter than 8 bytes"),
    ("huge_header", "past end of file"),
    ("wrong_size", "needs 16"),
    ("bad_dtype", "unknown dtype"),
])
def test_corrupt_headers_name_the_file(tmp_path, kind, expect):
    p = tmp_path / f"{kind}.safetensors"
    if kind == "bad_json":
        _write_raw(p, b"{not json", b"")
    elif kind == "past_eof":
        _write_raw(p, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    elif kind == "overlap":
        _write_raw(p, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                       "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, b"\0" * 24)
    elif kind == "short":
        p.write_bytes(b"abc")
    elif kind == "huge_header":
        p.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    elif kind == "wrong_size":
        _write_raw(p, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 12)
    elif kind == "bad_dtype":
        _write_raw(p, {"w": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(InputError, match=expect) as ei:
        scan_checkpoints([p])
    assert str(p) in str(ei.value) and "\n" not in str(ei.value)


def test_bad_checkpoint_fails_before_hashing(ckpts, tmp_path):
    bad = _write_raw(tmp_path / "bad.safetensors", b"[1, 2")
    calls = []
    with pytest.raises(InputError, match="bad.safetensors"):
        scan_checkpoints([ckpts["a"], ckpts["b"], bad], progress=lambda *a: calls.append(a))
    assert calls == []  # every header is validated before any tensor is hashed


def test_missing_and_empty_inputs(tmp_path, ckpts):
    with pytest.raises(InputError, match="no such file or directory"):
        scan_checkpoints([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no weights found"):
        scan_checkpoints([tmp_path / "empty"])
    (tmp_path / "pt").mkdir()
    (tmp_path / "pt" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(InputError, match="pickle checkpoints are not read"):
        scan_checkpoints([tmp_path / "pt"])
    with pytest.raises(InputError, match="no checkpoints"):
        scan_checkpoints([])
    with pytest.raises(InputError, match="unknown hash"):
        ScanConfig(hash="md5")
    # A sharded index naming a shard that is not there, and an index that is not JSON.
    sh = tmp_path / "sh"
    sh.mkdir()
    (sh / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(InputError, match="model-00001-of-00002.safetensors.*missing"):
        scan_checkpoints([sh])
    (sh / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(InputError, match="model.safetensors.index.json: shard index is not valid JSON"):
        scan_checkpoints([sh])


def test_truncated_after_header_check_names_file(ckpts, tmp_path, monkeypatch):
    """A file that shrinks between the header check and the read is reported, not a crash."""
    p = tmp_path / "x.safetensors"
    save_file({"w": torch.ones(1000)}, p)
    real = ds.collect_tensors

    def collect_then_truncate(cks):
        refs = real(cks)
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size - 100)
        return refs

    monkeypatch.setattr(ds, "collect_tensors", collect_then_truncate)
    with pytest.raises(InputError, match=r"x\.safetensors: file ends at byte .* inside tensor 'w'"):
        scan_checkpoints([p])


def test_rawfile_close_with_live_views(ckpts):
    rf = RawFile(ckpts["a"] / "model.safetensors")
    v = rf.view("model.norm.weight")
    arr = np.frombuffer(rf.view("lm_head.weight"), dtype=np.float32)  # an export numpy keeps alive
    rf.close()  # neither BufferError nor a dangling map
    with pytest.raises(ValueError):
        v.tobytes()
    assert arr.shape == (96 * 32,) and np.isfinite(arr).all()


def test_index_wins_over_stray_files(ckpts, tmp_path):
    """A sharded dir that also ships a consolidated copy: only the index's shards are read."""
    d = tmp_path / "both"
    shutil.copytree(ckpts["c"], d)
    shutil.copy(ckpts["a"] / "model.safetensors", d / "consolidated.safetensors")
    ck = resolve_checkpoint(d)
    assert ck.kind == "hf-sharded" and len(ck.files) == 3
    assert [p.name for p in ck.skipped] == ["consolidated.safetensors"]
    d2 = scan_checkpoints([d], ScanConfig(diff_stats=False)).to_dict()
    assert d2["totals"]["tensors"] == len(ckpts["sd"]) and d2["checkpoints"][0]["skipped_files"]
