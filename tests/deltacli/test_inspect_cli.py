"""`deltazip inspect`: bits per weight and ratios by tensor kind against the fine-tune's stored dtype,
side files copied vs referenced; and the CLI round trip of an artifact whose tokenizer is the base's
(compress -> merge / verify --base / pack / unpack)."""

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from _cli import run_cli, run_cli_ok
from _factories import calib_file, edit_json, make_pair

from deltazip.formats.artifact import Artifact
from deltazip.formats.report import summarize

FAST = ["--bits", "4", "--group-size", "32", "--nsamples", "4", "--seqlen", "32"]
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}  # bytes per element, by hand


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(tmp, base, ft, artifact) of a bf16 pair whose fine-tune changed tokenizer_config.json only."""
    tmp = tmp_path_factory.mktemp("inspect")
    base, ft = make_pair(tmp, dtype=torch.bfloat16)
    edit_json(ft / "tokenizer_config.json", model_max_length=64)
    art = tmp / "art"
    run_cli_ok("compress", "--base", base, "--finetuned", ft, "--calib", calib_file(tmp), "--out", art, *FAST, "--json")
    return tmp, base, ft, art


def _by_hand(art):
    """Per kind: weights, stored bytes, bf16 bytes, straight from the manifest."""
    m = json.loads((art / "manifest.json").read_text())
    kinds = {}
    for e in m["tensors"].values():
        k = kinds.setdefault(e["kind"], {"weights": 0, "stored": 0, "orig": 0, "tensors": 0})
        n = math.prod(e["shape"])
        k["weights"] += n
        k["stored"] += e["stored_bytes"]
        k["orig"] += n * ITEMSIZE[e["dtype"]]
        k["tensors"] += 1
    return m, kinds


def test_inspect_json_bits_per_weight_and_ratios(capsys, monkeypatch, made):
    tmp, base, ft, art = made
    code, out, err = run_cli(capsys, monkeypatch, "inspect", art, "--json")
    assert code == 0, err
    doc = json.loads(out)
    m, kinds = _by_hand(art)
    assert {"packed", "rows", "same"} <= set(kinds) and set(doc["by_kind"]) == set(kinds)
    for kind, k in kinds.items():
        got = doc["by_kind"][kind]
        assert got["tensors"] == k["tensors"] and got["weights"] == k["weights"]
        assert got["stored_bytes"] == k["stored"] and got["original_bytes"] == k["orig"]
        assert got["bits_per_weight"] == pytest.approx(k["stored"] * 8 / k["weights"])
        assert got["ratio"] == (pytest.approx(k["orig"] / k["stored"]) if k["stored"] else None)
    assert doc["by_kind"]["same"]["bits_per_weight"] == 0 and doc["by_kind"]["same"]["ratio"] is None
    # 4-bit 2:4 codes + positions + fp16 scales: well under 4 bits per weight, far above bf16 / 16.
    assert 2 < doc["by_kind"]["packed"]["bits_per_weight"] < 4
    # The whole artifact against the bf16 checkpoint's bytes (every tensor bf16 here).
    assert doc["finetuned_dtype"] == "bfloat16" and set(doc["finetuned_dtypes"]) == {"bfloat16"}
    ft_bytes = sum(k["orig"] for k in kinds.values())
    assert doc["finetuned_bytes"] == ft_bytes == sum(math.prod(e["shape"]) * 2 for e in m["tensors"].values())
    dir_bytes = sum(p.stat().st_size for p in art.rglob("*") if p.is_file())
    assert doc["artifact_bytes"] == dir_bytes
    assert doc["ratio"] == pytest.approx(ft_bytes / dir_bytes)
    assert doc["bits_per_weight"] == pytest.approx(dir_bytes * 8 / sum(k["weights"] for k in kinds.values()))
    # Side files: the changed tokenizer_config.json is copied, the rest referenced from the base.
    ref = [n for n, i in m["side_files"].items() if i["source"] == "base"]
    assert "tokenizer.json" in ref and "config.json" in ref
    assert doc["side_files"] == {
        "copied": {"files": 1, "bytes": (art / "hf" / "tokenizer_config.json").stat().st_size},
        "referenced": {"files": len(ref), "bytes": sum((base / n).stat().st_size for n in ref)}}


def test_inspect_table_names_the_dtype(capsys, monkeypatch, made):
    tmp, base, ft, art = made
    code, out, err = run_cli(capsys, monkeypatch, "inspect", art)
    assert code == 0, err
    doc = summarize(Artifact(art))
    out = " ".join(out.split())  # rich wraps long lines at the console width
    assert "bits/weight" in out and "vs bfloat16 fine-tune" in out
    assert f"{doc['by_kind']['packed']['bits_per_weight']:.3f}" in out
    assert f"{doc['by_kind']['packed']['ratio']:.2f}x" in out
    assert "1 copied" in out and f"{doc['side_files']['referenced']['files']} referenced from the base" in out


def test_summary_handles_any_kind():
    """Kinds are open-ended: figures come from shape, dtype and stored_bytes, whatever the kind."""
    tensors = {
        "a": {"kind": "xor", "shape": [8, 16], "dtype": "bfloat16", "stored_bytes": 40},
        "b": {"kind": "rows", "shape": [4, 16], "dtype": "float32", "stored_bytes": 64},
        "c": {"kind": "rows", "shape": [16], "dtype": "float32", "stored_bytes": 0},
    }
    fake = SimpleNamespace(path="x", tensors=tensors, lineage={}, config={}, side_files={}, nbytes=lambda: 1000,
                           manifest={"format_version": 1, "tensors": tensors})
    s = summarize(fake)
    assert s["by_kind"]["xor"]["bits_per_weight"] == pytest.approx(40 * 8 / 128)
    assert s["by_kind"]["xor"]["ratio"] == pytest.approx(256 / 40)
    assert s["by_kind"]["rows"]["weights"] == 80 and s["by_kind"]["rows"]["ratio"] == pytest.approx(320 / 64)
    assert s["finetuned_dtype"] == "bfloat16" and s["finetuned_dtypes"] == {"float32": 320, "bfloat16": 256}
    assert s["ratio"] == pytest.approx(576 / 1000)


def test_cli_round_trip_with_referenced_tokenizer(capsys, monkeypatch, made):
    tmp, base, ft, art = made
    assert not (art / "hf" / "tokenizer.json").exists()
    code, out, err = run_cli(capsys, monkeypatch, "merge", art, "--out", tmp / "merged", "--json")
    assert code == 0, err
    merged = tmp / "merged"
    assert (merged / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    assert (merged / "tokenizer_config.json").read_bytes() == (ft / "tokenizer_config.json").read_bytes()
    code, out, err = run_cli(capsys, monkeypatch, "verify", art, "--base", base)
    assert code == 0 and "side files in the base" in out, out + err
    work = tmp / "work"
    shutil.copytree(art, work)
    for cmd in ("pack", "unpack"):
        code, out, err = run_cli(capsys, monkeypatch, cmd, work, "--json")
        assert code == 0, err
        assert json.loads((work / "manifest.json").read_text())["side_files"] == \
            json.loads((art / "manifest.json").read_text())["side_files"]
        code, out, err = run_cli(capsys, monkeypatch, "verify", work, "--base", base, "--json")
        assert code == 0 and json.loads(out)["checked"]["side_files_referenced"] >= 3, out
    # A base whose referenced tokenizer differs: one line naming the file and the fix.
    other = tmp / "other-base"
    shutil.copytree(base, other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace("<pad>", "<PAD>"))
    code, out, err = run_cli(capsys, monkeypatch, "merge", art, "--base", other, "--out", tmp / "m2")
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "tokenizer.json" in lines[0] and "pass the right --base" in lines[0], err
    assert not (tmp / "m2").exists()
    code, out, err = run_cli(capsys, monkeypatch, "verify", art, "--base", other)
    assert code == 1 and any("tokenizer.json" in x and "pass the right --base" in x for x in out.splitlines()), out
