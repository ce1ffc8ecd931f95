"""ΔCompress, layer by layer (paper Algorithm 1; DESIGN.md "ΔCompress in one paragraph").

For each decoder layer: load that layer's base and fine-tuned tensors only; for each true-sequential
group of linears, accumulate the Hessian of their input on the calibration activations, compress
``Δ = W_ft - W_base`` with the OBS solver and put ``W_base + Q⊙M`` back into the layer, so that later
groups and the next layer see the reconstructed fine-tuned model; then run the layer to produce the
next layer's inputs. After the last layer an untied ``lm_head`` is compressed the same way, its
Hessian taken from the final hidden states after the final norm. Embeddings are stored row by row
and every other tensor exactly (compress/rows_and_exact.py).

Linears are ``nn.Linear``, GPT-2's ``Conv1D`` (stored ``[in, out]``, solved transposed) and
mixture-of-experts weights, whose every expert is solved with the Hessian of the tokens routed to it
(compress/experts.py); checkpoint names are mapped to the layer's parameters by models/layer_map.py.
"""

from __future__ import annotations

import json
import math
import re
import resource
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from deltazip.compress.allocation import Setting
from deltazip.compress.budget import error_curve, plan_settings
from deltazip.compress.calibration import check_calibration_source, load_calibration, model_context
from deltazip.compress.config import AUTO_GROUPS, CompressConfig, auto_group
from deltazip.compress.experts import HEAD_KEY, Hessians, collect_hessians, encode_target, solve_target
from deltazip.compress.host_memory import release_freed_memory
from deltazip.compress.obs import SolveResult, obs_compress, rtn_compress
from deltazip.compress.rows_and_exact import embedding_weight_names, new_stats, record_embedding, record_exact
from deltazip.compress.sensitivity import measure
from deltazip.compress.vision import (
    CrossAttentionImages,
    calibration_images,
    image_hessians,
    vision_linears,
    vision_scheme,
)
from deltazip.formats import codecs
from deltazip.formats.artifact import LOSSLESS_DEFAULT, Artifact, ArtifactWriter
from deltazip.formats.codecs.xor import bitwise_equal
from deltazip.formats.errors import DeltazipWarning, InputError
from deltazip.formats.gdeflate import DEFAULT_LEVEL
from deltazip.formats.outputs import check_output
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint
from deltazip.models.image_inputs import cross_attention_layers
from deltazip.models.layer_map import LayerMap, Piece, Target, map_layer
from deltazip.models.model_walk import (
    Catcher,
    LayerStandIn,
    Site,
    StopForward,
    decoder_layers,
    empty_model,
    sequential_groups,
    set_param,
)
from deltazip.models.param_names import module_names

Progress = Callable[[str, int, int], None]


def check_pair(base: Checkpoint, ft: Checkpoint) -> None:
    """Base and fine-tune must share architecture, tensor names and shapes."""
    bc, fc = base.config_dict(), ft.config_dict()
    for key in ("model_type", "architectures"):
        if bc.get(key) != fc.get(key):
            raise InputError(f"base and fine-tuned differ in {key}: {bc.get(key)} vs {fc.get(key)}; "
                             f"a delta needs the fine-tune's own base model")
    only_ft = sorted(set(ft.names) - set(base.names))
    only_base = sorted(set(base.names) - set(ft.names))
    if only_ft or only_base:
        which = f"{only_ft[0]!r} only in the fine-tune" if only_ft else f"{only_base[0]!r} only in the base"
        raise InputError(f"base and fine-tuned have different tensor names ({len(only_ft) + len(only_base)} "
                         f"differ, e.g. {which}); pass the fine-tune's own base model")
    for n in ft.names:
        if base.shape(n) != ft.shape(n):
            raise InputError(f"tensor {n} has shape {list(base.shape(n))} in the base but {list(ft.shape(n))} "
                             f"in the fine-tune; pass the fine-tune's own base model")


def _layer_maps(model, lname: str, layers, ft: Checkpoint) -> list[LayerMap]:
    """Per layer: its checkpoint tensors mapped to its parameters, and the linears among them; a
    parameter tied to an earlier layer's is borrowed from it (:func:`_tied_across_layers`)."""
    tied = _tied_across_layers(model, lname)
    maps = []
    for i, layer in enumerate(layers):
        prefix = f"{lname}.{i}."
        m = map_layer(model, prefix, layer, ft.names, ft.shape)
        m.borrow({t[len(prefix):]: s for t, s in tied.items() if t.startswith(prefix)})
        m.check_sites_covered()
        maps.append(m)
    return maps


