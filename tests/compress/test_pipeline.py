"""ΔCompress end to end on tiny models of several architectures."""

import json

import pytest
import torch
from _factories import calib_file, make_pair
from transformers import AutoModelForCausalLM, AutoTokenizer

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import load_merged_model, merge_to_dir, reconstruct_state_dict
from deltazip.compress.pipeline import compress_delta
from deltazip.formats.artifact import Artifact
from deltazip.kernels.reference import delta_weight, unpack_int32
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint

CFG = dict(scheme=DeltaScheme(group_size=32), nsamples=16, seqlen=48, batch_size=4)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _assert_closer_than_base(base, ft, art_dir) -> None:
    """The merged artifact's logits are closer to the fine-tune's than the base's are (half the distance)."""
    ids = torch.randint(4, 51, (2, 32), generator=torch.Generator().manual_seed(1))
    lb = _logits(AutoModelForCausalLM.from_pretrained(base).eval(), ids)
    lf = _logits(AutoModelForCausalLM.from_pretrained(ft).eval(), ids)
    lc = _logits(load_merged_model(Artifact(art_dir), Checkpoint(base)), ids)
    assert (lc - lf).norm() < 0.5 * (lb - lf).norm()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama")
    base, ft = make_pair(tmp)
    calib = calib_file(tmp)
    art = tmp / "art"
    compress_delta(base, ft, str(calib), art, CompressConfig(**CFG))
    return tmp, base, ft, calib, art


def test_artifact_invariants(llama):
    _, base, ft, _, art_dir = llama
    art = Artifact(art_dir)
    packed = [n for n, e in art.tensors.items() if e["kind"] == "packed"]
    assert len(packed) == 15  # 7 linears x 2 layers + the untied lm_head
    ckpt = Checkpoint(ft)
    assert set(art.tensors) == set(ckpt.names), "every tensor recorded, none dropped"
    for n in packed:
        d = art.packed(n)
        dense = delta_weight(d)
        nz = (dense.reshape(d.out_features, -1, 4) != 0).sum(-1)
        assert int(nz.max()) <= 2, f"{n} breaks 2:4"
        pos = unpack_int32(d.positions, 2, d.kept_per_row).reshape(d.out_features, -1, 2)
        assert bool((pos[..., 0] < pos[..., 1]).all())
        codes = unpack_int32(d.qweight, 4, d.kept_per_row)
        assert int(codes.max()) < 16
        assert d.qweight.numel() * 4 == d.out_features * d.in_features // 2 // 8 * 4  # only kept values stored
    kinds = {e["kind"] for e in art.tensors.values()}
    assert "same" in kinds  # norms were not perturbed: bit-identical, nothing stored


def test_compressed_is_closer_to_finetune_than_base(llama):
    _, base, ft, _, art_dir = llama
    ids = torch.randint(4, 51, (4, 40), generator=torch.Generator().manual_seed(5))
    m_base = AutoModelForCausalLM.from_pretrained(base).eval()
    m_ft = AutoModelForCausalLM.from_pretrained(ft).eval()
    m_c = load_merged_model(Artifact(art_dir), Checkpoint(base))
    lb, lf, lc = _logits(m_base, ids), _logits(m_ft, ids), _logits(m_c, ids)
    assert (lc - lf).norm() < 0.5 * (lb - lf).norm()


def test_merge_loads_in_transformers_and_matches_reconstruction(llama):
    tmp, base, ft, _, art_dir = llama
    art = Artifact(art_dir)
    out = merge_to_dir(art, Checkpoint(base), tmp / "merged")
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    sd = reconstruct_state_dict(art, Checkpoint(base))
    msd = merged.state_dict()
    for n, t in sd.items():
        assert torch.equal(msd[n], t), n
    assert not list(tmp.glob(".merged.tmp-*"))


