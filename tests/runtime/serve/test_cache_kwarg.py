"""Issue 25: the engine's forward passes its KV cache under the name the installed transformers takes
(``cache`` from 5.24 on, ``past_key_values`` before), so no forward emits a deprecation warning."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from _factories import tiny_model
from transformers import DynamicCache

from deltazip.runtime.serve.model_runner import cache_kwarg, run_model


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
def test_run_model_is_silent_and_equals_a_plain_forward(arch):
    model = tiny_model(arch).eval()
    params = inspect.signature(type(model).forward).parameters
    assert cache_kwarg(model) == ("cache" if "cache" in params else "past_key_values")
    ids = torch.tensor([[5, 9, 12, 7, 30]])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        want = model(input_ids=ids).logits[:, -1].float()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a FutureWarning (or any other) fails the test
            got = run_model(model, ids, pos, torch.ones_like(ids), DynamicCache(config=model.config))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
