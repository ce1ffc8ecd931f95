"""The paged KV cache (blocks, block tables, preemption) and its attention function, on tiny models."""

from __future__ import annotations

import random

import pytest
import torch
from _factories import tiny_model
from _serving import PlainBackend, single_thread

from deltazip.runtime.serve.attention import PAGED_ATTENTION, paged_attention_forward, use_paged_attention
from deltazip.runtime.serve.kv_cache import CURRENT_STEP, BlockPool, PagedStep, SeqBlocks
from deltazip.runtime.serve.kv_meter import KVCopyMeter
from deltazip.runtime.serve.model_runner import KVPool, SeqKV, forward_step


def test_block_pool_allocates_lowest_first_grows_and_holds_nothing_when_idle():
    pool = BlockPool(block_size=4)
    a = pool.alloc(3)
    assert a == [0, 1, 2] and pool.num_blocks == 8
    k, v = pool.layer(0, 2, 8, torch.zeros(1), dim_v=6)
    assert k.shape == (8, 2, 4, 8) and v.shape == (8, 2, 4, 6)
    k[a] = 1.0
    b = pool.alloc(7)  # more than is free: the pool doubles and keeps the cached blocks
    assert pool.num_blocks == 16 and b == [3, 4, 5, 6, 7, 8, 9]
    assert bool((pool.k[0][a] == 1).all()) and pool.copied_bytes == (8 * 4 * 2 * 8 + 8 * 4 * 2 * 6) * 4
    pool.free(a)
    assert pool.alloc(2) == [0, 1]  # freed blocks are reused, lowest first
    pool.free([0, 1] + b)
    assert pool.num_blocks == 0 and pool.k == [] and pool.nbytes() == 0