def test_rtn_is_worse_than_deltazip(llama):
    tmp, base, ft, calib, art_dir = llama
    rtn = tmp / "rtn"
    compress_delta(base, ft, None, rtn, CompressConfig(**{**CFG, "method": "rtn"}))
    # Held-out text from the calibration distribution: the solver fits that distribution.
    tok = AutoTokenizer.from_pretrained(ft)
    texts = [json.loads(x)["text"] for x in calib_file(tmp / "heldout", n=8, seed=99).read_text().splitlines()]
    ids = tok(texts, return_tensors="pt", padding=True)["input_ids"]
    lf = _logits(AutoModelForCausalLM.from_pretrained(ft).eval(), ids)
    err = {}
    assert ids.shape[0] == 8
    for name, d in (("deltazip", art_dir), ("rtn", rtn)):
        err[name] = float((_logits(load_merged_model(Artifact(d), Checkpoint(base)), ids) - lf).norm())
    assert err["deltazip"] < err["rtn"], err


def test_sparsegpt_stores_full_weights(llama):
    tmp, base, ft, calib, _ = llama
    out = tmp / "sgpt"
    compress_delta(base, ft, str(calib), out, CompressConfig(**{**CFG, "method": "sparsegpt"}))
    art = Artifact(out)
    e = next(e for e in art.tensors.values() if e["kind"] == "packed")
    assert e["additive"] is False
    n = next(n for n, e in art.tensors.items() if e["kind"] == "packed")
    w = art.reconstruct(n, None)
    assert float((w - Checkpoint(ft).get(n)).norm() / Checkpoint(ft).get(n).norm()) < 0.6


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gpt_neox", "gemma"])
def test_other_architectures(tmp_path, arch):
    base, ft = make_pair(tmp_path, arch)
    calib = calib_file(tmp_path)
    art = tmp_path / "art"
    s = compress_delta(base, ft, str(calib), art, CompressConfig(**CFG))
    assert s["linear_ratio"] > 5
    assert len(s["layers"]) == 2 and all(L["rel_out_err"] < 0.05 for L in s["layers"])
    _assert_closer_than_base(base, ft, art)


def test_bf16_stays_bf16(tmp_path):
    base, ft = make_pair(tmp_path, "llama", dtype=torch.bfloat16)
    calib = calib_file(tmp_path)
    art_dir = tmp_path / "art"
    compress_delta(base, ft, str(calib), art_dir, CompressConfig(**CFG))
    art = Artifact(art_dir)
    assert {e["dtype"] for e in art.tensors.values()} == {"bfloat16"}
    sd = reconstruct_state_dict(art, Checkpoint(base))
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    # Non-linear tensors of a bf16 fine-tune come back bit-exact, embeddings within their row bound.
    ftc = Checkpoint(ft)
    assert art.tensors["model.embed_tokens.weight"]["kind"] == "rows"
    for n, e in art.tensors.items():
        if e["kind"] not in ("packed", "rows"):
            assert torch.equal(sd[n].view(torch.int16), ftc.get(n).view(torch.int16)), n


def test_reconstructed_calibration_beats_base_activations(tmp_path):
    """Paper §4.2: calibrating on the reconstructed fine-tuned model's activations beats calibrating
    on the base model's own activations when the fine-tune moves activations (larger delta)."""
    base, ft = make_pair(tmp_path, scale=0.3, num_hidden_layers=4)
    calib = calib_file(tmp_path)
    tok = AutoTokenizer.from_pretrained(ft)
    texts = [json.loads(x)["text"] for x in calib_file(tmp_path / "heldout", n=16, seed=7).read_text().splitlines()]
    ids = tok(texts, return_tensors="pt", padding=True)["input_ids"]
    lf = _logits(AutoModelForCausalLM.from_pretrained(ft).eval(), ids)
    err = {}
    for act in ("reconstructed", "base"):
        out = tmp_path / act
        compress_delta(base, ft, str(calib), out, CompressConfig(scheme=DeltaScheme(group_size=32),
                                                                 nsamples=32, seqlen=48,
                                                                 calib_activations=act))
        lc = _logits(load_merged_model(Artifact(out), Checkpoint(base)), ids)
        err[act] = float((lc - lf).norm() / lf.norm())
    assert err["reconstructed"] < 0.9 * err["base"], err


