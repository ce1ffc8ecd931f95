"""``--tensor-parallel 2`` beyond Llama: families whose attention splits by heads with nothing shared
across them serve a compressed fine-tune as the merged model generates it. Each test starts its own
two-rank group (this process is rank 0), so they live apart from ``test_tensor_parallel.py``'s
module-wide group."""

from __future__ import annotations

import shutil

import pytest
import torch
from _factories import calib_file, finetune, lora_adapter, save_model, tiny_model
from _images import generate
from _serving import engine_runs, single_thread

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import load_merged_model
from deltazip.compress.pipeline import compress_delta
from deltazip.demo.pair import build_char_tokenizer
from deltazip.formats.artifact import Artifact
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint
from deltazip.models.loader import load_causal_lm
from deltazip.runtime.cluster.tp_group import start_tensor_parallel
from deltazip.runtime.serve.variant_sources import BaseTensorIndex, compare_full_checkpoint, discover_variants
from deltazip.runtime.share.dedup_serving import new_serving_registry


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "gemma4", "granite", "smollm3", "cohere", "apertus",
                                  "nemotron", "exaone", "phi3", "olmo2", "olmo3", "starcoder2", "phi", "opt", "gptj",
                                  "xglm", "gpt_neox", "persimmon", "bitnet", "falcon", "falcon_mha", "qwen3_5",
                                  "lfm2", "lfm3", "bamba", "mamba2", "falcon_h1", "mamba", "falcon_mamba", "olmo_hybrid",
                                  "gpt_bigcode", "gpt_bigcode_mha", "bloom", "mpt", "falcon_rw", "falcon_mq",
                                  "codegen"])
def test_more_families_shard_and_answer_as_the_merged_model(tmp_path, arch):
    """Families whose attention splits by heads with nothing shared across them (Qwen3's per-head q/k
    norms; Gemma 2's soft-capped logits and sliding windows; Gemma 3; Gemma 4's per-layer inputs;
    Granite's multipliers; SmolLM3's layers without rotary positions; Cohere's parallel attention and
    MLP; Apertus' and Nemotron's ungated MLPs; EXAONE; Phi-3's fused ``qkv_proj`` and
    ``gate_up_proj``, cut block by block; OLMo 2 and 3, whose q/k norms span every head, and BitNet,
    whose sub-layer norms span the split widths: each rank keeps its columns and the sum of squares
    is all-reduced; projections named otherwise:
    StarCoder2's ``c_fc``/``c_proj`` with biases, Phi-2's ``dense``/``fc1``/``fc2``, OPT's and XGLM's
    ``out_proj`` and layer-level ``fc1``/``fc2`` (XGLM reshaping to its own width), GPT-J's
    ``transformer.h`` layers, GPT-NeoX's and Persimmon's ``query_key_value`` holding each head's q, k
    and v together, Falcon's each KV group's; Qwen3.5's and OLMo Hybrid's gated delta nets (OLMo
    Hybrid's convolution stored as three checkpoint pieces, each cut to the rank's rows), Bamba's and Mamba-2's
    Mamba-2 mixers, Mamba's and Falcon-Mamba's Mamba-1 mixers (``x_proj`` row-parallel, all-reduced
    inside the mixer) and LFM2's and LFM3's short convolutions (LFM3's attention gated per head by
    ``g_proj``), split by channels with their recurrent states and the variant's own tensors of them;
    BLOOM, MPT (``Wqkv`` cut block by block) and Falcon-RW, whose ALiBi biases, built for every head
    above the layers, are cut to each rank's heads; Falcon-7B's multi-query ``query_key_value``, each
    rank keeping its query heads and the one key and value head whole; CodeGen's ``qkv_proj``, four
    blocks of a quarter of the heads' queries, values and keys each, two kept whole by each rank): two ranks serve a compressed fine-tune's greedy text and log probabilities as
    the merged model generates them."""
    # gemma4: its dense form with two KV heads everywhere (the factory's form is served below)
    dense = dict(enable_moe_block=False, attention_k_eq_v=False, num_global_key_value_heads=2) if arch == "gemma4" else {}
    _served_as_merged(tmp_path, arch, **dense)


