"""``--tensor-parallel 2`` on mixture-of-experts models: every expert is split by its intermediate width
(the gate and up halves of ``gate_up_proj`` by rows, ``down_proj`` by columns), the router stays whole,
and the experts' output is all-reduced. A compressed fine-tune whose every expert, router and attention
weight moved is served as the merged model generates it, beside base rows in the same steps. Each test
starts its own two-rank group (this process is rank 0), apart from ``test_tensor_parallel.py``'s."""

from __future__ import annotations

import pytest
import torch
from _factories import calib_file, perturb, save_model, tiny_model
from _images import generate
from _serving import engine_runs, single_thread

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import load_merged_model
from deltazip.compress.pipeline import compress_delta
from deltazip.demo.pair import build_char_tokenizer
from deltazip.formats.artifact import Artifact
from deltazip.formats.errors import InputError
from deltazip.kernels.packed import PackedDelta
from deltazip.kernels.reference import delta_weight
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint
from deltazip.runtime.cluster.tp_group import start_tensor_parallel
from deltazip.runtime.cluster.tp_shards import expert_row_runs, shard_expert_piece
from deltazip.runtime.serve.variant_sources import discover_variants

IDS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2, vocab_size=128)


def _save_fused(model, out):
    """``model`` saved with its state dict's own names (fused experts), the config as ``save_model`` writes it."""
    from safetensors.torch import save_file

    save_model(model, out, tokenizer=False)
    for f in out.glob("*.safetensors*"):
        f.unlink()
    save_file({n: p.detach().contiguous() for n, p in model.state_dict().items()
               if n != "lm_head.weight" or not model.config.tie_word_embeddings}, out / "model.safetensors")
    return out


def _moved(model):
    """A fake full fine-tune: every weight moved. Biases that start at 0 and sinks near 0 (GPT-OSS) move
    by a fixed amount, which noise relative to their spread would not give them; q/k norms (ones) by
    a fifth of themselves."""
    fixed = ("bias", "sinks")
    model = perturb(model, scale=0.3 if model.config.model_type != "gpt_oss" else 0.1, seed=5, skip=("norm", *fixed))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(fixed) and "norm" not in name:
                p.add_(torch.randn(p.shape, generator=g) * (1.5 if name.endswith("sinks") else 0.05))
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=g))
    return model


def _pair(tmp_path, arch: str, scheme: DeltaScheme, fused: bool = False, **config):
    """A tiny MoE base, a fine-tune in which every weight moved, one compressed artifact ``ft``
    (``fused``: both saved with their fused expert tensors instead of one tensor per expert)."""
    tok = build_char_tokenizer()
    save = _save_fused if fused else (lambda m, out: save_model(m, out, tokenizer=False))
    base = tiny_model(arch, **IDS, **config)
    base_dir = save(base, tmp_path / "base")
    ft_dir = save(_moved(tiny_model(arch, **IDS, **config)), tmp_path / "ft")
    for d in (base_dir, ft_dir):
        tok.save_pretrained(d)
    cfg = CompressConfig(scheme=scheme, method="deltazip", nsamples=8, seqlen=32, device="cpu")
    compress_delta(base_dir, ft_dir, str(calib_file(tmp_path / "calib", n=16)), tmp_path / "arts" / "ft", cfg)
    return Checkpoint(base_dir), base, tok


def _served_as_merged(tmp_path, ck, base_model, tok, prompts, delta_compute: str = "auto") -> None:
    merged = load_merged_model(Artifact(tmp_path / "arts" / "ft"), ck)
    want = [generate(merged, tok(p)["input_ids"], None, n=8) for p in prompts]
    base = [generate(base_model, tok(p)["input_ids"], None, n=8) for p in prompts[:1]]
    tp = start_tensor_parallel(ck, discover_variants(tmp_path / "arts"), 2, torch.device("cpu"), torch.float32, 2,
                               delta_compute=delta_compute)
    try:
        got = engine_runs(tp, tok, [("ft", p) for p in prompts] + [("base", prompts[0])], 8, max_batch_tokens=16)
    finally:
        tp.close()
    for g, w in zip(got, want + base):
        assert g.text == w[0], (g.text, w[0])
        assert max(abs(a[1] - b) for a, b in zip(g.logprobs, w[1])) < 1e-4, (g.logprobs, w[1])
    # the fine-tune answers otherwise than the base: its experts are applied
    moved = max(abs(a - b) for a, b in zip(want[0][1], base[0][1]))
    assert want[0][0] != base[0][0] or moved > 0.05, moved


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "phimoe", "ernie4_5_moe", "afmoe", "llama4",
                                  "deepseek_v3", "olmoe", "flex_olmo", "minimax_m2", "qwen3_5_moe", "qwen3_next",
                                  "lfm2_moe", "nemotron_h", "granitemoehybrid", "jamba", "kimi_linear"])
