"""PEFT trainable tokens (``trainable_token_indices`` beside LoRA factors, and ``TRAINABLE_TOKENS``
adapters): the adapter's rows of the token table, and of the ``lm_head`` tied to it, replace the base's
for the adapter's rows of a batch, and only those rows are held per slot. In delta mode beside a base
row and in swap mode, as PEFT computes."""

from __future__ import annotations

import json

import pytest
import torch
from _factories import lora_adapter, save_model, tiny_model
from _serving import adapter_rows, peft_logits, single_thread, swap_logits

from deltazip.formats.errors import InputError
from deltazip.models.checkpoint import Checkpoint
from deltazip.models.loader import load_causal_lm
from deltazip.runtime.serve.model import DeltaModel, SwapModels
from deltazip.runtime.serve.variant_sources import discover_variants

pytest.importorskip("peft")

TOKENS = [5, 7, 9, 40]


def _prompt() -> torch.Tensor:
    """Two rows of 24 ids in which every trained token appears."""
    ids = torch.randint(4, 51, (2, 24), generator=torch.Generator().manual_seed(0))
    ids[:, 2:2 + len(TOKENS)] = torch.tensor(TOKENS)
    ids[:, 14:14 + len(TOKENS)] = torch.tensor(TOKENS[::-1])
    return ids


def _tokens_adapter(model, out, seed: int, kind: str, indices):
    """``model`` with a PEFT adapter training token rows ``indices`` (a list, or a dict of module names),
    moved off their initial values: LoRA on ``q_proj`` beside them (``kind`` "lora") or a
    ``TRAINABLE_TOKENS`` adapter; saved to ``out``. The PEFT model, in eval mode."""
    if kind == "lora":
        return lora_adapter(model, out, seed, target_modules=["q_proj"], trainable_token_indices=indices)
    from peft import TrainableTokensConfig, get_peft_model

    pm = get_peft_model(model, TrainableTokensConfig(token_indices=indices))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in pm.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    pm.save_pretrained(out, safe_serialization=True)
    return pm.eval()


def _served(tmp_path, arch: str, tied: bool, kind: str, indices):
    with single_thread():
        base = save_model(tiny_model(arch, tie_word_embeddings=tied), tmp_path / "base")
        pm = _tokens_adapter(load_causal_lm(base, torch.float32), tmp_path / "arts" / "tokens", 3, kind, indices)
        (v,) = discover_variants(tmp_path / "arts")
        ids = _prompt()
        want, plain = peft_logits(pm, ids)
        got = adapter_rows(Checkpoint(base), v, ids)
    return Checkpoint(base), v, ids, want, plain, got


@pytest.mark.parametrize("arch,tied,kind,indices", [
    ("llama", True, "lora", TOKENS),  # the tied lm_head's rows change too
    ("llama", False, "lora", TOKENS),
    ("llama", False, "lora", {"embed_tokens": TOKENS[:2], "lm_head": TOKENS[1:]}),  # each its own rows
    ("llama", True, "tokens", TOKENS),
    ("gemma", True, "lora", TOKENS),  # scaled embeddings: the rows are scaled as the base's are
], ids=["tied", "untied", "untied-head-apart", "tied-trainable-tokens-adapter", "gemma-scaled"])
def test_trained_token_rows_replace_the_bases_for_the_adapters_rows(tmp_path, arch, tied, kind, indices):
    """Delta mode gives PEFT's logits for the adapter's row and the base's for a base row; swap mode
    merges the same rows into a whole model."""
    ck, v, ids, want, plain, got = _served(tmp_path, arch, tied, kind, indices)
    assert (want - plain).abs().max() > 0.05  # the adapter matters
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], plain[1], rtol=1e-5, atol=1e-5)
    with single_thread():
        torch.testing.assert_close(swap_logits(ck, v, ids), want, rtol=1e-5, atol=1e-5)


