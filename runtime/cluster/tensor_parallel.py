"""Tensor-parallel sharding of the base model and of every packed delta (Megatron-style, at load time).

Each decoder layer of a supported model (``SUPPORTED_MODEL_TYPES``: the Llama family and others laid
out alike) has two kinds of linears (``COLUMN_PARALLEL``, ``ROW_PARALLEL`` list every name):

- column-parallel (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``): rank ``r`` of ``n``
  keeps output rows ``[r * out/n, (r + 1) * out/n)``. Attention heads split with them (the attention
  reshapes to ``-1`` heads, so each rank attends over its own ``H/n`` query and ``H_kv/n`` KV heads);
- row-parallel (``o_proj``, ``down_proj``): rank ``r`` keeps input columns ``[r * in/n, (r + 1) * in/n)``;
  its output is a partial sum, completed by one all-reduce (a forward hook, see
  :class:`ShardedDeltaModel`). A row-parallel bias is kept on rank 0 only, so it is added once.

Mixture-of-experts layers (``MOE_MODEL_TYPES``) shard every expert the same way: each rank keeps
``1/n`` of each expert's intermediate width (the matching rows of the gate and the up halves of
``gate_up_proj [E, 2I, H]``, the columns of ``down_proj [E, H, I]``), the router stays whole (every
rank routes every token alike), and the experts module's output is all-reduced like a row-parallel
linear's (a Llama 4 block's output instead: its experts run over every token and are summed inside
it). Attention sinks, one per head, go with their heads. What each rank keeps of a tensor is
computed in :mod:`deltazip.runtime.cluster.tp_shards`.

A packed delta (``deltazip.kernels.packed``) shards the same way. Column shards slice every part by
rows. Row shards slice codes, 2:4 positions and group scales/zeros along the input dimension, which
only works when a shard holds whole quantization groups (and so whole 2:4 blocks): that is checked
before serving (:func:`check_variant`). Embeddings, norms and ``lm_head`` stay replicated, but for a
norm over a split width (a query or key norm over every head, OLMo 2's; BitNet's sub-layer norms),
which keeps the rank's columns and all-reduces the sum of squares
(:mod:`deltazip.runtime.cluster.tp_norms`); any other attention tensor that would not split with the
heads is refused (:func:`check_attention`). Recurrent mixers (gated delta nets, Kimi's delta
attention, Mamba-2 and Mamba-1 mixers, LFM2's short convolutions) split by channels like an attention
by heads, their own tensors and their linears with them (Mamba-1's ``x_proj``, which reads every
channel, row-parallel; :mod:`deltazip.runtime.cluster.tp_mixers`). Parameters tied across layers
(Zamba2's shared blocks) are cut once per module and tied again; the low-rank adapters added to a
split projection keep its rows (``ADAPTED``). An attention
with fewer KV heads than ranks has each rank keep whole the KV head its query heads read
(:func:`~deltazip.runtime.cluster.tp_shards.kv_head_rows`).

The artifact layout does not change: everything here runs when a model or a variant is loaded.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from deltazip.formats.errors import InputError
from deltazip.kernels.packed import PackedDelta
from deltazip.models.layer_map import checkpoint_prefix
from deltazip.models.loader import text_config
from deltazip.models.model_walk import decoder_layers, dense_routed, empty_model, experts_transposed
from deltazip.models.param_names import module_names, tied_names
from deltazip.runtime.cluster.tp_alibi import slice_alibi, uses_alibi
from deltazip.runtime.cluster.tp_mixers import MixerShard, shard_mixer_tensors, split_mixer
from deltazip.runtime.cluster.tp_norms import ShardedRMSNorm, split_activation_sparsity, split_norms
from deltazip.runtime.cluster.tp_shards import (
    expert_blocks,
    fused_blocks,
    kept_rows,
    kv_head_rows,
    shard_dense,
    shard_expert_bias,
    shard_expert_piece,
    shard_experts,
    shard_head_counts,
    shard_linear,
    shard_sinks,
    shard_slot_args,
    span,
)
from deltazip.runtime.serve.delta_experts import (
    BIAS_OF,
    ExpertLoraFactors,
    MoeLayout,
    is_fused_experts,
    parse_piece_key,
    piece_key,
)
from deltazip.runtime.serve.delta_linear import is_linear
from deltazip.runtime.serve.lora_variant import conv1d_modules, linear_shapes, lora_base
from deltazip.runtime.serve.model import DeltaModel, HostDelta, load_base_model
from deltazip.runtime.serve.variant_sources import VariantInfo

# Decoder layers whose projections split as below and whose attention reshapes to ``-1`` heads with
# any q/k norm per head (Qwen3, Gemma): a rank's heads need nothing of the others'. Each is served by
# two ranks as the merged model generates (``python bench/support.py``, its serve_tp2 column).
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "ministral", "ministral3", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3",
    "qwen3_vl_text", "gemma", "gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "vaultgemma", "granite", "granite_swa",
    "smollm3", "mllama_text_model", "stablelm", "cohere", "cohere2", "olmo", "exaone", "exaone4",
    "hunyuan_v1_dense", "ernie4_5", "seed_oss", "apertus", "nemotron", "arcee", "helium", "internlm3", "minicpm3",
    "phi3", "glm", "glm4", "olmo2", "olmo3", "starcoder2", "phi", "nanochat", "opt", "xglm", "gpt_neo", "gptj",
    "glm4v_text", "gpt_neox", "persimmon", "bitnet", "falcon", "gpt_bigcode", "bloom", "mpt", "gpt2", "codegen",
    # hybrids: recurrent mixers beside the attention layers, split by channels (tp_mixers)
    "qwen3_5_text", "lfm2", "lfm3", "bamba", "mamba2", "falcon_h1", "mamba", "falcon_mamba", "olmo_hybrid", "zamba2")
# The same attention beside mixture-of-experts layers of fused experts (and plain MLP layers and
# shared experts, sharded as any MLP).
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_vl_moe_text", "phimoe", "granitemoe",
                   "granitemoeshared", "granitemoe_swa", "glm4_moe", "ernie4_5_moe", "hunyuan_v1_moe", "dots1",
                   "cohere2_moe", "exaone_moe", "solar_open", "afmoe", "hy_v3", "gpt_oss", "llama4_text",
                   "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "olmoe", "flex_olmo", "minimax_m2",
                   "mimo_v2_flash", "qwen3_5_moe_text", "qwen3_next", "lfm2_moe",
                   "granitemoehybrid", "nemotron_h", "jamba", "kimi_linear")
# Experts whose gate and up columns alternate in ``gate_up_proj`` (GPT-OSS's ``gate_up[..., ::2]``);
# the others stack the gate half, then the up half (``chunk(2)``).
INTERLEAVED_GATE_UP = ("gpt_oss",)
# Fused projections (Phi-3's ``qkv_proj``, a ``gate_up_proj`` linear) are column-parallel block by
# block (``tp_shards.fused_blocks``); GPT-NeoX's and Persimmon's ``query_key_value`` hold each head's
# q, k and v together (Falcon's each KV group's queries, key and value), so a plain split of its rows
# is a split by heads. Multi-head latent attention
# (DeepSeek-V2/V3 and kin) splits its per-head expansions (``q_b_proj``, ``kv_b_proj``); what makes
# the latents, which every head reads, stays whole (``LATENT``). The MLPs and output projections of
# GPT-2-era layouts go by other names (StarCoder2's ``c_fc``/``c_proj``, OPT's and Phi-2's
# ``fc1``/``fc2``, GPT-J's ``fc_in``/``fc_out``, ``out_proj``, ``dense``); a decoder layer in which
# none of these names is found is refused rather than run whole on every rank.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj", "qkv_proj",
                   "gate_up_proj", "c_fc", "fc1", "fc_in", "query_key_value", "dense_h_to_4h", "w1", "w3",
                   "g_proj", "c_attn", "Wqkv")  # (LFM3's output gate, one row per head; GPT-BigCode's and
# MPT's q, k, v)
LATENT = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
# Per-layer low-rank adapters whose output is added to a split projection's (Zamba2's shared block:
# ``gate_up_proj_adapter_list.<k>`` is ``Sequential(Linear(H, r), Linear(r, 2I))``): the second linear is
# column-parallel with the projection's rows, the first stays whole.
ADAPTED = {"gate_up_proj_adapter_list": "gate_up_proj", "linear_q_adapter_list": "q_proj",
           "linear_k_adapter_list": "k_proj", "linear_v_adapter_list": "v_proj"}
ROW_PARALLEL = ("o_proj", "down_proj", "c_proj", "fc2", "fc_out", "out_proj", "dense", "dense_4h_to_h", "w2")


def shard_kind(module_name: str, layers: str | None = None) -> str | None:
    """``"column"``, ``"row"`` or None (replicated) for a module name such as ``model.layers.3.self_attn.q_proj``:
    a module under ``layers`` (the decoder list's name: an image-text model's vision tower, whose
    blocks may be ``layers`` too, stays whole); without it, under any ``.layers.``."""
    inside = module_name.startswith(f"{layers}.") if layers is not None else ".layers." in f".{module_name}"
    if not inside:
        return None
    leaf = module_name.rsplit(".", 1)[-1]
    return "column" if leaf in COLUMN_PARALLEL else "row" if leaf in ROW_PARALLEL else None


def _retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Tie again each group of parameter names that shared one tensor before the modules holding
    them were cut one by one (each got its own shard): every name then holds the first one's shard,
    as the full model held one tensor (and a variant's change of it, planned by identity, reaches all)."""
    for names in groups:
        first = model.get_parameter(names[0])
        for n in names[1:]:
            owner, _, attr = n.rpartition(".")
            mod = model.get_submodule(owner)
            if tuple(mod._parameters[attr].shape) != tuple(first.shape):
                raise InputError(f"--tensor-parallel cut the tied parameters {names[0]} and {n} apart; serve this "
                                 "base with --tensor-parallel 1")
            mod._parameters[attr] = first


