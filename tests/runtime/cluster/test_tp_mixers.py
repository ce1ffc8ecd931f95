"""Recurrent mixers split by channels for tensor parallelism (``runtime/cluster/tp_mixers.py``): each
rank's shard of a gated delta net, a Mamba-2 or Mamba-1 mixer or a short convolution gives its part of
the whole mixer's output, and what cannot be split so is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from _factories import tiny_model
from torch import nn

from deltazip.formats.errors import InputError
from deltazip.runtime.cluster.tensor_parallel import COLUMN_PARALLEL, ROW_PARALLEL
from deltazip.runtime.cluster.tp_mixers import shard_mixer_tensors, split_mixer
from deltazip.runtime.cluster.tp_shards import shard_linear


def _mixer(arch: str, **config) -> nn.Module:
    model = tiny_model(arch, **config)
    layer = (model.backbone if hasattr(model, "backbone") else model.model).layers[0]
    for child in ("linear_attn", "conv", "mamba", "mixer", "self_attn"):
        if hasattr(layer, child):
            return getattr(layer, child)
    raise AssertionError(f"no mixer in {arch}'s first layer")


def _shard(mixer: nn.Module, rank: int, world: int):
    """Rank ``rank``'s copy of ``mixer``, its linears cut as ShardedDeltaModel cuts them, and its shard."""
    part = copy.deepcopy(mixer)
    shard = split_mixer(part, "mixer", rank, world)
    for child, mod in list(part.named_modules()):
        if not isinstance(mod, nn.Linear) or child in shard.whole:
            continue
        leaf = child.rpartition(".")[2]
        if child in shard.columns or leaf in COLUMN_PARALLEL:
            shard_linear(mod, "column", rank, world, shard.columns.get(child))
        elif child in shard.rows or leaf in ROW_PARALLEL:
            shard_linear(mod, "row", rank, world)
        else:
            raise AssertionError(f"{child} is cut by no rule")
    return part, shard


