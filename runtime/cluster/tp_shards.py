"""What each tensor-parallel rank keeps of a tensor: the slicing behind
:mod:`deltazip.runtime.cluster.tensor_parallel`.

Rank ``r`` of ``n`` keeps, of a weight ``[out, in]``:

- column-parallel: rows ``[r * out/n, (r + 1) * out/n)``, or of a fused projection its share of
  each stacked block (:func:`fused_blocks`, :func:`kept_rows`);
- row-parallel: columns ``[r * in/n, (r + 1) * in/n)``; a bias whole on rank 0, zeros elsewhere.

A packed delta is cut the same way (:func:`shard_packed`: row shards re-pack the codes and cut the
group scales, which needs whole groups per shard). Fused experts ``[E, out, in]`` (or stored
``[E, in, out]``) keep each expert's share of its intermediate width (:func:`shard_experts`), and a
variant's expert pieces are cut to match (:func:`shard_expert_piece`). Everything returns new
tensors: the full ones can be dropped.
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
from deltazip.models.model_walk import experts_transposed
from deltazip.runtime.serve.delta_experts import expert_params


def span(size: int, rank: int, world: int) -> slice:
    per = size // world
    return slice(rank * per, (rank + 1) * per)


def _slice_codes(packed: torch.Tensor, bits: int, n: int, cols: slice) -> torch.Tensor:
    """Codes ``cols`` of every row of int32-packed ``packed`` (``n`` codes per row), packed again."""
    return pack_int32(unpack_int32(packed, bits, n)[:, cols], bits)


def shard_packed(d: PackedDelta, kind: str, rank: int, world: int, rows: torch.Tensor | None = None) -> PackedDelta:
    """Rank ``rank``'s shard of a packed delta ``[out, in]``.

    Column: ``[out/n, in]``, every part sliced by rows (``rows``, int64: those rows, for a fused
    projection or a KV head kept whole; else the rank's span). Row: ``[out, in/n]``; kept values
    ``in/2n`` per row under 2:4, groups ``G/n`` (the caller checked that groups do not straddle ranks).
    """
    if kind == "column":
        idx = span(d.out_features, rank, world) if rows is None else rows
        return d.map_parts(lambda t: t[idx].contiguous(),
                           out_features=d.out_features // world if rows is None else len(rows))
    width = d.in_features // world
    g = d.effective_group
    if world > 1 and (d.group_size == -1 or width % g or (d.sparse and width % 4)):
        raise InputError(f"a packed delta with groups of {g} columns cannot be split into {world} shards of {width} "
                         f"input columns; use a degree whose shard width is a multiple of the group size")
    kept = span(d.kept_per_row, rank, world)
    groups = span(d.num_groups, rank, world)
    qweight = _slice_codes(d.qweight, d.bits, d.kept_per_row, kept)
    positions = None if d.positions is None else _slice_codes(d.positions, 2, d.kept_per_row, kept)
    zeros = None if d.zeros is None else d.zeros[:, groups].contiguous()
    out = PackedDelta(qweight, d.scales[:, groups].contiguous(), zeros, positions, d.scheme, width, d.out_features)
    out.validate()
    return out


def shard_dense(t: torch.Tensor, kind: str, rank: int, world: int, rows: torch.Tensor | None = None,
                transposed: bool = False) -> torch.Tensor:
    """Rank ``rank``'s shard of a weight ``[out, in]`` (column: rows, ``rows`` as in :func:`shard_packed`;
    row: columns), a fresh tensor; with ``transposed``, of a Conv1D weight stored ``[in, out]``, in that
    layout."""
    t = t.as_subclass(torch.Tensor)  # a read-only registry tensor: the shard is new memory we own
    if transposed:
        return shard_dense(t.t(), kind, rank, world, rows).t().contiguous()
    if kind == "column":
        return t[span(t.shape[0], rank, world) if rows is None else rows].clone()
    return t[:, span(t.shape[1], rank, world)].clone()


def shard_bias(b: torch.Tensor, kind: str, rank: int, world: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Column: the rank's slice (or ``rows``) of ``[out]``; row: the whole bias on rank 0, zeros
    elsewhere (added once)."""
    b = b.as_subclass(torch.Tensor)
    if kind == "column":
        return b[span(b.shape[0], rank, world) if rows is None else rows].clone()
    return b.clone() if rank == 0 else torch.zeros_like(b)