def test_rows_trained_apart_for_two_tied_weights_serve_in_delta_mode_and_are_refused_by_swap(tmp_path):
    """A tied base whose ``embed_tokens`` and ``lm_head`` got other rows each (PEFT wraps them apart
    when the indices differ): delta mode applies each module's own rows, as PEFT does; one swapped-in
    model ties the two again, so swap mode refuses it in one line."""
    ck, v, ids, want, plain, got = _served(tmp_path, "llama", True, "lora",
                                           {"embed_tokens": TOKENS[:2], "lm_head": TOKENS[1:]})
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], plain[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match=r"trains token rows of (model\.embed_tokens|lm_head) apart from those of "
                                         r"the weights this base ties to it; serve it with --mode delta") as e:
        SwapModels(ck, [v], num_slots=1, device=torch.device("cpu"), dtype=torch.float32, base_name="base")
    assert "\n" not in str(e.value)


def test_a_slot_holds_the_trained_rows_not_a_whole_table(tmp_path):
    """An untied base: the adapter's slot holds its 4 embedding rows and a ``[V]`` id map, not a copy of
    the ``[V, H]`` table; ``lm_head`` is untouched. The variant's estimate is what it holds."""
    with single_thread():
        base = save_model(tiny_model("llama", tie_word_embeddings=False, vocab_size=4096), tmp_path / "base")
        _tokens_adapter(load_causal_lm(base, torch.float32), tmp_path / "arts" / "tokens", 3, "tokens", TOKENS)
        (v,) = discover_variants(tmp_path / "arts")
        model = DeltaModel(Checkpoint(base), [v], num_slots=2, device=torch.device("cpu"), dtype=torch.float32)
        model.write_slot(1, v.name, model.load_host(v.name))
    emb = model.model.model.embed_tokens
    table = emb.weight.numel() * 4
    assert emb.resident_bytes(1) == 4096 * 4 + len(TOKENS) * emb.weight.shape[1] * 4
    assert model.slot_bytes(1) == emb.resident_bytes(1) < table / 10
    assert model.slot_bytes(1) == model.resident_estimate(v.name)
    assert set(model.modules) == {"model.embed_tokens"}


@pytest.mark.parametrize("case,match", [
    ("outside", r"its token indices for model\.embed_tokens must be distinct ids below 51 \(the base's "
                r"vocabulary\), got \[5, 7, 9, 51\]"),
    ("repeated", r"must be distinct ids below 51"),
    ("count", r"trainable_tokens_delta is \[4, 64\], but 3 token indices of rows of 64 fit \[3, 64\]"),
    ("lora-on-head", r"it trains token rows of lm_head and also LoRA factors or a whole copy of it"),
])
def test_token_rows_that_do_not_fit_the_base_are_refused_in_one_line(tmp_path, case, match):
    """Indices outside the vocabulary, repeated, or not as many as the saved rows; and a tied ``lm_head``
    that also has LoRA factors (which PEFT would stack in wrapper order): refused, naming the module."""
    with single_thread():
        base = save_model(tiny_model("llama", tie_word_embeddings=True), tmp_path / "base")
        out = tmp_path / "arts" / "tokens"
        targets = ["q_proj", "lm_head"] if case == "lora-on-head" else ["q_proj"]
        lora_adapter(load_causal_lm(base, torch.float32), out, 3, target_modules=targets,
                     trainable_token_indices=TOKENS)
        cfg = json.loads((out / "adapter_config.json").read_text())
        cfg["trainable_token_indices"] = {"outside": TOKENS[:3] + [51], "repeated": [5, 5, 7, 9],
                                          "count": TOKENS[:3]}.get(case, TOKENS)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
        (v,) = discover_variants(tmp_path / "arts")
        with pytest.raises(InputError, match=match) as e:
            DeltaModel(Checkpoint(base), [v], num_slots=2, device=torch.device("cpu"), dtype=torch.float32)
    assert "\n" not in str(e.value)
