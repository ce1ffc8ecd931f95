"""``deltazip dedup-scan`` end to end: --json, --manifest, tables, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from deltazip.deltacli.app import app
from deltazip.formats.errors import InputError


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """Two safetensors 'checkpoints': B = A with one tensor changed and one converted to F16."""
    root = tmp_path_factory.mktemp("cli")
    g = torch.Generator().manual_seed(0)
    a = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(32, 16, generator=g) for i in range(3)}
    a["model.embed_tokens.weight"] = torch.randn(50, 16, generator=g)
    b = dict(a)
    b["model.layers.2.mlp.up_proj.weight"] = a["model.layers.2.mlp.up_proj.weight"] * 1.01
    b["model.embed_tokens.weight"] = a["model.embed_tokens.weight"].half()
    (root / "a").mkdir()
    (root / "b").mkdir()
    save_file(a, root / "a" / "model.safetensors")
    save_file(b, root / "b" / "model.safetensors")
    return root / "a", root / "b"


runner = CliRunner()


def test_json_report(pair, tmp_path):
    man = tmp_path / "m.json"
    r = runner.invoke(app, ["dedup-scan", str(pair[0]), str(pair[1]), "--json", "--manifest", str(man)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)  # exactly one JSON document, nothing else on stdout
    t = doc["totals"]
    assert (t["tensors"], t["unique_tensors"], t["reused_tensors"]) == (8, 6, 2)
    assert t["bytes_saved"] == 2 * 32 * 16 * 4
    assert doc["manifest"] == str(man) and json.loads(man.read_text())["format"] == "deltazip-dedup-manifest"
    diffs = {d["name"]: d for d in doc["differing"]}
    assert diffs["model.layers.2.mlp.up_proj.weight"]["rel_l2"] == pytest.approx(0.01, rel=1e-3)
    assert diffs["model.embed_tokens.weight"]["dtype"] == "F16"


@pytest.mark.parametrize("algo", ["blake3", "blake2b"])
def test_hash_choice_and_verify(pair, algo):
    r = runner.invoke(app, ["dedup-scan", str(pair[0]), str(pair[1]), "--json", "--hash", algo, "--verify-bytes",
                            "--min-bytes", "100", "--no-diff-stats"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["hash"].startswith(algo) and doc["verify_bytes"] and doc["verified_pairs"] == 2
    assert doc["totals"]["reused_tensors"] == 2 and doc["differing"] == []


def test_human_tables(pair):
    r = runner.invoke(app, ["dedup-scan", str(pair[0]), str(pair[1]), "--top", "1"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    for needle in ("Checkpoints", "Per component", "Identical tensors (top 1 of 2 groups", "saves",
                   "delta-compression candidates", "layer 2"):
        assert needle in r.stdout


def test_bad_input_in_process(tmp_path, pair):
    r = runner.invoke(app, ["dedup-scan", str(pair[0]), str(tmp_path / "missing")])
    assert r.exit_code == 1 and isinstance(r.exception, InputError)
    r = runner.invoke(app, ["dedup-scan", str(pair[0]), "--hash", "md5"])
    assert r.exit_code == 2  # usage error
    r = runner.invoke(app, ["dedup-scan", str(pair[0]), "--min-bytes", "-1"])
    assert r.exit_code == 2


def _deltazip(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DELTAZIP_DEBUG"}
    return subprocess.run([sys.executable, "-m", "deltazip.deltacli.app", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_real_entry_point(pair, tmp_path):
    ok = _deltazip("dedup-scan", str(pair[0]), str(pair[1]), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["totals"]["reused_tensors"] == 2
    assert ok.stderr == ""  # no progress bars or logs under --json

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    err = _deltazip("dedup-scan", str(pair[0]), str(bad), "--json")
    assert err.returncode == 1 and err.stdout == ""
    lines = err.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err.stderr
    assert lines[0].startswith("deltazip: error: ") and str(bad) in lines[0] and "not valid JSON" in lines[0]
