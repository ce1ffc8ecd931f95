"""Hybrid models in the serving engine: recurrent layers (Qwen3.5's gated-delta-rule linear attention,
LFM2's short convolutions, Falcon-H1's Mamba-2 mixers beside attention in every layer, Jamba's Mamba
layers, Mamba-2 alone) keep a fixed-size state per sequence in the pool's ``StatePool``.

Every row's logits through the engine's step runner equal a plain forward of its whole sequence,
through prefills of different lengths (left-padded new sequences), prompt chunks of different lengths
after a past (rows with a state are never padded), decode steps, a forked sequence and a sequence
moved to host memory and back, on the paged and the contiguous cache.
"""

from __future__ import annotations

import pytest
import torch
from _factories import tiny_model
from _serving import PlainBackend, single_thread

from deltazip.runtime.serve.attention import use_paged_attention
from deltazip.runtime.serve.kv_cache import BlockPool, SeqBlocks
from deltazip.runtime.serve.model import _scans_from_zero
from deltazip.runtime.serve.model_runner import KVPool, SeqKV, _unpadded_groups, forward_step
from deltazip.runtime.serve.recurrent_state import (
    RECURRENT_LAYER_TYPES,
    StatePool,
    mark_tokenwise,
    recurrent_layer_types,
)


def test_state_pool_rows_are_zeroed_grown_forked_and_dropped_when_idle():
    pool = StatePool()
    a, b = pool.alloc(), pool.alloc()
    rows = torch.tensor([a, b])
    pool.scatter((0, "conv", 0), rows, torch.ones(2, 3, 4))
    assert pool.rows == 8 and pool.row_bytes() == 3 * 4 * 4
    pool.copy_row(a, c := pool.alloc())
    assert torch.equal(pool.gather((0, "conv", 0), torch.tensor([c])), torch.ones(1, 3, 4))
    saved = pool.read_row(b)
    pool.release(b)
    assert torch.equal(pool.gather((0, "conv", 0), torch.tensor([pool.alloc()])), torch.zeros(1, 3, 4))  # zeroed
    extra = [pool.alloc() for _ in range(6)]  # past the first 8 rows: the tensors grow, rows kept
    assert pool.rows == 16 and torch.equal(pool.t[(0, "conv", 0)][a], torch.ones(3, 4))
    pool.write_row(extra[-1], saved)
    assert torch.equal(pool.t[(0, "conv", 0)][extra[-1]], torch.ones(3, 4))
    for r in [a, c, b, *extra]:  # b: the row the zeroed check took back
        pool.release(r)
    assert pool.t == {} and pool.rows == 0
    pool.write_row(pool.alloc(), saved)  # a preempted sequence back in an idle pool: on the model's device
    assert pool.t[(0, "conv", 0)].device == pool.device == torch.device("cpu")


def test_a_recurrent_layers_own_parameters_belong_to_its_mixer_not_to_its_attention():
    """In a ``hybrid`` layer (attention beside a state-space mixer) the mixer's decay and convolution go
    to the mixer; the attention module's norm is left to the norm decoupling; linears stay linears."""
    from types import SimpleNamespace

    from torch import nn

    from deltazip.runtime.serve.delta_mixer import mixer_of

    def block(causal: bool) -> nn.Module:
        m = nn.Module()
        m.proj, m.norm = nn.Linear(8, 8), nn.LayerNorm(8)
        if causal:
            m.is_causal = True
        else:
            m.A_log = nn.Parameter(torch.zeros(4))
        return m

    layer = nn.Module()
    layer.self_attn, layer.mamba = block(True), block(False)
    model = nn.Module()
    model.layers = nn.ModuleList([layer])
    model.config = SimpleNamespace(num_hidden_layers=1, layer_types=["hybrid"])
    assert mixer_of(model, "layers.0.mamba.A_log") == ("layers.0.mamba", "A_log")
    assert mixer_of(model, "layers.0.mamba.norm.weight") == ("layers.0.mamba", "norm.weight")
    assert mixer_of(model, "layers.0.self_attn.norm.weight") is None
    assert mixer_of(model, "layers.0.mamba.proj.weight") is None
    # a block holding an attention (Zamba2's shared transformer beside the Mamba layer) is not a mixer
    layer.shared = nn.Module()
    layer.shared.self_attn, layer.shared.norm = block(True), nn.LayerNorm(8)
    assert mixer_of(model, "layers.0.shared.norm.weight") is None
    model.config.layer_types = ["full_attention"]
    assert mixer_of(model, "layers.0.mamba.A_log") is None  # not a recurrent layer


