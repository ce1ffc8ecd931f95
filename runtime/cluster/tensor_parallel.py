"""Tensor-parallel sharding of the base model and of every packed delta (Megatron-style, at load time).

Each decoder layer of a supported model (``SUPPORTED_MODEL_TYPES``: the Llama family and others laid
out alike) has two kinds of linears:

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
linear's.

A packed delta (``deltazip.kernels.packed``) shards the same way. Column shards slice every part by
rows. Row shards slice codes, 2:4 positions and group scales/zeros along the input dimension, which
only works when a shard holds whole quantization groups (and so whole 2:4 blocks): that is checked
before serving (:func:`check_variant`). Embeddings, norms and ``lm_head`` stay replicated.

The artifact layout does not change: everything here runs when a model or a variant is loaded.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from deltazip.formats.errors import InputError
from deltazip.formats.packing import pack_int32
from deltazip.kernels.packed import PackedDelta
from deltazip.kernels.reference import unpack_int32
from deltazip.models.loader import text_config
from deltazip.models.model_walk import decoder_layers, dense_routed, empty_model, experts_transposed
from deltazip.models.param_names import module_names
from deltazip.runtime.serve.delta_experts import (
    BIAS_OF,
    MoeLayout,
    expert_params,
    is_fused_experts,
    parse_piece_key,
    piece_key,
)
from deltazip.runtime.serve.model import DeltaModel, HostDelta, load_base_model
from deltazip.runtime.serve.variant_sources import VariantInfo

# Decoder layers of separate q/k/v/o and gate/up/down projections whose attention reshapes to ``-1``
# heads, and any q/k norm is per head (Qwen3, Gemma 2 and 3): a rank's heads need nothing of the others'.
# Each is served by two ranks as the merged model generates (``python bench/support.py``, serve_tp2).
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "ministral", "ministral3", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3",
    "qwen3_vl_text", "gemma", "gemma2", "gemma3_text", "gemma4_text", "vaultgemma", "granite", "granite_swa",
    "smollm3", "mllama_text_model", "stablelm", "cohere", "cohere2", "olmo", "exaone", "exaone4",
    "hunyuan_v1_dense", "ernie4_5", "seed_oss", "apertus", "nemotron", "arcee", "helium", "internlm3", "minicpm3",
    "phi3", "glm", "glm4")
# The same attention, with mixture-of-experts layers whose fused experts gate by halves (``chunk(2)``
# of ``gate_up_proj``), beside plain MLP layers and shared experts (sharded as the MLP is).
# Experts whose gate and up columns alternate in ``gate_up_proj`` (GPT-OSS's ``gate_up[..., ::2]``).
INTERLEAVED_GATE_UP = ("gpt_oss",)
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_vl_moe_text", "phimoe", "granitemoe",
                   "granitemoeshared", "granitemoe_swa", "glm4_moe", "ernie4_5_moe", "hunyuan_v1_moe", "dots1",
                   "cohere2_moe", "exaone_moe", "solar_open", "afmoe", "hy_v3", "gpt_oss", "llama4_text",
                   "deepseek_v2", "deepseek_v3", "glm4_moe_lite")
# Multi-head latent attention (DeepSeek-V2/V3 and kin): the query's and the cached latent's per-head
# expansions are column-parallel; the projections and norms that make the latents, which every head
# reads, stay whole.
# Fused projections (Phi-3's ``qkv_proj``, GLM-4's and Phi-3's ``gate_up_proj``) are column-parallel
# block by block: a rank keeps its share of each of the stacked projections (``fused_blocks``).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj", "qkv_proj",
                   "gate_up_proj")
LATENT = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
ROW_PARALLEL = ("o_proj", "down_proj")


def shard_kind(module_name: str, layers: str | None = None) -> str | None:
    """``"column"``, ``"row"`` or None (replicated) for a module name such as ``model.layers.3.self_attn.q_proj``;
    with ``layers`` (the decoder list's name), only modules under it (an image-text model's vision tower,
    whose blocks are ``layers`` too, stays whole)."""
    if ".layers." not in f".{module_name}" or (layers is not None and not module_name.startswith(f"{layers}.")):
        return None
    leaf = module_name.rsplit(".", 1)[-1]
    return "column" if leaf in COLUMN_PARALLEL else "row" if leaf in ROW_PARALLEL else None


def check_config(config, world: int) -> None:
    """Refuse (one line) a model that ``world`` ranks cannot shard.

    Raises:
        InputError: unsupported architecture, or ``world`` not dividing the attention heads, the
            KV heads or the MLP intermediate size.
    """
    config = text_config(config)  # an image-text model's language model is what is sharded
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES + MOE_MODEL_TYPES:
        raise InputError(f"--tensor-parallel does not shard model_type {mt!r} (its layers are not split by heads and "
                         "intermediate width alike; docs/support.md's serve_tp2 column lists the families it shards); "
                         "serve this base with --tensor-parallel 1")
    for key, what in (("num_attention_heads", "attention heads"), ("num_key_value_heads", "KV heads"),
                      ("intermediate_size", "intermediate size"), ("moe_intermediate_size", "expert width"),
                      ("shared_expert_intermediate_size", "shared expert width"),
                      ("intermediate_size_mlp", "MLP width")):
        try:
            value = getattr(config, key, None)
        except Exception as e:  # transformers refuses one value for a setting that differs per layer
            raise InputError(f"--tensor-parallel needs one {what} count for every layer, and this {mt} model's "
                             f"varies per layer; serve this base with --tensor-parallel 1") from e
        if value is None and key == "num_key_value_heads":
            value = config.num_attention_heads  # no GQA: as many KV heads as query heads
        if value is not None and value % world:
            raise InputError(f"--tensor-parallel {world} does not divide the model's {what} ({value}); use a "
                             f"degree that divides it")


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


def check_variants(variants: list[VariantInfo], world: int) -> None:
    """:func:`check_variant` for every artifact, from its manifest alone (before any rank starts): the
    tensors named as row-parallel linears (``...o_proj.weight``, ``...down_proj.weight``, per-expert
    ones included). Each rank checks again against the model, which also names the rest (Mixtral's
    ``w2``, fused experts)."""
    for v in variants:
        if v.kind == "artifact":
            check_variant(v, {t: e.shape[-1] for t, e in v.entries.items()
                              if shard_kind(t.rsplit(".", 1)[0]) == "row"}, world)


def check_attention(attn: nn.Module, name: str, head_dim: int) -> None:
    """Refuse an attention module holding a tensor that splitting its heads would not split with them:
    anything beyond its sharded projections and per-head norms of ``[head_dim]`` (a q/k norm over every
    head, OLMo 2's; one weight per head, Cohere's q/k norms, attention sinks).

    Raises:
        InputError: naming the tensor.
    """
    for child, mod in attn.named_children():  # (attention sinks, one per head, are split: shard_sinks)
        if child in LATENT or (isinstance(mod, nn.Linear) and child in COLUMN_PARALLEL + ROW_PARALLEL):
            continue
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


def _span(size: int, rank: int, world: int) -> slice:
    per = size // world
    return slice(rank * per, (rank + 1) * per)


def _slice_codes(packed: torch.Tensor, bits: int, n: int, cols: slice) -> torch.Tensor:
    """Codes ``cols`` of every row of int32-packed ``packed`` (``n`` codes per row), packed again."""
    return pack_int32(unpack_int32(packed, bits, n)[:, cols], bits)


def shard_packed(d: PackedDelta, kind: str, rank: int, world: int, rows: torch.Tensor | None = None) -> PackedDelta:
    """Rank ``rank``'s shard of a packed delta ``[out, in]``.

    Column: ``[out/n, in]``, every part sliced by rows (``rows``, int64: those rows, for a fused
    projection; else the rank's span). Row: ``[out, in/n]``; kept values ``in/2n`` per row under
    2:4, groups ``G/n`` (the caller checked that groups do not straddle ranks).
    """
    if kind == "column":
        idx = _span(d.out_features, rank, world) if rows is None else rows
        return d.map_parts(lambda t: t[idx].contiguous(), out_features=d.out_features // world)
    width = d.in_features // world
    g = d.effective_group
    if world > 1 and (d.group_size == -1 or width % g or (d.sparse and width % 4)):
        raise InputError(f"a packed delta with groups of {g} columns cannot be split into {world} shards of {width} "
                         f"input columns; use a degree whose shard width is a multiple of the group size")
    kept = _span(d.kept_per_row, rank, world)
    groups = _span(d.num_groups, rank, world)
    qweight = _slice_codes(d.qweight, d.bits, d.kept_per_row, kept)
    positions = None if d.positions is None else _slice_codes(d.positions, 2, d.kept_per_row, kept)
    zeros = None if d.zeros is None else d.zeros[:, groups].contiguous()
    out = PackedDelta(qweight, d.scales[:, groups].contiguous(), zeros, positions, d.scheme, width, d.out_features)
    out.validate()
    return out


def shard_dense(t: torch.Tensor, kind: str, rank: int, world: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rank ``rank``'s shard of a weight ``[out, in]`` (column: rows, ``rows`` as in :func:`shard_packed`;
    row: columns), a fresh tensor."""
    t = t.as_subclass(torch.Tensor)  # a read-only registry tensor: the shard is new memory we own
    if kind == "column":
        return t[_span(t.shape[0], rank, world) if rows is None else rows].clone()
    return t[:, _span(t.shape[1], rank, world)].clone()


def shard_bias(b: torch.Tensor, kind: str, rank: int, world: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Column: the rank's slice (or ``rows``) of ``[out]``; row: the whole bias on rank 0, zeros
    elsewhere (added once)."""
    b = b.as_subclass(torch.Tensor)
    if kind == "column":
        return b[_span(b.shape[0], rank, world) if rows is None else rows].clone()
    return b.clone() if rank == 0 else torch.zeros_like(b)


def shard_slot_args(kw: dict[str, Any], kind: str, rank: int, world: int,
                    rows: torch.Tensor | None = None) -> dict[str, Any]:
    """The ``DeltaLinear.load_slot`` arguments of one variant, sharded for ``rank`` (``rows``: a fused
    projection's rows the rank keeps, :func:`fused_blocks`).

    LoRA: a column shard keeps its rows of ``B [out, r]`` (``A`` whole); a row shard its columns of
    ``A [r, in]`` (``B`` whole), so its partial product sums to the full one in the all-reduce.
    """
    out = dict(kw)
    if kw.get("packed") is not None:
        out["packed"] = shard_packed(kw["packed"], kind, rank, world, rows)
    if kw.get("dense") is not None:
        out["dense"] = shard_dense(kw["dense"], kind, rank, world, rows)
    if kw.get("bias") is not None:
        out["bias"] = shard_bias(kw["bias"], kind, rank, world, rows)
    if kw.get("lora_a") is not None:
        if kind == "column":
            out["lora_b"] = shard_dense(kw["lora_b"], "column", rank, world, rows)
        else:
            out["lora_a"] = shard_dense(kw["lora_a"], "row", rank, world)
    return out


def expert_blocks(param: str, interleaved: bool) -> int:
    """How many equal blocks of rows each expert's ``param`` stacks in its ``[out, in]`` view, each
    sharded alike: 2 for ``gate_up_proj`` (gate, then up), 1 for an ungated ``up_proj`` or a gate_up
    whose gate and up columns alternate (``interleaved``, GPT-OSS: a span of pairs is a span of rows),
    0 for ``down_proj`` (sharded by columns)."""
    return 0 if param == "down_proj" else 1 if param == "up_proj" or interleaved else 2


def kept_rows(sizes: list[int], rank: int, world: int) -> torch.Tensor:
    """The rank's rows of a stack of blocks of ``sizes`` rows (its ``1/n`` of each block), in order: int64."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return torch.cat([torch.arange(a + rank * (n // world), a + (rank + 1) * (n // world))
                      for a, n in zip(starts, sizes)])


def fused_blocks(leaf: str, out: int, config, head_dim: int) -> list[int] | None:
    """The blocks a fused column-parallel linear stacks (``qkv_proj``: query, key and value heads;
    ``gate_up_proj``: gate and up halves), None for any other linear.

    Raises:
        InputError: a ``qkv_proj`` whose width is not the heads' (a layout this does not know).
    """
    if leaf == "gate_up_proj":
        return [out // 2, out // 2]
    if leaf != "qkv_proj":
        return None
    config = text_config(config)
    h = config.num_attention_heads
    hkv = getattr(config, "num_key_value_heads", None) or h
    sizes = [h * head_dim, hkv * head_dim, hkv * head_dim]
    if sum(sizes) != out:
        raise InputError(f"--tensor-parallel cannot split a qkv_proj of {out} rows into {h} query and {hkv} KV heads "
                         f"of {head_dim}; serve this base with --tensor-parallel 1")
    return sizes


def expert_row_runs(r0: int, r1: int, out: int, blocks: int, rank: int, world: int) -> list[tuple[int, int, int]]:
    """Rows of an expert parameter seen as ``[E * out, in]`` that rank ``rank`` keeps, within ``[r0, r1)``:
    ``(lo, hi, at)`` runs, ``at`` the first row's place in the rank's ``[E * out/n, in]``.

    Each expert's ``out`` rows are ``blocks`` equal blocks (gate, up); a rank keeps its ``1/n`` of each.
    """
    per_block, per = out // blocks, out // blocks // world
    runs = []
    for e in range(r0 // out, (r1 - 1) // out + 1):
        for b in range(blocks):
            start = e * out + b * per_block + rank * per  # the rank's first row of this block
            lo, hi = max(start, r0), min(start + per, r1)
            if lo < hi:
                runs.append((lo, hi, e * (out // world) + b * per + lo - start))
    return runs


def shard_expert_piece(param: str, r0: int, r1: int, value, out: int, blocks: int, rank: int,
                       world: int) -> list[tuple[int, int, Any]]:
    """Rank ``rank``'s parts of a variant's piece of an experts parameter: full rows ``[r0, r1)`` of
    ``[E * out, in]``, ``value`` their dense delta ``[r1 - r0, in]`` or a :class:`PackedDelta`
    (``blocks``: :func:`expert_blocks`).

    Returns:
        ``(row0, row1, part)`` in the rank's ``[E * out/n, in]`` (``down_proj``: the same rows, the
        rank's columns of ``value``).
    """
    if not blocks:
        part = shard_packed(value, "row", rank, world) if isinstance(value, PackedDelta) \
            else shard_dense(value, "row", rank, world)
        return [(r0, r1, part)]
    parts = []
    for lo, hi, at in expert_row_runs(r0, r1, out, blocks, rank, world):
        a, b = lo - r0, hi - r0
        part = value.map_parts(lambda t, a=a, b=b: t[a:b].contiguous(), out_features=b - a) \
            if isinstance(value, PackedDelta) else value[a:b].clone()
        parts.append((at, at + hi - lo, part))
    return parts


def shard_expert_bias(param: str, bias: torch.Tensor, blocks: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s part of an experts bias ``[E, out]``: the columns of its rows for the first
    projection; ``down_proj``'s whole on rank 0 and zeros elsewhere (added once, after the all-reduce's sum)."""
    bias = bias.as_subclass(torch.Tensor)
    if not blocks:
        return bias.clone() if rank == 0 else torch.zeros_like(bias)
    return bias[:, kept_rows([bias.shape[1] // blocks] * blocks, rank, world)].contiguous()


def shard_experts(mod: nn.Module, rank: int, world: int, interleaved: bool) -> None:
    """Shard a fused-experts module in place: each expert keeps its ``1/n`` of the intermediate width
    (rows of each block of the first projection, columns of ``down_proj``, in the ``[E, out, in]``
    view of either storage), and its biases with them (:func:`shard_expert_bias`).
    """
    transposed = experts_transposed(mod)
    for param in expert_params(mod):
        w = getattr(mod, param).detach().as_subclass(torch.Tensor)
        view = w.transpose(1, 2) if transposed else w  # [E, out, in]
        blocks = expert_blocks(param, interleaved)
        if blocks:
            view = view[:, kept_rows([view.shape[1] // blocks] * blocks, rank, world)]
        else:
            view = view[:, :, _span(view.shape[2], rank, world)]
        kept = view.transpose(1, 2) if transposed else view
        setattr(mod, param, nn.Parameter(kept.contiguous(), requires_grad=False))
        if getattr(mod, "has_bias", False):
            b = getattr(mod, f"{param}_bias").detach()
            setattr(mod, f"{param}_bias", nn.Parameter(shard_expert_bias(param, b, blocks, rank, world),
                                                       requires_grad=False))
    for attr in ("intermediate_dim", "intermediate_size", "expert_dim"):
        if isinstance(getattr(mod, attr, None), int):
            setattr(mod, attr, getattr(mod, attr) // world)


def shard_sinks(attn: nn.Module, rank: int, world: int) -> None:
    """An attention module's sinks ``[H]`` (one logit per query head): the rank's heads'."""
    sinks = attn.sinks.detach().as_subclass(torch.Tensor)
    attn.sinks = nn.Parameter(sinks[_span(sinks.shape[0], rank, world)].clone(), requires_grad=False)


def _shard_module(mod: nn.Linear, kind: str, rank: int, world: int, rows: torch.Tensor | None = None) -> None:
    """Shard an ``nn.Linear`` in place (its full weight is dropped)."""
    w = shard_dense(mod.weight.detach(), kind, rank, world, rows)
    mod.weight = nn.Parameter(w, requires_grad=False)
    if mod.bias is not None:
        mod.bias = nn.Parameter(shard_bias(mod.bias.detach(), kind, rank, world, rows), requires_grad=False)
    mod.out_features, mod.in_features = w.shape


def _is_attention(mod: nn.Module) -> bool:
    """A module holding the query projection (``q_proj``, Phi-3's ``qkv_proj``, MLA's ``q_a_proj``/``q_b_proj``)."""
    return any(isinstance(getattr(mod, n, None), nn.Linear) for n in ("q_proj", "qkv_proj", "q_b_proj"))


def _head_dim(attn: nn.Module, config) -> int:
    """An attention module's head width: its own ``head_dim``, else the text config's."""
    hd = getattr(attn, "head_dim", None)
    if isinstance(hd, int):
        return hd
    config = text_config(config)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _shard_head_counts(attn: nn.Module, world: int) -> None:
    """An attention module that views its projections with its own head counts (Mllama's
    ``num_heads``, ``num_key_value_heads``) holds ``1/world`` of them on each rank; one that reads
    them from its config in the forward (Phi-3 finds the end of its queries in ``qkv_proj``'s output
    so) gets a copy of its config with the rank's counts."""
    for attr in ("num_heads", "num_key_value_heads"):
        n = getattr(attn, attr, None)
        if isinstance(n, int):
            setattr(attn, attr, n // world)
    if isinstance(getattr(attn, "qkv_proj", None), nn.Linear) and getattr(attn, "config", None) is not None:
        attn.config = copy.copy(attn.config)
        attn.config.num_attention_heads //= world
        if isinstance(getattr(attn.config, "num_key_value_heads", None), int):
            attn.config.num_key_value_heads //= world


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
        self._full_linears = {n: (m.out_features, m.in_features) for n, m in model.named_modules()
                              if isinstance(m, nn.Linear)}
        self._layers = decoder_layers(model)[0]
        self._experts: dict[str, bool] = {}  # fused-experts modules (sharded by expert width, all-reduced)
        # -> whether stored [E, in, out]
        self._sinks: set[str] = set()  # attention modules whose sinks are sharded by heads
        self._interleaved = text_config(model.config).model_type in INTERLEAVED_GATE_UP
        # MoE blocks of experts run over every token (Llama 4): their [E * T, H] output is summed over
        # experts and added to the shared expert's inside the block, so the block's output is what is
        # all-reduced (once, and E times smaller), not the experts' nor the shared expert's down_proj.
        self._reduced_blocks = {n.rpartition(".")[0] for n, m in model.named_modules()
                                if n.startswith(f"{self._layers}.") and is_fused_experts(m) and dense_routed(m)}
        self._fused_rows: dict[str, torch.Tensor] = {}  # fused column-parallel linear -> the rank's rows
        rank, world = self.group.rank, self.group.world
        heads = {n: _head_dim(m, model.config) for n, m in model.named_modules() if _is_attention(m)}
        for name, mod in model.named_modules():
            kind = self._kind(name)
            if kind is not None and isinstance(mod, nn.Linear):
                parent, _, leaf = name.rpartition(".")
                sizes = fused_blocks(leaf, mod.out_features, model.config, heads.get(parent, 0))
                if sizes is not None:
                    self._fused_rows[name] = kept_rows(sizes, rank, world)
                _shard_module(mod, kind, rank, world, self._fused_rows.get(name))
            elif name.startswith(f"{self._layers}.") and is_fused_experts(mod):
                shard_experts(mod, rank, world, self._interleaved)
                self._experts[name] = experts_transposed(mod)
            elif name.startswith(f"{self._layers}.") and name in heads:
                check_attention(mod, name, heads[name])
                _shard_head_counts(mod, world)
                if isinstance(getattr(mod, "sinks", None), nn.Parameter):
                    shard_sinks(mod, rank, world)
                    self._sinks.add(name)
        for name, mod in model.named_modules():
            self._hook(mod, name)
        # Checkpoint names of expert tensors map to rows of the full parameters (a meta skeleton).
        self._full_model = empty_model(base.path, dtype) if self._experts else None
        return model.to(device)

    def _moe_layout(self) -> MoeLayout:
        return MoeLayout(self.model, full=self._full_model)

    def _kind(self, module_name: str) -> str | None:
        return shard_kind(module_name, self._layers)

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
                                  lambda names: module_names(self.model, names))
            wanted.update({m: "linear" for m in spec.modules})
            return spec
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

    def _expert_parts(self, mname: str, attr: str, value) -> list[tuple[str, Any]]:
        """``(attr, value)`` for a target that is not an experts module; for one, this rank's parts of
        the piece ``attr`` (full rows of the ``[E * out, in]`` view, or a whole ``[E, out]`` bias), keyed
        by their rows in the rank's sharded parameter."""
        if mname not in self._experts:
            return [(attr, value)]
        rank, world = self.group.rank, self.group.world
        param, r0, r1 = parse_piece_key(attr)
        if param in BIAS_OF:
            return [(attr, shard_expert_bias(BIAS_OF[param], value, expert_blocks(BIAS_OF[param], self._interleaved),
                                             rank, world))]
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
            host.modules[mname] = kw if kind is None else shard_slot_args(kw, kind, rank, world,
                                                                          self._fused_rows.get(mname))
            if mname in self._sinks and "sinks" in kw:  # the variant's sinks [H]: this rank's heads'
                host.modules[mname] = {**kw, "sinks": kw["sinks"][_span(kw["sinks"].shape[0], rank, world)].clone()}
        return host

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
