"""Decoupled base + delta modules and the decoupled model against merged fine-tunes."""

from __future__ import annotations

import json

import pytest
import torch
from _serving import PROMPTS, VARIANTS, served_set, single_thread
from torch import nn

from deltazip.formats.packing import pack_delta
from deltazip.kernels.reference import delta_weight
from deltazip.runtime.serve.delta_embedding import decouple_embedding
from deltazip.runtime.serve.delta_linear import DeltaContext, DeltaLinear
from deltazip.runtime.serve.delta_norms import DeltaRMSNorm, is_llama_rmsnorm


def _packed(out_f, in_f, bits, sparse, asym, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=g)
    scales = (torch.rand(out_f, in_f // 16, generator=g) * 0.05 + 0.01).half()
    zeros = torch.randint(0, 2**bits, (out_f, in_f // 16), generator=g) if asym else None
    mask = None
    if sparse:
        keep = torch.rand(out_f, in_f // 4, 4, generator=g).argsort(-1)[..., :2]
        mask = torch.zeros(out_f, in_f // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(out_f, in_f)
    return pack_delta(codes, scales, zeros, mask, bits, 16)


@pytest.mark.parametrize("dequantize", [False, True], ids=["packed-sbmm", "dequantized"])
def test_delta_linear_rows_follow_their_slot(dequantize):
    torch.manual_seed(0)
    base = nn.Linear(32, 24, bias=True)
    ctx = DeltaContext(num_slots=4, dequantize=dequantize)
    lin = DeltaLinear(base, ctx)
    d0 = _packed(24, 32, 4, True, False, 1)      # 4-bit 2:4 symmetric
    d1 = _packed(24, 32, 2, False, True, 2)      # 2-bit dense asymmetric: another stack
    d2 = _packed(24, 32, 4, True, True, 3)       # asymmetric into the 4-bit 2:4 stack (rebuilt asym)
    dense = torch.randn(24, 32)
    bias3 = torch.randn(24)
    lin.load_slot(0, packed=d0)
    lin.load_slot(1, packed=d1)
    lin.load_slot(2, packed=d2, additive=False)   # SparseGPT-style whole weight
    lin.load_slot(3, dense=dense, bias=bias3)     # dense replacement with its own bias
    x = torch.randn(6, 3, 32)
    slots = [-1, 0, 1, 2, 3, 0]
    ctx.bind(slots, "cpu")
    with torch.no_grad():
        y = lin(x)
    W, b = base.weight.detach(), base.bias.detach()
    want = {
        -1: lambda v: v @ W.T + b,
        0: lambda v: v @ (W + delta_weight(d0)).T + b,
        1: lambda v: v @ (W + delta_weight(d1)).T + b,
        2: lambda v: v @ delta_weight(d2).T + b,
        3: lambda v: v @ dense.T + bias3,
    }
    for r, s in enumerate(slots):
        torch.testing.assert_close(y[r], want[s](x[r]), rtol=1e-5, atol=1e-5)
    assert lin.resident_bytes(1) > 0
    # Clearing a slot sends its rows back to the base weights.
    lin.clear_slot(0)
    with torch.no_grad():
        y2 = lin(x)
    torch.testing.assert_close(y2[1], want[-1](x[1]), rtol=1e-5, atol=1e-5)
    assert lin.resident_bytes(0) == 0
    ctx.unbind()


@pytest.mark.parametrize("slots,t", [
    ([0, 1, 2, 3, 0, 1, 2, 3], 1),          # spread evenly: one batched GEMM over slots 0..3
    ([1, 3, 1, 3, -1, 3, 1, -1], 3),        # a gap (slot 2 padding only), base rows, 3 tokens per row
    ([5, 5, 5, 5, 5, 5, 2, -1], 1),         # skewed: padding would be > 2x, one GEMM per slot
    ([4, -1, 6, 4, 6, 4], 2),               # non-zero first slot: the stack is read through a view
])
def test_dense_rows_regrouped_per_slot_match_each_rows_own_weight(slots, t):
    from deltazip.runtime.serve.delta_linear import SlotSegments, _dense_rows

    torch.manual_seed(0)
    n, out_f, in_f = 8, 96, 160  # above the all-slots-GEMM size, so the regrouped path is exercised
    weights = torch.randn(n, out_f, in_f)
    ctx = DeltaContext(num_slots=n, dequantize=True)
    ctx.bind(slots, "cpu")
    x = torch.randn(len(slots), t, in_f)
    idx = ctx.token_index(x)
    present = {s for s in slots if s >= 0}
    y = _dense_rows(x.reshape(-1, in_f), idx, weights, present, ctx)
    want = torch.stack([torch.zeros(out_f) if s < 0 else x[r, j] @ weights[s].T
                        for r, s in enumerate(slots) for j in range(t)])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    seg = ctx.segments(len(slots) * t, frozenset(present))
    rows_in = sum(s >= 0 for s in slots) * t
    if seg is None:  # refused only when padding would more than double the rows
        counts = {s: slots.count(s) * t for s in present}
        assert (max(present) - min(present) + 1) * max(counts.values()) > SlotSegments.MAX_PADDING * rows_in
    else:
        assert seg.span == max(present) - min(present) + 1 and seg.span * seg.width <= 2 * rows_in
    ctx.unbind()


def test_base_only_batch_is_the_plain_linear_and_unbound_context_is_an_error():
    base = nn.Linear(16, 8)
    ctx = DeltaContext(2)
    lin = DeltaLinear(base, ctx)
    lin.load_slot(0, packed=_packed(8, 16, 4, False, False, 0))
    x = torch.randn(3, 2, 16)
    ctx.bind([-1, -1, -1], "cpu")
    with torch.no_grad():
        assert torch.equal(lin(x), base(x))
    ctx.unbind()
    ctx.bind([0, 0, -1], "cpu")
    ctx.unbind()
    with pytest.raises(ValueError, match="slot 5"):
        ctx.bind([5], "cpu")


def test_a_batch_in_one_slot_routes_inputs_of_any_layout():
    """Rows all in one slot: every token is that slot's, whatever the input's first dimension
    (Mllama's vision tower sees ``[B · images · tiles, P, H]`` in a batch of B prompts); rows in
    several slots still need inputs that start with the batch."""
    base = nn.Linear(16, 8)
    ctx = DeltaContext(2)
    lin = DeltaLinear(base, ctx)
    lin.load_slot(1, packed=_packed(8, 16, 4, False, False, 0))
    x = torch.randn(8, 5, 16)  # 2 prompts x 4 tiles
    full = base.weight + delta_weight(_packed(8, 16, 4, False, False, 0)).to(base.weight.dtype)
    ctx.bind([1, 1], "cpu")
    with torch.no_grad():
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, full, base.bias), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lin(x[:3]), torch.nn.functional.linear(x[:3], full, base.bias), atol=1e-5,
                                   rtol=1e-5)  # 3 rows of a 2-row batch: still all slot 1
    ctx.bind([1, -1], "cpu")
    with pytest.raises(ValueError, match="does not start with the batch size 2"), torch.no_grad():
        lin(x[:3])
    ctx.unbind()


def test_embedding_and_norm_rows_read_their_variant_and_same_costs_nothing():
    torch.manual_seed(0)
    ctx = DeltaContext(3)
    emb = decouple_embedding(nn.Embedding(10, 4), ctx)
    own = torch.randn(10, 4)
    emb.load_slot(1, own)
    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    ctx.bind([-1, 1, 0], "cpu")  # slot 0 holds a variant whose embedding is "same"
    with torch.no_grad():
        out = emb(ids)
    assert torch.equal(out[0], emb.weight[ids[0]]) and torch.equal(out[2], emb.weight[ids[2]])
    assert torch.equal(out[1], own[ids[1]])
    assert emb.resident_bytes(0) == 0 and emb.resident_bytes(1) == own.numel() * 4

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    base_norm = LlamaRMSNorm(4, eps=1e-6)
    with torch.no_grad():
        base_norm.weight.copy_(torch.rand(4) + 0.5)
    assert is_llama_rmsnorm(base_norm)
    norm = DeltaRMSNorm(base_norm, ctx)
    w1 = torch.rand(4) + 0.5
    norm.load_slot(1, w1)
    x = torch.randn(3, 2, 4)
    with torch.no_grad():
        y = norm(x)
        ref_norm = LlamaRMSNorm(4, eps=1e-6)
        ref_norm.weight.copy_(w1)
        assert torch.equal(y[1], ref_norm(x[1:2])[0])  # bit-exact: the merged model's own formula
        assert torch.equal(y[0], base_norm(x[0:1])[0]) and torch.equal(y[2], base_norm(x[2:3])[0])
    ctx.unbind()


def test_norms_that_are_not_llama_rmsnorm_are_recognised():
    class GemmaLike(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4))
            self.eps = 1e-6

        def forward(self, x):
            h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * (1 + self.weight.float())).to(x.dtype)

    assert not is_llama_rmsnorm(GemmaLike())
    assert not is_llama_rmsnorm(nn.LayerNorm(4))


# ------------------------------------------------------------------------------------------------
# The decoupled model against the merged models
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.getbasetemp() / "serving")


@pytest.mark.parametrize("compute", ["packed", "dequantized"])
def test_mixed_batch_logits_match_each_merged_model(served, compute):
    """One forward over rows of the base and all three variants = each row's merged model."""
    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.serve.model import DeltaModel
    from deltazip.runtime.serve.model_runner import prefill_logits
    from deltazip.runtime.serve.variant_sources import discover_variants

    with single_thread():
        variants = discover_variants(served.artifacts)
        assert [v.name for v in variants] == sorted(VARIANTS)
        dm = DeltaModel(Checkpoint(served.base_dir), variants, num_slots=3, device=torch.device("cpu"),
                        dtype=torch.float32, delta_compute=compute)
        for slot, v in enumerate(variants):
            dm.write_slot(slot, v.name, dm.load_host(v.name))
        # beta keeps its norms "same": their slot points at the base row, no copy
        norm = dm.modules["model.norm"]
        assert norm.resident_bytes(1) == 0 and norm.resident_bytes(0) > 0
        tok = served.tokenizer()
        names = ["base"] + [v.name for v in variants]
        slot_of = {"base": -1, **{v.name: i for i, v in enumerate(variants)}}
        prompt_ids = [tok(p)["input_ids"] for p in PROMPTS[:4]]
        rows = [(n, ids) for n in names for ids in prompt_ids]
        logits = prefill_logits(dm, [slot_of[n] for n, _ in rows], [ids for _, ids in rows], pad_id=2)
        with torch.no_grad():
            for i, (n, ids) in enumerate(rows):
                ref = served.model(n)(torch.tensor([ids])).logits[0, -1]
                torch.testing.assert_close(logits[i], ref, rtol=1e-4, atol=1e-4)
                assert int(logits[i].argmax()) == int(ref.argmax())
        # the variants really differ from the base (otherwise this test proves little)
        base_rows = logits[: len(prompt_ids)]
        for k in range(1, len(names)):
            assert (logits[k * len(prompt_ids):(k + 1) * len(prompt_ids)] - base_rows).abs().max() > 1e-2


def test_unsupported_changes_are_refused_with_the_tensor_name(served):
    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.serve.model import DeltaModel, UnsupportedVariant
    from deltazip.runtime.serve.variant_sources import VariantInfo

    bogus = VariantInfo("odd", served.root, {"model.rotary.weight": {"kind": "full", "shape": [4]}}, {}, 0)
    with single_thread(), pytest.raises(UnsupportedVariant, match="model.rotary.weight.*--mode swap"):
        DeltaModel(Checkpoint(served.base_dir), [bogus], num_slots=1, device=torch.device("cpu"), dtype=torch.float32)


@pytest.mark.parametrize("compute", ["packed", "dequantized"])
def test_phi_variant_with_changed_layernorms_matches_its_merged_model(tmp_path, compute):
    """A non-Llama family: Phi (LayerNorm with bias, biased linears and lm_head, partial rotary).
    The fine-tune changes every tensor, norms and biases included; one forward over base and variant
    rows equals each row's own model."""
    from _factories import perturb, save_model, tiny_model

    from deltazip.compress.config import CompressConfig
    from deltazip.compress.merge import load_merged_model
    from deltazip.compress.pipeline import compress_delta
    from deltazip.formats.artifact import Artifact
    from deltazip.kernels.scheme import DeltaScheme
    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.serve.delta_norms import DeltaLayerNorm
    from deltazip.runtime.serve.model import DeltaModel
    from deltazip.runtime.serve.model_runner import prefill_logits
    from deltazip.runtime.serve.variant_sources import discover_variants

    with single_thread():
        base = tiny_model("phi")
        save_model(base, tmp_path / "base")
        save_model(perturb(tiny_model("phi"), scale=0.2, seed=3, skip=()), tmp_path / "ft")
        calib = tmp_path / "calib.jsonl"
        calib.write_text("".join(json.dumps({"text": ("abc def ghi jkl " * 6)[i:i + 60]}) + "\n" for i in range(8)))
        cfg = CompressConfig(scheme=DeltaScheme(bits=4, group_size=32),
                             method="deltazip", nsamples=4, seqlen=32, device="cpu")
        compress_delta(tmp_path / "base", tmp_path / "ft", str(calib), tmp_path / "arts" / "phi", cfg)
        (v,) = discover_variants(tmp_path / "arts")
        ck = Checkpoint(tmp_path / "base")
        merged = load_merged_model(Artifact(v.path), ck).eval()
        dm = DeltaModel(ck, [v], num_slots=2, device=torch.device("cpu"), dtype=torch.float32, delta_compute=compute)
        kinds = {type(m).__name__ for m in dm.modules.values()}
        assert "DeltaLayerNorm" in kinds and "DeltaEmbedding" in kinds  # norms and embeddings really changed
        dm.write_slot(1, v.name, dm.load_host(v.name))
        ln = next(m for m in dm.modules.values() if isinstance(m, DeltaLayerNorm))
        assert ln.resident_bytes(1) > 0 and ln.resident_bytes(0) == 0
        ids = [[5, 9, 13, 4, 22, 30, 7], [8, 8, 17, 40], [5, 9, 13, 4, 22, 30, 7], [8, 8, 17, 40]]
        slots = [-1, -1, 1, 1]
        logits = prefill_logits(dm, slots, ids)
        with torch.no_grad():
            for r, (i, s) in enumerate(zip(ids, slots)):
                ref = (merged if s >= 0 else base)(torch.tensor([i])).logits[0, -1]
                torch.testing.assert_close(logits[r], ref, rtol=1e-4, atol=1e-4)
            assert (logits[2] - logits[0]).abs().max() > 1e-2  # the variant's rows differ from the base's


@pytest.mark.parametrize("dequantize", [False, True], ids=["packed-sbmm", "dequantized"])
def test_conv1d_rows_follow_their_slot(dequantize):
    """GPT-2's Conv1D (weight stored [in, out], y = x W + b): packed deltas are [out, in] as for any
    linear; a dense replacement comes in the parameter's layout; biases per row. The [B * t, in]
    input some models pass (flattened batch-first rows) routes like [B, t, in]."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    base = Conv1D(32, 32)  # square: a dense [in, out] is told apart by layout, not by shape
    with torch.no_grad():
        base.bias.copy_(torch.randn(32))
    ctx = DeltaContext(num_slots=2, dequantize=dequantize)
    lin = DeltaLinear(base, ctx)
    assert (lin.in_features, lin.out_features) == (32, 32)
    d0 = _packed(32, 32, 4, False, False, 1)
    dense, bias1 = torch.randn(32, 32), torch.randn(32)  # [in, out], as Conv1D stores it
    lin.load_slot(0, packed=d0)
    lin.load_slot(1, dense=dense, bias=bias1)
    x = torch.randn(3, 4, 32)
    ctx.bind([1, -1, 0], "cpu")
    with torch.no_grad():
        y = lin(x)
        y_flat = lin(x.reshape(-1, 32)).reshape(3, 4, 32)
    W, b = base.weight.detach(), base.bias.detach()
    torch.testing.assert_close(y[0], x[0] @ dense + bias1)
    torch.testing.assert_close(y[1], base(x[1:2])[0])
    torch.testing.assert_close(y[2], x[2] @ (W + delta_weight(d0).t()) + b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_flat, y)


def test_a_stack_allocated_from_another_thread_during_a_forward_leaves_the_forward_whole():
    """The start-up tuning's thread allocates the stacks of the served configurations (``stack_for``)
    while the engine's forwards iterate them: a configuration added in the middle of ``add_into`` must
    not break that forward's iteration (it is added by replacing the map, not changing it in place), and
    two threads asking for one configuration get one stack."""
    import threading

    torch.manual_seed(0)
    base = nn.Linear(16, 8)
    ctx = DeltaContext(2)
    lin = DeltaLinear(base, ctx)
    packed = _packed(8, 16, 4, False, False, 0)
    lin.load_slot(0, packed=packed)
    store = lin._store
    (group,) = store.groups.values()
    inner = group.launch

    def launch_while_a_stack_is_added(*a, **k):
        store.stack_for(8, -1, False, False)  # what served_stacks does from the start-up thread
        return inner(*a, **k)

    group.launch = launch_while_a_stack_is_added
    x = torch.randn(2, 16)
    ctx.bind([0, -1], "cpu")
    with torch.no_grad():
        y = lin(x)
    ctx.unbind()
    want = base(x)
    want[0] += x[0] @ delta_weight(packed).T
    assert torch.allclose(y, want, atol=1e-5) and len(store.groups) == 2

    barrier = threading.Barrier(8)
    got = []

    def ask():
        barrier.wait()
        got.append(store.stack_for(2, -1, False, True))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(s) for s in got}) == 1 and len(store.groups) == 3