def _adapted(module_name: str) -> str:
    """The projection whose output the adapter linear ``module_name`` adds to (its second linear,
    ``...gate_up_proj_adapter_list.3.1`` -> ``...gate_up_proj``), else ``module_name`` itself."""
    parts = module_name.split(".")
    if len(parts) >= 3 and parts[-1] == "1" and parts[-3] in ADAPTED:
        return ".".join([*parts[:-3], ADAPTED[parts[-3]]])
    return module_name


def check_config(config, world: int) -> None:
    """Refuse (one line) a model that ``world`` ranks cannot shard.

    Raises:
        InputError: unsupported architecture, or ``world`` not dividing the attention heads, the
            KV heads (nor a multiple of them, where a rank can keep a KV head whole) or the MLP
            intermediate size.
    """
    config = text_config(config)  # an image-text model's language model is what is sharded
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES + MOE_MODEL_TYPES:
        raise InputError(f"--tensor-parallel does not shard model_type {mt!r} (its layers are not split by heads and "
                         "intermediate width alike; the support matrix's serve_tp2 column lists the families it "
                         "shards); serve this base with --tensor-parallel 1")
    if mt == "bloom" and getattr(config, "slow_but_exact", False) and getattr(config, "pretraining_tp", 1) > 1:
        # (its output projection is then applied in slices of the full width, which a rank does not hold)
        raise InputError("--tensor-parallel does not split BLOOM's slow_but_exact projections; set slow_but_exact "
                         "to false in the base's config.json or serve it with --tensor-parallel 1")
    for key, what in (("num_attention_heads", "attention heads"), ("num_key_value_heads", "KV heads"),
                      ("intermediate_size", "intermediate size"), ("moe_intermediate_size", "expert width"),
                      ("shared_expert_intermediate_size", "shared expert width"),
                      ("intermediate_size_mlp", "MLP width"), ("ffn_dim", "MLP width"), ("n_inner", "MLP width"),
                      ("linear_num_key_heads", "linear-attention key heads"),
                      ("linear_num_heads", "linear-attention heads"),
                      ("linear_num_value_heads", "linear-attention value heads")):
        try:
            value = getattr(config, key, None)
        except Exception as e:  # transformers refuses one value for a setting that differs per layer
            if key == "num_key_value_heads":  # (each attention's are checked as it is cut: _kv_heads_of)
                continue
            raise InputError(f"--tensor-parallel needs one {what} count for every layer, and this {mt} model's "
                             f"varies per layer; serve this base with --tensor-parallel 1") from e
        if value is None and key == "num_key_value_heads":
            value = _kv_heads(config)
        if (key == "num_key_value_heads" and value and world % value == 0
                and not (mt == "falcon" and config.new_decoder_architecture)):
            continue  # fewer KV heads than ranks: each rank keeps the one its query heads read (kv_head_rows);
            # (Falcon-40B's KV groups each hold their queries, key and value together: not cut so)
        if isinstance(value, (list, tuple)):  # one per layer (Gemma 3n's MLP widths)
            value = next((v for v in value if v % world), value[0])
        if value is not None and value % world:
            raise InputError(f"--tensor-parallel {world} does not divide the model's {what} ({value}); use a "
                             f"degree that divides it")


