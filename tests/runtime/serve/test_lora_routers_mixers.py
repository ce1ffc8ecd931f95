"""LoRA factors on modules that are not plain linears to the forward: a MoE router (Mixtral's
``TopKRouter``, which PEFT's ``all-linear`` wraps by its weight; Phi-3.5-MoE's ``nn.Linear`` router with
a forward of its own, returning routing weights and experts) and a linear a recurrent mixer reads
itself (Mamba's ``dt_proj``: ``self.dt_proj.weight @ ...``). Each is served as its merged weight, the
router's per row through its own forward and the mixer's for its rows, in delta mode beside a base
row and in swap mode, as PEFT's merged model computes."""

from __future__ import annotations

import pytest
import torch
from _factories import lora_adapter, save_model, tiny_model
from _serving import adapter_rows, single_thread, swap_logits

from deltazip.models.checkpoint import Checkpoint
from deltazip.models.loader import load_causal_lm
from deltazip.runtime.serve.model import DeltaModel
from deltazip.runtime.serve.variant_sources import discover_variants

pytest.importorskip("peft")


@pytest.mark.parametrize("arch,targets,kind", [
    ("mixtral", "all-linear", "router"),
    ("phimoe", "all-linear", "router"),
    ("mamba", ["in_proj", "x_proj", "dt_proj"], "mixer"),
], ids=["mixtral-router", "phimoe-own-forward-router", "mamba-dt-proj"])
def test_routers_and_mixer_read_linears_serve_their_merged_weights(tmp_path, arch, targets, kind):
    with single_thread():
        base = save_model(tiny_model(arch), tmp_path / "base")
        pm = lora_adapter(load_causal_lm(base, torch.float32), tmp_path / "arts" / "lora", 6, target_modules=targets)
        (v,) = discover_variants(tmp_path / "arts")
        ids = torch.randint(4, 51, (2, 20), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            want = pm.merge_and_unload()(input_ids=ids).logits
            plain = load_causal_lm(base, torch.float32)(input_ids=ids).logits
        ck = Checkpoint(base)
        got = adapter_rows(ck, v, ids)
        model = DeltaModel(ck, [v], num_slots=2, device=torch.device("cpu"), dtype=torch.float32)
        swapped = swap_logits(ck, v, ids)
    assert (want - plain).abs().max() > 0.05  # the adapter matters
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], plain[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(swapped, want, rtol=1e-4, atol=1e-4)
    kinds = {type(m).__name__ for m in model.modules.values()}
    assert {"router": "DeltaRouter", "mixer": "DeltaMixer"}[kind] in kinds


def test_lora_on_tied_weights_applies_each_modules_term_where_it_runs(tmp_path):
    """Zamba2's shared transformer block runs at two layers with tied weights; PEFT gives each use its
    own LoRA and adds each where that module runs (its merge would add both to the one tensor). Delta
    mode gives PEFT's own logits for the adapter's row; swap mode, whose whole model ties the weights
    again, refuses it in one line."""
    from peft import PeftModel

    from deltazip.formats.errors import InputError
    from deltazip.runtime.serve.model import SwapModels

    with single_thread():
        base = save_model(tiny_model("zamba2"), tmp_path / "base")
        lora_adapter(load_causal_lm(base, torch.float32), tmp_path / "arts" / "lora", 6,
                     target_modules=["q_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"])
        pm = PeftModel.from_pretrained(load_causal_lm(base, torch.float32), tmp_path / "arts" / "lora").eval()
        (v,) = discover_variants(tmp_path / "arts")
        ids = torch.randint(4, 51, (2, 20), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            want = pm(input_ids=ids, use_cache=False).logits
            plain = load_causal_lm(base, torch.float32)(input_ids=ids, use_cache=False).logits
        ck = Checkpoint(base)
        got = adapter_rows(ck, v, ids)
        with pytest.raises(InputError, match=r"it adapts model\.layers\.\d\.shared_transformer\.\S+, "
                                             r"whose weight this base ties to .*serve it with --mode delta") as e:
            SwapModels(ck, [v], num_slots=1, device=torch.device("cpu"), dtype=torch.float32, base_name="base")
    assert (want - plain).abs().max() > 0.05
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], plain[1], rtol=1e-5, atol=1e-5)
    assert "\n" not in str(e.value)
