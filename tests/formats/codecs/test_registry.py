"""The codec registry: one codec per manifest kind, typed entries, and the scheme in every packed entry."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltazip.formats import codecs
from deltazip.formats.artifact import Artifact, ArtifactWriter
from deltazip.formats.packing import pack_delta
from deltazip.formats.verify import verify_artifact
from deltazip.kernels.scheme import DeltaScheme

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures"


def test_every_kind_has_one_codec_in_its_own_module():
    assert {"packed", "rows", "xor", "dense_delta", "full", "same", "alias"} <= set(codecs.kinds())
    assert "lora" in codecs.kinds(manifest_only=False) and "lora" not in codecs.kinds()
    for kind in codecs.kinds(manifest_only=False):
        assert codecs.get(kind).kind == kind
        assert codecs.codec_file(kind).parent == ROOT / "formats" / "codecs"
    assert codecs.get("packed").layouts == ("canonical", "mma")  # what it offers the SBMM kernels
    with pytest.raises(Exception, match="unknown kind 'codebook'"):
        codecs.get("codebook")


def test_a_first_use_from_many_threads_at_once_finds_every_codec():
    """The registry fills on first use; threads that reach it together (an artifact writer's pool, a server's
    loaders) wait for every codec instead of reading a half-filled registry ("unknown kind 'packed'").
    A fresh interpreter, so that the first use is the threads'."""
    code = """
import threading
from deltazip.formats import codecs
kinds = ["packed", "rows", "xor", "dense_delta", "full", "same", "alias", "lora"]
errors, barrier = [], threading.Barrier(8)
def first_use(kind):
    barrier.wait()
    try:
        assert codecs.get(kind).kind == kind
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=first_use, args=(k,)) for k in kinds]
[t.start() for t in threads]
[t.join() for t in threads]
print(len(errors), errors[:2])
"""
    for _ in range(3):
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert got.returncode == 0 and got.stdout.strip() == "0 []", (got.stdout, got.stderr[-2000:])


@pytest.mark.parametrize("art", ["v1/art-deltazip", "v2/art-llama", "v2/art-gpt2"])
def test_old_entries_read_as_typed_entries_with_a_scheme(art):
    a = Artifact(FIXTURES / art)
    config = a.config
    for name, e in a.entries().items():
        assert e.kind == a.tensors[name]["kind"] and e.name == name
        if e.kind == "packed":
            assert e.scheme == DeltaScheme(bits=config["bits"], group_size=config["group_size"],
                                           sparsity=config["sparsity"], sym=config["sym"])
            assert e.additive and e.needs_base and e.kernel_ready and e.is_matrix
            assert list(e.stored_shape) == (list(e.shape)[::-1] if e.transposed else list(e.shape))
        else:
            assert e.scheme is None and not e.is_matrix
        assert e.needs_base == (e.kind in ("packed", "same", "rows", "xor", "dense_delta", "alias"))


def _delta(sym: bool):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (8, 32), generator=g)
    scales = torch.rand(8, 2, generator=g) / 100
    zeros = None if sym else torch.full((8, 2), 7)
    mask = torch.zeros(8, 8, 4, dtype=torch.bool)
    mask[..., :2] = True
    return pack_delta(codes, scales, zeros, mask.reshape(8, 32), 4, 16)


def test_packed_entries_carry_their_scheme_and_the_loose_fields_beside_it(tmp_path):
    with ArtifactWriter(tmp_path / "a") as w:
        w.add_packed("x.weight", _delta(sym=False), torch.float32, additive=True)
        w.finalize(lineage={}, config={})
    e = Artifact(tmp_path / "a").entry("x.weight")
    assert e.raw["scheme"] == {"version": 1, "bits": 4, "group_size": 16, "sparsity": "2:4", "sym": False,
                               "kind": "packed"}
    assert [k for k in e.raw if k in ("bits", "group_size", "sym", "sparsity", "additive", "scheme")] == \
        ["bits", "group_size", "sym", "sparsity", "additive", "scheme"]  # v2's order, then the new field
    assert e.scheme.sym is False and verify_artifact(tmp_path / "a")["ok"]
    with pytest.raises(ValueError, match="sym=True"):
        ArtifactWriter(tmp_path / "b").add_packed("x.weight", _delta(sym=False), torch.float32, True, sym=True)


def test_verify_names_loose_fields_that_disagree_with_the_scheme(tmp_path):
    with ArtifactWriter(tmp_path / "a") as w:
        w.add_packed("x.weight", _delta(sym=True), torch.float32, additive=True)
        w.finalize(lineage={}, config={})
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    m["tensors"]["x.weight"]["bits"] = 2
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(m))
    (tmp_path / "a" / "manifest.sha256").unlink()
    r = verify_artifact(tmp_path / "a")
    assert not r["ok"] and any("'bits' (2) differs from its scheme's (4)" in p for p in r["problems"]), r["problems"]