@pytest.mark.parametrize("arch,config", [("llama", dict(num_key_value_heads=1)), ("qwen2", dict(num_key_value_heads=1)),
                                         ("phi3", dict(num_key_value_heads=1)), ("gemma4", {})])
def test_fewer_kv_heads_than_ranks_are_kept_whole_by_each_rank(tmp_path, arch, config):
    """One KV head over two ranks (Gemma 3 1B's and Gemma 2B's layout; Qwen2's with its k/v biases;
    Phi-3's inside its fused ``qkv_proj``; Gemma 4's global layers, one KV head beside sliding layers
    of two, with experts): each rank keeps the KV head its query heads read, a variant's k/v deltas
    cut alike, and serves the merged model's text and log probabilities."""
    _served_as_merged(tmp_path, arch, **config)


@pytest.mark.parametrize("config", [{}, dict(use_shared_attention_adapter=True, num_key_value_heads=4)],
                         ids=["mlp-adapters", "attention-adapters"])
def test_zamba2_shared_blocks_and_their_adapters_shard(tmp_path, config):
    """Zamba2: the transformer block its hybrid layers share (tied parameters) is cut once per layer
    and tied again, so a variant's change of it reaches every layer that runs it; each layer's
    low-rank adapter adds its second linear's output to a split projection's, so that linear keeps
    the projection's rows (``gate_up_proj``'s gate and up halves; with attention adapters, ``q``, ``k``,
    ``v``'s heads) and the first stays whole; the Mamba-2 mixer inside ``mamba_decoder`` (decoupled
    with its norm as one block) is cut by heads. Two ranks serve the merged model's text."""
    _served_as_merged(tmp_path, "zamba2", **config)


@pytest.mark.parametrize("arch", ["llama", "olmo2", "qwen3_5", "granitemoehybrid"])
def test_bf16_shards_answer_as_the_merged_model_in_bf16(tmp_path, arch):
    """Served in bf16, as on GPUs: Llama, OLMo 2's split q/k norms (their sums of squares all-reduced
    in fp32), Qwen3.5's gated delta nets and Granite 4's one-group Mamba-2 norm give the merged bf16
    model's greedy text, log probabilities within 0.05 (0.023 at most when this was written)."""
    _served_as_merged(tmp_path, arch, torch.bfloat16)


def test_gpt2_conv1d_layers_shard_for_compressed_and_whole_fine_tunes(tmp_path):
    """GPT-2's linears are Conv1D, weights stored ``[in, out]``, ``c_attn`` stacking every query, key
    and value head, split at the attention's ``split_size``: each rank keeps its heads' columns of each
    block. A compressed fine-tune (packed ``[out, in]``), the same fine-tune served whole (dense
    replacements in the ``[in, out]`` layout, cut alike) and a LoRA adapter on the Conv1D layers
    (factors ``[r, in]``, ``[out, r]``) answer as the merged, the fine-tuned and PEFT's merged model."""
    _served_as_merged(tmp_path, "gpt2", whole=True,
                      lora=dict(target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True))


def test_a_lora_adapter_with_saved_modules_is_cut_as_its_layers_are(tmp_path):
    """A LoRA adapter on ``q_proj`` and ``down_proj`` that also saves ``lm_head`` and ``embed_tokens``
    whole (``modules_to_save``): the factors are cut with their projections, the saved tensors kept whole
    on every rank as the layers they replace are; two ranks serve PEFT's merged model's text."""
    _served_as_merged(tmp_path, "llama", lora=dict(target_modules=["q_proj", "down_proj"],
                                                   modules_to_save=["lm_head", "embed_tokens"]))


def test_a_lora_adapter_that_trains_biases_is_cut_as_its_layers_are(tmp_path):
    """Qwen2's q/k/v biases trained whole (``bias="all"``) and ``lora_bias`` on ``q_proj`` and ``v_proj``:
    each rank keeps its rows of every column-parallel bias; two ranks serve PEFT's merged model's text."""
    _served_as_merged(tmp_path, "qwen2", lora=dict(target_modules=["q_proj", "v_proj"], bias="all", lora_bias=True))