def _rank_part(mixer: nn.Module, rank: int, world: int, x: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s shard of ``mixer`` run on ``x``: its partial sum of the output, before the all-reduce."""
    with torch.no_grad():
        return _shard(mixer, rank, world)[0](x)


@pytest.mark.parametrize("arch,config", [
    ("qwen3_5", dict(linear_num_key_heads=4, linear_num_value_heads=8)),
    ("qwen3_next", dict(linear_num_key_heads=4, linear_num_value_heads=8)),
    ("lfm2", {}), ("mamba2", dict(n_groups=4)), ("nemotron_h", dict(n_groups=4)), ("olmo_hybrid", {}),
    ("kimi_linear", {})])
def test_each_ranks_mixer_shard_gives_its_part_of_the_whole_output(arch, config):
    """Qwen3.5's gated delta net (``in_proj_qkv`` cut block by block with the convolution's channels),
    Qwen3-Next's (``in_proj_qkvz``/``in_proj_ba`` grouped per key head: a span is the rank's groups),
    OLMo Hybrid's (separate ``q``/``k``/``v``/``a``/``b`` projections, a per-head output norm),
    Kimi Linear's delta attention (per-channel decay: ``f_b_proj``'s rows and ``dt_bias`` by channels,
    ``A_log [1, 1, heads, 1]`` by heads, the low-rank ``f_a_proj`` and ``g_a_proj`` whole), LFM2's
    short convolution (``B``, ``C``, ``x`` blocks) and Mamba-2 mixers of 4 groups (``z``, ``x``,
    ``B``, ``C``, ``dt`` rows of ``in_proj``, each group's gated norm on the rank holding it): the
    ranks' outputs sum to the whole mixer's over 2 ranks and over 4."""
    mixer = _mixer(arch, **config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in mixer.parameters():  # every tensor away from its initial value (A_log, dt_bias, norm)
            p.add_(torch.randn_like(p) * 0.1)
        x = torch.randn(2, 7, 64)
        whole = mixer(x)
    for world in (2, 4):
        got = sum(_rank_part(mixer, r, world, x) for r in range(world))
        assert torch.allclose(got, whole, atol=1e-5), (world, (got - whole).abs().max())


def test_a_variants_mixer_tensors_are_cut_as_the_base_is():
    """A variant's ``A_log``/``dt_bias`` (value heads), ``conv1d.weight`` (channels of q, k and v) and
    per-head norm (whole), substituted into the rank's shard, give the rank's part of the variant's
    whole mixer."""
    base = _mixer("qwen3_5")
    torch.manual_seed(1)
    tensors = {"A_log": torch.randn(4), "dt_bias": torch.randn(4), "conv1d.weight": torch.randn(128, 1, 4),
               "norm.weight": 1 + torch.randn(16) * 0.1}
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        whole = torch.func.functional_call(base, tensors, (x,))
        got = 0
        for rank in range(2):
            part, shard = _shard(base, rank, 2)
            mine = shard_mixer_tensors(tensors, shard, "mixer")
            assert mine["conv1d.weight"].shape == (64, 1, 4) and mine["A_log"].shape == (2,)
            got = got + torch.func.functional_call(part, mine, (x,))
    assert torch.allclose(got, whole, atol=1e-5)


def test_a_variants_convolution_pieces_land_on_each_ranks_rows():
    """Kimi Linear's checkpoint holds its convolution as three pieces (``q_conv1d``, ``k_conv1d``,
    ``v_conv1d``), which a variant hands the mixer as rows of ``conv1d.weight``: each rank gets its
    channels of each piece at their places in its shard, and with them its part of the variant's
    whole mixer."""
    base = _mixer("kimi_linear")
    torch.manual_seed(2)
    conv = torch.randn(192, 1, 4)
    pieces = {f"conv1d.weight:{r0}:{r0 + 64}": conv[r0:r0 + 64] for r0 in (0, 64, 128)}
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        whole = torch.func.functional_call(base, {"conv1d.weight": conv}, (x,), strict=False)
        got = 0
        for rank in range(2):
            part, shard = _shard(base, rank, 2)
            mine = shard_mixer_tensors(pieces, shard, "mixer")
            assert sorted(mine) == ["conv1d.weight:0:32", "conv1d.weight:32:64", "conv1d.weight:64:96"]
            conv_r = torch.cat([mine[k] for k in sorted(mine, key=lambda k: int(k.split(":")[1]))])
            got = got + torch.func.functional_call(part, {"conv1d.weight": conv_r}, (x,), strict=False)
    assert torch.allclose(got, whole, atol=1e-5), (got - whole).abs().max()


def _mamba1_ranks(mixer: nn.Module, world: int, x: torch.Tensor, tensors: dict | None = None) -> torch.Tensor:
    """The sum of every rank's part of ``mixer`` (Mamba-1) on ``x``, each rank's ``x_proj`` output
    all-reduced as the group would: a first pass records each rank's partial ``x_proj`` output (which
    nothing after it feeds), a second runs every rank with their sum in its place. ``tensors``: a
    variant's own mixer tensors, cut to each rank's channels."""
    ranks = [_shard(mixer, r, world) for r in range(world)]
    partial: list[torch.Tensor] = []

    def run(part, shard):
        mine = shard_mixer_tensors(tensors, shard, "mixer") if tensors else {}
        return torch.func.functional_call(part, mine, (x,), strict=False) if mine else part(x)

    with torch.no_grad():
        for part, shard in ranks:
            h = part.x_proj.register_forward_hook(lambda _m, _i, out: partial.append(out.clone()))
            run(part, shard)
            h.remove()
        total = sum(partial)
        out = 0
        for part, shard in ranks:
            h = part.x_proj.register_forward_hook(lambda _m, _i, _out: total)
            out = out + run(part, shard)
            h.remove()
    return out


@pytest.mark.parametrize("arch", ["mamba", "falcon_mamba", "jamba"])
def test_mamba1_shards_all_reduce_x_proj_and_give_their_part_of_the_output(arch):
    """Mamba-1 mixers (Mamba; Falcon-Mamba, which normalises dt, B and C; Jamba, whose norms of them
    have weights): ``in_proj``'s x and gate rows, the convolution, ``A_log``, ``D`` and ``dt_proj``
    (read by the mixer itself) cut by channels, ``x_proj`` row-parallel; with its output all-reduced,
    the ranks' outputs sum to the whole mixer's over 2 ranks and over 4."""
    mixer = _mixer(arch, **(dict(mamba_dt_rank=16) if arch == "jamba" else {}))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        x = torch.randn(2, 7, 64)
        whole = mixer(x)
    for world in (2, 4):
        part, shard = _shard(mixer, 0, world)
        assert part.x_proj.weight.shape == (48, 128 // world) and part.dt_proj.weight.shape == (128 // world, 16)
        assert part.intermediate_size == 128 // world and shard.rows == ("x_proj",)
        got = _mamba1_ranks(mixer, world, x)
        assert torch.allclose(got, whole, atol=1e-5), (world, (got - whole).abs().max())


def test_a_variants_mamba1_tensors_are_cut_as_the_base_is():
    """A variant's ``A_log``, ``D``, convolution and ``dt_proj`` weight and bias (the mixer's own: it
    reads them itself), and Jamba's norm weights (whole), substituted into each rank's shard, give
    the variant's whole mixer."""
    base = _mixer("jamba", mamba_dt_rank=16)
    torch.manual_seed(1)
    tensors = {"A_log": torch.randn(128, 16) * 0.1, "D": torch.randn(128), "conv1d.weight": torch.randn(128, 1, 4),
               "dt_proj.weight": torch.randn(128, 16) * 0.1, "dt_proj.bias": torch.randn(128) * 0.1,
               "dt_layernorm.weight": 1 + torch.randn(16) * 0.1}
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        whole = torch.func.functional_call(base, tensors, (x,), strict=False)
    assert not torch.allclose(whole, base(x).detach(), atol=1e-3)  # the variant's tensors matter
    got = _mamba1_ranks(base, 2, x, tensors)
    assert torch.allclose(got, whole, atol=1e-5), (got - whole).abs().max()


