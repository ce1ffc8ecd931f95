"""The CLI: `deltazip compress --lossless`, `verify`, `pack`, `unpack` (exit codes, --json, one-line errors)."""

import json
import shutil

import pytest
import torch
from _cli import run_cli, run_cli_ok, without_progress
from _factories import calib_file, edit_json, make_pair
from safetensors.torch import load_file

from deltazip.formats.artifact import Artifact

FAST = ["--bits", "2", "--group-size", "32", "--nsamples", "4", "--seqlen", "32"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(tmp, base, ft, lossless artifact made by `compress --lossless gdeflate`)."""
    tmp = tmp_path_factory.mktemp("vp")
    # Wide enough that the lossless stage pays for some parts (tiny parts are stored raw).
    base, ft = make_pair(tmp, hidden_size=128, intermediate_size=256)
    edit_json(ft / "config.json", finetuning_task="tiny")  # stored in hf/; the tokenizer is referenced
    art = tmp / "art"
    run_cli_ok("compress", "--base", base, "--finetuned", ft, "--calib", calib_file(tmp), "--out", art, *FAST,
               "--lossless", "gdeflate", "--lossless-level", "6", "--json")
    return tmp, base, ft, art


def test_help_lists_new_commands(capsys, monkeypatch):
    for cmd in ("verify", "pack", "unpack"):
        code, out, _ = run_cli(capsys, monkeypatch, cmd, "--help")
        assert code == 0 and "Usage" in out, cmd
    code, out, _ = run_cli(capsys, monkeypatch, "compress", "--help")
    assert "--lossless" in out and "--lossless-level" in out


def test_compress_lossless_then_verify(capsys, monkeypatch, made):
    tmp, base, ft, art = made
    a = Artifact(art)
    assert a.lossless == "gdeflate"
    assert {m["level"] for e in a.tensors.values() for m in (e.get("lossless") or {}).values()} == {6}
    code, out, err = run_cli(capsys, monkeypatch, "verify", art, "--base", base)
    assert code == 0 and "sound" in out and "base fingerprint matches" in out, err
    code, out, _ = run_cli(capsys, monkeypatch, "verify", art, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["checked"]["lossless_parts"] > 0


def test_verify_exit_1_lists_every_problem(capsys, monkeypatch, made, tmp_path):
    tmp, base, ft, art = made
    a = tmp_path / "a"
    shutil.copytree(art, a)
    (a / "hf" / "config.json").write_text("{}")
    (a / "deltas-00001.safetensors").write_bytes((a / "deltas-00001.safetensors").read_bytes()[:-10])
    code, out, err = run_cli(capsys, monkeypatch, "verify", a, "--base", ft)
    lines = [x for x in out.splitlines() if x.startswith("problem: ")]
    assert code == 1 and len(lines) >= 3, out
    assert any("hf/config.json" in x for x in lines) and any("deltas-00001" in x for x in lines)
    assert any("fingerprint" in x for x in lines)
    code, out, _ = run_cli(capsys, monkeypatch, "verify", a, "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["ok"] and len(doc["problems"]) >= 2


def test_verify_bad_paths(capsys, monkeypatch, tmp_path):
    code, out, err = run_cli(capsys, monkeypatch, "verify", tmp_path / "nope")
    assert code == 1 and "no such artifact directory" in out
    code, out, err = run_cli(capsys, monkeypatch, "verify", tmp_path, "--base", tmp_path / "nobase")
    assert code == 1 and "not a deltazip artifact" in out and "cannot fingerprint the base" in out


def test_unpack_pack_roundtrip(capsys, monkeypatch, made, tmp_path):
    tmp, base, ft, art = made
    code, out, err = run_cli(capsys, monkeypatch, "unpack", art, "--out", tmp_path / "u", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["changed"] and doc["bytes_after"] > doc["bytes_before"], err
    assert Artifact(tmp_path / "u").lossless == "none"
    code, out, err = run_cli(capsys, monkeypatch, "pack", tmp_path / "u", "--level", "6")
    assert code == 0 and "GDeflate level 6" in out, err
    a, b = load_file(tmp_path / "u" / "deltas-00001.safetensors"), load_file(art / "deltas-00001.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "pack(unpack(x)) == x at the same level"
    code, out, _ = run_cli(capsys, monkeypatch, "verify", tmp_path / "u")
    assert code == 0
    code, out, err = run_cli(capsys, monkeypatch, "unpack", art, "--out", tmp_path / "u")
    assert code == 1 and "already exists" in err and without_progress(err).count("\n") == 1


def test_pack_refuses_corrupt_and_bad_level(capsys, monkeypatch, made, tmp_path):
    tmp, base, ft, art = made
    a = tmp_path / "a"
    shutil.copytree(art, a)
    f = a / "deltas-00001.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    code, out, err = run_cli(capsys, monkeypatch, "unpack", a)
    assert code == 1 and "deltas-00001.safetensors" in err and without_progress(err).count("\n") == 1
    assert f.read_bytes() == bytes(data), "a failed unpack leaves the artifact as it was"
    assert not list(tmp_path.glob(".a.*"))
    code, _, err = run_cli(capsys, monkeypatch, "pack", art, "--level", "13")
    assert code == 2


def test_compress_rejects_unknown_lossless(capsys, monkeypatch, made, tmp_path):
    tmp, base, ft, _ = made
    code, out, err = run_cli(capsys, monkeypatch, "compress", "--base", base, "--finetuned", ft, "--method", "rtn",
                             "--out", tmp_path / "x", "--lossless", "zstd")
    assert code == 1 and "unknown lossless stage 'zstd'" in err
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.tmp-*"))
