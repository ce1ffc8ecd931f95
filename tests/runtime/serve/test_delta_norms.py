"""Decoupled norms reproduce each model's own norm formula bit for bit, in bf16 too."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
from transformers.models.helium.modeling_helium import HeliumRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from deltazip.runtime.serve.delta_linear import DeltaContext
from deltazip.runtime.serve.delta_norms import DeltaRMSNorm, rms_norm_style

# the norm class, and the style it computes in bf16 (fp32 inputs cannot tell "llama" from "fp32")
NORMS = [(LlamaRMSNorm, "llama"), (Olmo2RMSNorm, "fp32"), (GptOssRMSNorm, "fp32"), (Gemma4RMSNorm, "fp32"),
         (HeliumRMSNorm, "fp32"), (NemotronHRMSNorm, "fp32")]


@pytest.mark.parametrize("cls,style", NORMS, ids=[c.__name__ for c, _ in NORMS])
def test_bf16_rows_equal_the_model_norm_with_their_variant_weight(cls, style):
    """A base norm of ones (a fresh model's), two variants with weights of their own: each row equals
    the model's norm class holding that row's weight, bit for bit in bf16."""
    base = cls(64).to(torch.bfloat16)  # weight of ones: every style agrees on it, so the probe must not use it
    assert rms_norm_style(base) == style
    assert torch.equal(base.weight, torch.ones(64, dtype=torch.bfloat16))  # the probe left the module as it was
    ctx = DeltaContext(num_slots=2)
    norm = DeltaRMSNorm(base, ctx)
    g = torch.Generator().manual_seed(0)
    weights = [(1 + 0.3 * torch.randn(64, generator=g)).to(torch.bfloat16) for _ in range(2)]
    for slot, w in enumerate(weights):
        norm.load_slot(slot, w)
    x = torch.randn(3, 5, 64, generator=g).to(torch.bfloat16)
    ctx.bind([0, -1, 1], "cpu")
    with torch.no_grad():
        got = norm(x)
        for row, w in ((0, weights[0]), (1, None), (2, weights[1])):
            ref = cls(64).to(torch.bfloat16)
            if w is not None:
                ref.weight.copy_(w)
            want = ref(x[row:row + 1])[0]
            assert torch.equal(got[row], want), f"row {row}: max diff {(got[row].float() - want.float()).abs().max()}"
    ctx.unbind()


def test_the_two_scale_forms_differ_in_bf16():
    """What the fp32 style exists for: the Llama form (cast, then scale in bf16) rounds twice and
    gives other values than OLMo 2's (scale in fp32, cast once) for a weight not of ones."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    w = (1 + 0.3 * torch.randn(64, generator=g)).to(torch.bfloat16)
    llama, olmo = LlamaRMSNorm(64).to(torch.bfloat16), Olmo2RMSNorm(64).to(torch.bfloat16)
    with torch.no_grad():
        llama.weight.copy_(w)
        olmo.weight.copy_(w)
        assert not torch.equal(llama(x), olmo(x))


def test_a_norm_with_a_bias_or_no_weight_is_not_decoupled():
    class Biased(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))
            self.bias = torch.nn.Parameter(torch.zeros(8))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return LlamaRMSNorm.forward(self, x) + self.bias

    assert rms_norm_style(Biased()) is None
    assert rms_norm_style(Gemma4RMSNorm(8, with_scale=False)) is None
    with pytest.raises(ValueError, match="not an RMSNorm"):
        DeltaRMSNorm(Biased(), DeltaContext(num_slots=1))