def _tied_across_layers(model, lname: str) -> dict[str, str]:
    """``parameter -> the parameter it is tied to`` (module names) where transformers ties a decoder
    layer's parameter to an earlier layer's (Zamba2's shared transformer block: one set of weights
    that every hybrid layer runs, stored under the first). Such a matrix is compressed with the first
    layer that runs it, on that layer's inputs, and the later layers run its reconstruction.

    Raises:
        InputError: a layer's parameter is tied to a later layer's (the later one is compressed after
            the earlier one has run it).
    """
    try:
        tied = model.get_expanded_tied_weights_keys(all_submodels=True)
    except (AttributeError, TypeError):  # transformers 4.x: no layer ties of this kind
        return {}
    head = lname + "."
    out = {}
    for target, source in tied.items():
        if not (target.startswith(head) and source.startswith(head)):
            continue
        i, j = int(target[len(head):].split(".", 1)[0]), int(source[len(head):].split(".", 1)[0])
        if i < j:
            raise InputError(f"layer {i} of {type(model).__name__} runs {source}, a weight of the later layer {j} "
                             "(tied across layers): compress calibrates layers in order and cannot compress it")
        if i != j:
            out[target] = source
    return out


def _check_shapes(maps: list[LayerMap], cfg: CompressConfig, group_of: Callable[[int], int]) -> None:
    for m in maps:
        order = {k: i for i, k in enumerate(m.sites)}  # module order: the first offender a user meets
        for n, t in sorted(m.targets.items(), key=lambda kv: (order.get(kv[1].site.key, len(order)), kv[0])):
            _check_in_features(n, t.in_features, cfg, group_of)


def _check_in_features(name: str, in_f: int, cfg: CompressConfig, group_of: Callable[[int], int]) -> None:
    if (cfg.sparse24 or cfg.allocates) and in_f % 4:
        fix = "use --sparsity none" if not cfg.allocates else "2:4 is among --target-ratio's settings"
        raise InputError(f"tensor {name} has {in_f} input features, not divisible by 4: {fix}")
    group = group_of(in_f)
    if group != -1 and in_f % group:
        raise InputError(f"tensor {name} has {in_f} input features, not divisible by --group-size "
                         f"{cfg.group_size}: pick a divisor, -1 or auto")


def _solve(target: torch.Tensor, H: torch.Tensor | None, scheme: DeltaScheme, damp: float) -> SolveResult:
    if H is None:
        return rtn_compress(target, scheme)
    return obs_compress(target, H, scheme, damp)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024




class _Replay(LayerStandIn):
    """Stands in for a decoder layer in ``replay_to_head``: hands back the recorded output of batch
    ``batch`` (the last layer; ``change(output)`` rewrites it when given) or its input unchanged (every
    other layer)."""

    def __init__(self, inner: torch.nn.Module, batches, arity: int, change=None):
        super().__init__(inner, arity)
        self.batches, self.batch, self.change = batches, 0, change

    def forward(self, hidden_states, *args, **kwargs):
        out = hidden_states if self.batches is None else self.batches[self.batch][0]
        if self.batches is not None and self.change is not None:
            out = self.change(out)
        return self.wrap(out)