def test_linears_a_mixer_reads_itself_are_found_in_its_source():
    """Jamba's and Mamba's mixers compute ``self.dt_proj.weight @ x``: a ``DeltaLinear`` would not see
    it. Bamba reads ``out_proj.weight`` only under ``if self.training``, which serving never takes;
    reads of metadata (``.dtype``) do not count."""
    from transformers.models.bamba.modeling_bamba import BambaMixer
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer
    from transformers.models.mamba.modeling_mamba import MambaMixer

    from deltazip.runtime.serve.delta_mixer import _direct_reads

    assert {"dt_proj", "conv1d"} <= _direct_reads(JambaMambaMixer)
    assert "dt_proj" in _direct_reads(MambaMixer) and "out_proj" not in _direct_reads(MambaMixer)
    assert "out_proj" not in _direct_reads(BambaMixer) and "conv1d" in _direct_reads(BambaMixer)
    assert _direct_reads(_Reader) == {"b", "d"}


class _Reader(torch.nn.Module):
    def forward(self, x):
        x = x.to(self.a.weight.dtype)  # metadata only
        if self.training and x.shape[0]:
            x = x @ self.c.weight.T  # training only
        else:
            x = x + self.d.bias
        return self.b.weight @ x


def test_rows_with_a_state_are_never_left_padded():
    cfg = tiny_model("qwen3_5").config
    assert recurrent_layer_types(cfg) == ["linear_attention"]
    assert _unpadded_groups(cfg, [0, 0, 4], [5, 2, 5]) == [[0, 1, 2]]  # new rows may be padded
    assert _unpadded_groups(cfg, [0, 3, 4, 6], [5, 2, 5, 2]) == [[0, 2], [1, 3]]
    assert _unpadded_groups(tiny_model("llama").config, [0, 3], [5, 2]) == [[0, 1]]  # no recurrent layers


# Qwen3.5's class takes no attention function (the contiguous cache); LFM2's does (both caches)
@pytest.mark.parametrize("arch,paged", [("qwen3_5", False), ("lfm2", True), ("lfm2", False), ("falcon_h1", False),
                                       ("jamba", False), ("mamba2", False), ("zamba2-untied", False)],
                         ids=["qwen3_5-contiguous", "lfm2-paged", "lfm2-contiguous", "falcon_h1-contiguous",
                              "jamba-contiguous", "mamba2-contiguous", "zamba2-contiguous"])
def test_engine_steps_equal_a_full_forward(arch, paged):
    with single_thread():
        model = tiny_model(arch)
        if paged:
            assert use_paged_attention(model)
        # Jamba's Mamba mixer scans a step of several tokens from a zero state: the loader's probe finds
        # it, and the step runner then continues its states one token at a time
        scans = _scans_from_zero(model, torch.device("cpu"), torch.float32)
        assert scans == (arch == "jamba")
        if scans:
            mark_tokenwise(model.config)
        be = PlainBackend(model)
        pool = BlockPool(block_size=4) if paged else KVPool()
        new_cache = SeqBlocks if paged else SeqKV
        seqs = [[5, 9, 14, 3, 22, 7, 8], [11, 4, 30], [6, 2, 19, 17, 25]]
        caches = [new_cache() for _ in seqs]

        def check(logits, rows):
            for i, r in enumerate(rows):
                with torch.no_grad():
                    want = model(torch.tensor([seqs[r]])).logits[0, -1]
                torch.testing.assert_close(logits[i], want, rtol=1e-4, atol=1e-4)

        # a prefill of three new sequences of different lengths (left-padded)
        check(forward_step(be, pool, caches, [-1] * 3, [list(s) for s in seqs], [0] * 3), range(3))
        # prompt chunks of different lengths after a past: 4, 1 and 2 more tokens
        more = [[12, 13, 3, 9], [21], [4, 4]]
        for s, m in zip(seqs, more):
            s.extend(m)
        got = forward_step(be, pool, caches, [-1] * 3, more, [len(s) - len(m) for s, m in zip(seqs, more)],
                           every_position=True)  # [3, Tm, V], rows left-padded
        check(got[:, -1], range(3))
        for r, m in enumerate(more):  # every new position of every row, not just the last
            for j in range(len(m)):
                with torch.no_grad():
                    want = model(torch.tensor([seqs[r][:len(seqs[r]) - len(m) + j + 1]])).logits[0, -1]
                torch.testing.assert_close(got[r, got.shape[1] - len(m) + j], want, rtol=1e-4, atol=1e-4)
        # a fork of row 0 decodes beside it with another token; row 1 is moved to host memory
        caches.append(caches[0].fork())
        seqs.append(list(seqs[0]))
        caches[1].offload()
        for step in range(3):
            live = [0, 2, 3]
            toks = [[3 + (5 * step + 7 * r) % 37] for r in live]
            for r, t in zip(live, toks):
                seqs[r].append(t[0])
            check(forward_step(be, pool, [caches[r] for r in live], [-1] * 3, toks,
                               [caches[r].length for r in live]), live)
        seqs[1].append(33)  # back from host memory
        check(forward_step(be, pool, [caches[1]], [-1], [[33]], [caches[1].length]), [1])
        assert pool.states.row_bytes() > 0
        for c in caches:
            c.free()
        assert pool.states.t == {}


