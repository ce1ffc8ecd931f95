"""Checkpoint names -> parameter names by transformers' rules, and the decoupled embedding kept inside
each embedding subclass's own forward (scale, position offset), [1, T] ids broadcast to the batch."""

from __future__ import annotations

import pytest
import torch
from _factories import save_model, tiny_model
from torch import nn

from deltazip.models.checkpoint import Checkpoint
from deltazip.models.param_names import module_names
from deltazip.runtime.serve.delta_embedding import DeltaEmbedding, can_decouple, decouple_embedding
from deltazip.runtime.serve.delta_linear import DeltaContext


def test_checkpoint_names_map_by_transformers_rules(tmp_path):
    neox = tiny_model("gpt_neox", tie_word_embeddings=False)
    ck = Checkpoint(save_model(neox, tmp_path / "neox"))
    assert "embed_out.weight" in ck.names and "lm_head.weight" not in ck.names  # save_pretrained's name
    got = module_names(neox, list(ck.names))
    assert got["embed_out.weight"] == "lm_head.weight"
    assert set(got) == set(ck.names) and all(v in dict(neox.named_parameters()) for v in got.values())
    # per-expert checkpoint tensors that transformers fuses with a converter have no single parameter
    mix = tiny_model("mixtral")
    mck = Checkpoint(save_model(mix, tmp_path / "mix"))
    mapped = module_names(mix, list(mck.names))
    experts = [n for n in mck.names if ".experts." in n]
    assert experts and not any(n in mapped for n in experts)
    assert all(mapped[n] == n for n in mck.names if n in dict(mix.named_parameters()))


class Offset(nn.Embedding):
    """A learned-position table in OPT's manner: looks up ``position + 2``, then scales."""

    def forward(self, positions):
        return super().forward(positions + 2) * 3.0


class OwnGather(nn.Embedding):
    def forward(self, ids):  # never reaches nn.Embedding.forward: its rows cannot be decoupled
        return self.weight[ids]


def test_subclass_forward_semantics_kept_and_shared_ids_broadcast():
    torch.manual_seed(0)
    ctx = DeltaContext(2)
    emb = Offset(12, 4)
    base_w = emb.weight.detach().clone()
    same = decouple_embedding(emb, ctx)
    assert same is emb and isinstance(emb, Offset) and isinstance(emb, DeltaEmbedding)
    own = torch.randn(12, 4)
    emb.load_slot(1, own)
    pos = torch.arange(5).unsqueeze(0)  # [1, T], shared by the 3 rows
    ctx.bind([1, -1, 0], "cpu")
    with torch.no_grad():
        out = emb(pos)
    ctx.unbind()
    assert out.shape == (3, 5, 4)
    assert torch.equal(out[0], own[pos[0] + 2] * 3.0)
    assert torch.equal(out[1], base_w[pos[0] + 2] * 3.0) and torch.equal(out[2], out[1])
    assert not can_decouple(OwnGather(4, 2)) and can_decouple(nn.Embedding(4, 2))
    with pytest.raises(ValueError, match="nn.Embedding.forward"):
        decouple_embedding(OwnGather(4, 2), ctx)
