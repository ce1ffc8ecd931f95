"""Sites of a layer (linears, Conv1D, fused experts, routers), their true-sequential groups, and the
per-expert tap."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from deltazip.compress.experts import collect_hessians
from deltazip.models.expert_tap import ExpertTap
from deltazip.models.model_walk import layer_sites, sequential_groups


class _Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _Toy(nn.Module):
    """A Conv1D, an nn.Linear router over 3 per-expert modules; ``forward(x, experts)`` runs the
    listed experts only."""

    def __init__(self):
        super().__init__()
        self.proj = Conv1D(8, 8)  # nf=8 outputs, nx=8 inputs: weight [in, out]
        self.gate = nn.Linear(8, 3, bias=False)
        self.experts = nn.ModuleList(_Expert() for _ in range(3))

    def forward(self, x, experts):
        h = self.proj(x)
        self.gate(h)
        return sum(self.experts[e](h) for e in experts)


def test_sites_skip_the_router_and_know_conv1d():
    sites = layer_sites(_Toy())
    assert "gate" not in sites  # out_features == E of the sibling experts: the router, stored exactly
    assert sites["proj"].kind == "conv1d" and sites["experts.0.up"].kind == "linear"


def test_groups_follow_later_batches_for_experts_the_first_one_missed():
    toy = _Toy()
    x = torch.randn(5, 8)
    groups = sequential_groups(toy, [lambda: toy(x, [0]), lambda: toy(x, [1]), lambda: toy(x, [0])])
    assert groups == [["proj"], ["experts.0.up"], ["experts.0.down"], ["experts.1.up"], ["experts.1.down"],
                      ["experts.2.down", "experts.2.up"]]  # expert 2 never ran: last, on its own


class _Fused(nn.Module):
    """transformers 5 style fused experts: F.linear on param[e] for the tokens routed to e."""

    def __init__(self, E=4):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 6, 8))
        self.down_proj = nn.Parameter(torch.randn(E, 8, 3))

    def forward(self, x, route):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok = (route == e).nonzero().flatten()
            if tok.numel():
                g, u = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
                out[tok] = F.linear(F.silu(g) * u, self.down_proj[e])
        return out


class _FusedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = _Fused()

    def forward(self, x, route):
        return self.experts(x, route)


def test_expert_tap_and_per_expert_hessians():
    layer = _FusedLayer()
    sites = layer_sites(layer)
    assert {k: (s.kind, s.experts) for k, s in sites.items()} == {
        "experts.gate_up_proj": ("experts", 4), "experts.down_proj": ("experts", 4)}
    x = torch.randn(10, 8)
    route = torch.tensor([0, 0, 1, 2, 0, 1, 1, 2, 0, 0])  # expert 3 gets nothing
    calls = []
    with ExpertTap({k: layer.get_parameter(s.param) for k, s in sites.items()}, lambda k, e, t: calls.append((k, e))):
        layer(x, route)
    assert calls == [("experts.gate_up_proj", 0), ("experts.down_proj", 0), ("experts.gate_up_proj", 1),
                     ("experts.down_proj", 1), ("experts.gate_up_proj", 2), ("experts.down_proj", 2)]
    assert sequential_groups(layer, lambda: layer(x, route), sites) == [["experts.gate_up_proj"],
                                                                       ["experts.down_proj"]]
    hs = collect_hessians(layer, sites, ["experts.gate_up_proj"], lambda: layer(x, route))
    for e in range(3):
        H, n = hs.get("experts.gate_up_proj", e)
        xe = x[route == e]
        assert n == xe.shape[0]
        torch.testing.assert_close(H, 2 * xe.t() @ xe / n)  # only the tokens routed to e
    assert hs.get("experts.gate_up_proj", 3) == (None, 0)


class _DenseRouted(nn.Module):
    """Llama 4 style experts: ``[E, in, out]`` weights, ``torch.bmm`` over every token of ``x [E * T, in]``,
    whose block ``e`` is each token scaled by its routing weight for ``e`` (0 where not routed)."""

    def __init__(self, E=4):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 8, 6))
        self.down_proj = nn.Parameter(torch.randn(E, 3, 8))

    def forward(self, hidden_states):
        x = hidden_states.view(self.num_experts, -1, 8)
        g, u = torch.bmm(x, self.gate_up_proj).chunk(2, dim=-1)
        return torch.bmm(F.silu(g) * u, self.down_proj).view(-1, 8)


def test_dense_routed_experts_are_transposed_and_tapped_per_routed_token():
    from deltazip.models.model_walk import dense_routed, experts_transposed

    layer = _DenseRouted()
    assert dense_routed(layer) and experts_transposed(layer)
    assert not dense_routed(_Fused()) and not experts_transposed(_Fused())
    sites = layer_sites(nn.ModuleDict({"experts": layer}))
    assert {k: (s.experts, s.transposed) for k, s in sites.items()} == {
        "experts.gate_up_proj": (4, True), "experts.down_proj": (4, True)}
    x = torch.randn(10, 8)
    route = torch.tensor([0, 0, 1, 2, 0, 1, 1, 2, 0, 0])  # expert 3 gets nothing
    weight = torch.rand(10) + 0.5
    routed = torch.zeros(4, 10, 1)
    routed[route, torch.arange(10), 0] = weight
    got = {}
    params = {"gate_up_proj": layer.gate_up_proj, "down_proj": layer.down_proj}
    with ExpertTap(params, lambda k, e, t: got.setdefault((k, e), []).append(t.clone())):
        layer((x * routed).reshape(-1, 8))
    assert sorted(got) == sorted((k, e) for k in params for e in range(3))  # no call for expert 3
    for e in range(3):
        rows = got["gate_up_proj", e]
        assert len(rows) == 1
        torch.testing.assert_close(rows[0], x[route == e] * weight[route == e, None])  # its tokens only, scaled
        assert got["down_proj", e][0].shape == (int((route == e).sum()), 3)


class _RouterModule(nn.Module):
    """Gemma 4 style: a router module holding scales around its one linear."""

    def __init__(self, E=4):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.proj = nn.Linear(8, E, bias=False)


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)  # out == E
        self.down_proj = nn.Linear(4, 8, bias=False)


def test_the_one_linear_of_a_router_module_beside_the_experts_is_the_router():
    layer = nn.Module()
    layer.router, layer.experts, layer.mlp = _RouterModule(), _Fused(), _Mlp()
    sites = layer_sites(layer)
    assert "router.proj" not in sites  # stored exactly
    assert {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"} <= set(sites)  # E outputs by chance: still linears
    lone = nn.Module()
    lone.router, lone.mlp = _RouterModule(), _Mlp()  # no experts beside it: an ordinary linear
    assert "router.proj" in layer_sites(lone)


def test_the_decoder_list_is_the_outer_one_of_the_layer_count_whatever_its_classes():
    """Jamba's list mixes Mamba and attention layers (exactly ``num_hidden_layers`` of them); a list
    inside a layer (LongCat-Flash's two attentions per layer, its config counting two "layers" per
    layer) is never taken for the model's."""
    from types import SimpleNamespace

    from deltazip.models.model_walk import decoder_layers

    class Attn(nn.Module):
        pass

    class Mamba(nn.Module):
        pass

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = nn.ModuleList([Attn(), Attn()])

    hybrid = nn.Module()
    hybrid.layers = nn.ModuleList([Mamba(), Attn(), Mamba()])
    hybrid.extra = nn.ModuleList([Attn(), Attn(), Attn(), Attn()])  # of one class, but not the layer count
    hybrid.config = SimpleNamespace(num_hidden_layers=3)
    assert decoder_layers(hybrid) == ("layers", hybrid.layers)
    nested = nn.Module()
    nested.model = nn.Module()
    nested.model.layers = nn.ModuleList([Layer()])
    nested.config = SimpleNamespace(num_hidden_layers=2)
    assert decoder_layers(nested)[0] == "model.layers"
