"""Which parameters are output scales (``forward(x) = x * p``), and their per-row values."""

from __future__ import annotations

import torch
from _factories import tiny_model
from torch import nn

from deltazip.runtime.serve.delta_scale import DeltaScale, output_scale_param


class _Bias(nn.Module):
    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return x + self.b


def test_only_a_forward_that_multiplies_by_the_parameter_is_an_output_scale():
    model = tiny_model("gemma3n", vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    altup = model.model.layers[0].altup
    with torch.no_grad():
        altup.correct_output_scale.normal_()
    assert output_scale_param(altup) == "correct_output_scale"
    assert output_scale_param(model.model.layers[0].input_layernorm) is None  # x·w after a normalization
    assert output_scale_param(model.model.layers[0].self_attn.q_proj) is None  # a matrix
    assert output_scale_param(_Bias()) is None  # x + b


def test_each_row_is_scaled_by_its_slots_value_also_through_self_forward():
    model = tiny_model("gemma3n", vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    altup = model.model.layers[0].altup
    base = torch.randn(64)
    with torch.no_grad():
        altup.correct_output_scale.copy_(base)

    class Ctx:
        num_slots, active = 2, set()
        row_slot = torch.tensor([1, -1, 0])

    ctx = Ctx()
    ds = DeltaScale(altup, "correct_output_scale", ctx)
    v0, v1 = torch.randn(64), torch.randn(64)
    ds.load_slot(0, correct_output_scale=v0)
    ds.load_slot(1, correct_output_scale=v1)
    x = torch.randn(3, 5, 64)
    assert torch.equal(altup.scale_corrected_output(x), x * base)  # no changed variant in the batch
    ctx.active = {0, 1}
    got = altup.scale_corrected_output(x)  # the layer's own call: self.forward
    assert torch.equal(got, torch.stack([x[0] * v1, x[1] * base, x[2] * v0]))
    assert torch.equal(altup(x), got)
    ds.clear_slot(1)
    assert torch.equal(altup(x)[0], x[0] * base)