def test_a_dora_adapter_takes_each_rows_norm_over_the_whole_base_weight(tmp_path):
    """DoRA (``use_dora``) on the column-parallel ``q_proj`` and the row-parallel ``down_proj``: each
    output row of ``W + scale · B A`` is rescaled by its norm over every input column, which a
    row-parallel shard does not hold; the rank reads the whole base weight from the checkpoint, merges,
    then keeps its columns. Two ranks serve PEFT's merged model's text."""
    _served_as_merged(tmp_path, "llama", lora=dict(target_modules=["q_proj", "down_proj"], use_dora=True))


@pytest.mark.parametrize("arch,targets", [("phimoe", "all-linear"), ("mamba", ["in_proj", "x_proj", "dt_proj"])],
                         ids=["phimoe-router", "mamba-dt-proj"])
def test_lora_on_a_router_or_a_mixer_read_linear_is_served_by_two_ranks(tmp_path, arch, targets):
    """LoRA on Phi-3.5-MoE's own-forward router (its merged weight, whole on every rank, through the
    router's forward) and on Mamba's ``dt_proj``, which the mixer reads itself (its merged weight cut
    with the mixer's channels): two ranks serve PEFT's merged model's text."""
    _served_as_merged(tmp_path, arch, lora=dict(target_modules=targets))


def test_a_lora_adapter_with_trained_token_rows_keeps_them_whole_on_every_rank(tmp_path):
    """A LoRA adapter on ``q_proj`` that trains the rows of the prompts' own tokens
    (``trainable_token_indices``) on a base with tied embeddings: the token table and ``lm_head`` are
    whole on every rank, so each applies the rows as one model does; two ranks serve PEFT's merged
    model's text."""
    ids = sorted(set(build_char_tokenizer()("zip model tune")["input_ids"]))[:6]
    _served_as_merged(tmp_path, "llama", tie_word_embeddings=True,
                      lora=dict(target_modules=["q_proj"], trainable_token_indices=ids))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-gates", "sparse-gates-shared-kv"])
def test_gemma3n_sparse_gates_altup_and_per_layer_inputs_shard(tmp_path, sparse):
    """Gemma 3n: AltUp, Laurel and the per-layer inputs stay whole on every rank beside the split
    attention and MLP; the first layer's gate kept sparse (``relu(g - (mean + z * std))``) takes its
    mean and deviation over both ranks' columns; the last two layers read the KV heads of the earlier
    layers of their kind (Gemma 3n's shared KV), each rank its own. Served as the merged model
    (``--group-size auto``, as AltUp's coefficients have 2 inputs: widths of 256 keep each rank's 128
    columns whole groups)."""
    shape = dict(head_dim=64, intermediate_size=[256] * 4, num_hidden_layers=4, layer_types=["sliding_attention",
                 "full_attention"] * 2, num_kv_shared_layers=2 if sparse else 0,
                 activation_sparsity_pattern=[0.95 if sparse else 0.0, 0.0, 0.0, 0.0])
    _served_as_merged(tmp_path, "gemma3n", group_auto=True, **shape)


