"""GPT-2 (Conv1D) and mixture-of-experts artifacts: served in swap mode (through merge) and in delta
mode, both with the merged model's logits. Greedy serving of these families:
tests/runtime/serve/test_arch_params.py (GPT-2) and tests/runtime/serve/test_moe_serving.py."""

from __future__ import annotations

import pytest
import torch
from _factories import lora_adapter, make_pair
from _serving import adapter_rows, peft_logits, single_thread, swap_logits

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import load_merged_model
from deltazip.compress.pipeline import compress_delta
from deltazip.formats.artifact import Artifact
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint
from deltazip.models.loader import load_causal_lm
from deltazip.runtime.serve.model import DeltaModel, SwapModels
from deltazip.runtime.serve.variant_sources import discover_variants

CASES = [("gpt2", False), ("mixtral", False), ("mixtral", True)]


@pytest.mark.parametrize("arch,fused", CASES, ids=["gpt2", "mixtral-ckpt", "mixtral-fused"])
def test_served_in_delta_mode_and_in_swap_mode(tmp_path, arch, fused):
    cpu = torch.device("cpu")
    with single_thread():
        base, ft = make_pair(tmp_path, arch, module_names=fused)
        # packed entries, no calibration needed
        cfg = CompressConfig(scheme=DeltaScheme(group_size=32), method="rtn", device="cpu")
        compress_delta(base, ft, None, tmp_path / "arts" / arch, cfg)
        (v,) = discover_variants(tmp_path / "arts")
        ck = Checkpoint(base)
        _delta_mode_equals_merged(ck, v)
        swap = SwapModels(ck, [v], num_slots=1, device=cpu, dtype=torch.float32, base_name="base")
        swap.write_slot(0, v.name, swap.load_host(v.name))
        merged = load_merged_model(Artifact(v.path), ck)
        ids = torch.randint(4, 51, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            got, want = swap.models[0](input_ids=ids).logits, merged(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _delta_mode_equals_merged(ck, v):
    """Delta mode (GPT-2's Conv1D; both MoE checkpoint layouts, per-expert and fused names): the merged logits."""
    model = DeltaModel(ck, [v], num_slots=2, device=torch.device("cpu"), dtype=torch.float32)
    model.write_slot(1, v.name, model.load_host(v.name))
    merged = load_merged_model(Artifact(v.path), ck)
    ids = torch.randint(4, 51, (2, 24), generator=torch.Generator().manual_seed(0))
    model.ctx.bind([1, 1], "cpu")
    try:
        with torch.no_grad():
            got = model.model(input_ids=ids).logits
    finally:
        model.ctx.unbind()
    with torch.no_grad():
        torch.testing.assert_close(got, merged(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_gpt2_lora_adapter_on_conv1d_layers_serves_as_peft_computes(tmp_path):
    """A LoRA adapter on GPT-2's Conv1D layers (weights stored ``[in, out]``; its factors ``A [r, in]``,
    ``B [out, r]`` as for any linear): delta mode adds its term to the adapter's rows beside base rows,
    swap mode merges it into the transposed weights; both give PEFT's logits."""
    with single_thread():
        base, _ = make_pair(tmp_path, "gpt2")
        pm = lora_adapter(load_causal_lm(base, torch.float32), tmp_path / "arts" / "lora",
                          target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
        (v,) = discover_variants(tmp_path / "arts")
        ck = Checkpoint(base)
        ids = torch.randint(4, 51, (2, 24), generator=torch.Generator().manual_seed(0))
        want, plain = peft_logits(pm, ids)
        assert (want - plain).abs().max() > 0.1  # the adapter matters
        got = adapter_rows(ck, v, ids)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], plain[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(swap_logits(ck, v, ids), want, rtol=1e-5, atol=1e-5)