@pytest.mark.parametrize("arch,layers,head", [("exaone", "transformer.h", "lm_head.weight"),
                                              ("nemotron_h", "backbone.layers", "lm_head.weight"),
                                              ("gpt_neox", "gpt_neox.layers", "embed_out.weight")])
def test_checkpoint_names_transformers_renames_on_load(tmp_path, arch, layers, head):
    """EXAONE 3 (``transformer.h.0.attn.attention.q_proj``), Nemotron-H (``backbone.``) and GPT-NeoX's
    output head (``embed_out``) load under other module names: every layer's linears and the untied
    head are compressed under their checkpoint names, the embeddings and norms reach the calibration
    forward, and the merged model is closer to the fine-tune than the base."""
    base, ft = make_pair(tmp_path, arch)
    art_dir = tmp_path / "art"
    s = compress_delta(base, ft, str(calib_file(tmp_path)), art_dir, CompressConfig(**CFG))
    art = Artifact(art_dir)
    assert set(art.tensors) == set(Checkpoint(ft).names)
    assert art.lineage["layers_path"] == layers
    assert art.tensors[head]["kind"] == "packed"
    depth = len(layers.split("."))
    packed_layers = {n.split(".")[depth] for n, e in art.tensors.items()
                     if e["kind"] == "packed" and n.startswith(layers + ".")}
    assert packed_layers == {str(i) for i in range(len(s["layers"]))}
    assert all(L["rel_out_err"] < 0.05 for L in s["layers"])
    _assert_closer_than_base(base, ft, art_dir)


@pytest.mark.parametrize("arch", ["bamba", "jamba"])
def test_models_that_unpack_layer_outputs_or_mix_layer_classes(tmp_path, arch):
    """Bamba's model unpacks ``hidden_states, attn_weights = layer(...)`` (the stand-ins for its layers
    during calibration hand back a pair); Jamba's layer list holds Mamba and attention layers of two
    classes. Both compress every layer with calibration, and the merged model is closer to the fine-tune."""
    base, ft = make_pair(tmp_path, arch, **({"mamba_dt_rank": 32} if arch == "jamba" else {}))  # dt_proj in 32
    art_dir = tmp_path / "art"
    s = compress_delta(base, ft, str(calib_file(tmp_path)), art_dir, CompressConfig(**CFG))
    assert len(s["layers"]) == 2 and all(0 < L["rel_out_err"] < 0.05 for L in s["layers"])
    _assert_closer_than_base(base, ft, art_dir)


def test_weights_tied_across_layers_are_compressed_once_and_run_as_reconstructed(tmp_path, monkeypatch):
    """Zamba2's hybrid layers 1 and 3 share one transformer block, stored under layer 1: it is
    compressed once, on layer 1's inputs, and layer 3's calibration runs its reconstruction (what the
    merged model holds) beside layer 3's own Mamba mixer. Every checkpoint tensor is in the artifact
    once, and the merged model is closer to the fine-tune than the base."""
    import deltazip.compress.pipeline as pipeline

    base, ft = make_pair(tmp_path, "zamba2")
    put = {}
    real = pipeline.set_param

    def spy(module, name, value, device="cpu"):  # what goes into layer 3's shared block
        if value is not None and "shared_transformer" in name and module.mamba_decoder.mamba.layer_idx == 3:
            put[name] = value.detach().clone()
        return real(module, name, value, device)

    monkeypatch.setattr(pipeline, "set_param", spy)
    art_dir = tmp_path / "art"
    s = compress_delta(base, ft, str(calib_file(tmp_path)), art_dir, CompressConfig(**CFG))
    art = Artifact(art_dir)
    assert set(art.tensors) == set(Checkpoint(ft).names)
    layers = art.manifest["layers"]
    shared = {n for n in layers[1]["tensors"] if ".shared_transformer." in n}
    assert "model.layers.1.shared_transformer.self_attn.q_proj.weight" in shared and len(shared) >= 6
    assert not any(".shared_transformer." in n for n in layers[3]["tensors"])
    assert all(L["rel_out_err"] < 0.05 for L in s["layers"])
    merged = load_merged_model(art, Checkpoint(base))
    want = dict(merged.model.layers[1].named_parameters())
    assert "shared_transformer.self_attn.q_proj.weight" in put and set(put) <= set(want)
    for name, value in put.items():
        assert torch.allclose(value, want[name].float(), atol=1e-6), name
    _assert_closer_than_base(base, ft, art_dir)