class _Run:
    """State of one compression run (keeps compress_delta readable)."""

    def __init__(self, base: Checkpoint, ft: Checkpoint, cfg: CompressConfig, writer: ArtifactWriter,
                 progress: Progress):
        self.base, self.ft, self.cfg, self.writer, self.progress = base, ft, cfg, writer, progress
        self.device = cfg.torch_device()
        first = next(n for n in ft.names if ft.dtype(n).is_floating_point)
        self.cdtype = cfg.compute_dtype(self.device, ft.dtype(first))
        self.model = empty_model(ft.path, self.cdtype)
        self.lname, self.layers = decoder_layers(self.model)
        self.maps = _layer_maps(self.model, self.lname, self.layers, ft)
        self.layer_names = {n for m in self.maps for n in m.names}
        # checkpoint name -> module parameter name, and back, where transformers renames at load
        # (Nemotron-H's ``backbone.``, EXAONE 3's ``transformer.h``, GPT-NeoX's ``embed_out``)
        self.module_name = module_names(self.model, ft.names)
        self.ckpt_name = {m: n for n, m in self.module_name.items()}
        self.head, self.head_alias_of = self._find_head()
        self.group_of, self.config_group = self._groups()
        _check_shapes(self.maps, cfg, self.group_of)
        if self.head:
            _check_in_features(self.head, ft.shape(self.head)[1], cfg, self.group_of)
        self.embeddings = {self.ckpt_name.get(n, n) for n in embedding_weight_names(self.model)}
        self.head_alias_name, self.tied_names = self._tied()
        # the vision tower's and projector's linears (image-text models; compress/vision.py)
        self.vision = vision_linears(self.model, self.ckpt_name, set(ft.names) - self.layer_names - {self.head})
        self.vision_images: list[Path] | None = None  # --calib-images
        self.cross_images: CrossAttentionImages | None = None  # the windows' images, for cross-attention layers
        self.vision_stats: dict | None = None
        self.plan: dict[str, Setting] = {}  # per-tensor settings of --target-ratio (empty: the options')
        self.other_stats = new_stats()
        self.layer_stats: list[dict] = []
        self.head_stats: dict | None = None
        self.layer_arity = 0  # how the model takes a layer's output (LayerStandIn.arity)
        self.base_view = cfg.calib_activations == "base"
        self.layer_kw: list[list[dict]] = []  # per layer, per calibration batch (first_inputs)
        # parameters later layers share (tied): their values as the layer that holds them left them
        self.lent = {src for m in self.maps for src in m.borrowed.values()}
        self.held: dict[str, torch.Tensor] = {}

    def warn_unrecognised_matrices(self) -> None:
        """A warning when the layers' matrices that are not compressed (stored exactly: neither a linear
        nor fused experts to deltazip, such as DBRX's flat ``[E·F, H]`` experts) hold more than a tenth
        of the fine-tune's matrix bytes: the artifact will be far larger than the method allows."""
        ft = self.ft
        size = {n: math.prod(ft.shape(n)) * ft.dtype(n).itemsize for n in ft.names if len(ft.shape(n)) >= 2}
        targets = {n for m in self.maps for n in m.targets}
        exact = sorted((n for n in self.layer_names if n in size and n not in targets), key=lambda n: (-size[n], n))
        share = sum(size[n] for n in exact) / max(1, sum(size.values()))
        if share > 0.1:
            warnings.warn(f"{share:.0%} of the fine-tune's matrix bytes are in tensors deltazip does not compress "
                          f"(e.g. {exact[0]} {list(ft.shape(exact[0]))}, not a linear or fused experts it "
                          "recognises): they are stored exactly and the artifact will be large", DeltazipWarning,
                          stacklevel=2)

    @property
    def compresses_vision(self) -> bool:
        """The vision side's linears are compressed (with ``--calib-images``, or rounded by ``rtn``)."""
        return bool(self.vision) and (self.cfg.method == "rtn" or self.vision_images is not None)

    def layer_prefix(self, i: int) -> str:
        """Layer ``i``'s checkpoint name prefix (``model.layers.3.``)."""
        return self.maps[i].prefix

    def outside(self):
        """``(checkpoint name, module parameter or buffer name or None)`` of every tensor outside the
        decoder layers but the untied head, in checkpoint order."""
        held = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        held |= {n for n, _ in self.model.named_buffers()}
        for n in self.ft.names:
            if n not in self.layer_names and n != self.head:
                mod = self.module_name.get(n)
                yield n, mod if mod in held else None

    # -- settings -------------------------------------------------------------------------------
    def _groups(self) -> tuple[Callable[[int], int], int]:
        """``(group of a tensor with that many input features, the group the config records)``. With
        ``--group-size auto``: the largest of 128/64/32 dividing every compressed input dimension, or,
        when none divides them all, each tensor's own (-1 where none divides it)."""
        cfg = self.cfg
        if not cfg.group_auto:
            return (lambda _in_f: cfg.group_size), cfg.group_size
        dims = [t.in_features for m in self.maps for t in m.targets.values()]
        dims += [self.ft.shape(self.head)[1]] if self.head else []
        common = auto_group(dims) if dims else AUTO_GROUPS[0]
        if common != -1 or not dims:
            return (lambda _in_f: common), common
        own = [auto_group([d]) for d in dims]
        return (lambda in_f: auto_group([in_f])), max(set(own), key=own.count)

    def row_group_of(self, hidden: int) -> int:
        """Hidden columns per group of an embedding's rows (``--embed-group-size``, else as the linears)."""
        cfg = self.cfg
        if cfg.embed_group_size:
            return cfg.embed_group_size
        return auto_group([hidden]) if cfg.group_auto else cfg.group_size

    def scheme_for(self, t: Target) -> DeltaScheme | None:
        """The scheme of target ``t``: its allocated setting (None: its delta is dropped), else the
        options' scheme with ``t``'s group."""
        group, s = self.group_of(t.in_features), self.plan.get(t.name)
        if s is None:
            return self.cfg.scheme if group == self.cfg.group_size else self.cfg.scheme.replace(group_size=group)
        if s.dropped:
            return None
        return DeltaScheme(bits=s.bits, group_size=group, sparsity=s.sparsity, sym=self.cfg.sym)

    def row_bits_of(self, name: str) -> int | None:
        """Code width of embedding ``name``'s changed rows (None: its delta is dropped)."""
        s = self.plan.get(name)
        if s is None:
            return self.cfg.row_bits
        return None if s.dropped else s.bits

    def head_target(self, shape: tuple[int, ...]) -> Target:
        """The untied lm_head as a compression target (its Hessian key is ``HEAD_KEY``)."""
        site = Site(key=HEAD_KEY, kind="linear", param=self.head)
        return Target(self.head, site, Piece(self.head, 0, shape[0]), shape, shape)

    def _tied(self) -> tuple[str | None, set[str]]:
        """``(the lm_head name stored as an alias, the embeddings that are also the output head)``."""
        out, emb = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        head_name = self._weight_of(out) if out else None
        if self.head_alias_of:
            return head_name, {self.head_alias_of}
        ename = self._weight_of(emb)
        tied = out is not None and emb is not None and getattr(out, "weight", None) is emb.weight
        return None, ({ename} if tied and ename in self.embeddings and head_name not in self.ft.table else set())

    # -- non-layer tensors ----------------------------------------------------------------------
    def _find_head(self) -> tuple[str | None, str | None]:
        """``(lm_head weight name, None)`` when the output projection is an untied linear stored in the
        checkpoint (compressed as a linear after the layers); ``(None, embedding name)`` when the
        checkpoint stores it as a bit-identical copy of the input embedding in both models (stored
        once, as an alias); ``(None, None)`` otherwise (tied and not stored, or not a linear)."""
        out = self.model.get_output_embeddings()
        if not isinstance(out, torch.nn.Linear):
            return None, None
        name = self._weight_of(out)
        if name is None or name not in self.ft.table:
            return None, None
        ename = self._weight_of(self.model.get_input_embeddings())
        if ename in self.ft.table and ename != name and self.ft.shape(ename) == self.ft.shape(name):
            same_ft = bitwise_equal(self.ft.get(ename), self.ft.get(name))
            if same_ft and bitwise_equal(self.base.get(ename), self.base.get(name)):
                return None, ename
        return name, None

    def _weight_of(self, module) -> str | None:
        """The checkpoint name of ``module``'s weight (None: not a module of the model)."""
        name = next((f"{n}.weight" for n, m in self.model.named_modules() if m is module), None)
        return None if name is None else self.ckpt_name.get(name, name)

    def outside_layers(self) -> None:
        """Record embeddings, final norm...; load them into the skeleton for the forward. The untied
        lm_head waits for the final hidden states (``compress_head``)."""
        exact_vision: list[str] = []  # changed vision linears stored exactly (no --calib-images)
        for n, mod in self.outside():
            if self.head_alias_of and n == self.head_alias_name:
                self.writer.add_alias(n, self.head_alias_of, self.ft.shape(n), self.ft.dtype(n))
                self.other_stats["alias"] += 1
                continue
            b, f = self.base.get(n), self.ft.get(n)
            if n in self.vision and self.compresses_vision:  # compressed once the images are read
                if mod is not None and self.cfg.method != "rtn":
                    set_param(self.model, mod, (b if self.base_view else f).to(self.cdtype), self.device)
                continue
            if n in self.vision and not bitwise_equal(b, f):
                exact_vision.append(n)
            bits = self.row_bits_of(n)
            if n in self.embeddings and f.dim() == 2 and f.is_floating_point() and bits is None:
                self.writer.add_drop(n, tuple(f.shape), f.dtype)
                self.other_stats["drop"] = self.other_stats.get("drop", 0) + 1
                rec = b
            elif n in self.embeddings and f.dim() == 2 and f.is_floating_point():
                rec = record_embedding(self.writer, n, b, f, bits, self.row_group_of(f.shape[1]), self.other_stats)
            else:
                rec = record_exact(self.writer, n, b, f, self.other_stats)
            if mod is not None and self.cfg.method != "rtn":
                set_param(self.model, mod, (b if self.base_view else rec).to(self.cdtype), self.device)
        self.compress_vision(exact_vision)

    def compress_vision(self, stored_exactly: list[str]) -> None:
        """The vision side's linears: Hessians from the calibration images, then each solved like a
        text linear (``compress/vision.py``); without images they were stored exactly
        (``stored_exactly``: those that changed, which a warning counts)."""
        if not self.compresses_vision:
            if stored_exactly:
                mib = sum(math.prod(self.ft.shape(n)) * self.ft.dtype(n).itemsize for n in stored_exactly) / 2**20
                warnings.warn(f"{len(stored_exactly)} linears of the vision tower or projector changed ({mib:.1f} MiB) "
                              "and are stored exactly; pass --calib-images DIR (images like the fine-tune's) to "
                              "compress them", DeltazipWarning, stacklevel=2)
            return
        hs = None
        if self.cfg.method != "rtn":
            self.progress("reading calibration images", 0, len(self.vision_images))
            hs = image_hessians(self.model, self.vision, self.ft.path, self.vision_images, self.device, self.cdtype)
            self.progress("reading calibration images", len(self.vision_images), len(self.vision_images))
        stats: dict = {"tensors": {}}
        for n in self.vision:
            shape = tuple(self.ft.shape(n))
            scheme = vision_scheme(self.cfg.scheme, shape[1]) if len(shape) == 2 else None
            if scheme is None:  # 2:4 cannot tile its inputs
                record_exact(self.writer, n, self.base.get(n), self.ft.get(n), self.other_stats)
                continue
            t = Target(n, Site(key=n, kind="linear", param=n), Piece(n, 0, shape[0]), shape, shape)
            rec = self._compress_linear(t, hs, stats, scheme)
            mod = self.module_name.get(n, n)
            if self.cfg.method != "rtn" and not self.base_view:
                set_param(self.model, mod, rec.to(self.cdtype), self.device)
        self.vision_stats = {"images": len(self.vision_images or []), "tensors": stats["tensors"]}

    def compress_head(self, input_ids: torch.Tensor | None, batches) -> None:
        """Compress the untied lm_head like a linear, its Hessian from what it reads: the last layer's
        outputs through whatever the model runs after its layers (the final norm)."""
        if self.head is None:
            return
        hs = self.head_hessian(input_ids, batches) if self.cfg.method != "rtn" else None
        stats = {"tensors": {}}
        self._compress_linear(self.head_target(tuple(self.ft.shape(self.head))), hs, stats)
        self.head_stats = stats["tensors"].get(self.head)

    def head_hessian(self, input_ids: torch.Tensor, batches) -> Hessians:
        """``H = 2 XᵀX / n`` of the lm_head input, replaying the last layer's outputs through the model
        (every decoder layer replaced by a module that hands back the recorded output of its batch)."""
        hs = Hessians()
        self.replay_to_head(input_ids, batches, lambda x: hs.add(HEAD_KEY, None, x))
        return hs

    def replay_to_head(self, input_ids: torch.Tensor, batches, take, only: int | None = None,
                       change=None) -> None:
        """Run the model up to its output head on the calibration batches (``only``: that one), every
        decoder layer replaced by a stand-in that hands back the last layer's recorded output of the batch
        (``batches``; ``change(output)`` rewrites it first); ``take(x)`` gets the head's input ``[B, T, H]``."""
        head = self.model.get_output_embeddings()

        def hook(_m, args):
            take(args[0])
            raise StopForward

        last = len(self.layers) - 1
        originals = list(self.layers)
        replay = [_Replay(m, batches if i == last else None, self.layer_arity, change)
                  for i, m in enumerate(originals)]
        handle = head.register_forward_pre_hook(hook)
        try:
            for i, r in enumerate(replay):
                self.layers[i] = r
            with torch.no_grad():
                for k, s in enumerate(range(0, input_ids.shape[0], self.cfg.batch_size)):
                    if only is not None and k != only:
                        continue
                    replay[last].batch = k
                    try:
                        self.model(input_ids=input_ids[s:s + self.cfg.batch_size].to(self.device), use_cache=False)
                    except StopForward:
                        pass
        finally:
            handle.remove()
            for i, m in enumerate(originals):
                self.layers[i] = m

    # -- calibration ----------------------------------------------------------------------------
    def first_inputs(self, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, dict]]:
        """Run the model through stand-ins for its layers: layer 0's inputs, one entry per batch, and
        every layer's own keyword arguments (``self.layer_kw[i][batch]``; see ``Catcher``).

        The stand-ins hand back bare hidden states, or, where the model unpacks its layers' outputs
        (Bamba: ``hidden_states, attn_weights = layer(...)``), a tuple of the length Python names in
        the unpacking error; the layers' own outputs are not known before their weights are."""
        if self.vision_images is not None and cross_attention_layers(self.model.config) and self.cross_images is None:
            # Mllama: its cross-attention layers run only with an image: each window gets one
            self.cross_images = CrossAttentionImages(self.ft.path, self.vision_images, input_ids)
        try:
            return self._catch(input_ids, 0)
        except ValueError as e:
            m = re.search(r"values to unpack \(expected (\d+)", str(e))
            if m is None:
                raise
            self.layer_arity = int(m.group(1))
            return self._catch(input_ids, self.layer_arity)

    def _catch(self, input_ids: torch.Tensor, arity: int) -> list[tuple[torch.Tensor, dict]]:
        last = len(self.layers) - 1
        catchers = [Catcher(m, last=i == last, keep_hidden=i == 0, arity=arity) for i, m in enumerate(self.layers)]
        images = self.cross_images
        if images is not None:
            input_ids = images.input_ids
        try:
            for i, c in enumerate(catchers):
                self.layers[i] = c
            with torch.no_grad():
                for s in range(0, input_ids.shape[0], self.cfg.batch_size):
                    e = s + self.cfg.batch_size
                    media = {} if images is None else images.batch(s, e, self.device, self.cdtype)
                    try:
                        self.model(input_ids=input_ids[s:e].to(self.device), use_cache=False, **media)
                    except StopForward:
                        pass
        finally:
            for i, c in enumerate(catchers):
                self.layers[i] = c.inner
        self.layer_kw = [[kw for _, kw in c.captured] for c in catchers]
        return catchers[0].captured

    def runs_layer(self, i: int) -> bool:
        """Whether the calibration forward reached layer ``i`` (after :meth:`first_inputs`): a text-only
        forward skips Mllama's cross-attention layers, which run with an image only (with
        ``--calib-images`` every window has one)."""
        return bool(self.layer_kw[i])

    def layer_kwargs(self, i: int, batch: int) -> dict:
        """Keyword arguments the model passes layer ``i`` for calibration batch ``batch``."""
        return self.layer_kw[i][batch]

    def run_layer(self, layer, h: torch.Tensor, kw: dict) -> torch.Tensor:
        """One layer forward on one batch; notes whether layers return tuples (``head_hessian``'s replay
        hands back the same shape)."""
        kw = dict(kw)
        args = kw.pop("__args__", ())
        out = layer(h, *args, **kw)
        if isinstance(out, tuple):
            self.layer_arity = len(out)
            return out[0]
        return out

    def hessians(self, layer, sites, group: list[str], batches) -> Hessians:
        """``H = 2 XᵀX / n`` (fp32) of each site's input over all calibration tokens (per expert:
        over the tokens routed to it)."""

        def run():
            with torch.no_grad():
                for h, kw in batches:
                    self.run_layer(layer, h, kw)

        return collect_hessians(layer, sites, group, run)

    # -- one layer ------------------------------------------------------------------------------
    def layer(self, i: int, batches) -> list[tuple[torch.Tensor, dict]]:
        """Compress layer ``i``; returns the next layer's inputs (unchanged list when uncalibrated)."""
        cfg, layer = self.cfg, self.layers[i]
        lmap = self.maps[i]
        lin = lmap.targets
        # A layer the calibration forward never reaches has no inputs to calibrate on, and leaves the next
        # layer's inputs as they are: its linears are rounded to nearest (what a text forward never runs).
        calibrated = cfg.method != "rtn" and self.runs_layer(i)
        for n in lmap.names:
            if n in lin:
                continue
            b, f = self.base.get(n), self.ft.get(n)
            rec = record_exact(self.writer, n, b, f, self.other_stats)
            if calibrated:
                lmap.put(layer, n, b if self.base_view else rec, self.cdtype, self.device)
        stats = {"index": i, "tensors": {}}
        if cfg.method != "rtn" and not calibrated:
            stats["calibration"] = "rtn: the calibration forward does not run this layer"
        if not calibrated:
            for t in lin.values():
                self._compress_linear(t, None, stats)
            self.layer_stats.append(stats)
            return batches
        for n in lin:
            lmap.put(layer, n, self.base.get(n) if self.base_view else self.ft.get(n), self.cdtype, self.device)
        for pn, src in lmap.borrowed.items():  # tied to an earlier layer's: as that layer left it
            set_param(layer, pn, self.held[src], self.device)
        lmap.finish()
        batches = [(h, self.layer_kwargs(i, k)) for k, (h, _) in enumerate(batches)]  # this layer's own mask, rotary
        with torch.no_grad():
            ys_ft = [self.run_layer(layer, h, kw) for h, kw in batches]
        groups = sequential_groups(layer, [lambda b=b: self.run_layer(layer, *b) for b in batches], lmap.sites)
        for group in groups:
            hs = self.hessians(layer, lmap.sites, group, batches)
            for t in lmap.targets_of(group):
                rec = self._compress_linear(t, hs, stats)
                if not self.base_view:
                    lmap.store(layer, t, rec.to(self.cdtype))
            del hs
        with torch.no_grad():
            outs = [(self.run_layer(layer, h, kw), kw) for h, kw in batches]
        num = sum(float((y - yf).float().pow(2).sum()) for (y, _), yf in zip(outs, ys_ft))
        den_y = sum(float(yf.float().pow(2).sum()) for yf in ys_ft)
        den_d = sum(float((yf - h).float().pow(2).sum()) for yf, (h, _) in zip(ys_ft, batches))
        stats["rel_out_err"] = (num / den_y) ** 0.5 if den_y else 0.0
        stats["rel_update_err"] = (num / den_d) ** 0.5 if den_d else 0.0
        for n, p in layer.named_parameters():
            if lmap.module_prefix + n in self.lent:  # a later layer runs it (Zamba2's shared block)
                self.held[lmap.module_prefix + n] = p.detach().clone()
            set_param(layer, n, None)
        self.layer_stats.append(stats)
        return outs

    def _compress_linear(self, t: Target, hs: Hessians | None, stats: dict,
                         scheme: DeltaScheme | None = None) -> torch.Tensor:
        """Compress one linear / expert tensor; returns its reconstruction in the checkpoint's shape.
        ``scheme``: its scheme where not the plan's or the options' (the vision side's linears)."""
        cfg, n = self.cfg, t.name
        fb, ff = self.base.get(n), self.ft.get(n)
        if bitwise_equal(fb, ff):
            # a frozen matrix (partial fine-tunes, untouched heads): nothing to store, not a packed all-zero delta
            self.writer.add_same(n, tuple(ff.shape), ff.dtype)
            stats["tensors"][n] = {"rel_weight_err": 0.0, "delta_rel_norm": 0.0, "same": True,
                                   **({"rel_out_err": 0.0} if hs is not None else {})}
            return fb.float().to(self.device)
        wf = ff.float().to(self.device)
        wb = fb.float().to(self.device)
        scheme = self.scheme_for(t) if scheme is None else scheme
        if scheme is None:  # --target-ratio dropped this delta: the tensor stays the base's
            self.writer.add_drop(n, tuple(ff.shape), ff.dtype)
            stats["tensors"][n] = {"rel_weight_err": 1.0, "delta_rel_norm": float((wf - wb).norm() / wb.norm())
                                   if float(wb.norm()) else 0.0, "drop": True}
            return wb
        target = wf - wb if cfg.additive else wf
        codec = codecs.get(scheme.kind)
        if codec.solver_free:  # a scheme that needs no Hessian: its codec encodes the matrix itself
            res = encode_target(t, target, codec, scheme)
            self.writer.add_matrix(n, scheme, res.parts, res.shape, self.ft.dtype(n), cfg.additive,
                                   t.transposed, t.experts)
        else:
            res = solve_target(t, target, hs, lambda m, H: _solve(m, H, scheme, cfg.damp), scheme)
            self.writer.add_packed(n, res.packed, self.ft.dtype(n), additive=cfg.additive,
                                   transposed=t.transposed, experts=t.experts)
        rec = wb + res.values if cfg.additive else res.values
        err = target - res.values
        st = {"rel_weight_err": float(err.norm() / target.norm()) if float(target.norm()) else 0.0,
              "delta_rel_norm": float((wf - wb).norm() / wb.norm()) if float(wb.norm()) else 0.0, **res.stats}
        stats["tensors"][n] = st
        return rec