def test_moe_models_shard_by_expert_width_and_answer_as_the_merged_model(tmp_path, arch):
    """Mixtral (per-expert ``w1``/``w3``/``w2`` in the checkpoint), Qwen2-MoE (shared experts and
    their gate), Qwen3-MoE (per-head q/k norms), Phi-3.5-MoE (an ``nn.Linear`` router with its own
    top-k), Ernie 4.5 (dense layers first, a router holding statistics), AFMoE (gated attention, a
    router bias the block passes), Llama 4 (experts stored ``[E, in, out]`` and run over every token,
    summed with a shared expert inside the block, whose output is the one all-reduced), DeepSeek-V3
    (multi-head latent attention: the latents are made whole on every rank, their per-head
    expansions split), OLMoE, FlexOlmo and MiniMax-M2 (q/k norms over every head, split by columns
    with their sums of squares all-reduced; OLMoE's q/k/v clipped), Qwen3.5-MoE, Qwen3-Next,
    LFM2-MoE, Nemotron-H, Granite 4 and Jamba (experts beside recurrent layers split by channels;
    Granite 4's one group of Mamba-2 states kept by both ranks, its gated norm's sum of squares
    all-reduced; Jamba's Mamba-1 ``x_proj`` row-parallel, its output all-reduced inside the mixer
    before the norms of ``dt``, ``B`` and ``C``; Kimi Linear's delta attention split by heads, its
    convolution's three checkpoint pieces cut to each rank's rows, beside latent attention): two
    ranks give the merged model's greedy text and log probabilities, 4-bit groups of 16."""
    config = dict(mamba_dt_rank=16) if arch == "jamba" else {}  # (dt_proj's 16 inputs: one group)
    with single_thread():
        ck, base, tok = _pair(tmp_path, arch, DeltaScheme(bits=4, group_size=16, sparsity="none"), **config)
        _served_as_merged(tmp_path, ck, base, tok, ["zip model tune", "alpha beta gamma delta"])


def test_gpt_oss_experts_stored_transposed_with_biases_and_its_sinks_shard_too(tmp_path):
    """GPT-OSS: experts stored ``[E, in, out]`` whose gate and up columns alternate, per-expert biases
    (the first projection's cut with its columns, ``down_proj``'s added on rank 0 alone), attention
    sinks cut with the heads; a fine-tune that moved all of them is served as the merged model,
    in packed and in dequantized slots."""
    with single_thread():
        ck, base, tok = _pair(tmp_path, "gpt_oss", DeltaScheme(bits=4, group_size=16, sparsity="none"))
        for compute in ("packed", "dequantized"):
            _served_as_merged(tmp_path, ck, base, tok, ["zip model tune", "alpha beta"], delta_compute=compute)


def test_fused_expert_tensors_and_2_4_deltas_shard_too(tmp_path):
    """A fine-tune saved with its fused ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` tensors,
    compressed 2:4 sparse 4-bit: each fused piece is cut into every expert's gate and up rows of the
    rank, and ``down_proj``'s 2:4 blocks and groups by columns. Slots hold the packed shards (the
    stacked low-bit layout a GPU serves), not dequantized copies."""
    with single_thread():
        ck, base, tok = _pair(tmp_path, "mixtral", DeltaScheme(bits=4, group_size=16, sparsity="2:4"), fused=True)
        names = Artifact(tmp_path / "arts" / "ft").manifest["tensors"]
        assert any(n.endswith("experts.gate_up_proj") for n in names), sorted(names)[:8]
        _served_as_merged(tmp_path, ck, base, tok, ["zip model tune"], delta_compute="packed")


def test_an_expert_width_a_degree_would_split_into_part_groups_is_refused(tmp_path):
    """Experts of width 32 and groups of 32: two ranks would each hold half a group of ``down_proj``
    (``w2`` in the checkpoint, which only the model names as row-parallel); start-up stops with one
    line that names the tensor and the fix."""
    with single_thread():
        ck, _, _ = _pair(tmp_path, "mixtral", DeltaScheme(bits=4, group_size=32, sparsity="none"), intermediate_size=32)
        with pytest.raises(InputError, match=r"w2.weight has quantization groups of 32 input columns.*shards of 16") as e:
            start_tensor_parallel(ck, discover_variants(tmp_path / "arts"), 2, torch.device("cpu"), torch.float32, 2)
    assert "\n" not in str(e.value) and "w2" in str(e.value)


