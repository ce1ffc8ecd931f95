"""Recurrent token mixers whose own parameters a variant changes, per row: :class:`DeltaMixer`.

A hybrid model's recurrent layer (Qwen3.5's gated delta net, a Mamba-2 mixer, LFM2's short
convolution) holds, besides its linears, parameters it uses in ways no per-row add can express: a
depthwise convolution, per-head decay (``A_log``) and step size (``dt_bias``), a gated norm. A full
fine-tune moves them. When a batch holds a variant that changed them, the mixer runs once per group
of rows: the rows of each such variant with that variant's tensors (``torch.func.functional_call``),
the other rows with the base's. Each group runs with the decoupled context and the step's recurrent
states narrowed to its rows, so the linears inside the mixer (``DeltaLinear``) still apply every
row's own delta, and each row's state is read and written in place.

The mixer of a tensor is the decoder layer's child holding it, in a layer of a recurrent type
(:func:`mixer_of`). Linears inside it are decoupled as any linear, except a linear whose weight the
mixer reads itself rather than calling it (Jamba's and Mamba's ``self.dt_proj.weight @ ...``): a
``DeltaLinear`` only changes what a call returns, so such a linear's tensors are the mixer's own,
held whole per variant like its other parameters.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch
from torch import nn
from transformers.cache_utils import Cache

from deltazip.models.loader import text_config
from deltazip.runtime.serve.delta_experts import DeltaRouter
from deltazip.runtime.serve.delta_linear import DeltaLinear, is_linear
from deltazip.runtime.serve.recurrent_state import RECURRENT_LAYER_TYPES, RecurrentStep


def mixer_of(model: nn.Module, pname: str) -> tuple[str, str] | None:
    """``(mixer module, name in it)`` of parameter ``pname`` when it lies in the token mixer of a
    recurrent layer (a child of the decoder layer holding linears and parameters of its own) and is
    not a linear's, or is one of a linear the mixer reads directly (:func:`reads_directly`), else None."""
    from deltazip.models.model_walk import decoder_layers

    text = text_config(model.config)
    types = getattr(text, "layer_types", None) or []
    lname, layers = decoder_layers(model)
    head = lname + "."
    idx, _, rest = pname[len(head):].partition(".") if pname.startswith(head) else ("", "", "")
    if not idx.isdigit() or int(idx) >= len(types) or types[int(idx)] not in RECURRENT_LAYER_TYPES or "." not in rest:
        return None
    child, _, attr = rest.partition(".")
    owner = model.get_submodule(pname.rpartition(".")[0])
    mixer = layers[int(idx)].get_submodule(child)
    if (is_linear(owner) or isinstance(owner, DeltaLinear)) and not reads_directly(mixer, attr.rpartition(".")[0]):
        return None  # linears stay linears
    return (f"{head}{idx}.{child}", attr) if _is_mixer(mixer) else None


def reads_directly(mixer: nn.Module, linear: str) -> bool:
    """Whether ``mixer``'s class reads its child linear ``linear``'s tensors itself
    (``self.dt_proj.weight``) instead of only calling it."""
    if "." in linear or not linear:
        return False
    if isinstance(mixer, DeltaMixer):  # decoupled for an earlier variant: the class that runs is the wrapped one
        mixer = mixer._inner[0]
    return linear in _direct_reads(type(mixer))


@functools.cache
def _direct_reads(cls: type) -> frozenset[str]:
    """Children whose ``.weight``/``.bias`` values the class's source reads (``self.NAME.weight``),
    outside branches taken only in training (``if self.training ...``: Bamba's fused training kernel)
    and other than for metadata (``.dtype``, ``.device``, ``.shape``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # no source (built in C, made at runtime): assume calls only
        return frozenset()
    found: set[str] = set()

    def visit(node: ast.AST, parent: ast.AST | None) -> None:
        if isinstance(node, ast.If) and _training_only(node.test):
            for child in node.orelse:
                visit(child, node)
            return
        if (isinstance(node, ast.Attribute) and node.attr in ("weight", "bias")
                and isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "self"
                and not (isinstance(parent, ast.Attribute) and parent.attr in _METADATA)):
            found.add(node.value.attr)
        for child in ast.iter_child_nodes(node):
            visit(child, node)

    visit(tree, None)
    return frozenset(found)


_METADATA = ("dtype", "device", "shape", "ndim", "is_cuda")


def _training_only(test: ast.AST) -> bool:
    """``self.training`` or ``self.training and ...``."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_training_only(v) for v in test.values)
    return isinstance(test, ast.Attribute) and test.attr == "training" and isinstance(test.value, ast.Name) \
        and test.value.id == "self"