def _kv_heads(config) -> int | None:
    """KV heads of a config without ``num_key_value_heads``: Falcon's ``num_kv_heads`` (one in its
    multi-query layout, Falcon-7B's), GPT-BigCode's one in its multi-query layout, else as many as
    query heads (no GQA)."""
    if getattr(config, "model_type", None) == "falcon":
        return config.num_kv_heads if config.new_decoder_architecture or not config.multi_query else 1
    if getattr(config, "model_type", None) == "gpt_bigcode" and config.multi_query:
        return 1
    return getattr(config, "num_attention_heads", None)  # (None: no attention at all, Mamba-2's)


def check_variant(v: VariantInfo, row_in: dict[str, int], world: int) -> None:
    """Refuse a variant whose packed row-parallel deltas a shard boundary would cut through.

    Args:
        v: the variant (its manifest entries).
        row_in: per tensor of ``v`` that lands on a row-parallel weight (``o_proj``, ``down_proj``, an
            experts module's ``down_proj``), that weight's full input width.
        world: tensor-parallel degree.
    Raises:
        InputError: a quantization group (or a 2:4 block) would straddle two ranks.
    """
    for tname, e in v.entries.items():
        if not e.kernel_ready or tname not in row_in:
            continue
        width = row_in[tname] // world
        group = e.scheme.effective_group(row_in[tname])
        block = 4 if e.scheme.sparse else 1
        if width % group or width % block:
            raise InputError(f"variant {v.name}: {tname} has quantization groups of {group} input columns, which "
                             f"--tensor-parallel {world} shards of {width} columns would split; use a degree whose "
                             f"shard width is a multiple of the group size")