@pytest.mark.parametrize("arch", ["qwen3_5", "lfm2", "falcon_h1", "kimi_linear", "jamba", "mamba2", "nemotron_h",
                                  "zamba2-untied", "zamba2"])
def test_delta_mode_runs_each_variants_recurrent_parameters_on_its_rows(tmp_path, arch):
    """Two real fine-tunes (every tensor moved: the convolution, the decay and step size, the gated
    norm) served as full checkpoints in delta mode: their recurrent layers are ``DeltaMixer``s, and in
    one batch with a base row, through a prefill, a prompt chunk after a past and decode steps, each
    row's logits equal its own model's plain forward. Kimi Linear's checkpoint holds its fused
    convolution as three pieces, which land as rows of the mixer's parameter. Jamba's mixer reads its
    ``dt_proj`` weight itself: that linear's tensors are the mixer's, not a ``DeltaLinear``'s.
    Nemotron-H's checkpoint names its tensors under ``backbone.``. Zamba2's hybrid layers share one
    transformer block, stored once: a variant's change of it reaches both layers."""
    _check_delta_mode(tmp_path, arch, torch.device("cpu"), 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_5", "lfm2", "jamba", "nemotron_h"])
def test_delta_mode_hybrid_models_on_cuda(tmp_path, arch):
    """The same on a GPU (the state pool and the per-group runs on CUDA tensors)."""
    _check_delta_mode(tmp_path, arch, torch.device("cuda"), 2e-3)


def _check_delta_mode(tmp_path, arch: str, device: torch.device, tol: float) -> None:
    from _factories import finetune, save_model

    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.serve.delta_mixer import DeltaMixer
    from deltazip.runtime.serve.model import DeltaModel
    from deltazip.runtime.serve.model_runner import new_kv_pool, new_seq_kv
    from deltazip.runtime.serve.variant_sources import (
        BaseTensorIndex,
        compare_full_checkpoint,
        inspect_variant,
    )

    with single_thread():
        base_model = tiny_model(arch)
        base = Checkpoint(save_model(base_model, tmp_path / "base"))
        fts = {n: finetune(tiny_model(arch), steps=8, seed=s) for n, s in (("a", 3), ("b", 4))}
        dm = DeltaModel(base, [], 2, device, torch.float32)
        for slot, (name, ft) in enumerate(fts.items()):
            v = inspect_variant(save_model(ft, tmp_path / name), name)
            compare_full_checkpoint(v, BaseTensorIndex(base, dm.registry.fingerprint_bytes), 4)
            dm.commit_variant(v, dm.prepare_variant(v))
            dm.write_slot(slot, name, dm.load_host(name))
        mixers = {n.split(".")[2] for n, m in dm.modules.items() if isinstance(m, DeltaMixer)}
        types = base_model.config.layer_types
        assert mixers == {str(i) for i, t in enumerate(types) if t in RECURRENT_LAYER_TYPES}  # one per recurrent layer
        if arch == "jamba":  # read by the mixer itself: held whole by it, never a DeltaLinear
            assert not any(n.endswith("dt_proj") for n in dm.modules), [n for n in dm.modules if n.endswith("dt_proj")]
        refs = [m.to(device) for m in (fts["a"], base_model, fts["b"])]
        slots = [0, -1, 1]
        pool = new_kv_pool(dm)
        caches = [new_seq_kv(pool) for _ in slots]
        seqs = [[5, 9, 14, 3, 22], [11, 4, 30], [6, 2, 19, 17, 25, 8]]
        steps = [[list(s) for s in seqs], [[12, 13, 3], [21], [4, 4]], [[7], [9], [3]], [[15], [2], [28]]]
        for new in steps:
            past = [c.length for c in caches]
            if past[0]:
                for s, t in zip(seqs, new):
                    s.extend(t)
            got = forward_step(dm, pool, caches, slots, new, past)
            for i, ref in enumerate(refs):
                with torch.no_grad():
                    want = ref(torch.tensor([seqs[i]], device=device)).logits[0, -1]
                torch.testing.assert_close(got[i], want.float(), rtol=tol, atol=tol)
        for c in caches:
            c.free()