def test_what_a_mixer_split_cannot_cut_is_refused_in_one_line():
    """Key heads the degree does not divide, Mamba-2 groups it neither divides nor holds one of (two
    groups over four ranks: each group's norm would span two ranks), a tensor of the mixer's own that
    no rule cuts, a variant's tensor no rule cuts and rows of a tensor cut along another dimension
    (Kimi's ``A_log`` by heads) are each refused, naming what."""
    with pytest.raises(InputError, match=r"--tensor-parallel 2 does not divide mixer's 1 linear-attention key heads") as e:
        split_mixer(_mixer("qwen3_5", linear_num_key_heads=1, linear_num_value_heads=2), "mixer", 0, 2)
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match=r"--tensor-parallel 4 does not divide mixer's 2 Mamba groups"):
        split_mixer(_mixer("nemotron_h", n_groups=2), "mixer", 0, 4)  # (one group would be kept whole per rank)
    odd = _mixer("qwen3_5")
    odd.register_parameter("mix_scale", nn.Parameter(torch.ones(3)))
    with pytest.raises(InputError, match=r"cannot split mixer\.mix_scale \[3\] with the mixer's heads or channels"):
        split_mixer(odd, "mixer", 0, 2)
    shard = split_mixer(_mixer("kimi_linear"), "mixer", 0, 2)
    with pytest.raises(InputError, match=r"cannot split a variant's mixer\.forget_gate\.A_log:0:1"):
        shard_mixer_tensors({"forget_gate.A_log:0:1": torch.zeros(1, 1, 4, 1)}, shard, "mixer")
    with pytest.raises(InputError, match=r"cannot split a variant's mixer\.mix_scale"):
        shard_mixer_tensors({"mix_scale": torch.zeros(3)}, shard, "mixer")
    assert split_mixer(tiny_model("llama").model.layers[0].self_attn, "attn", 0, 2) is None


def test_widths_a_degree_does_not_divide_are_refused_before_serving(tmp_path):
    """Linear-attention key heads that the degree does not divide are refused from the config; an MLP
    whose width the model derives from its config (LFM2 makes 85 of 128) is refused by name when a
    rank cuts it, instead of a span silently dropping its last row."""
    from _factories import save_model
    from _serving import single_thread

    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.cluster.tensor_parallel import check_config
    from deltazip.runtime.cluster.tp_group import start_tensor_parallel

    with pytest.raises(InputError, match=r"does not divide the model's linear-attention key heads \(1\)"):
        check_config(tiny_model("qwen3_5", linear_num_key_heads=1, linear_num_value_heads=2).config, 2)
    with single_thread():
        base = save_model(tiny_model("lfm2", block_ffn_dim_multiplier=1.0, block_multiple_of=1), tmp_path / "base")
        with pytest.raises(InputError, match=r"rank 0: .*--tensor-parallel 2 does not divide "
                                             r"model\.layers\.0\.feed_forward\.w1's 85 output features") as e:
            start_tensor_parallel(Checkpoint(base), [], 1, torch.device("cpu"), torch.float32, 2)
    assert "\n" not in str(e.value)