def check_variants(variants: list[VariantInfo], world: int, layers: str) -> None:
    """:func:`check_variant` for every artifact, from its manifest alone (before any rank starts): the
    tensors under ``layers`` (the decoder list's checkpoint name, :func:`checkpoint_layers`) named as
    row-parallel linears (``...o_proj.weight``, ``...down_proj.weight``, per-expert ones included).
    Each rank checks again against the model, which also names the rest (Mixtral's ``w2``, fused
    experts)."""
    for v in variants:
        if v.kind == "artifact":
            check_variant(v, {t: e.shape[-1] for t, e in v.entries.items()
                              if shard_kind(t.rsplit(".", 1)[0], layers) == "row"}, world)


def checkpoint_layers(model_dir) -> str:
    """The checkpoint name of a model's decoder layer list (``model.layers``, GPT-J's ``transformer.h``,
    an image-text model's language model's), from a meta skeleton of its config."""
    model = empty_model(model_dir, torch.float32)
    lname = decoder_layers(model)[0]
    return checkpoint_prefix(model, f"{lname}.0.")[:-len(".0.")]


def check_attention(attn: nn.Module, name: str, head_dim: int) -> None:
    """Refuse an attention module holding a tensor that splitting its heads would not split with them:
    anything beyond its sharded projections, per-head norms of ``[head_dim]`` and the norms over a
    split width already split (``tp_norms``): one weight per head, Cohere's q/k norms, say.

    Raises:
        InputError: naming the tensor.
    """
    for child, mod in attn.named_children():  # (attention sinks, one per head, are split: shard_sinks)
        if (child in LATENT or isinstance(mod, ShardedRMSNorm)
                or (is_linear(mod) and child in COLUMN_PARALLEL + ROW_PARALLEL)
                or (child in ADAPTED and all(isinstance(m, nn.Linear) for m in mod.modules()
                                             if not list(m.children())))):
            continue  # (an adapter list's linears: its first whole, its second with the projection's rows)
        for pname, p in mod.named_parameters():
            if tuple(p.shape) != (head_dim,):
                raise InputError(f"--tensor-parallel cannot split {name}.{child}.{pname} {list(p.shape)} with the "
                                 f"attention heads (only per-head norms of [{head_dim}] are); serve this base with "
                                 "--tensor-parallel 1")
    for pname, p in attn.named_parameters(recurse=False):
        if pname == "sinks" and p.dim() == 1:
            continue
        raise InputError(f"--tensor-parallel cannot split {name}.{pname} {list(p.shape)} with the attention heads; "
                         "serve this base with --tensor-parallel 1")


def check_blocks(attn: nn.Module, name: str, world: int) -> None:
    """Refuse a degree that does not divide the ``mp_num`` blocks CodeGen's ``qkv_proj`` interleaves its
    heads in (each block a share of the heads' queries, values and keys, which a rank keeps whole).

    Raises:
        InputError: naming the blocks and the fix.
    """
    blocks = getattr(attn, "mp_num", None)
    if isinstance(blocks, int) and blocks % world:
        raise InputError(f"--tensor-parallel {world} does not divide the {blocks} blocks {name}.qkv_proj interleaves "
                         "its heads in; use a degree that divides them")


def _is_attention(mod: nn.Module) -> bool:
    """A module holding the query projection (``q_proj``, Phi-3's ``qkv_proj``, MLA's ``q_a_proj``/``q_b_proj``,
    GPT-NeoX's ``query_key_value``, GPT-BigCode's and GPT-2's ``c_attn``)."""
    return any(is_linear(getattr(mod, n, None))
               for n in ("q_proj", "qkv_proj", "q_b_proj", "query_key_value", "c_attn", "Wqkv"))