def test_sequence_blocks_on_demand_offload_and_restore():
    pool = BlockPool(block_size=4)
    s = SeqBlocks()
    s.reserve(pool, 5)
    assert len(s.blocks) == 2
    s.reserve(pool, 8)
    assert len(s.blocks) == 2  # still fits
    s.reserve(pool, 9)
    assert len(s.blocks) == 3
    other = SeqBlocks()
    other.reserve(pool, 4)
    k, v = pool.layer(0, 2, 3, torch.zeros(1))
    k[s.blocks] = torch.arange(3.0).view(3, 1, 1, 1) + 1
    v[s.blocks] = -k[s.blocks]
    s.length, held = 9, list(s.blocks)
    s.offload()
    assert s.blocks == [] and s.host is not None and s.nbytes() == 2 * 3 * 4 * 2 * 3 * 4
    assert sorted(pool._free)[:3] == sorted(held)  # its blocks went back to the pool
    k[held] = 0.0  # someone else overwrites them
    filler = SeqBlocks()
    filler.reserve(pool, 4)  # takes the lowest free block: the restored blocks land elsewhere
    s.attach(pool)
    assert s.host is None and s.blocks != held and len(s.blocks) == 3
    assert torch.equal(pool.k[0][s.blocks][:, 0, 0, 0], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(pool.v[0][s.blocks], -pool.k[0][s.blocks])
    for c in (s, other, filler):
        c.free()
    assert pool.num_blocks == 0


def _gemma2():
    """Gemma 2: soft-capped attention logits, sliding-window layers (window 6) between global ones."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma2", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=128,
                               vocab_size=40, sliding_window=6, attn_logit_softcapping=5.0,
                               query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _gpt_oss():
    """GPT-OSS: attention sinks (drawn large enough to matter), a window of 6 on every other layer."""
    model = tiny_model("gpt_oss", vocab_size=40)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(3))
    return model


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_without_a_bound_step_the_paged_attention_is_the_models_own(arch):
    """A model switched to the paged attention and called outside the engine (``generate``, say): the
    soft-capping and attention-sink paths give the eager attention's logits, windows included."""
    import copy

    with single_thread():
        model = {"gemma2": _gemma2, "gpt_oss": _gpt_oss}[arch]()
        ref = copy.deepcopy(model)
        ref.set_attn_implementation("eager")
        assert use_paged_attention(model)
        ids = torch.tensor([[5, 9, 14, 3, 22, 7, 11, 4, 30, 8, 12]])
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gemma", "gemma2", "gpt_oss"])
def test_paged_decoding_equals_full_forward_under_churn(arch):
    """Sequences of random lengths start, grow in chunks and one token at a time, get preempted and
    restored and finish, their blocks interleaved in the pool; every step's logits equal a full
    forward of the sequence, without a cache, by transformers' eager attention."""
    import copy

    with single_thread():
        model = {"gemma2": _gemma2, "gpt_oss": _gpt_oss}.get(arch, lambda: tiny_model(arch))()
        ref = copy.deepcopy(model)
        ref.set_attn_implementation("eager")
        assert use_paged_attention(model) and model.config._attn_implementation == PAGED_ATTENTION
        be, pool, rng = PlainBackend(model), BlockPool(block_size=4), random.Random(0)
        live: dict[int, tuple[SeqBlocks, list[int]]] = {}
        for step in range(14):
            if len(live) < 4:
                live[step] = (SeqBlocks(), [rng.randrange(3, 40) for _ in range(rng.randrange(2, 11))])
            if step % 5 == 4:
                victim = next(iter(live))
                live[victim][0].offload()
            rows = list(live)
            toks = []
            for r in rows:
                cache, ids = live[r]
                n = len(ids) - cache.length if cache.length < len(ids) else 1
                n = min(n, rng.randrange(1, 6))
                if cache.length == len(ids):
                    ids.append(rng.randrange(3, 40))
                toks.append(ids[cache.length:cache.length + n])
            caches = [live[r][0] for r in rows]
            logits = forward_step(be, pool, caches, [-1] * len(rows), toks, [c.length for c in caches])
            for i, r in enumerate(rows):
                ids = live[r][1][: caches[i].length]
                with torch.no_grad():
                    want = ref(torch.tensor([ids])).logits[0, -1]
                torch.testing.assert_close(logits[i], want, rtol=1e-4, atol=1e-4)
            if step % 3 == 2:
                done = rows[0]
                live.pop(done)[0].free()
        for c, _ in live.values():
            c.free()
        assert pool.num_blocks == 0 and pool.nbytes() == 0


def test_latent_attention_takes_the_contiguous_pool_and_decodes_as_a_full_forward():
    """Multi-head latent attention (DeepSeek-V3) caches a latent (kv_lora_rank wide) and a rope key
    (qk_rope_head_dim wide) that ``kv_b_proj`` expands after the cache read: it keeps the contiguous
    pool, whose read is the batch's rows (the paged read is the whole pool). Keys and values of two
    widths go through prefill, decode, offload to the host and back; every step's logits equal a full
    forward, the cache's bytes are those two widths, and the engine's admission counts them per token."""
    import copy

    from deltazip.runtime.serve.attention import expands_cached_latents
    from deltazip.runtime.serve.engine import _kv_bytes_per_token

    with single_thread():
        model = tiny_model("deepseek_v3")
        ref = copy.deepcopy(model)
        assert expands_cached_latents(model) and not expands_cached_latents(tiny_model("llama"))
        assert not use_paged_attention(model) and model.config._attn_implementation != PAGED_ATTENTION
        cfg = model.config
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim  # 32 + 8
        assert _kv_bytes_per_token(cfg, torch.float32) == cfg.num_hidden_layers * width * 4
        be, pool = PlainBackend(model), KVPool()
        seqs = [(SeqKV(), [5, 9, 14, 3, 22, 7]), (SeqKV(), [11, 4, 30])]
        for step in range(6):
            if step == 3:
                seqs[0][0].offload()
                assert seqs[0][0].nbytes() == cfg.num_hidden_layers * width * 4 * seqs[0][0].length
            toks = []
            for cache, ids in seqs:
                if cache.length == len(ids):
                    ids.append(3 + (7 * step + len(ids)) % 37)
                toks.append(ids[cache.length:])
            caches = [c for c, _ in seqs]
            logits = forward_step(be, pool, caches, [-1, -1], toks, [c.length for c in caches])
            for i, (_, ids) in enumerate(seqs):
                with torch.no_grad():
                    want = ref(torch.tensor([ids])).logits[0, -1]
                torch.testing.assert_close(logits[i], want, rtol=1e-4, atol=1e-4)
        assert seqs[1][0].nbytes() == cfg.num_hidden_layers * width * 4 * pool.capacity
        for c, _ in seqs:
            c.free()


@pytest.mark.parametrize("arch,paged", [("llama", True), ("gemma2", True), ("llama", False)])
def test_forked_sequences_share_the_prefix_and_decode_as_fresh_ones(arch, paged):
    """The samples of one prompt (n > 1): three forks of a prefilled 13-token prompt share its three
    full blocks (counted by reference, the partial fourth copied) and, decoding different tokens in
    one batch beside an unrelated sequence, give the logits of a fresh forward of each sequence;
    when all finish the pool is empty. The contiguous pool (``paged=False``) copies the row instead."""
    import copy

    with single_thread():
        model = _gemma2() if arch == "gemma2" else tiny_model(arch)
        ref = copy.deepcopy(model)
        ref.set_attn_implementation("eager")
        if paged:
            use_paged_attention(model)
        be = PlainBackend(model)
        pool = BlockPool(block_size=4) if paged else KVPool()
        new = SeqBlocks if paged else SeqKV
        prompt, other = list(range(5, 18)), [9, 8, 7, 6, 5]
        parent, stranger = new(), new()
        forward_step(be, pool, [parent, stranger], [-1, -1], [prompt, other], [0, 0])
        kids = [parent.fork() for _ in range(3)]
        if paged:
            assert pool.used() == 4 + 2 + 3  # the prompt's 4 blocks, the stranger's 2, one copied block per fork
            assert all(k.blocks[:3] == parent.blocks[:3] and k.blocks[3] != parent.blocks[3] for k in kids)
        seqs = [(c, list(prompt)) for c in [parent, *kids]] + [(stranger, list(other))]
        for step in range(6):  # past the shared blocks' end: the forks write only their own blocks
            toks = [[20 + i + step] for i in range(len(seqs))]
            caches = [c for c, _ in seqs]
            logits = forward_step(be, pool, caches, [-1] * len(seqs), toks, [c.length for c in caches])
            for i, ((_, ids), t) in enumerate(zip(seqs, toks)):
                ids += t
                with torch.no_grad():
                    want = ref(torch.tensor([ids])).logits[0, -1]
                torch.testing.assert_close(logits[i], want, rtol=1e-4, atol=1e-4)
        for c, _ in seqs:
            c.free()
        assert pool.nbytes() == 0 and (not paged or not pool._refs)


def _reference(q, k, v, q_pos, k_pos, scaling, window, softcap):
    """Eager attention of one row: q [H, T, D], k/v [S, H_kv, D], positions; K/V repeated per group."""
    g = q.shape[0] // k.shape[1]
    kk = k.permute(1, 0, 2).repeat_interleave(g, 0)
    vv = v.permute(1, 0, 2).repeat_interleave(g, 0)
    s = q @ kk.transpose(1, 2) * scaling
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    ok = k_pos.view(1, -1) <= q_pos.view(-1, 1)
    if window:
        ok &= k_pos.view(1, -1) > q_pos.view(-1, 1) - window
    s = s.masked_fill(~ok, float("-inf"))
    return (torch.softmax(s, -1) @ vv).transpose(0, 1)  # [T, H, D]


@pytest.mark.parametrize("window,softcap,new", [(None, None, [1, 1, 1]), (5, None, [1, 1, 1]), (None, 30.0, [1, 1, 1]),
                                                 (4, 20.0, [6, 2, 9]), (None, None, [3, 7, 1])])
def test_attention_honours_scaling_window_softcap_and_gqa(window, softcap, new):
    torch.manual_seed(0)
    pool, hq, hkv, d = BlockPool(block_size=4), 6, 2, 8
    past = [9, 0, 14]
    caches = [SeqBlocks() for _ in past]
    junk = SeqBlocks()
    for c, p in zip(caches, past):  # interleave the rows' blocks with another sequence's
        c.reserve(pool, p)
        junk.reserve(pool, len(junk.blocks) * 4 + 4)
    step = PagedStep(pool, caches, past, new, "cpu")
    tm = max(new)
    k_new, v_new = torch.randn(3, hkv, tm, d), torch.randn(3, hkv, tm, d)
    pk, pv = pool.layer(0, hkv, d, k_new)
    pk.normal_()
    pv.normal_()
    pool_k, pool_v = step.update(k_new, v_new, 0)
    q = torch.randn(3, hq, tm, d)
    token = CURRENT_STEP.set(step)
    try:
        out, _ = paged_attention_forward(None, q, pool_k, pool_v, None, scaling=0.3, sliding_window=window,
                                         softcap=softcap)
    finally:
        CURRENT_STEP.reset(token)
    assert out.shape == (3, tm, hq, d)
    for b in range(len(caches)):
        n = past[b] + new[b]
        blk, off = [step.tables[b][x // 4] for x in range(n)], [x % 4 for x in range(n)]
        k, v = pk[blk, :, off], pv[blk, :, off]  # [n, H_kv, D]
        torch.testing.assert_close(k[past[b]:], k_new[b, :, tm - new[b]:].transpose(0, 1))  # appended in place
        q_pos = torch.arange(past[b], n)
        want = _reference(q[b, :, tm - new[b]:], k, v, q_pos, torch.arange(n), 0.3, window, softcap)
        torch.testing.assert_close(out[b, tm - new[b]:], want, rtol=1e-5, atol=1e-5)


def test_a_decode_step_copies_no_kv_bytes_beyond_the_new_tokens():
    """The 0-KV-bytes proxy: on the paged cache a decode step writes exactly the new tokens' keys and
    values and copies nothing else out of the cache; the contiguous pool copies the whole past."""
    with single_thread():
        model = tiny_model("llama")
        use_paged_attention(model)
        be, cfg = PlainBackend(model), model.config
        rows, context = 4, 21
        per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
        measured = {}
        for name, pool in (("paged", BlockPool()), ("contiguous", KVPool())):
            caches = [SeqBlocks() if name == "paged" else SeqKV() for _ in range(rows)]
            forward_step(be, pool, caches, [-1] * rows, [[5 + i] * context for i in range(rows)], [0] * rows)
            with KVCopyMeter(pool) as meter:
                forward_step(be, pool, caches, [-1] * rows, [[7]] * rows, [c.length for c in caches])
            measured[name] = meter
        assert measured["paged"].copied == 0
        assert measured["paged"].appended == rows * per_token
        assert measured["contiguous"].appended == rows * per_token
        assert measured["contiguous"].copied >= 2 * rows * context * per_token  # gather + concatenate


def test_the_cuda_graph_step_layout_run_eagerly_equals_the_paged_step():
    """What a captured decode step computes (static buffers over the whole pool, padding rows up to
    the bucket writing into a free block), run eagerly on the CPU: the real rows' logits equal the
    ordinary paged step's, and the padding touched no sequence's cache."""
    from deltazip.runtime.serve.cuda_graphs import StaticDecodeStep

    with single_thread():
        model = tiny_model("llama")
        use_paged_attention(model)
        be = PlainBackend(model)
        pools = [BlockPool(block_size=4), BlockPool(block_size=4)]
        prompts = [[5, 6, 7, 8, 9], [10, 11], [12] * 9]
        caches = [[SeqBlocks() for _ in prompts] for _ in pools]
        toks = [forward_step(be, p, c, [-1] * 3, prompts, [0] * 3).argmax(-1).tolist() for p, c in zip(pools, caches)]
        assert toks[0] == toks[1]
        toks = toks[0]
        for _ in range(5):
            want = forward_step(be, pools[1], caches[1], [-1] * 3, [[t] for t in toks], [c.length for c in caches[1]])
            past = [c.length for c in caches[0]]
            for c, p in zip(caches[0], past):
                c.reserve(pools[0], p + 1)
            step = StaticDecodeStep(pools[0], 4, torch.device("cpu"))
            scratch = pools[0]._free[0]
            step.fill(caches[0], toks, past, scratch)
            with torch.inference_mode():
                got = be.forward([-1] * 4, step.ids, step.q_pos, step.mask, step)
            for c in caches[0]:
                c.length += 1
            assert scratch not in {b for c in caches[0] for b in c.blocks}
            torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
            assert bool(torch.isfinite(got).all())  # padding rows attend to nothing, yet no NaN
            toks = want.argmax(-1).tolist()


def test_a_decode_composition_met_once_runs_eagerly_and_is_captured_the_second_time():
    """``DecodeGraphs.run``'s policy: a key (bucket, rows' slots, ...) met for the first time gets None
    (the engine runs it eagerly) without any capture; met again, it is captured. On this CPU the
    capture cannot succeed, so the second meeting marks the key eager for good and later ones try no
    more; a different composition starts over at its own first meeting."""
    from deltazip.runtime.serve.cuda_graphs import DecodeGraphs
    from deltazip.runtime.serve.delta_linear import DeltaContext

    with single_thread():
        model = tiny_model("llama")
        use_paged_attention(model)
        be = PlainBackend(model)
        be.ctx = DeltaContext(num_slots=2)
        pool = BlockPool(block_size=4)
        caches = [SeqBlocks() for _ in range(3)]
        forward_step(be, pool, caches, [-1] * 3, [[5, 6, 7], [8, 9], [10]], [0] * 3)
        graphs = DecodeGraphs(be, pool)
        for slots in ([-1, -1, -1], [-1, -1]):  # a batch composition, then another: each met once
            assert graphs.run(caches[:len(slots)], slots, [1] * len(slots), ("w",)) is None
        assert not graphs.failed and graphs.captures == 0 and not graphs.graphs
        assert graphs.run(caches, [-1, -1, -1], [1, 1, 1], ("w",)) is None  # met again: a capture, failed here
        key = (4, (-1, -1, -1, -1), ("w",))
        assert graphs.failed == {key} and graphs.captures == 0
        assert graphs.run(caches, [-1, -1, -1], [1, 1, 1], ("w",)) is None and graphs.failed == {key}


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}), ("gpt_oss", {}), ("llama4", {}),
    ("gemma4", {}),  # global layers: twice the head size, one key/value head (keys doubling as values)
    # wider global layers, and two last layers that reuse earlier layers' keys and values (no cache of their own)
    ("gemma4", dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                    num_kv_shared_layers=2, enable_moe_block=False, attention_k_eq_v=False,
                    hidden_size_per_layer_input=16, vocab_size_per_layer_input=64)),
], ids=["llama", "gpt_oss", "llama4", "gemma4-moe", "gemma4-kv-shared"])
def test_kv_admission_counts_what_the_paged_pool_holds_per_token(arch, overrides):
    """The engine admits requests by ``_kv_bytes_per_token`` (from the config); after a prefill through
    the paged pool, the pool's layers hold exactly that many bytes per token position."""
    from deltazip.runtime.serve.engine import _kv_bytes_per_token

    with single_thread():
        model = tiny_model(arch, **overrides)
        assert use_paged_attention(model)
        pool = BlockPool(block_size=4)
        caches = [SeqBlocks(), SeqBlocks()]
        forward_step(PlainBackend(model), pool, caches, [-1, -1], [[5, 9, 14, 3, 22], [11, 4]], [0, 0])
        held = pool.nbytes() // (pool.num_blocks * pool.block_size)
        assert held == _kv_bytes_per_token(model.config, torch.float32) > 0
        for c in caches:
            c.free()