def _calibration(cfg: CompressConfig, ft: Checkpoint, calib: str | None):
    """The calibration windows (``load_calibration``'s result), or None for ``--method rtn``."""
    if cfg.method == "rtn":
        return None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(ft.path)
    except Exception as e:
        raise InputError(f"fine-tuned {ft.path}: no usable tokenizer for the calibration data ({e})") from e
    return load_calibration(calib, tok, cfg.nsamples, cfg.seqlen, cfg.seed, model_context(ft.config_dict()))


def _measure_and_plan(run: _Run, cal, progress: Progress) -> dict:
    """The sensitivity probe on a run state of its own, then (``--target-ratio``/``--max-bytes``) the
    per-tensor settings into ``run.plan``; returns the manifest fields they add (``sensitivity``,
    ``allocation``)."""
    probe_run = _Run(run.base, run.ft, run.cfg, run.writer, progress)
    probe_run.vision_images = run.vision_images
    sens = measure(probe_run, cal.input_ids, progress)
    del probe_run
    extra = {"sensitivity": error_curve(sens)}
    if run.cfg.allocates:
        run.plan, extra["allocation"] = plan_settings(sens, run.cfg, len(json.dumps(extra["sensitivity"])) + 20)
    return extra


def _run_stats(run: _Run, elapsed: float, extra: dict) -> dict:
    stats = {"seconds": round(elapsed, 3), "peak_rss_mib": round(_peak_rss_mib(), 1),
             "device": str(run.device), "compute_dtype": str(run.cdtype).removeprefix("torch."),
             "other_tensors": run.other_stats}
    if "sensitivity" in extra:
        stats["probe_seconds"] = extra["sensitivity"]["probe_seconds"]
    if run.device.type == "cuda":
        stats["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    if run.vision_stats is not None:
        stats["vision"] = run.vision_stats
    return stats


def compress_delta(
    base_spec: str | Path,
    ft_spec: str | Path,
    calib: str | None,
    out_dir: str | Path,
    cfg: CompressConfig,
    overwrite: bool = False,
    progress: Progress | None = None,
    lossless: str = LOSSLESS_DEFAULT,
    lossless_level: int = DEFAULT_LEVEL,
    calib_images: str | Path | None = None,
) -> dict:
    """Compress a fine-tune against its base into an artifact at ``out_dir``.

    Args:
        base_spec, ft_spec: model directories or hub ids.
        calib: calibration data (file or hub dataset id); unused (may be None) for ``rtn``.
        out_dir: artifact directory to create (atomically).
        cfg: compression options.
        overwrite: replace an existing ``out_dir``.
        progress: optional ``progress(description, done, total)`` callback.
        lossless: ``"auto"`` (default: GDeflate where its library loads), ``"none"`` or
            ``"gdeflate"``: store parts as chunked GDeflate containers where
            that pays (see formats/artifact.py); ``lossless_level`` is its level 0..12.
        calib_images: a directory of images whose reading calibrates an image-text fine-tune's vision
            tower and projector (``compress/vision.py``); without it they are stored exactly.
    Returns:
        A report dict (also stored in the manifest's ``stats``).
    """
    progress = progress or (lambda *a: None)
    t0 = time.time()
    if calib and cfg.method != "rtn":
        check_calibration_source(calib)  # a typo fails now, before any model is read
    images = calibration_images(calib_images) if calib_images and cfg.method != "rtn" else None
    inputs = [("--base", base_spec), ("--finetuned", ft_spec), ("--calib", calib), ("--calib-images", calib_images)]
    check_output(out_dir, "--out", inputs, overwrite)  # before a model is read (local paths; hub ids next)
    torch.manual_seed(cfg.seed)
    base, ft = Checkpoint(base_spec, "base"), Checkpoint(ft_spec, "fine-tuned")
    check_output(out_dir, "--out", [("--base", base.path), ("--finetuned", ft.path)], overwrite)
    check_pair(base, ft)
    base_fp, ft_fp = base.fingerprint(), ft.fingerprint()
    if base_fp == ft_fp:
        warnings.warn(f"the fine-tuned model {ft_spec} is bit-identical to the base {base_spec}: the artifact "
                      f"stores no delta (check that --finetuned names the fine-tune)", DeltazipWarning, stacklevel=2)
    if cfg.method != "rtn" and not calib:
        raise InputError(f"--calib is required for --method {cfg.method}; pass a .jsonl/.json/.txt/.parquet file")
    with ArtifactWriter(out_dir, overwrite=overwrite, lossless=lossless, lossless_level=lossless_level) as writer:
        run = _Run(base, ft, cfg, writer, progress)
        if images is not None and not run.vision:
            raise InputError(f"--calib-images: {ft_spec} has no vision tower or projector linears to calibrate; "
                             "drop --calib-images")
        run.vision_images = images
        run.warn_unrecognised_matrices()
        cal = _calibration(cfg, ft, calib)
        extra = _measure_and_plan(run, cal, progress) if cfg.measures else {}
        run.outside_layers()
        batches = run.first_inputs(cal.input_ids) if cal is not None else []
        n_layers = len(run.layers)
        progress("compressing layers", 0, n_layers)
        for i in range(n_layers):
            batches = run.layer(i, batches)
            release_freed_memory()  # the next layer's peak, not every layer's holes (compress/host_memory.py)
            progress("compressing layers", i + 1, n_layers)
        run.compress_head(cal.input_ids if cal is not None else None, batches)
        for f in ft.side_files():  # byte-identical to the base's: kept by reference, not copied
            writer.add_file(f, f.name, base_dir=base.path)
        stats = _run_stats(run, time.time() - t0, extra)
        lineage = {"base": str(base_spec), "finetuned": str(ft_spec), "base_fingerprint": base_fp,
                   "finetuned_fingerprint": ft_fp,
                   "architectures": ft.config_dict().get("architectures"),
                   "model_type": ft.config_dict().get("model_type"), "finetuned_bytes": ft.nbytes(),
                   "layers_path": run.layer_prefix(0).removesuffix(".0.") if n_layers else run.lname,
                   "num_layers": n_layers}
        path = writer.finalize(lineage=lineage, config=cfg.to_dict() | {"group_size": run.config_group},
                               calibration=cal.summary if cal is not None else None, layers=run.layer_stats,
                               head=run.head_stats, stats=stats, **extra)
    from deltazip.formats.report import summarize

    return summarize(Artifact(path))