def _head_dim(attn: nn.Module, config) -> int:
    """An attention module's head width: its own ``head_dim``, else the text config's."""
    hd = getattr(attn, "head_dim", None)
    if isinstance(hd, int):
        return hd
    config = text_config(config)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class ShardedDeltaModel(DeltaModel):
    """A :class:`DeltaModel` holding rank ``rank``'s shard of the base and of every variant.

    The base is loaded on the host, sharded, and only the shard moves to ``device`` (a rank never
    holds the whole model on its GPU). Variants are planned and checked against the full shapes.
    Host copies of variants (:meth:`load_host`) are sharded too, so the delta cache of each rank
    holds its shard.

    Args:
        group: the :class:`deltazip.runtime.cluster.tp_group.TPGroup` (rank, degree, all-reduce).
        (the rest as :class:`DeltaModel`)
    """

    def __init__(self, base, variants: list[VariantInfo], num_slots: int, device, dtype, group,
                 delta_compute: str = "auto", registry=None, ledger=None):
        self.group = group
        super().__init__(base, variants, num_slots, device, dtype, delta_compute=delta_compute, registry=registry,
                         ledger=ledger)

    def _load_model(self, base, dtype, device) -> nn.Module:
        model = load_base_model(base, dtype, torch.device("cpu"))
        check_config(model.config, self.group.world)
        # Planning compares artifact and adapter shapes with the full model's (meta tensors: shapes only).
        self._full_params = {n: torch.empty(p.shape, device="meta")
                             for n, p in model.named_parameters(remove_duplicate=False)}
        self._full_linears = linear_shapes(model)  # (out, in) of every nn.Linear and Conv1D
        self._full_base = lora_base(model)  # (LoRA on experts parameters, modules_to_save: on full shapes)
        # GPT-2's Conv1D linears: weight (and a variant's dense replacement) stored [in, out]
        self._transposed = set(conv1d_modules(model))
        tied = tied_names(model)  # parameters tied across modules (Zamba2's shared block), before they are cut
        self._layers = decoder_layers(model)[0]
        self._experts: dict[str, bool] = {}  # fused-experts modules (sharded by expert width, all-reduced)
        # -> whether stored [E, in, out]
        self._sinks: set[str] = set()  # attention modules whose sinks are sharded by heads
        self._split_norms: set[str] = set()  # norms over a split width, kept by columns (tp_norms)
        self._mixers: dict[str, MixerShard] = {}  # recurrent mixers, kept by channels (tp_mixers)
        self._mixer_columns: set[str] = set()  # their linears split by rows, named as the lists do not
        self._mixer_rows: set[str] = set()  # and by input columns (Mamba-1's x_proj)
        self._interleaved = text_config(model.config).model_type in INTERLEAVED_GATE_UP
        # MoE blocks of experts run over every token (Llama 4): their [E * T, H] output is summed over
        # experts and added to the shared expert's inside the block, so the block's output is what is
        # all-reduced (once, and E times smaller), not the experts' nor the shared expert's down_proj.
        self._reduced_blocks = {n.rpartition(".")[0] for n, m in model.named_modules()
                                if n.startswith(f"{self._layers}.") and is_fused_experts(m) and dense_routed(m)}
        self._fused_rows: dict[str, torch.Tensor] = {}  # fused column-parallel linear -> the rank's rows
        self._kv_rows: dict[str, torch.Tensor] = {}  # attention with fewer KV heads than ranks -> its KV head's rows
        heads = {n: _head_dim(m, model.config) for n, m in model.named_modules() if _is_attention(m)}
        # the decoder layers (their index) in which something was split
        touched = {name[len(self._layers) + 1:].partition(".")[0] for name, mod in model.named_modules()
                   if name.startswith(f"{self._layers}.") and self._shard_module(name, mod, heads, model.config)}
        unsplit = [i for i in range(len(model.get_submodule(self._layers))) if str(i) not in touched]
        if unsplit:  # its linears named otherwise: every rank would run (and hold) the whole layer
            raise InputError(f"--tensor-parallel found no projection it splits in decoder layer {unsplit[0]} of "
                             f"{type(model).__name__}; serve this base with --tensor-parallel 1")
        for name, mod in model.named_modules():
            self._hook(mod, name)
        _retie(model, tied)
        # Checkpoint names of expert (and mixer) tensors map to rows of the full parameters (a meta skeleton).
        self._full_model = empty_model(base.path, dtype) if self._experts or self._mixers else None
        return model.to(device)

    def _shard_module(self, name: str, mod: nn.Module, heads: dict[str, int], config) -> bool:
        """Cut module ``name`` (under the decoder layers; modules come before their children) to this
        rank's shard in place; whether it was a linear or experts module split."""
        rank, world = self.group.rank, self.group.world
        # (norms first: the attention's own check would refuse them whole)
        norms = split_norms(mod, name, self._full_linears, rank, world, self.group)
        self._split_norms.update(f"{name}.{c}" for c in norms)
        if f"{name}.gate_proj" in self._full_linears:  # (Gemma 3n's sparse gates: statistics over the split width)
            split_activation_sparsity(mod, self._full_linears[f"{name}.gate_proj"][0], self.group)
        kind = self._kind(name)
        if kind is not None and is_linear(mod):
            rows = self._rows_of(name, kind, heads, config)
            if rows is not None:
                self._fused_rows[name] = rows
            shard_linear(mod, kind, rank, world, rows)
            return True
        if is_fused_experts(mod):
            shard_experts(mod, rank, world, self._interleaved)
            self._experts[name] = experts_transposed(mod)
            return True
        if (mixer := split_mixer(mod, name, rank, world, self.group)) is not None:  # (visited before its linears)
            self._mixers[name] = mixer
            for child, rows in mixer.columns.items():
                self._mixer_columns.add(f"{name}.{child}")
                if rows is not None:
                    self._fused_rows[f"{name}.{child}"] = rows
            self._mixer_rows.update(f"{name}.{child}" for child in mixer.rows)
            whole = [c for c, m in mod.named_children() if isinstance(m, nn.Linear) and c not in mixer.whole
                     and self._kind(f"{name}.{c}") is None]
            if whole:  # a linear every rank would run whole beside its split neighbours, on the rank's channels
                raise InputError(f"--tensor-parallel cannot split {name}.{whole[0]} with the mixer's heads or "
                                 "channels; serve this base with --tensor-parallel 1")
        elif name in heads:
            check_attention(mod, name, heads[name])
            check_blocks(mod, name, world)
            kv = self._kv_heads_of(name, heads[name], config)
            rows = None if kv is None else kv_head_rows(kv, heads[name], rank, world)
            if rows is not None:
                if "k_norm" in norms:  # its sum of squares would count each replicated head several times
                    raise InputError(f"--tensor-parallel {world} exceeds {name}'s {kv} KV heads, whose key norm "
                                     "spans them all; use a degree that divides the KV heads")
                self._kv_rows[name] = rows
            if uses_alibi(text_config(config)):  # slopes built for every head above the layers: the rank's
                slice_alibi(mod, text_config(config).num_attention_heads, rank, world)
            shard_head_counts(mod, world, 1 if rows is None else world // kv)
            if isinstance(getattr(mod, "sinks", None), nn.Parameter):
                shard_sinks(mod, rank, world)
                self._sinks.add(name)
        return False

    def _kv_heads_of(self, attn: str, head_dim: int, config) -> int | None:
        """The KV heads of attention module ``attn`` (from its full ``k_proj``, ``qkv_proj``, ``c_attn`` or
        Falcon-7B's multi-query ``query_key_value``), None for a layout that holds none apart (GPT-NeoX's
        ``query_key_value``, latent attention: checked from the config).

        Raises:
            InputError: the degree neither divides them nor is a multiple of them.
        """
        world = self.group.world
        if f"{attn}.k_proj" in self._full_linears:
            kv = self._full_linears[f"{attn}.k_proj"][0] // head_dim
        elif leaf := next((n for n in ("qkv_proj", "c_attn", "query_key_value")
                           if f"{attn}.{n}" in self._full_linears), None):
            sizes = fused_blocks(leaf, self._full_linears[f"{attn}.{leaf}"][0], config, head_dim)
            if sizes is None:  # each head's (or KV group's) q, k, v together: split by heads
                return None
            kv = sizes[1] // head_dim
        else:
            return None
        if kv % world and world % kv:
            raise InputError(f"--tensor-parallel {world} neither divides {attn}'s {kv} KV heads nor is a multiple of "
                             "them; use a degree that divides them or one they divide")
        return kv

    def _rows_of(self, name: str, kind: str, heads: dict[str, int], config) -> torch.Tensor | None:
        """The rows a column-parallel linear keeps where not its plain span (else None): a fused
        projection's share of each block, a mixer's (set when the mixer was cut), or a KV head kept
        whole (:func:`kv_head_rows`).

        Raises:
            InputError: ``world`` does not divide the width it splits (a span would drop its last rows).
        """
        world, rank = self.group.world, self.group.rank
        parent, _, leaf = _adapted(name).rpartition(".")  # (an adapter's rows are its projection's)
        kv = self._kv_rows.get(parent)
        out, in_ = self._full_linears[name]
        sizes = fused_blocks(leaf, out, config, heads.get(parent, 0))
        if kv is not None and leaf in ("k_proj", "v_proj"):
            return kv
        if kv is not None and leaf in ("qkv_proj", "c_attn", "query_key_value"):
            q = sizes[0]
            return torch.cat([kept_rows([q], rank, world), q + kv, q + sizes[1] + kv])
        width = out if kind == "column" else in_
        if any(n % world for n in sizes or [width]):
            raise InputError(f"--tensor-parallel {world} does not divide {name}'s {width} "
                             f"{'output' if kind == 'column' else 'input'} features; use a degree that divides them")
        return self._fused_rows.get(name) if sizes is None else kept_rows(sizes, rank, world)

    def _layout_model(self) -> nn.Module:
        return self._full_model if self._full_model is not None else self.model

    def _moe_layout(self) -> MoeLayout:
        return MoeLayout(self.model, full=self._full_model)

    def _kind(self, module_name: str) -> str | None:
        adapted = _adapted(module_name)  # (an adapter's second linear: its projection's kind)
        if module_name in self._mixer_columns or (adapted != module_name and shard_kind(adapted, self._layers) == "column"):
            return "column"
        return "row" if module_name in self._mixer_rows else shard_kind(module_name, self._layers)

    def _reduced(self, name: str) -> str | None:
        """How module ``name``'s output is all-reduced: ``"output"`` (a row-parallel linear, or fused
        experts), ``"first"`` (a MoE block returning ``(output, router logits)``), None (not here)."""
        if name in self._reduced_blocks:
            return "first"
        if any(name.startswith(f"{b}.") for b in self._reduced_blocks):
            return None  # summed into its block's output, which is all-reduced
        return "output" if self._kind(name) == "row" or name in self._experts else None

    def _hook(self, mod: nn.Module, name: str) -> None:
        # Held on the module itself: an id() could be reused by a new module once the linear that
        # a DeltaLinear replaced is collected, and a row-parallel layer without its all-reduce would
        # leave the ranks out of step.
        how = self._reduced(name)
        if how is None or getattr(mod, "_tp_all_reduce", None) is not None:
            return
        if how == "output":
            mod._tp_all_reduce = mod.register_forward_hook(lambda _m, _i, out: self.group.all_reduce(out))
        else:
            mod._tp_all_reduce = mod.register_forward_hook(self._reduce_first)

    def _reduce_first(self, _mod: nn.Module, _inputs, out: tuple) -> None:
        """All-reduce a block's ``(output, router logits)`` output in place (the tuple is unchanged)."""
        self.group.all_reduce(out[0])

    def prepare_variant(self, v: VariantInfo, wanted: dict[str, str] | None = None):
        wanted = {} if wanted is None else wanted
        if v.kind == "lora":  # checked against the full linears, not this rank's shards
            from deltazip.runtime.serve.lora_variant import read_lora_spec

            spec = read_lora_spec(v.path, self._full_linears, type(self.model).__name__,
                                  lambda names: module_names(self.model, names), self._full_base)
            for mname in spec.magnitudes:  # (DoRA's norm of each output row spans every input column)
                if self._kind(mname) is not None and f"{mname}.weight" not in self._checkpoint_names:
                    raise InputError(f"variant {v.name}: DoRA on {mname} needs its whole base weight, which is no "
                                     "tensor of the base checkpoint; serve it with --tensor-parallel 1")
            return self._plan_lora(v, spec, wanted)
        plan = self._plan_variant(v, self._full_params, wanted)
        if v.kind == "artifact":
            check_variant(v, self._row_inputs(plan), self.group.world)
        return plan

    def _row_inputs(self, plan: dict[str, list[tuple[str, str]]]) -> dict[str, int]:
        """Per planned tensor landing on a row-parallel weight (a linear's, or experts' ``down_proj``),
        that weight's full input width."""
        out = {}
        for tname, targets in plan.items():
            for mname, attr in targets:
                if self._kind(mname) == "row" and attr == "weight":
                    out[tname] = self._full_linears[mname][1]
                elif mname in self._experts and parse_piece_key(attr)[0] == "down_proj":
                    shape = self._full_params[f"{mname}.down_proj"].shape  # [E, out, in], or [E, in, out]
                    out[tname] = shape[1] if self._experts[mname] else shape[2]
        return out

    def _replace(self, mname: str, kind: str) -> nn.Module:
        old = self.model.get_submodule(mname)
        if getattr(old, "_tp_all_reduce", None) is not None:
            # DeltaExperts runs the base module for steps without expert deltas: the all-reduce moves
            # to the outer module, to run once
            old._tp_all_reduce.remove()
            old._tp_all_reduce = None
        new = super()._replace(mname, kind)  # built over the (already sharded) base module
        self._hook(new, mname)
        return new

    def _put_packed(self, host: HostDelta, targets: list[tuple[str, str]], delta: PackedDelta, additive: bool) -> None:
        for mname, attr in targets:
            for key, part in self._expert_parts(mname, attr, delta):
                super()._put_packed(host, [(mname, key)], part, additive)

    def _put_dense(self, host: HostDelta, targets: list[tuple[str, str]], tensor: torch.Tensor) -> None:
        for mname, attr in targets:
            if mname not in self._experts:
                super()._put_dense(host, [(mname, attr)], tensor)
                continue
            mod, kw = self.modules[mname], host.modules.setdefault(mname, {})
            if parse_piece_key(attr)[0] in BIAS_OF:  # the variant's whole [E, out] bias
                ((key, part),) = self._expert_parts(mname, attr, tensor)
                kw[key] = mod.host_dense(key, part)
                continue
            for key, part in self._expert_parts(mname, attr, mod.piece_rows(attr, tensor)):
                kw[key] = mod.rows_delta(key, part)

    @functools.cached_property
    def _checkpoint_names(self) -> dict[str, str]:
        """Model parameter name -> the base checkpoint's tensor of it (transformers' renames)."""
        return {p: n for n, p in module_names(self.model, list(self.base.names)).items()}

    def _whole_weight(self, mname: str) -> torch.Tensor:
        """The whole base weight of a linear this rank holds a shard of, read from the base checkpoint
        (a DoRA adapter's row norms span every input column); an unsplit one's, as held."""
        if self._kind(mname) is None:
            return super()._whole_weight(mname)
        return self.base.get(self._checkpoint_names[f"{mname}.weight"]).to(self.dtype)

    def _put_expert_lora(self, host: HostDelta, mname: str, param: str, f: ExpertLoraFactors) -> None:
        """The rank's share of an adapter's experts factors: ``B``'s rows that the rank keeps of each
        expert's first projection (as a delta's rows are cut), ``A``'s columns of ``down_proj`` (the
        rank's inputs; the all-reduce sums the parts)."""
        e, out, r = f.b.shape
        rank, world = self.group.rank, self.group.world
        blocks = expert_blocks(param, self._interleaved)
        if blocks:
            parts = sorted(shard_expert_piece(param, 0, e * out, f.b.reshape(e * out, r), out, blocks, rank, world),
                           key=lambda p: p[0])
            f = f._replace(b=torch.cat([p for _, _, p in parts]).reshape(e, -1, r))
        else:
            f = f._replace(a=shard_dense(f.a.reshape(e * r, -1), "row", rank, world).reshape(e, r, -1))
        super()._put_expert_lora(host, mname, param, f)

    def _expert_parts(self, mname: str, attr: str, value) -> list[tuple[str, Any]]:
        """``(attr, value)`` for a target that is not an experts module; for one, this rank's parts of
        the piece ``attr`` (full rows of the ``[E * out, in]`` view, or a whole ``[E, out]`` bias), keyed
        by their rows in the rank's sharded parameter."""
        if mname not in self._experts:
            return [(attr, value)]
        rank, world = self.group.rank, self.group.world
        param, r0, r1 = parse_piece_key(attr)
        if param in BIAS_OF:
            return [(attr, shard_expert_bias(value, expert_blocks(BIAS_OF[param], self._interleaved), rank, world))]
        full = self._full_params[f"{mname}.{param}"]
        out = full.shape[2] if self._experts[mname] else full.shape[1]
        return [(piece_key(param, a, b), part) for a, b, part in
                shard_expert_piece(param, r0, r1, value, out, expert_blocks(param, self._interleaved), rank, world)]

    def load_host(self, name: str) -> HostDelta:
        """The variant decoded from disk, then cut to this rank's shard (the full copy is dropped)."""
        full = super().load_host(name)
        host = HostDelta(name)
        rank, world = self.group.rank, self.group.world
        for mname, kw in full.modules.items():
            kind = self._kind(mname)
            host.modules[mname] = kw if kind is None else shard_slot_args(
                kw, kind, rank, world, self._fused_rows.get(mname), transposed=mname in self._transposed)
            if mname in self._mixers:  # the variant's own tensors of a recurrent mixer (DeltaMixer's)
                host.modules[mname] = shard_mixer_tensors(kw, self._mixers[mname], mname)
            elif any(m.startswith(f"{mname}.") for m in self._mixers):  # a block holding one (Zamba2's)
                host.modules[mname] = self._cut_inner_mixer(mname, kw)
            for key, held in (("sinks", self._sinks), ("weight", self._split_norms)):
                if mname in held and key in kw:  # the variant's sinks [H], or norm [H * d]: this rank's heads'
                    host.modules[mname] = {**kw, key: kw[key][span(kw[key].shape[0], rank, world)].clone()}
        return host

    def _cut_inner_mixer(self, mname: str, kw: dict[str, Any]) -> dict[str, Any]:
        """A ``DeltaMixer``'s tensors of a block that holds a split mixer (Zamba2's ``mamba_decoder``,
        decoupled as a whole, around its ``mamba``): those of the mixer cut as :func:`shard_mixer_tensors`
        cuts them, the block's others (its norm) whole, as the rank holds them."""
        out = {}
        for key, t in kw.items():
            inner = next((m for m in self._mixers if f"{mname}.{key}".startswith(f"{m}.")), None)
            if inner is None:
                out[key] = t
                continue
            rel = f"{mname}.{key}"[len(inner) + 1:]
            out.update({f"{inner[len(mname) + 1:]}.{k}": v
                        for k, v in shard_mixer_tensors({rel: t}, self._mixers[inner], inner).items()})
        return out

    def resident_estimate(self, name: str) -> int:
        """Device bytes of this rank's shard of a variant (sharded linears count ``1/n``)."""
        v = self.variants[name]
        full = super().resident_estimate(name)
        if v.kind != "artifact":
            return full
        part = 0
        esize = torch.tensor([], dtype=self.dtype).element_size()
        for tname, targets in self._targets[name].items():
            e = v.entries[tname]
            sharded = [m for m, _ in targets if self._kind(m) is not None or m in self._experts]
            if not sharded or len(e.shape) != 2:
                continue
            packed_here = e.kernel_ready and self.delta_compute == "packed"
            per = e.stored_bytes if packed_here else e.numel * esize
            part += per * len(sharded)
        return full - part + part // self.group.world