def _served_as_merged(tmp_path, arch: str, dtype: torch.dtype = torch.float32, whole: bool = False,
                      group_auto: bool = False, lora: dict | None = None, **config) -> None:
    """A tiny ``arch`` base and a fine-tune compressed 4-bit (groups of 16); two ranks serve its greedy
    text and log probabilities as the merged model generates them, in ``dtype`` (log probabilities
    within 1e-4 in fp32; in bf16, where the ranks' partial sums round apart from one whole matmul,
    within 0.05). ``whole``: the fine-tune is served as a plain checkpoint too, as it generates;
    ``group_auto``: groups as ``--group-size auto`` picks them; ``lora``: a PEFT adapter of that config
    on the base is served too, as PEFT's merged model generates."""
    ids = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2, vocab_size=128, **config)
    tok = build_char_tokenizer()
    prompts = ["zip model tune", "alpha beta gamma delta"]
    with single_thread():
        base_dir = save_model(tiny_model(arch, **ids), tmp_path / "base", tokenizer=False)
        ft_model = finetune(tiny_model(arch, **ids), steps=30, seed=3)
        ft_dir = save_model(ft_model, tmp_path / "ft", tokenizer=False)
        for d in (base_dir, ft_dir):
            tok.save_pretrained(d)
        cfg = CompressConfig(scheme=DeltaScheme(bits=4, group_size=16, sparsity="none"), method="deltazip",
                             nsamples=8, seqlen=32, device="cpu", group_auto=group_auto)
        compress_delta(base_dir, ft_dir, str(calib_file(tmp_path / "calib", n=16)), tmp_path / "arts" / "ft", cfg)
        ck = Checkpoint(base_dir)
        merged = load_merged_model(Artifact(tmp_path / "arts" / "ft"), ck).to(dtype)
        want = [generate(merged, tok(p)["input_ids"], None, n=8) for p in prompts]
        asked = [("ft", p) for p in prompts]
        if whole:
            shutil.copytree(ft_dir, tmp_path / "arts" / "whole")
            want += [generate(ft_model.to(dtype), tok(p)["input_ids"], None, n=8) for p in prompts]
            asked += [("whole", p) for p in prompts]
        if lora is not None:
            pm = lora_adapter(load_causal_lm(base_dir, torch.float32), tmp_path / "arts" / "lora", 5, **lora)
            peft_merged = pm.merge_and_unload().to(dtype)
            want += [generate(peft_merged, tok(p)["input_ids"], None, n=8) for p in prompts]
            asked += [("lora", p) for p in prompts]
        variants = discover_variants(tmp_path / "arts")
        index = BaseTensorIndex(ck, new_serving_registry().fingerprint_bytes)
        for v in variants:  # (as the server does: a whole checkpoint's tensors compared with the base's)
            if v.kind == "full":
                compare_full_checkpoint(v, index, torch.tensor([], dtype=dtype).element_size())
        tp = start_tensor_parallel(ck, variants, max(2, len(variants)), torch.device("cpu"), dtype, 2)
        try:
            got = engine_runs(tp, tok, asked, 8, max_batch_tokens=16)
        finally:
            tp.close()
    tol = 1e-4 if dtype == torch.float32 else 0.05
    for g, w in zip(got, want):
        assert g.text == w[0] and max(abs(a[1] - b) for a, b in zip(g.logprobs, w[1])) < tol, (g.text, w)


def test_attention_tensors_that_do_not_split_with_the_heads_are_refused_in_one_line():
    """One norm weight per head (Cohere's ``use_qk_norm``) or a q/k norm over every head that is not
    split (OLMo 2's, before ``split_qk_norms``) would be wrong on a rank holding half the heads:
    refused, naming the tensor; per-head norms pass."""
    from deltazip.formats.errors import InputError
    from deltazip.runtime.cluster.tensor_parallel import check_attention

    olmo2 = tiny_model("olmo2")
    cohere = tiny_model("cohere", use_qk_norm=True)
    for model, bad in ((olmo2, "q_norm.weight [64]"), (cohere, "q_norm.weight [4, 16]")):
        with pytest.raises(InputError, match=r"cannot split model\.layers\.0\.self_attn\." + bad.replace("[", r"\[")) as e:
            check_attention(model.model.layers[0].self_attn, "model.layers.0.self_attn", 16)
        assert "\n" not in str(e.value) and "--tensor-parallel 1" in str(e.value)
    check_attention(tiny_model("qwen3").model.layers[0].self_attn, "model.layers.0.self_attn", 16)  # [16] norms


def test_fused_projection_shards_keep_each_ranks_share_of_every_block():
    """A ``qkv_proj`` of 4 query and 2 KV heads of 16 on 2 ranks: rank r keeps query heads 2r, 2r+1 and
    KV head r; its shard of a packed delta, a dense one, a bias and a LoRA ``B`` is exactly those rows,
    and the rank outputs put back in place give the whole projection's."""
    from deltazip.formats.packing import pack_delta
    from deltazip.kernels.reference import delta_weight
    from deltazip.runtime.cluster.tp_shards import fused_blocks, kept_rows, shard_slot_args

    config = tiny_model("phi3").config
    sizes = fused_blocks("qkv_proj", 128, config, 16)
    assert sizes == [64, 32, 32] and fused_blocks("gate_up_proj", 256, config, 16) == [128, 128]
    assert fused_blocks("o_proj", 64, config, 16) is None
    torch.manual_seed(0)
    packed = pack_delta(torch.randint(0, 16, (128, 64)), torch.rand(128, 4) + 0.1, None, None, 4, 16)
    kw = dict(packed=packed, dense=torch.randn(128, 64), bias=torch.randn(128), lora_a=torch.randn(8, 64),
              lora_b=torch.randn(128, 8))
    x = torch.randn(3, 64)
    full = x @ (delta_weight(packed) + kw["dense"] + kw["lora_b"] @ kw["lora_a"]).T + kw["bias"]
    got = torch.empty_like(full)
    for rank in range(2):
        rows = kept_rows(sizes, rank, 2)
        assert rows.tolist() == [*range(32 * rank, 32 * rank + 32), *range(64 + 16 * rank, 80 + 16 * rank),
                                 *range(96 + 16 * rank, 112 + 16 * rank)]
        part = shard_slot_args(kw, "column", rank, 2, rows)
        got[:, rows] = x @ (delta_weight(part["packed"]) + part["dense"] + part["lora_b"] @ part["lora_a"]).T \
            + part["bias"]
    assert torch.allclose(got, full, atol=1e-5)


