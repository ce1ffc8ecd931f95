"""Checkpoint tensor names <-> the parameters of one decoder layer, and what gets compressed.

The pipeline works on checkpoint tensors (what the artifact stores, by name), the forward on module
parameters. They are the same for most models, but not always: transformers 5 keeps a
mixture-of-experts layer's experts as fused 3-D parameters (``mlp.experts.gate_up_proj`` ``[E,
2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) while ``save_pretrained`` writes one 2-D tensor
per expert and projection under the historical names (Mixtral:
``block_sparse_moe.experts.{e}.w1/w3/w2.weight``; Qwen2-MoE: ``mlp.experts.{e}.gate_proj/up_proj/
down_proj.weight``). A checkpoint written from the fused state dict keeps the fused names; both
load.

Each checkpoint tensor of a layer is mapped to a ``Piece``: a range of rows of one parameter seen
as ``[rows, last_dim]``. A name equal to a parameter of the same shape is that whole parameter.
Otherwise transformers' own save-side conversion (``revert_weight_conversion``, which defines what
``save_pretrained`` writes) is run on small tag tensors, ``shape[:-1] + (1,)`` per parameter, whose
values number the rows: where a checkpoint tensor's rows came from is then read off its tags. A
conversion that is not a row selection (a transpose, an interleave of columns) leaves tags that do
not form one contiguous range of one parameter, and the tensor is refused by name when it matters.

A ``Target`` is a checkpoint tensor that lands on a compressible site (``model_walk.Site``) and is
stored as one packed entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from deltazip.formats.errors import InputError
from deltazip.models.model_walk import Site, layer_sites, set_param


def as_rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, last)`` of a parameter seen as a 2-D row view (1-D: one element per row)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], 1
    return math.prod(shape[:-1]), shape[-1]


@dataclass(frozen=True)
class Piece:
    """Rows ``[row0, row1)`` of layer parameter ``param`` (relative name) in its row view."""

    param: str
    row0: int
    row1: int


@dataclass(frozen=True)
class Target:
    """A checkpoint tensor compressed as one packed entry.

    Attributes:
        name: checkpoint tensor name.
        site: where it multiplies activations.
        piece: the rows of the site's parameter it holds.
        shape: its shape in the checkpoint.
        param_shape: the site parameter's shape.

    Orientation: a linear's tensor (or a row slice of it) is ``[out, in]``; a Conv1D's is stored
    ``[in, out]`` and solved transposed; a fused expert tensor is ``[E, out, in]`` (``experts`` = E;
    GPT-OSS stores ``[E, in, out]``, each expert solved transposed) and solved one expert at a time;
    one expert's slice of a fused parameter (per-expert checkpoint names) is ``[out_e, in]`` and uses
    that expert's Hessian (``expert``).
    """

    name: str
    site: Site
    piece: Piece
    shape: tuple[int, ...]
    param_shape: tuple[int, ...]

    @property
    def transposed(self) -> bool:
        """Stored ``[in, out]`` (a Conv1D's weight, or each expert of ``[E, in, out]``)."""
        return self.site.kind == "conv1d" or self.site.transposed

    @property
    def in_features(self) -> int:
        return self.shape[-2] if self.transposed else self.shape[-1]

    @property
    def matrix_shape(self) -> list[int]:
        """The shape an artifact entry states: ``[out, in]`` or ``[E, out, in]`` (stored orientation undone)."""
        return [*self.shape[:-2], self.shape[-1], self.shape[-2]] if self.transposed else list(self.shape)

    @property
    def experts(self) -> int:
        """E when the tensor is a whole fused expert parameter, else 0."""
        return self.site.experts if self.site.kind == "experts" and len(self.shape) == 3 else 0

    @property
    def expert(self) -> int | None:
        """The expert a per-expert slice belongs to (None otherwise)."""
        if self.site.kind != "experts" or self.experts:
            return None
        return self.piece.row0 // self.param_shape[1]

    def matrices(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The ``[out, in]`` matrices the solver works on, from a tensor of the checkpoint's shape."""
        if self.experts:
            return [m.t() if self.transposed else m
                    for m in t.reshape(self.experts, *self.shape[-2:]).unbind(0)]
        if self.transposed:
            return [t.t()]
        return [t.reshape(-1, self.in_features)]

    def stored(self, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of ``matrices`` on the stacked ``[sum(out), in]`` rows: the checkpoint's layout."""
        if self.transposed:
            return rows.reshape(self.matrix_shape).transpose(-1, -2).contiguous()
        return rows.reshape(self.shape)

    def hessian_keys(self) -> list[tuple[str, int | None]]:
        """Per matrix of ``matrices``: ``(site key, expert or None)`` of its Hessian."""
        if self.experts:
            return [(self.site.key, e) for e in range(self.experts)]
        return [(self.site.key, self.expert)]


def _target(name: str, site: Site, piece: Piece, shape: tuple[int, ...], pshape: tuple[int, ...]) -> Target:
    rows, last = as_rows(pshape)
    n = piece.row1 - piece.row0
    full = piece.row0 == 0 and piece.row1 == rows
    if site.kind == "conv1d" or site.transposed:  # stored [in, out]: whole matrices only
        ok = full and shape == pshape
    elif site.kind == "linear":
        ok = shape == (n, last)
    else:
        out = pshape[1]
        ok = (full and shape == pshape) or (
            piece.row0 // out == (piece.row1 - 1) // out and shape == (n, last))
    if not ok:
        raise InputError(f"checkpoint tensor {name} {list(shape)} holds rows {piece.row0}..{piece.row1} of "
                         f"{site.kind} parameter {site.param} {list(pshape)}: deltazip compresses a whole "
                         "matrix, a row range of a linear or one expert's rows, not this")
    return Target(name, site, piece, shape, pshape)


class LayerMap:
    """Checkpoint tensors of one decoder layer: their pieces, and the targets among them.

    Args:
        prefix: the layer's checkpoint prefix (``model.layers.3.``; Nemotron-H: ``backbone.layers.3.``).
        module_prefix: the layer's module prefix (``model.layers.3.``).
        layer: the layer module (meta parameters are fine).
        pieces: checkpoint name -> Piece.
        problems: checkpoint name -> why it could not be mapped.
        names: the layer's checkpoint names, in checkpoint order.
        shape_of: checkpoint name -> shape.
    """

    def __init__(self, prefix: str, layer: nn.Module, pieces: dict[str, Piece], problems: dict[str, str],
                 names: list[str], shape_of: Callable[[str], tuple[int, ...]], module_prefix: str | None = None):
        self.prefix = prefix
        self.module_prefix = prefix if module_prefix is None else module_prefix
        self.sites = layer_sites(layer)
        self.params = {n: tuple(p.shape) for n, p in layer.named_parameters()}
        self.buffers = {n for n, _ in layer.named_buffers()}
        self.pieces, self.problems, self.names = pieces, problems, names
        self._partial: dict[str, tuple[torch.Tensor, list[Piece]]] = {}
        self._loaded: set[str] = set()
        self.borrowed: dict[str, str] = {}  # parameter -> the earlier layer's (module name) it is tied to
        by_param = {s.param: s for s in self.sites.values()}
        self.targets: dict[str, Target] = {}
        for n in names:
            pc = pieces.get(n)
            if pc is not None and pc.param in by_param:
                site = by_param[pc.param]
                self.targets[n] = _target(n, site, pc, tuple(shape_of(n)), self.params[site.param])

    def borrow(self, tied: dict[str, str]) -> None:
        """Parameters of this layer tied to an earlier layer's (``parameter -> that one's module name``:
        Zamba2's shared transformer block): compressed with that layer, so no site of this one, and
        put into the layer by the caller rather than from this layer's checkpoint tensors."""
        self.borrowed.update(tied)
        self.sites = {k: s for k, s in self.sites.items() if s.param not in tied}

    def check_sites_covered(self) -> None:
        """Every compressible parameter is fully held by checkpoint tensors (else InputError)."""
        for s in self.sites.values():
            self._check_covered(s.param, [t.piece for t in self.targets.values() if t.site.param == s.param])

    def _check_covered(self, param: str, pieces: list[Piece]) -> None:
        rows, _ = as_rows(self.params[param])
        got = sorted((p.row0, p.row1) for p in pieces)
        pos = 0
        for r0, r1 in got:  # the pieces must tile the rows: no gap, no overlap
            if r0 != pos:
                pos = -1
                break
            pos = r1
        if pos != rows:
            hints = [f"{k}: {v}" for k, v in self.problems.items()]
            hint = next((h for h in hints if f"{self.module_prefix}{param} " in h), hints[0] if hints else None)
            raise InputError(f"parameter {self.module_prefix}{param} {list(self.params[param])} of the model class is not "
                             f"(exactly) in the checkpoint; the checkpoint's tensor names do not follow transformers' "
                             f"layout" + (f" ({hint})" if hint else ""))

    def targets_of(self, keys: Iterable[str]) -> list[Target]:
        """Targets on the given site keys, in checkpoint order."""
        keys = set(keys)
        return [t for t in self.targets.values() if t.site.key in keys]

    def put(self, layer: nn.Module, name: str, t: torch.Tensor, dtype: torch.dtype, device) -> None:
        """Put checkpoint tensor ``name`` (of this layer) into the layer: a whole parameter or buffer at
        once; a piece of a parameter into a buffer that becomes the parameter once every row is in
        (``finish`` checks that none is left incomplete)."""
        pc = self.pieces.get(name)
        if pc is None:
            rel = name[len(self.prefix):]
            if rel in self.buffers:
                set_param(layer, rel, t.to(dtype), device)
            # else: a tensor the module does not use (an old checkpoint's rotary inv_freq): it is in the
            # artifact all the same; a parameter it should have fed is reported by ``finish``.
            return
        shape = self.params[pc.param]
        rows, last = as_rows(shape)
        if pc.row0 == 0 and pc.row1 == rows:
            set_param(layer, pc.param, t.reshape(shape).to(dtype), device)
            self._loaded.add(pc.param)
            return
        buf, got = self._partial.setdefault(pc.param, (torch.empty(rows, last, dtype=dtype, device=device), []))
        buf[pc.row0:pc.row1] = t.reshape(-1, last).to(dtype)
        got.append(pc)
        if sum(g.row1 - g.row0 for g in got) >= rows:
            self._check_covered(pc.param, got)
            set_param(layer, pc.param, buf.reshape(shape), device)
            self._loaded.add(pc.param)
            del self._partial[pc.param]

    def finish(self) -> None:
        """After ``put``: every parameter of the layer got all of its rows (else InputError)."""
        partial, self._partial = self._partial, {}
        loaded, self._loaded = self._loaded, set()
        for param, (_, got) in partial.items():
            self._check_covered(param, got)
        for param in self.params:
            if param not in loaded and param not in self.borrowed:
                self._check_covered(param, [])
    def store(self, layer: nn.Module, t: Target, value: torch.Tensor) -> None:
        """Write a target's (reconstructed) tensor, in the checkpoint's shape, back into the layer."""
        p = layer.get_parameter(t.site.param)
        rows, last = as_rows(tuple(p.shape))
        if t.piece.row0 == 0 and t.piece.row1 == rows:
            set_param(layer, t.site.param, value.reshape(p.shape).to(p.dtype), p.device)
            return
        with torch.no_grad():
            p.data.view(rows, last)[t.piece.row0:t.piece.row1].copy_(value.reshape(-1, last))


def _reverted_pieces(model: nn.Module, prefix: str, params: dict[str, tuple[int, ...]], wanted: set[str],
                     shape_of: Callable[[str], tuple[int, ...]]) -> tuple[dict[str, Piece], dict[str, str]]:
    """Pieces of checkpoint names that transformers' save-side conversion makes of ``params``."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # pragma: no cover - transformers 4.x has no conversion mappings
        return {}, {}
    tags, spans, off = {}, [], 0
    for pn, shape in params.items():
        rows, _ = as_rows(shape)
        tshape = shape[:-1] + (1,) if len(shape) >= 2 else (rows,)
        tags[prefix + pn] = torch.arange(off, off + rows, dtype=torch.int64).reshape(tshape)
        spans.append((off, off + rows, pn))
        off += rows
    try:
        out = revert_weight_conversion(model, tags)
    except Exception as e:  # a conversion that does not take row tags: report per name below
        return {}, dict.fromkeys(wanted, f"transformers' checkpoint conversion failed on it: {e}")
    pieces, problems = {}, {}
    for name, t in out.items():
        if name not in wanted or not isinstance(t, torch.Tensor):
            continue
        shape = tuple(shape_of(name))
        flat = t.reshape(-1)
        span = next(((a, b, pn) for a, b, pn in spans if flat.numel() and a <= int(flat[0]) < b), None)
        if span is None:
            problems[name] = "no parameter maps to it"
            continue
        a, b, pn = span
        r0 = int(flat[0]) - a
        pshape = params[pn]
        rows_shape = (shape[:-1] + (1,)) if len(pshape) >= 2 else shape
        contiguous = torch.equal(flat, torch.arange(int(flat[0]), int(flat[0]) + flat.numel()))
        if (not contiguous or int(flat[-1]) >= b or tuple(t.shape) != rows_shape
                or (len(pshape) >= 2 and (len(shape) < 2 or shape[-1] != pshape[-1]))):
            problems[name] = f"it is not a contiguous row range of {prefix}{pn} {list(pshape)}"
            continue
        pieces[name] = Piece(pn, r0, r0 + flat.numel())
    return pieces, problems


def checkpoint_prefix(model: nn.Module, prefix: str) -> str:
    """The checkpoint's name prefix for module prefix ``prefix``, by transformers' save-side renaming
    (Nemotron-H: ``model.layers.3.`` -> ``backbone.layers.3.``; EXAONE 3: ``transformer.h.3.``). A name
    under the prefix that no rule of the layer's own matches is reverted alone, so that only the
    prefix's renaming applies."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # pragma: no cover - transformers 4.x: checkpoints use module names
        return prefix
    probe = "__deltazip_probe__"
    try:
        name = next(iter(revert_weight_conversion(model, {prefix + probe: torch.zeros(1)})), "")
    except Exception:  # a conversion that refuses a lone tensor: the names are the module's
        return prefix
    return name[:-len(probe)] if name.endswith(probe) else prefix


def map_layer(model: nn.Module, prefix: str, layer: nn.Module, names: Iterable[str],
              shape_of: Callable[[str], tuple[int, ...]]) -> LayerMap:
    """Map the checkpoint tensors of the layer at module prefix ``prefix`` to ``layer``'s parameters.

    Args:
        model: the whole model (transformers looks its conversion mapping up from it).
        prefix: the layer's module prefix with the trailing dot (``model.layers.0.``); its checkpoint
            tensors are those under ``checkpoint_prefix(model, prefix)``.
        layer: the layer module.
        names: checkpoint tensor names (those of other layers are ignored).
        shape_of: checkpoint name -> shape.
    """
    ck = checkpoint_prefix(model, prefix)
    layer_names = [n for n in names if n.startswith(ck)]
    have = set(layer_names)
    params = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    pieces: dict[str, Piece] = {}
    unmatched = {}
    for pn, shape in params.items():
        if ck + pn in have and tuple(shape_of(ck + pn)) == shape:
            pieces[ck + pn] = Piece(pn, 0, as_rows(shape)[0])
        else:
            unmatched[pn] = shape
    problems: dict[str, str] = {}
    rest = have - set(pieces)
    if unmatched and rest:
        more, problems = _reverted_pieces(model, prefix, unmatched, rest, shape_of)
        pieces.update(more)
    return LayerMap(ck, layer, pieces, problems, layer_names, shape_of, module_prefix=prefix)


def converted_params(model: nn.Module, names: Iterable[str],
                     shape_of: Callable[[str], tuple[int, ...]]) -> dict[str, list[tuple[str, Piece]]]:
    """Decoder-layer parameters that transformers assembles on load from checkpoint tensors of other
    names (one expert's ``w1``/``w3``/``w2`` rows stacked into fused ``[E, ., .]`` experts, gate and
    up halves concatenated): ``module parameter name -> [(checkpoint name, Piece)]`` in row order,
    for each parameter whose pieces tile all of its rows with no gap or overlap. A parameter held
    by its own checkpoint name is not listed.

    Args:
        model: the model (meta parameters are fine).
        names: checkpoint tensor names.
        shape_of: checkpoint name -> shape.
    """
    from deltazip.models.model_walk import decoder_layers

    names = list(names)
    lname, layers = decoder_layers(model)
    out: dict[str, list[tuple[str, Piece]]] = {}
    for i, layer in enumerate(layers):
        m = map_layer(model, f"{lname}.{i}.", layer, names, shape_of)
        by_param: dict[str, list[tuple[str, Piece]]] = {}
        for name, pc in m.pieces.items():
            if name != m.prefix + pc.param:
                by_param.setdefault(pc.param, []).append((name, pc))
        for param, got in by_param.items():
            got.sort(key=lambda x: x[1].row0)
            ends = [0] + [pc.row1 for _, pc in got]
            if [pc.row0 for _, pc in got] == ends[:-1] and ends[-1] == as_rows(m.params[param])[0]:
                out[m.module_prefix + param] = got
    return out
