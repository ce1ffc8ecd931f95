"""Merged projection groups (``deltazip.runtime.serve.projections``): the same outputs as one
``DeltaLinear`` per projection, with one GEMM and one SBMM per group; the per-layer launch count of a
Llama decode step; the build hook in ``DeltaModel``; the kernel warm-up skipped on a CPU."""

from __future__ import annotations

import copy
import gc
import importlib.util
from pathlib import Path

import pytest
import torch
from _factories import tiny_model
from _serving import served_set
from torch import nn

from deltazip.kernels import dispatch
from deltazip.kernels.reference import delta_weight
from deltazip.runtime.serve.delta_linear import DeltaContext, DeltaLinear
from deltazip.runtime.serve.projections import ProjectionGroup, merge_projections

_BENCH = Path(__file__).resolve().parents[3] / "bench" / "launches.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_launches", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _decouple(model, ctx) -> dict[str, DeltaLinear]:
    mods = {}
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and ".layers." in f".{name}":
            parent_name, _, child = name.rpartition(".")
            lin = DeltaLinear(mod, ctx)
            setattr(model.get_submodule(parent_name), child, lin)
            mods[name] = lin
    return mods


def _load_mixture(mods: dict[str, DeltaLinear], gen: torch.Generator) -> None:
    """Slot 0: packed deltas everywhere; slot 1: packed on q and v only, a LoRA on k, a whole-weight
    replacement on up_proj; slot 2: an 8-bit asymmetric delta on gate_proj only (another stack)."""
    b = _bench()
    for name, lin in sorted(mods.items()):
        o, i = lin.out_features, lin.in_features
        lin.load_slot(0, packed=b.random_delta(o, i, gen))
        if name.endswith(("q_proj", "v_proj")):
            lin.load_slot(1, packed=b.random_delta(o, i, gen))
        elif name.endswith("k_proj"):
            lin.load_slot(1, lora_a=torch.randn(4, i, generator=gen) * 0.05,
                          lora_b=torch.randn(o, 4, generator=gen) * 0.05, lora_scale=0.5)
        elif name.endswith("up_proj"):
            lin.load_slot(1, dense=torch.randn(o, i, generator=gen) * 0.05)
        if name.endswith("gate_proj"):
            from deltazip.formats.packing import pack_delta

            codes = torch.randint(0, 256, (o, i), generator=gen)
            scales = (torch.rand(o, i // 32, generator=gen) * 1e-4).half()
            zeros = torch.randint(0, 256, (o, i // 32), generator=gen)
            lin.load_slot(2, packed=pack_delta(codes, scales, zeros, None, 8, 32))


def _logits(model, ctx, slots, ids):
    with torch.no_grad():
        ctx.bind(slots, "cpu")
        out = model(input_ids=ids, use_cache=False).logits
        ctx.unbind()
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
@pytest.mark.parametrize("dequantize", [True, False], ids=["dequantized", "packed"])
def test_merged_groups_give_the_per_linear_outputs(arch, dequantize):
    base = tiny_model(arch)
    per, merged = copy.deepcopy(base), copy.deepcopy(base)
    ctx_p, ctx_m = DeltaContext(3, dequantize=dequantize), DeltaContext(3, dequantize=dequantize)
    mods_p, mods_m = _decouple(per, ctx_p), _decouple(merged, ctx_m)
    assert merge_projections(merged, mods_m, ctx_m) == {}  # every sibling was decoupled already
    groups = {id(m.merged) for m in mods_m.values() if m.merged is not None}
    assert len(groups) == 2 * base.config.num_hidden_layers  # q/k/v and gate/up per layer
    _load_mixture(mods_p, torch.Generator().manual_seed(3))
    _load_mixture(mods_m, torch.Generator().manual_seed(3))
    ids = torch.randint(3, 20, (5, 4), generator=torch.Generator().manual_seed(4))
    slots = [0, 1, 2, -1, 1]
    want = _logits(per, ctx_p, slots, ids)
    got = _logits(merged, ctx_m, slots, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - _logits(base, DeltaContext(3), slots, ids)).abs().max() > 1e-3  # the deltas do something
    torch.testing.assert_close(_logits(merged, ctx_m, [-1] * 5, ids), _logits(per, ctx_p, [-1] * 5, ids),
                               rtol=1e-5, atol=1e-5)  # base rows only: one GEMM with the concatenated bias


def test_group_weights_are_views_of_one_tensor_and_slots_clear_by_rows():
    torch.manual_seed(0)
    ctx = DeltaContext(2, dequantize=False)
    lins = [DeltaLinear(nn.Linear(64, o, bias=False), ctx) for o in (64, 32, 32)]
    originals = [lin.weight.detach().clone() for lin in lins]
    group = ProjectionGroup(lins, ctx)
    for lin, w, (r0, _) in zip(lins, originals, group.rows):
        assert lin.weight.data_ptr() == group.weight[r0:].data_ptr() and torch.equal(lin.weight, w)
    b = _bench()
    gen = torch.Generator().manual_seed(1)
    deltas = [b.random_delta(lin.out_features, 64, gen) for lin in lins]
    for lin, d in zip(lins, deltas):
        lin.load_slot(0, packed=d)
    lins[1].clear_slot(0)  # k's rows of slot 0 become a zero delta; q and v keep theirs
    x = torch.randn(2, 1, 64)
    ctx.bind([0, -1], "cpu")
    with torch.no_grad():
        ys = [lin(x) for lin in lins]
    for lin, d, y, w in zip(lins, deltas, ys, originals):
        want = x[0, 0] @ w.T + (0 if lin is lins[1] else x[0, 0] @ delta_weight(d).T)
        torch.testing.assert_close(y[0, 0], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y[1, 0], x[1, 0] @ w.T)
    # Every member cleared, then only k reloaded: q's and v's old rows must not come back.
    lins[0].clear_slot(0)
    lins[2].clear_slot(0)
    lins[1].load_slot(0, packed=deltas[1])
    ctx.bind([0], "cpu")
    with torch.no_grad():
        ys = [lin(x[:1]) for lin in lins]
    torch.testing.assert_close(ys[0][0, 0], x[0, 0] @ originals[0].T)
    torch.testing.assert_close(ys[2][0, 0], x[0, 0] @ originals[2].T)
    assert lins[0].resident_bytes(0) == 0 and lins[1].resident_bytes(0) > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_merging_registry_shared_weights_frees_the_old_ones(arch):
    """As DeltaModel builds: parameters routed through the dedup registry, then merged. The members'
    old tensors must be freed (their parameters become row views of the stack), not kept alive next
    to the stack (a second copy of q/k/v and gate/up)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from deltazip.runtime.share.dedup_serving import new_serving_registry, share_parameters, share_tensor

    model = tiny_model(arch)
    registry = new_serving_registry()
    held, _, _ = share_parameters(model, registry)
    members = {n: p for n, p in model.named_parameters() if ".layers." in n and "_proj" in n
               and n.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
    values = {n: p.detach().clone() for n, p in members.items()}
    old = {n: StorageWeakRef(p.untyped_storage()) for n, p in members.items()}
    ctx = DeltaContext(1)
    merge_projections(model, _decouple(model, ctx), ctx, held, lambda t: share_tensor(registry, t)[0])
    gc.collect()
    assert all(r.expired() for r in old.values()), [n for n, r in old.items() if not r.expired()]
    params = dict(model.named_parameters())
    for n, v in values.items():
        assert torch.equal(params[n], v), n


def test_members_back_to_back_in_one_buffer_are_stacked_by_a_view():
    """The weight owner of ``serve --workers`` lays q/k/v out back to back (weights, then biases):
    the group's weight and bias are then views of that memory, read-only like the members."""
    from deltazip.runtime.share.dedup_registry import ReadOnlyTensor, SharedTensorWriteError, read_only

    torch.manual_seed(0)
    ctx = DeltaContext(1)
    lins = [DeltaLinear(nn.Linear(64, o), ctx) for o in (64, 32, 32)]
    with torch.no_grad():
        flat = torch.cat([lin.weight.detach().reshape(-1) for lin in lins] + [lin.bias.detach() for lin in lins])
        buf = read_only(flat.clone())  # [W_q W_k W_v b_q b_k b_v], as the owner's buffer holds them
        w_end = sum(lin.weight.numel() for lin in lins)
        w_off, b_off = 0, w_end
        for lin in lins:
            n, o = lin.weight.numel(), lin.out_features
            lin.weight = nn.Parameter(buf[w_off:w_off + n].view(o, 64), requires_grad=False)
            lin.bias = nn.Parameter(buf[b_off:b_off + o], requires_grad=False)
            w_off, b_off = w_off + n, b_off + o
    group = ProjectionGroup(lins, ctx)
    assert group.weight.data_ptr() == buf.data_ptr() and tuple(group.weight.shape) == (128, 64)
    assert group.bias.data_ptr() == buf[w_end:].data_ptr() and tuple(group.bias.shape) == (128,)
    assert isinstance(group.weight, ReadOnlyTensor)
    with pytest.raises(SharedTensorWriteError):
        group.weight.add_(1)
    assert torch.equal(group.weight, flat[:w_end].view(128, 64)) and torch.equal(group.bias, flat[w_end:])
    x = torch.randn(2, 1, 64)
    with torch.no_grad():
        for lin in lins:
            torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-6, atol=1e-6)


def test_a_member_called_with_another_input_still_gets_its_own_answer():
    ctx = DeltaContext(1)
    lins = [DeltaLinear(nn.Linear(16, 8, bias=False), ctx) for _ in range(2)]
    ProjectionGroup(lins, ctx)
    a, b = torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    ctx.bind([-1], "cpu")
    with torch.no_grad():
        ya = lins[0](a)
        yb = lins[1](b)  # not the cached input
        yb2 = lins[1](b)  # twice in a row
    torch.testing.assert_close(ya, a @ lins[0].weight.T)
    torch.testing.assert_close(yb, b @ lins[1].weight.T)
    torch.testing.assert_close(yb2, yb)


def test_projections_that_cannot_merge_keep_one_linear_each():
    ctx = DeltaContext(1)
    with pytest.raises(ValueError, match="input sizes"):
        ProjectionGroup([DeltaLinear(nn.Linear(16, 8), ctx), DeltaLinear(nn.Linear(32, 8), ctx)], ctx)
    with pytest.raises(ValueError, match="bias"):
        ProjectionGroup([DeltaLinear(nn.Linear(16, 8), ctx), DeltaLinear(nn.Linear(16, 8, bias=False), ctx)], ctx)
    model = tiny_model("gpt_neox")  # fused query_key_value: no Llama sibling names
    mods = _decouple(model, ctx)
    assert merge_projections(model, mods, ctx) == {}
    assert all(m.merged is None for m in mods.values())


def test_decode_step_launches_per_llama_layer_dequantized():
    """The CPU serving path (deltas kept dequantized): GEMMs per layer 14 -> 8 (base 7 -> 4, delta
    7 -> 4), and fewer ops in all."""
    b = _bench()
    counts = {}
    for merge in (False, True):
        model, ctx = b.build(layers=1, hidden=128, intermediate=256, heads=2, kv_heads=1, slots=3,
                             dequantize=True, merge=merge)
        counts[merge] = b.count_step(model, ctx, rows=4, slots=3)
    torch.testing.assert_close(counts[True]["logits"], counts[False]["logits"])
    assert counts[False]["gemms"] == 14 + 1 and counts[True]["gemms"] == 8 + 1  # + lm_head
    assert counts[True]["top_level_ops"] < counts[False]["top_level_ops"]


@pytest.mark.slow
def test_decode_step_launches_per_llama_layer_packed(monkeypatch):
    """The SBMM path (the CUDA kernel on a GPU; on a CPU the reference over its layout): one SBMM call per
    projection group, 7 -> 4 per layer, and 7 -> 4 base GEMMs."""
    monkeypatch.setenv("DELTAZIP_SBMM_LAYOUT", "mma")
    path = "cuda" if torch.cuda.is_available() else "reference"
    b = _bench()
    counts = {}
    for merge in (False, True):
        model, ctx = b.build(layers=1, hidden=128, intermediate=256, heads=2, kv_heads=1, slots=3,
                             dequantize=False, merge=merge)
        counts[merge] = b.count_step(model, ctx, rows=4, slots=3)
    assert counts[False]["sbmm"] == {path: 7} and counts[True]["sbmm"] == {path: 4}
    assert counts[False]["gemms"] == 7 + 1 and counts[True]["gemms"] == 4 + 1
    torch.testing.assert_close(counts[True]["logits"], counts[False]["logits"], rtol=1e-4, atol=1e-4)


def test_delta_model_merges_llama_projections_and_skips_the_warm_up_on_cpu(tmp_path):
    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.serve import kernel_warmup
    from deltazip.runtime.serve.model import DeltaModel
    from deltazip.runtime.serve.variant_sources import discover_variants

    s = served_set(tmp_path / "serving")
    variants = discover_variants(s.artifacts)
    for compute in ("auto", "packed"):
        dm = DeltaModel(Checkpoint(s.base_dir), variants, num_slots=2, device=torch.device("cpu"),
                        dtype=torch.float32, delta_compute=compute)
        assert kernel_warmup.warm_up_kernels(dm) == 0
        groups = {id(m.merged) for m in dm.modules.values() if isinstance(m, DeltaLinear) and m.merged is not None}
        assert groups, "no q/k/v or gate/up group was formed"
        lin = next(m for m in dm.modules.values() if isinstance(m, DeltaLinear) and m.merged is not None)
        held = {t.data_ptr() for t in dm._base_held}
        assert lin.weight.data_ptr() in held  # the registry keeps the view, not the old copy
    dispatch.CALLS.clear()
