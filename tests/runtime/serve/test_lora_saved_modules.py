"""LoRA adapters beyond additive factors: ``modules_to_save`` (a fine-tune's own ``lm_head`` and
``embed_tokens`` beside the LoRA factors, as chat fine-tunes that teach new special tokens save them),
whose whole tensors replace the base's for the adapter's rows, tied embeddings included; and DoRA,
whose linears are served as their whole merged weights. In delta mode beside base rows and in swap
mode, as PEFT computes."""

from __future__ import annotations

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


def _logits(tmp_path, tied: bool, saved: list[str], **config):
    """A tiny Llama (``tied`` embeddings), an adapter on ``q_proj`` saving ``saved``; PEFT's logits with
    and without it, and the served model's for a batch of an adapter row and a base row."""
    with single_thread():
        base = save_model(tiny_model("llama", tie_word_embeddings=tied), tmp_path / "base")
        pm = lora_adapter(load_causal_lm(base, torch.float32), tmp_path / "arts" / "lora", 3,
                          target_modules=["q_proj"], modules_to_save=saved, **config)
        (v,) = discover_variants(tmp_path / "arts")
        ids = torch.randint(4, 51, (2, 24), generator=torch.Generator().manual_seed(0))
        want, plain = peft_logits(pm, ids)
        got = adapter_rows(Checkpoint(base), v, ids)
    return Checkpoint(base), v, ids, want, plain, got


@pytest.mark.parametrize("tied,saved,config,swap", [
    (False, ["lm_head", "embed_tokens"], {}, True),
    (True, ["embed_tokens"], {}, False),  # PEFT trains a copy: the tied lm_head stays the base's
    (True, ["embed_tokens"], {"ensure_weight_tying": True}, True),  # the copy is saved as lm_head too
    (True, ["lm_head", "embed_tokens"], {}, False),  # two copies trained apart
], ids=["untied-both", "tied-embed", "tied-embed-ensure-tying", "tied-both"])
def test_saved_modules_replace_the_bases_for_the_adapters_rows(tmp_path, tied, saved, config, swap):
    """Delta mode gives PEFT's logits for the adapter's row and the base's for a base row, whatever
    PEFT did with tied embeddings; swap mode merges the same, but where PEFT left weights tied to a
    saved copy apart from it, which a swapped-in model would tie again: that is refused in one line."""
    ck, v, ids, want, plain, got = _logits(tmp_path, tied, saved, **config)
    assert (want - plain).abs().max() > 0.05  # the adapter matters
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], plain[1], rtol=1e-5, atol=1e-5)
    cpu = torch.device("cpu")
    if not swap:
        with pytest.raises(InputError, match=r"saves (model\.embed_tokens|lm_head)\.weight apart from the "
                                             r"weights this base ties to it \(modules_to_save\); serve it with "
                                             r"--mode delta") as e:
            SwapModels(ck, [v], num_slots=1, device=cpu, dtype=torch.float32, base_name="base")
        assert "\n" not in str(e.value)
        return
    with single_thread():
        torch.testing.assert_close(swap_logits(ck, v, ids), want, rtol=1e-5, atol=1e-5)


def test_dora_linears_serve_as_their_merged_weights(tmp_path):
    """A DoRA adapter (``use_dora``: each output row of ``W + scale · B A`` rescaled to a learned
    magnitude) on ``q_proj`` and ``down_proj``, its magnitudes moved off their initial norms: the
    adapter's row gives PEFT's logits and the base row the base's; swap mode merges the same (two
    tensor-parallel ranks: tests/runtime/cluster/test_tensor_parallel_families.py)."""
    from safetensors.torch import load_file, save_file

    with single_thread():
        base = save_model(tiny_model("llama"), tmp_path / "base")
        out = tmp_path / "arts" / "lora"
        lora_adapter(load_causal_lm(base, torch.float32), out, 4, target_modules=["q_proj", "down_proj"],
                     use_dora=True)
        tensors = load_file(out / "adapter_model.safetensors")  # (PEFT starts m at the norms: move it)
        g = torch.Generator().manual_seed(0)
        save_file({k: t * (1 + 0.3 * torch.rand(t.shape, generator=g)) if k.endswith("magnitude_vector") else t
                   for k, t in tensors.items()}, str(out / "adapter_model.safetensors"))
        from peft import PeftModel

        pm = PeftModel.from_pretrained(load_causal_lm(base, torch.float32), out).eval()
        (v,) = discover_variants(tmp_path / "arts")
        ids = torch.randint(4, 51, (2, 24), generator=torch.Generator().manual_seed(0))
        want, plain = peft_logits(pm, ids)
        assert (want - plain).abs().max() > 0.05
        ck = Checkpoint(base)
        got = adapter_rows(ck, v, ids)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], plain[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(swap_logits(ck, v, ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [dict(bias="lora_only"), dict(bias="all"), dict(lora_bias=True),
                                    dict(bias="all", lora_bias=True)],
                         ids=["bias-lora-only", "bias-all", "lora-bias", "both"])
def test_trained_biases_serve_as_peft_computes(tmp_path, config):
    """Qwen2's q/k/v biases trained with the adapter (``bias``: the adapted linears' own, or every
    bias, saved whole) or a bias on ``lora_B`` (``lora_bias``: ``scale · b`` added to the linear's),
    or both: the adapter's row gives PEFT's logits, the base row the base's, and swap mode the same."""
    with single_thread():
        base = save_model(tiny_model("qwen2"), tmp_path / "base")
        pm = lora_adapter(load_causal_lm(base, torch.float32), tmp_path / "arts" / "lora", 5,
                          target_modules=["q_proj", "v_proj"], **config)
        (v,) = discover_variants(tmp_path / "arts")
        ids = torch.randint(4, 51, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():  # (PEFT trains the base's own biases in place: the base is read again)
            want = pm(input_ids=ids).logits
            plain = load_causal_lm(base, torch.float32)(input_ids=ids).logits
        ck = Checkpoint(base)
        got = adapter_rows(ck, v, ids)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], plain[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(swap_logits(ck, v, ids), want, rtol=1e-5, atol=1e-5)
    assert (want - plain).abs().max() > 0.05


def test_a_lora_bias_on_a_linear_without_one_is_refused_in_one_line(tmp_path):
    """Llama's projections have no bias: a ``lora_bias`` adapter would give them one, which a base row
    does not have: refused in one line, naming the module."""
    with single_thread():
        base = save_model(tiny_model("llama"), tmp_path / "base")
        lora_adapter(load_causal_lm(base, torch.float32), tmp_path / "arts" / "lora", 5,
                     target_modules=["q_proj"], lora_bias=True)
        (v,) = discover_variants(tmp_path / "arts")
        with pytest.raises(InputError, match=r"model\.layers\.0\.self_attn\.q_proj has a LoRA bias \(lora_bias\) "
                                             r"\[64\], but the base linear has no bias of that size") as e:
            DeltaModel(Checkpoint(base), [v], num_slots=2, device=torch.device("cpu"), dtype=torch.float32)
    assert "\n" not in str(e.value)
