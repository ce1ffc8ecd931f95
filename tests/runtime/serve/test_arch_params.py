"""Families whose fine-tunes change more than linears, served in delta mode: Gemma 1 and Gemma 3
(scaled embeddings, ``1 + w`` norms), GPT-NeoX (checkpoint ``embed_out`` -> module ``lm_head``), OPT
(learned positions with an offset), GPT-2 (Conv1D weights stored ``[in, out]`` and their biases),
Cohere (a LayerNorm with a weight and no bias), Nemotron (a LayerNorm scaling by ``1 + w``), Apertus
(xIELU activations with two learned scalars per layer), Gemma 3n (AltUp's output scale, a parameter
its module multiplies by, reached through ``self.forward``).

Each base is fine-tuned for real (30 Adam steps: every tensor moves), compressed twice (ΔCompress
4-bit calibrated, RTN 4-bit), and served by the engine: every greedy output, alone and in one batch
mixed with the other variant and base rows, equals the merged model's ``generate``.
"""

from __future__ import annotations

import pytest
import torch
from _factories import calib_file, finetune, save_model, tiny_model
from _serving import char_greedy, engine_texts, single_thread

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import load_merged_model
from deltazip.compress.pipeline import compress_delta
from deltazip.formats.artifact import Artifact
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint
from deltazip.runtime.serve.model import DeltaModel
from deltazip.runtime.serve.variant_sources import discover_variants

FAMILIES = ["gemma", "gemma3", "gemma3n", "gpt_neox", "opt", "gpt2", "cohere", "nemotron", "apertus"]
IDS = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)  # the demo's character tokenizer
PROMPTS = ["alpha beta", "zip model tune", "12 + 345 ="]
VARIANTS = {"dz": dict(method="deltazip", bits=4, group_size=32, sparsity="none", seed=5),
            "rtn": dict(method="rtn", bits=4, group_size=32, sparsity="none", seed=6)}


def build_family(root, arch):
    """Base dir and artifacts dir: two fine-tunes of one tiny base, compressed."""
    from deltazip.demo.pair import build_char_tokenizer

    tok = build_char_tokenizer()
    base_dir = save_model(tiny_model(arch, **IDS), root / "base", tokenizer=False)
    tok.save_pretrained(base_dir)
    calib = calib_file(root / "calib", n=16)
    for name, spec in VARIANTS.items():
        ft = finetune(tiny_model(arch, **IDS), steps=30, seed=spec["seed"])
        ft_dir = save_model(ft, root / f"ft-{name}", tokenizer=False)
        tok.save_pretrained(ft_dir)
        cfg = CompressConfig(scheme=DeltaScheme(bits=spec["bits"], group_size=spec["group_size"], sparsity=spec["sparsity"]),
                             method=spec["method"], nsamples=8, seqlen=32, device="cpu",
                             group_auto=arch == "gemma3n")  # AltUp's 2-wide coefficient linears: no group of 32
        compress_delta(base_dir, ft_dir, str(calib), root / "arts" / name, cfg)
    return base_dir, root / "arts", tok


@pytest.mark.parametrize("arch", FAMILIES)
def test_delta_mode_serves_the_merged_greedy_output(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    n = 8
    with single_thread():
        base_dir, arts, tok = build_family(tmp_path, arch)
        variants = discover_variants(arts)
        ck = Checkpoint(base_dir)
        refs = {v.name: load_merged_model(Artifact(v.path), ck) for v in variants}
        refs["base"] = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        want = {(m, i): char_greedy(refs[m], tok, p, n) for m in refs for i, p in enumerate(PROMPTS)}
        assert any(want["dz", i] != want["base", i] for i in range(len(PROMPTS)))  # the fine-tune matters
        dm = DeltaModel(ck, variants, num_slots=2, device=torch.device("cpu"), dtype=torch.float32)
        for m in ("dz", "rtn"):  # alone
            got = engine_texts(dm, tok, [(m, p) for p in PROMPTS], n)
            assert got == [want[m, i] for i in range(len(PROMPTS))], m
        jobs = [(m, i) for i in range(len(PROMPTS)) for m in ("dz", "base", "rtn")]  # mixed rows
        got = engine_texts(dm, tok, [(m, PROMPTS[i]) for m, i in jobs], n)
        assert got == [want[j] for j in jobs]


def test_learned_activation_parameters_are_per_row(tmp_path):
    """Apertus's xIELU alphas move in a fine-tune; in one batch each row's logits equal its own merged
    model's, which the base's alphas would miss by far more than the tolerance."""
    from transformers import AutoModelForCausalLM

    from deltazip.runtime.serve.delta_activation import DeltaActivation
    from deltazip.runtime.serve.model_runner import prefill_logits

    with single_thread():
        base_dir, arts, tok = build_family(tmp_path, "apertus")
        variants = discover_variants(arts)
        ck = Checkpoint(base_dir)
        dm = DeltaModel(ck, variants, num_slots=2, device=torch.device("cpu"), dtype=torch.float32)
        acts = {n: m for n, m in dm.modules.items() if isinstance(m, DeltaActivation)}
        assert sorted(acts) == [f"model.layers.{i}.mlp.act_fn" for i in range(2)]
        slots = {}
        for slot, v in enumerate(variants):
            dm.write_slot(slot, v.name, dm.load_host(v.name))
            slots[v.name] = slot
        ids = tok(PROMPTS[1])["input_ids"]
        rows = ["dz", "base", "rtn"]
        got = prefill_logits(dm, [slots.get(r, -1) for r in rows], [ids] * 3, pad_id=2)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            for i, r in enumerate(rows):
                ref = base if r == "base" else load_merged_model(Artifact(arts / r), ck)
                want = ref(torch.tensor([ids])).logits[0, -1]
                torch.testing.assert_close(got[i], want, atol=1e-4, rtol=1e-4)
                if r != "base":
                    alpha = ref.get_submodule("model.layers.0.mlp.act_fn").alpha_p
                    assert not torch.equal(alpha, base.get_submodule("model.layers.0.mlp.act_fn").alpha_p)
                    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
                    plain.load_state_dict({k: t for k, t in ref.state_dict().items() if "act_fn" not in k}, strict=False)
                    other = plain(torch.tensor([ids])).logits[0, -1]  # the variant with the base's alphas
                    assert (other - want).abs().max() > 100 * 1e-4
