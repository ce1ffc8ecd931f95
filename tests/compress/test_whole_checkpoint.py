"""Every tensor of a checkpoint compressed (format v2): the untied lm_head as a calibrated linear,
embeddings row by row, tied embeddings stored once, and v1 artifacts still readable."""

import hashlib
import json
from pathlib import Path

import torch
from _factories import calib_file, make_pair
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import load_merged_model, merge_to_dir, reconstruct_state_dict
from deltazip.compress.pipeline import compress_delta
from deltazip.formats.artifact import Artifact
from deltazip.formats.verify import verify_artifact
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint

CFG = dict(scheme=DeltaScheme(group_size=32), nsamples=16, seqlen=48, batch_size=4)
FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "v1"


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_untied_lm_head_is_a_calibrated_linear(tmp_path):
    base, ft = make_pair(tmp_path, "llama", dtype=torch.bfloat16, tie_word_embeddings=False)
    calib = calib_file(tmp_path)
    arts = {}
    for method in ("deltazip", "rtn"):
        arts[method] = tmp_path / method
        compress_delta(base, ft, str(calib), arts[method], CompressConfig(method=method, **CFG))
    art = Artifact(arts["deltazip"])
    e = art.tensors["lm_head.weight"]
    assert e["kind"] == "packed" and e["bits"] == 4 and e["sparsity"] == "2:4" and e["additive"]
    assert art.tensors["model.embed_tokens.weight"]["kind"] == "rows"
    head = art.manifest["head"]
    assert 0 < head["rel_out_err"] < 0.5
    # held-out text from the calibration distribution: the solver fits that distribution
    texts = [json.loads(x)["text"] for x in calib_file(tmp_path / "heldout", n=8, seed=99).read_text().splitlines()]
    ids = AutoTokenizer.from_pretrained(ft)(texts, return_tensors="pt", padding=True)["input_ids"]
    lf = _logits(AutoModelForCausalLM.from_pretrained(ft).eval(), ids)
    lb = _logits(AutoModelForCausalLM.from_pretrained(base).eval(), ids)
    lc = _logits(load_merged_model(art, Checkpoint(base)), ids)
    lr = _logits(load_merged_model(Artifact(arts["rtn"]), Checkpoint(base)), ids)
    assert _rel(lc, lf) < 0.5 * _rel(lb, lf)
    assert _rel(lc, lf) < _rel(lr, lf), "calibrated head and layers beat round-to-nearest"
    # every tensor but the linears and the embedding comes back bit for bit
    sd, ftc = reconstruct_state_dict(art, Checkpoint(base)), Checkpoint(ft)
    for n, ent in art.tensors.items():
        if ent["kind"] not in ("packed", "rows"):
            assert torch.equal(sd[n].view(torch.int16), ftc.get(n).view(torch.int16)), n


def test_tied_embeddings_are_stored_once(tmp_path):
    base, ft = make_pair(tmp_path, "llama", dtype=torch.bfloat16, tie_word_embeddings=True)
    calib = calib_file(tmp_path)
    art_dir = tmp_path / "art"
    compress_delta(base, ft, str(calib), art_dir, CompressConfig(**CFG))
    art = Artifact(art_dir)
    assert "lm_head.weight" not in art.tensors
    assert [n for n, e in art.tensors.items() if e["kind"] == "rows"] == ["model.embed_tokens.weight"]

    # A checkpoint that writes the tied matrix under both names: the second is an alias, no bytes.
    both = {}
    for d in (base, ft):
        sd = load_file(d / "model.safetensors")
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
        nd = tmp_path / f"{d.name}-both"
        nd.mkdir()
        for f in d.iterdir():
            if f.name != "model.safetensors":
                (nd / f.name).write_bytes(f.read_bytes())
        save_file(sd, nd / "model.safetensors", metadata={"format": "pt"})
        both[d] = nd
    art2_dir = tmp_path / "art2"
    compress_delta(both[base], both[ft], str(calib), art2_dir, CompressConfig(**CFG))
    art2 = Artifact(art2_dir)
    e = art2.tensors["lm_head.weight"]
    assert e == {"kind": "alias", "of": "model.embed_tokens.weight", "shape": e["shape"], "dtype": "bfloat16",
                 "stored_bytes": 0}
    assert art2.nbytes() - art.nbytes() < 1024  # a manifest line, not a second matrix
    assert verify_artifact(art2_dir, Checkpoint(both[base]).fingerprint())["ok"]
    sd = reconstruct_state_dict(art2, Checkpoint(both[base]))
    assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])


def test_scaled_and_position_embeddings_follow_the_row_rule(tmp_path):
    """Gemma's scaled embedding and OPT's learned positions are nn.Embedding subclasses: same rule."""
    for arch, names in (
        ("gemma", ["model.embed_tokens.weight"]),
        ("opt", ["model.decoder.embed_tokens.weight", "model.decoder.embed_positions.weight"]),
    ):
        base, ft = make_pair(tmp_path / arch, arch, dtype=torch.bfloat16)
        calib = calib_file(tmp_path / arch)
        compress_delta(base, ft, str(calib), tmp_path / arch / "art", CompressConfig(**CFG))
        art = Artifact(tmp_path / arch / "art")
        for n in names:
            assert art.tensors[n]["kind"] == "rows", (arch, n, art.tensors[n]["kind"])
        ids = torch.randint(4, 51, (2, 32), generator=torch.Generator().manual_seed(1))
        lf = _logits(AutoModelForCausalLM.from_pretrained(ft).eval(), ids)
        lb = _logits(AutoModelForCausalLM.from_pretrained(base).eval(), ids)
        lc = _logits(load_merged_model(art, Checkpoint(base)), ids)
        assert _rel(lc, lf) < 0.5 * _rel(lb, lf), arch


def test_a_v1_artifact_still_merges(tmp_path):
    """tests/fixtures/v1 was written by deltazip at format version 1 (commit e436d4c)."""
    art = Artifact(FIXTURE / "art-deltazip")
    assert art.manifest["format_version"] == 1
    expected = json.loads((FIXTURE / "art-deltazip.expected.json").read_text())
    assert {n: e["kind"] for n, e in art.tensors.items()} == expected["kinds"]
    base = Checkpoint(FIXTURE / "base")
    sd = reconstruct_state_dict(art, base)
    got = {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in sd.items()}
    assert got == expected["sha256"]
    assert verify_artifact(art.path, base.fingerprint())["ok"]
    out = merge_to_dir(art, base, tmp_path / "merged")
    m = AutoModelForCausalLM.from_pretrained(out).eval()
    for n, t in sd.items():
        assert torch.equal(m.state_dict()[n], t), n