def shard_slot_args(kw: dict[str, Any], kind: str, rank: int, world: int,
                    rows: torch.Tensor | None = None, transposed: bool = False) -> dict[str, Any]:
    """The ``DeltaLinear.load_slot`` arguments of one variant, sharded for ``rank`` (``rows``: a fused
    projection's rows the rank keeps, :func:`fused_blocks`; ``transposed``: a Conv1D's, whose dense
    replacement is stored ``[in, out]`` and its packed delta ``[out, in]`` as any linear's).

    LoRA: a column shard keeps its rows of ``B [out, r]`` (``A`` whole); a row shard its columns of
    ``A [r, in]`` (``B`` whole), so its partial product sums to the full one in the all-reduce.
    """
    out = dict(kw)
    if kw.get("packed") is not None:
        out["packed"] = shard_packed(kw["packed"], kind, rank, world, rows)
    if kw.get("dense") is not None:
        out["dense"] = shard_dense(kw["dense"], kind, rank, world, rows, transposed)
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
    GPT-BigCode's multi-query ``c_attn`` likewise; ``gate_up_proj``: gate and up halves), None for any
    other linear.

    Raises:
        InputError: a ``qkv_proj`` whose width is not the heads' (a layout this does not know).
    """
    if leaf == "gate_up_proj":
        return [out // 2, out // 2]
    if leaf == "Wqkv":  # MPT: every query head, then every key head, then every value head
        return [out // 3] * 3
    config = text_config(config)
    if leaf == "c_attn" and config.model_type == "gpt2":  # every query head, then every key, every value head
        return [out // 3] * 3
    if leaf == "c_attn":  # GPT-BigCode: every query head, then the one KV head's key and value
        kv = (out - config.hidden_size) // 2  # (or each head's q, k and v together: a plain span, None)
        return None if out == 3 * config.hidden_size else [config.hidden_size, kv, kv]
    if leaf == "query_key_value" and config.model_type == "falcon":  # multi-query (Falcon-7B): every
        # query head, then the one key and value head; else each head's or KV group's q, k, v together
        kv = (out - config.hidden_size) // 2
        return [config.hidden_size, kv, kv] if config.multi_query and not config.new_decoder_architecture else None
    if leaf != "qkv_proj" or config.model_type == "codegen":
        # (CodeGen's holds 4 blocks, each a quarter of the heads' queries, values and keys: a plain
        # span of whole blocks is a span of heads, tensor_parallel checks the degree divides them)
        return None
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


def shard_expert_bias(bias: torch.Tensor, blocks: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s part of an experts bias ``[E, out]`` (``blocks``: its projection's
    :func:`expert_blocks`): the columns of its rows for the first projection; ``down_proj``'s whole on rank 0 and zeros elsewhere (added once, after the all-reduce's sum)."""
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
            view = view[:, :, span(view.shape[2], rank, world)]
        kept = view.transpose(1, 2) if transposed else view
        setattr(mod, param, nn.Parameter(kept.contiguous(), requires_grad=False))
        if getattr(mod, "has_bias", False):
            b = getattr(mod, f"{param}_bias").detach()
            setattr(mod, f"{param}_bias", nn.Parameter(shard_expert_bias(b, blocks, rank, world),
                                                       requires_grad=False))
    for attr in ("intermediate_dim", "intermediate_size", "expert_dim"):
        if isinstance(getattr(mod, attr, None), int):
            setattr(mod, attr, getattr(mod, attr) // world)


def shard_sinks(attn: nn.Module, rank: int, world: int) -> None:
    """An attention module's sinks ``[H]`` (one logit per query head): the rank's heads'."""
    sinks = attn.sinks.detach().as_subclass(torch.Tensor)
    attn.sinks = nn.Parameter(sinks[span(sinks.shape[0], rank, world)].clone(), requires_grad=False)


def shard_linear(mod: nn.Module, kind: str, rank: int, world: int, rows: torch.Tensor | None = None) -> None:
    """Shard an ``nn.Linear``, or a Conv1D (GPT-2's: weight ``[in, out]``), in place (its full weight
    is dropped)."""
    transposed = not isinstance(mod, nn.Linear)
    w = shard_dense(mod.weight.detach(), kind, rank, world, rows, transposed)
    mod.weight = nn.Parameter(w, requires_grad=False)
    if mod.bias is not None:
        mod.bias = nn.Parameter(shard_bias(mod.bias.detach(), kind, rank, world, rows), requires_grad=False)
    if transposed:  # (its forward shapes the output by nf)
        mod.nx, mod.nf = w.shape
    else:
        mod.out_features, mod.in_features = w.shape


def kv_head_rows(kv_heads: int, head_dim: int, rank: int, world: int) -> torch.Tensor | None:
    """Rows of a key or value projection ``[kv_heads * head_dim, in]`` that rank ``rank`` keeps when
    the degree exceeds the KV heads (``kv_heads`` divides ``world``): KV head ``rank * kv_heads // world``
    whole (int64), the one every query head of the rank reads under grouped-query attention; each KV
    head is then held by ``world / kv_heads`` ranks. None when ``world`` divides ``kv_heads``: a span."""
    if kv_heads % world == 0:
        return None
    h = rank * kv_heads // world
    return torch.arange(h * head_dim, (h + 1) * head_dim)


def shard_head_counts(attn: nn.Module, world: int, copies: int = 1) -> None:
    """An attention module that views its projections with its own head counts (Mllama's
    ``num_heads``, ``num_key_value_heads``, GPT-J's ``num_attention_heads``, Falcon's
    ``num_kv_heads``, MPT's ``n_heads``) or reshapes its heads' output to its own width (XGLM's ``embed_dim``, heads x
    head width) holds ``1/world`` of them on each rank; one that reads them from its config in the
    forward (Phi-3 finds the end of its queries in ``qkv_proj``'s output so) gets a copy of its
    config with the rank's counts. ``copies``: how many ranks hold each KV head (:func:`kv_head_rows`;
    1 when they are split): a rank then holds ``kv * copies / world`` of them, and each serves
    ``1/copies`` of the query heads it served (``num_key_value_groups``)."""
    heads, head_dim = getattr(attn, "num_heads", None), getattr(attn, "head_dim", None)
    for attr in ("embed_dim", "split_size"):  # (GPT-2 splits c_attn's output at split_size)
        width = getattr(attn, attr, None)
        if isinstance(width, int) and isinstance(heads, int) and isinstance(head_dim, int) and width == heads * head_dim:
            setattr(attn, attr, width // world)
    for attr in ("num_heads", "n_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "kv_heads",
                 "num_key_value_groups"):
        n = getattr(attn, attr, None)
        if isinstance(n, int):
            setattr(attn, attr, _per_rank(attr, n, world, copies))
    if isinstance(getattr(attn, "qkv_proj", None), nn.Linear) and getattr(attn, "config", None) is not None:
        attn.config = copy.copy(attn.config)
        for attr in ("num_attention_heads", "num_key_value_heads"):
            if isinstance(getattr(attn.config, attr, None), int):
                setattr(attn.config, attr, _per_rank(attr, getattr(attn.config, attr), world, copies))


def _per_rank(attr: str, n: int, world: int, copies: int) -> int:
    if attr == "num_key_value_groups":
        return n // copies
    return n * copies // world if attr in ("num_key_value_heads", "num_kv_heads", "kv_heads") else n // world
