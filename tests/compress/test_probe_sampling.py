"""The probe's gain runs take a calibration batch cut to its leading sequences."""

import torch

from deltazip.compress.sensitivity import _leading


def test_leading_cuts_batch_major_tensors_only():
    B, T, D = 8, 16, 4
    h, y0 = torch.randn(B, T, D), torch.randn(B, T, D)
    kw = {"position_embeddings": (torch.randn(B, T, 2), torch.randn(1, T, 2)), "attention_mask": torch.ones(B, 1, T, T),
          "cache_position": torch.arange(T), "position_ids": [torch.arange(T).expand(B, T)], "use_cache": False}
    (h2, kw2), y2 = _leading((h, kw), y0, 2)
    assert torch.equal(h2, h[:2]) and torch.equal(y2, y0[:2])
    cos, sin = kw2["position_embeddings"]
    assert cos.shape == (2, T, 2) and sin.shape == (1, T, 2)  # a broadcast [1, T, ...] stays whole
    assert kw2["attention_mask"].shape == (2, 1, T, T) and torch.equal(kw2["cache_position"], torch.arange(T))
    assert kw2["position_ids"][0].shape == (2, T) and kw2["use_cache"] is False


def test_leading_leaves_small_or_ambiguous_batches_alone():
    for B, T in ((2, 16), (1, 16), (8, 8)):  # B <= n, or T == B: a [T, ...] tensor looks batch-major
        batch, y0 = (torch.randn(B, T, 4), {"m": torch.ones(B, T)}), torch.randn(B, T, 4)
        got, y = _leading(batch, y0, 2)
        assert got is batch and y is y0