def test_expert_row_runs_keep_each_ranks_share_of_every_block():
    """Expert rows ``[E * out, in]`` with gate and up halves: the runs of every rank tile the whole
    parameter once, each in the rank's own compact rows, for a fused piece and for one expert's up half."""
    e_all, out, world = 3, 8, 2
    seen = []
    for rank in range(world):
        runs = expert_row_runs(0, e_all * out, out, 2, rank, world)
        at = [a for _, _, a in runs]
        assert at == sorted(at) and sum(hi - lo for lo, hi, _ in runs) == e_all * out // world
        seen += [r for lo, hi, _ in runs for r in range(lo, hi)]
    assert sorted(seen) == list(range(e_all * out))
    # expert 1's up half (rows [12, 16) of its [8, 16)): each rank keeps 2 rows, at its rows 4 + 2 = 6, 7
    assert expert_row_runs(12, 16, out, 2, 0, world) == [(12, 14, 6)]
    assert expert_row_runs(12, 16, out, 2, 1, world) == [(14, 16, 6)]
    assert expert_row_runs(9, 13, out, 2, 1, world) == [(10, 12, 4)]  # expert 1's gate rows 10, 11: its rows 4, 5


def test_sharded_expert_pieces_reassemble_each_ranks_product():
    """The rank parts of a packed gate_up piece and of a packed down_proj piece, dequantized, are
    exactly the rank's rows (columns) of the dequantized piece."""
    from deltazip.formats.packing import pack_delta

    torch.manual_seed(0)
    e_all, inter, hidden, world = 2, 8, 32, 2
    codes = torch.randint(0, 16, (e_all * 2 * inter, hidden))
    gate_up = pack_delta(codes, torch.rand(e_all * 2 * inter, 2) + 0.1, None, None, 4, 16)
    dense = delta_weight(gate_up)
    for rank in range(world):
        parts = shard_expert_piece("gate_up_proj", 0, e_all * 2 * inter, gate_up, 2 * inter, 2, rank, world)
        got = torch.zeros(e_all * 2 * inter // world, hidden)
        for a, b, p in parts:
            assert isinstance(p, PackedDelta)
            got[a:b] = delta_weight(p)
        rows = [e * 2 * inter + h * inter + rank * inter // world + i
                for e in range(e_all) for h in range(2) for i in range(inter // world)]
        assert torch.equal(got, dense[rows])
    down = pack_delta(torch.randint(0, 16, (hidden, 2 * inter)), torch.rand(hidden, 2) + 0.1, None, None, 4, 8)
    for rank in range(world):
        ((a, b, p),) = shard_expert_piece("down_proj", 32, 64, down, hidden, 0, rank, world)
        assert (a, b) == (32, 64)
        assert torch.equal(delta_weight(p), delta_weight(down)[:, rank * inter:(rank + 1) * inter])


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_a_lora_adapter_on_the_experts_is_cut_by_each_experts_width(tmp_path, arch):
    """A PEFT adapter on every layer's experts weights (``target_parameters``) and ``q_proj``: each rank
    keeps its rows of each expert's gate and up deltas and its columns of ``down_proj``'s (GPT-OSS's
    ``[E, in, out]``, gate and up interleaved, alike), and the ``q_proj`` factors' rows. Two ranks
    serve PEFT's merged model's greedy text and log probabilities, beside base rows."""
    from _factories import lora_adapter

    from deltazip.models.loader import load_causal_lm

    tok = build_char_tokenizer()
    prompts = ["zip model tune", "alpha beta gamma delta"]
    with single_thread():
        base = tiny_model(arch, **IDS)
        base_dir = save_model(base, tmp_path / "base", tokenizer=False)
        tok.save_pretrained(base_dir)
        pm = lora_adapter(load_causal_lm(base_dir, torch.float32), tmp_path / "arts" / "lora", 4,
                          target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj",
                                                                        "mlp.experts.down_proj"])
        merged = pm.merge_and_unload()
        want = [generate(merged, tok(p)["input_ids"], None, n=8) for p in prompts]
        plain = generate(base, tok(prompts[0])["input_ids"], None, n=8)
        tp = start_tensor_parallel(Checkpoint(base_dir), discover_variants(tmp_path / "arts"), 2,
                                   torch.device("cpu"), torch.float32, 2)
        try:
            got = engine_runs(tp, tok, [("lora", p) for p in prompts] + [("base", prompts[0])], 8,
                              max_batch_tokens=16)
        finally:
            tp.close()
    for g, w in zip(got, want + [plain]):
        assert g.text == w[0] and max(abs(a[1] - b) for a, b in zip(g.logprobs, w[1])) < 1e-4, (g.text, w)
    assert want[0] != plain