def mixer_pieces(model: nn.Module, shapes: dict[str, list[int]], names: list[str]) -> dict[str, tuple[str, str]]:
    """``checkpoint name -> (mixer, "attr:row0:row1")`` for names that transformers' conversion
    concatenates into a mixer's parameter (Kimi Linear's ``q_conv1d``/``k_conv1d``/``v_conv1d`` into one
    ``conv1d``), rows of the parameter seen as ``[rows, ...]``; ``names`` are the ones not renamed plainly."""
    from deltazip.models.layer_map import checkpoint_prefix, map_layer
    from deltazip.models.model_walk import decoder_layers

    lname, layers = decoder_layers(model)
    out: dict[str, tuple[str, str]] = {}
    for i, layer in enumerate(layers):
        prefix = f"{lname}.{i}."
        ck = checkpoint_prefix(model, prefix)
        mine = [n for n in names if n.startswith(ck)]
        if not mine:
            continue
        pieces = map_layer(model, prefix, layer, [n for n in shapes if n.startswith(ck)],
                           lambda n: tuple(shapes[n])).pieces
        for n in mine:
            pc = pieces.get(n)
            mixer = None if pc is None else mixer_of(model, prefix + pc.param)
            if mixer is not None:
                out[n] = (mixer[0], f"{mixer[1]}:{pc.row0}:{pc.row1}")
    return out


def _is_mixer(m: nn.Module) -> bool:
    """Linears inside, and parameters of its own outside them (a norm has no linear, an MLP nothing else);
    not an attention module nor a block holding one (``is_causal``: beside a mixer in a ``hybrid`` layer,
    or in Zamba2's shared transformer block, it reads the KV cache, which a group of rows cannot narrow;
    its norms are decoupled as norms)."""
    if any(getattr(x, "is_causal", False) for x in m.modules()):  # an attention, or a block holding one
        return False
    subs = list(m.modules())
    linear = [is_linear(x) or isinstance(x, DeltaLinear) for x in subs]
    own = any(not lin and any(True for _ in x.parameters(recurse=False)) for x, lin in zip(subs, linear))
    return own and any(linear[1:])


class DeltaMixer(DeltaRouter):
    """A recurrent mixer whose rows of a changed variant run with that variant's tensors (module
    docstring). ``load_slot(slot, **tensors)``: whole tensors by name in the mixer (``A_log``,
    ``conv1d.weight``...), not deltas."""

    def __setattr__(self, name, value):
        # A linear inside the mixer decoupled later (another variant) must land where the mixer's
        # forward reads it: on the wrapped module too.
        inner = self.__dict__.get("_inner")
        if inner and isinstance(value, nn.Module) and name in inner[0]._modules:
            setattr(inner[0], name, value)
        super().__setattr__(name, value)

    def load_slot(self, slot: int, **tensors: torch.Tensor) -> None:
        """Whole tensors by name, or rows of one (``"conv1d.weight:0:64"``: the rest of it is the base's)."""
        own, whole = dict(self._inner[0].named_parameters()), {}
        for key, t in tensors.items():
            name, sep, rows = key.partition(":")
            if not sep:
                whole[key] = t
                continue
            r0, r1 = (int(r) for r in rows.split(":"))
            base = own[name]
            buf = whole.setdefault(name, base.detach().clone())
            buf.view(base.shape[0], -1)[r0:r1] = t.reshape(r1 - r0, -1).to(buf.dtype)
        super().load_slot(slot, **whole)

    def forward(self, *args, **kwargs):
        inner = self._inner[0]
        changed = sorted(self._tables.keys() & self.ctx.active)
        if not changed:
            return inner(*args, **kwargs)
        slots = self.ctx.row_slot_host().tolist()
        groups = [([i for i, s in enumerate(slots) if s == c], self._tables[c]) for c in changed]
        rest = [i for i, s in enumerate(slots) if s not in changed]
        if rest:
            groups.append((rest, {}))
        if len(groups) > 1 and any(isinstance(a, Cache) for a in (*args, *kwargs.values())):
            # (each group would read and write the whole batch's states in the model's own cache)
            raise RuntimeError("rows of several variants through a recurrent mixer need the server's per-row "
                               "states; run the model with use_cache=False, or through the engine")
        b, out = len(slots), None
        for rows, table in groups:
            got = self._run(inner, rows, table, b, args, kwargs)
            if out is None:
                out = _like(got, b)
            _place(out, got, rows)
        return out

    def _run(self, inner, rows: list[int], table: dict, b: int, args, kwargs):
        """The mixer on rows ``rows`` of the batch (of ``b``) with ``table``'s tensors: tensors of the
        batch and the step's recurrent states narrowed to those rows."""
        idx = torch.tensor(rows, dtype=torch.long)
        views = []

        def narrow(v):
            if isinstance(v, RecurrentStep):
                views.append(v.rows_view(rows))
                return views[-1]
            if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == b:
                return v.index_select(0, idx.to(v.device))
            return v

        with self.ctx.narrowed(rows):
            out = torch.func.functional_call(inner, table, tuple(narrow(a) for a in args),
                                             {k: narrow(v) for k, v in kwargs.items()})
        for view in views:
            view.commit_states()
        return out


def _like(got, b: int):
    if isinstance(got, torch.Tensor):
        return got.new_empty(b, *got.shape[1:])
    return tuple(_like(g, b) if isinstance(g, torch.Tensor) else g for g in got)


def _place(out, got, rows: list[int]) -> None:
    if isinstance(got, torch.Tensor):
        out[torch.tensor(rows, device=out.device)] = got
        return
    for o, g in zip(out, got):
        if isinstance(g, torch.Tensor):
            o[torch.tensor(rows, device=o.device)] = g