def test_the_decoder_layers_are_named_as_the_checkpoint_names_them(tmp_path):
    """The manifest check before any rank starts looks at the tensors under the decoder list's
    checkpoint name: GPT-J's ``transformer.h``, an image-text model's language model's (never the
    vision tower's ``layers``, whose ``fc2`` a shard would not cut)."""
    from safetensors import safe_open

    from deltazip.runtime.cluster.tensor_parallel import checkpoint_layers

    for arch, want in (("llama", "model.layers"), ("gptj", "transformer.h"), ("gemma3_vl", "language_model.model.layers")):
        d = save_model(tiny_model(arch), tmp_path / arch, tokenizer=False)
        assert checkpoint_layers(d) == want
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            assert any(n.startswith(f"{want}.0.") for n in f.keys())


def test_a_model_whose_layers_hold_nothing_it_splits_is_refused(tmp_path, monkeypatch):
    """Were a family's projections named otherwise than the lists say, every rank would run and hold
    the whole model: rank 0, seeing no projection of its lists in the layers, refuses in one line."""
    from deltazip.formats.errors import InputError
    from deltazip.runtime.cluster import tensor_parallel

    # rank 0 finds no projection it splits (rank 1, spawned, shards as usual)
    monkeypatch.setattr(tensor_parallel, "shard_kind", lambda name, layers=None: None)
    with single_thread():
        base_dir = save_model(tiny_model("llama"), tmp_path / "base")
        with pytest.raises(InputError, match=r"rank 0: .*found no projection it splits in decoder layer 0 of "
                                             r"LlamaForCausalLM; serve this base with --tensor-parallel 1") as e:
            start_tensor_parallel(Checkpoint(base_dir), [], 1, torch.device("cpu"), torch.float32, 2)
    assert "\n" not in str(e.value)


def test_a_norm_over_a_split_width_that_is_not_an_rmsnorm_is_refused_by_name():
    """A sum of squares per rank gives an RMSNorm's statistics, not a LayerNorm's (its mean): a
    LayerNorm over OLMo 2's whole query width is refused, naming it; the RMSNorm is split."""
    from deltazip.formats.errors import InputError
    from deltazip.runtime.cluster.tp_norms import ShardedRMSNorm, split_norms

    attn = tiny_model("olmo2").model.layers[0].self_attn
    full = {"a.q_proj": (64, 64), "a.k_proj": (32, 64)}
    assert split_norms(attn, "a", full, 0, 2, None) == ["q_norm", "k_norm"]
    assert isinstance(attn.q_norm, ShardedRMSNorm) and attn.q_norm.weight.shape == (32,)
    attn = tiny_model("olmo2").model.layers[0].self_attn
    attn.q_norm = torch.nn.LayerNorm(64)
    with pytest.raises(InputError, match=r"cannot split a\.q_norm \(LayerNorm over the full width 64, not an "
                                         r"RMSNorm\); serve this base with --tensor-parallel 1"):
        split_norms(attn, "a", full, 0, 2, None)