def test_a_weight_tied_to_a_later_layer_is_refused_in_one_line(monkeypatch):
    """A layer that runs a later layer's weight cannot be calibrated in layer order: refused, naming it."""
    from _factories import tiny_model

    from deltazip.compress.pipeline import _tied_across_layers
    from deltazip.formats.errors import InputError

    model = tiny_model("zamba2")
    ties = {s: t for t, s in model.get_expanded_tied_weights_keys(all_submodels=True).items() if "layers" in t}
    monkeypatch.setattr(model, "get_expanded_tied_weights_keys", lambda all_submodels=True: ties)
    with pytest.raises(InputError, match=r"layer 1 of Zamba2ForCausalLM runs model\.layers\.3\.shared_transformer\.") as e:
        _tied_across_layers(model, "model.layers")
    assert "\n" not in str(e.value)


def test_a_checkpoint_mostly_stored_exactly_is_warned_about(tmp_path):
    """DBRX keeps its experts as flat ``[E·F, H]`` matrices that deltazip does not recognise: they are
    stored exactly, most of the model, and compress says so up front. A Llama pair gets no such line."""
    import warnings

    from deltazip.formats.errors import DeltazipWarning

    cfg = CompressConfig(**{**CFG, "method": "rtn"})
    base, ft = make_pair(tmp_path, "dbrx")
    with pytest.warns(DeltazipWarning, match=r"^[0-9]+% of the fine-tune's matrix bytes are in tensors deltazip does "
                                             r"not compress \(e\.g\. transformer\.blocks\.[01]\.ffn\.experts\.mlp\."):
        compress_delta(base, ft, None, tmp_path / "dbrx-art", cfg)
    base, ft = make_pair(tmp_path, "llama")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compress_delta(base, ft, None, tmp_path / "llama-art", cfg)
    assert not [w for w in seen if "matrix bytes" in str(w.message)]


@pytest.mark.parametrize("target_ratio", [0.0, 6.0])
def test_a_layer_the_text_forward_skips_is_rounded_to_nearest(tmp_path, target_ratio):
    """Mllama's cross-attention layer runs only with an image: a text calibration forward never reaches
    it. Its changed linears are stored rounded to nearest (and scored without an output error by the
    probe of --target-ratio), the layers around it calibrated; the language model's layers are found
    under it, not the vision tower's."""
    from deltazip.models.loader import load_causal_lm

    base, ft = make_pair(tmp_path, "mllama", skip=("norm", "vision", "multi_modal"))
    art = tmp_path / "art"
    compress_delta(base, ft, str(calib_file(tmp_path)), art, CompressConfig(**CFG, target_ratio=target_ratio))
    layers = Artifact(art).manifest["layers"]
    assert [L["index"] for L in layers] == [0, 1, 2]
    assert "calibration" not in layers[0] and "calibration" not in layers[2]
    assert layers[1]["calibration"].startswith("rtn")
    cross = [n for n in layers[1]["tensors"] if "cross_attn." in n and n.endswith("_proj.weight")]
    assert len(cross) == 4
    merged = reconstruct_state_dict(Artifact(art), Checkpoint(base))
    fb, ff = Checkpoint(base), Checkpoint(ft)
    for n in cross:  # the delta kept at 4-bit 2:4 (half its values pruned), not dropped (error 1)
        d = ff.get(n).float() - fb.get(n).float()
        err = (merged[n].float() - ff.get(n).float()).norm() / d.norm()
        assert float(err) < 0.6, (n, float(err))
    assert load_causal_lm(base, torch.float32) is not None