def test_falcon_layouts_a_degree_cannot_split_are_refused_in_one_line():
    """Falcon-40B's layout with fewer KV groups than ranks holds each group's queries, key and value
    together, so a rank cannot keep a whole KV head beside its share of the queries: refused.
    Falcon-7B's multi-query layout (every query head, then one key and one value head) and ALiBi
    Falcon (Falcon-RW) split; BLOOM's "slow but exact" emulation of its pretraining's tensor
    parallelism slices the output projection by the full width, so it is refused by name."""
    from transformers import AutoConfig

    from deltazip.formats.errors import InputError
    from deltazip.runtime.cluster.tensor_parallel import check_config

    base = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    check_config(AutoConfig.for_model("falcon", **base, new_decoder_architecture=True, num_kv_heads=2), 2)
    check_config(AutoConfig.for_model("falcon", **base, multi_query=False), 2)
    check_config(AutoConfig.for_model("falcon", **base), 2)  # multi_query by default
    with pytest.raises(InputError, match=r"--tensor-parallel 2 does not divide the model's KV heads \(1\)"):
        check_config(AutoConfig.for_model("falcon", **base, new_decoder_architecture=True, num_kv_heads=1), 2)
    check_config(AutoConfig.for_model("falcon", **base, multi_query=False, alibi=True), 2)
    bloom = dict(hidden_size=64, n_head=4, n_layer=2, pretraining_tp=2)
    check_config(AutoConfig.for_model("bloom", **bloom), 2)
    with pytest.raises(InputError, match=r"does not split BLOOM's slow_but_exact projections") as e:
        check_config(AutoConfig.for_model("bloom", **bloom, slow_but_exact=True), 2)
    assert "\n" not in str(e.value)


def test_a_degree_that_does_not_divide_codegens_qkv_blocks_is_refused_in_one_line():
    """CodeGen's ``qkv_proj`` holds 4 blocks of a quarter of the heads each; 2 and 4 ranks keep whole
    blocks, 8 would cut them (16 heads: the degree divides the heads, not the blocks)."""
    from deltazip.formats.errors import InputError
    from deltazip.runtime.cluster.tensor_parallel import check_blocks

    attn = tiny_model("codegen", n_head=16).transformer.h[0].attn
    for world in (2, 4):
        check_blocks(attn, "transformer.h.0.attn", world)
    with pytest.raises(InputError, match=r"^--tensor-parallel 8 does not divide the 4 blocks transformer\.h\.0\.attn"
                                         r"\.qkv_proj interleaves its heads in; use a degree that divides them$"):
        check_blocks(attn, "transformer.h.0.attn", 8)


def test_kv_head_counts_a_degree_can_neither_split_nor_keep_whole_are_refused(tmp_path):
    """Three KV heads over two ranks can neither be split nor kept whole per rank (2 is no multiple of
    3); OLMo 2's key norm over two KV heads, each kept by two of four ranks, would count every head's
    squares twice: both refused in one line."""
    from transformers import AutoConfig

    from deltazip.formats.errors import InputError
    from deltazip.runtime.cluster.tensor_parallel import check_config

    shape = dict(hidden_size=96, num_attention_heads=12, num_hidden_layers=2, intermediate_size=128)
    check_config(AutoConfig.for_model("llama", **shape, num_key_value_heads=2), 4)  # each KV head on 2 ranks
    with pytest.raises(InputError, match=r"--tensor-parallel 2 does not divide the model's KV heads \(3\)"):
        check_config(AutoConfig.for_model("llama", **shape, num_key_value_heads=3), 2)
    with single_thread():
        base_dir = save_model(tiny_model("olmo2", num_key_value_heads=2), tmp_path / "base")
        with pytest.raises(InputError, match=r"rank 0: .*--tensor-parallel 4 exceeds model\.layers\.0\.self_attn's 2 "
                                             r"KV heads, whose key norm spans them all") as e:
            start_tensor_parallel(Checkpoint(base_dir), [], 1, torch.device("cpu"), torch.float32, 4)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("before_gate", [True, False])
def test_falcon_h1_gated_norm_and_row_scales_shard_too(tmp_path, before_gate):
    """Falcon-H1 with its Mamba gated norm on (one group over both ranks: each rank's sum of squares
    all-reduced, the norm gated before or after as the model says) and ``in_proj`` rows scaled apart
    (``mup_vector``, each rank keeping its rows' scales): served as the merged model."""
    _served_as_merged(tmp_path, "falcon_h1", mamba_rms_norm=True, mamba_norm_before_gate=before_gate,
                      ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 2.0])
