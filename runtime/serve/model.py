"""The served models: one base model with decoupled delta modules, or whole models to swap.

- :func:`discover_artifacts` finds every artifact under a directory (variant name = directory name);
  :func:`open_served_base` picks the base and refuses artifacts compressed against another one.
- :class:`DeltaModel` (``--mode delta``, paper §5.1): the base model built by transformers from its
  checkpoint, each module that some variant changes replaced by its decoupled counterpart
  (``deltazip.runtime.serve.delta_linear``), ``N`` device slots. A variant is loaded from disk into a
  :class:`HostDelta` (packed deltas as stored, replaced tensors rebuilt) and from there into a slot.
- :class:`SwapModels` (``--mode swap``, the paper's vLLM-SCB baseline): ``N`` whole models on the
  device, each slot holding one merged fine-tune (or the base), replaced whole on a miss.

Both expose the same small interface to the engine (``load_host``, ``write_slot``, ``clear_slot``,
``forward``) and are driven through a :class:`deltazip.runtime.serve.delta_cache.TieredCache`.

Tensor names: artifacts name tensors as the checkpoint does. The decoupled model needs those names
to be module parameter names, which holds for most decoder-only families (Llama, Mistral, Qwen2,
GPT-NeoX, ...). Per row it applies changed ``nn.Linear`` weights and biases, plain ``nn.Embedding``
tables, Llama-style RMSNorm weights and ``nn.LayerNorm`` weights and biases. A variant that changes
a tensor the runtime cannot apply per row (or whose name is not a parameter name) is refused with a
message naming the tensor and pointing at ``--mode swap``, which goes through transformers' own
loader and so serves any causal LM it can load.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deltazip.compress.checkpoint import Checkpoint
from deltazip.formats.artifact import MANIFEST, Artifact, needs_base
from deltazip.formats.errors import ArtifactError, InputError
from deltazip.kernels.packed import PackedDelta
from deltazip.runtime.serve.delta_linear import (
    DeltaContext,
    DeltaEmbedding,
    DeltaLayerNorm,
    DeltaLinear,
    DeltaRMSNorm,
    is_llama_rmsnorm,
)
from deltazip.runtime.share.dedup_registry import TensorDedupRegistry
from deltazip.runtime.share.dedup_serving import (
    DedupLedger,
    LoadTally,
    new_serving_registry,
    share_parameters,
    share_tensor,
)

BASE_SLOT = -1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# --------------------------------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------------------------------


@dataclass
class VariantInfo:
    """One variant found under the served directory (manifest or config only; nothing decoded).

    ``kind``: ``artifact`` (deltazip artifact), ``full`` (plain HF checkpoint; ``tensors`` filled by
    ``deltazip.runtime.serve.variant_sources.compare_full_checkpoint``) or ``lora`` (PEFT adapter;
    ``tensors`` empty, its factors are described by a ``deltazip.runtime.serve.lora_variant.LoraSpec``).
    """

    name: str
    path: Path
    tensors: dict[str, dict[str, Any]]
    lineage: dict[str, Any]
    disk_bytes: int
    kind: str = "artifact"
    same_as_base_bytes: int = 0  # full checkpoints: bytes (served dtype) of tensors equal to the base's
    fingerprints: dict[str, Any] = field(default_factory=dict, repr=False)

    _side_dirs: dict[Path, Path] = field(default_factory=dict, repr=False, compare=False)

    def side_dir(self, base_dir: Path) -> Path:
        """Where the variant's config/tokenizer/generation files live: for an artifact, every side file
        (those it copied into hf/ and those it keeps by reference to ``base_dir``, checked; see
        ``Artifact.side_file_dir``); for other kinds, the variant's own directory.

        Raises:
            InputError: a side file the artifact references differs in ``base_dir`` (wrong base).
        """
        if self.kind != "artifact":
            return self.path
        key = Path(base_dir).resolve()
        if key not in self._side_dirs:
            self._side_dirs[key] = Artifact(self.path).side_file_dir(base_dir)
        return self._side_dirs[key]

    def tokenizer_dir(self, base_dir: Path) -> Path:
        """The variant's own tokenizer files when it has them, else the base's."""
        side = self.side_dir(base_dir)
        if any((side / f).is_file() for f in _TOKENIZER_FILES):
            return side
        return base_dir


def discover_artifacts(root: str | Path) -> list[VariantInfo]:
    """Every artifact (directory with a ``manifest.json``) at or under ``root``, sorted by name.

    Hidden directories (including the ``.name.tmp-*`` of unfinished writes) are skipped. Names must
    be unique: two artifacts in different folders with the same directory name are refused.
    """
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"{root}: no such directory; pass the directory that holds your artifacts")
    found: list[Path] = []
    if (root / MANIFEST).is_file():
        found.append(root)
    else:
        for m in sorted(root.rglob(MANIFEST)):
            rel = m.parent.relative_to(root)
            if any(part.startswith(".") for part in rel.parts):
                continue
            if any((p / MANIFEST).is_file() for p in m.parent.parents if p != root and root in p.parents):
                continue  # an artifact nested in another one's folder (e.g. its hf/) is part of it
            found.append(m.parent)
    if not found:
        raise InputError(f"{root}: no deltazip artifacts found (no */manifest.json); create some with "
                         f"`deltazip compress`")
    out: dict[str, VariantInfo] = {}
    for path in found:
        art = Artifact(path, check_tensors=False)
        name = path.name
        if name in out:
            raise InputError(f"two artifacts are named {name!r} ({out[name].path} and {path}); variant names are "
                             f"directory names and must be unique")
        out[name] = VariantInfo(name, path, art.tensors, art.lineage, art.nbytes())
    return [out[k] for k in sorted(out)]


def open_served_base(variants: list[VariantInfo], base_spec: str | None, command: str = "serve") -> Checkpoint:
    """The base to serve: ``base_spec`` or the artifacts' lineage base, fingerprint-checked.

    Only artifacts carry a lineage with a fingerprint; LoRA adapters and full checkpoints are checked
    against the base when the model is built (names, shapes, ``base_model_name_or_path``).
    ``command`` (``serve`` or ``eval``) picks the wording of the fixes the errors suggest.

    Raises:
        InputError: no base named anywhere, lineages disagree, or an artifact was compressed
            against another base (the message names the artifact).
    """
    spec = base_spec
    variants = [v for v in variants if v.kind == "artifact"]
    if spec is None:
        named = {str(v.lineage.get("base")) for v in variants if v.lineage.get("base")}
        if not named:
            raise InputError("no artifact names its base model; pass --base")
        fps = {v.lineage.get("base_fingerprint") for v in variants}
        if len(fps) > 1:
            raise InputError(f"the artifacts were compressed against {len(fps)} different bases; "
                             + ("serve one base per server (pass --base and point at a directory of its variants)"
                                if command == "serve" else "evaluate the artifacts of one base per run"))
        spec = sorted(named)[0]
        if not Path(spec).expanduser().exists() and len(named) > 1:
            spec = next((s for s in sorted(named) if Path(s).expanduser().exists()), spec)
    base = Checkpoint(spec, "base")
    fp = base.fingerprint()
    for v in variants:
        want = v.lineage.get("base_fingerprint")
        if not want:
            raise InputError(f"artifact {v.name} ({v.path}) records no base fingerprint; it cannot be checked "
                             f"against the base")
        if want != fp:
            fix = ("remove it from the directory or serve its own base" if command == "serve" else
                   "pass the base it was compressed against as --base (its lineage names "
                   f"{v.lineage.get('base')}), or evaluate it in a run of its own")
            raise InputError(f"artifact {v.name} ({v.path}) was compressed against a different base than {base.path} "
                             f"(base fingerprint differs); {fix}")
    return base


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # missing or broken tokenizer files: the server cannot encode prompts
        raise InputError(f"{path}: no usable tokenizer ({type(e).__name__}: {e})") from e


def resolve_dtype(name: str, device: torch.device, base: Checkpoint) -> torch.dtype:
    """``auto``: fp32 on CPU; on CUDA the checkpoint's half dtype, fp16 for an fp32 checkpoint."""
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name != "auto":
        if name not in table:
            raise InputError(f"--dtype {name!r} is unknown; use auto, float32, float16 or bfloat16")
        return table[name]
    if device.type != "cuda":
        return torch.float32
    first = next((n for n in base.names if base.dtype(n).is_floating_point), None)
    stored = base.dtype(first) if first else torch.float32
    return stored if stored in (torch.float16, torch.bfloat16) else torch.float16


def load_base_model(base: Checkpoint, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The base causal LM through transformers' loader, with SDPA attention, in eval mode."""
    from transformers import AutoModelForCausalLM

    from deltazip.runtime.share.weight_share import attached_model

    # A worker of `deltazip serve --workers K` builds the model over the weight owner's mapped tensors.
    model = attached_model(base.path, dtype, device)
    try:
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(str(base.path), dtype=dtype, attn_implementation="sdpa")
    except Exception as e:  # unknown architecture, no SDPA support, broken weights
        raise InputError(f"base {base.path} cannot be loaded as a causal LM with SDPA attention "
                         f"({type(e).__name__}: {e})") from e
    cfg = model.config
    # The engine builds its own attention masks (full causal), so a window that could bite must be refused.
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or (window and window < max_context(cfg)):
        raise InputError(f"base {base.path} uses sliding-window or other non-full attention layers, which the "
                         f"serving engine does not implement")
    return model.to(device).eval()


def max_context(config) -> int:
    """Longest sequence (prompt + completion) the model's position embeddings allow."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 2048


def eos_token_ids(model_dir: Path, tokenizer, config) -> list[int]:
    """Token ids that end a generation: the generation config's, else the model config's, else the
    tokenizer's (what ``generate`` stops on)."""
    ids: Any = None
    gpath = model_dir / "generation_config.json"
    if gpath.is_file():
        try:
            ids = json.loads(gpath.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            ids = None
    if ids is None:
        ids = getattr(config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


# --------------------------------------------------------------------------------------------------
# The decoupled model
# --------------------------------------------------------------------------------------------------


@dataclass
class HostDelta:
    """One variant decoded into host memory, ready to be copied into a device slot.

    ``modules`` maps a decoupled module's qualified name to the keyword arguments of its
    ``load_slot`` (packed deltas stay packed; replaced tensors are in the model dtype).
    """

    name: str
    modules: dict[str, dict[str, Any]] = field(default_factory=dict)

    def nbytes(self) -> int:
        total = 0
        for kw in self.modules.values():
            for v in kw.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
                elif isinstance(v, PackedDelta):
                    total += v.nbytes()
        return total


def load_checkpoint_tensors(v: VariantInfo, names: list[str], dtype: torch.dtype, tally: LoadTally
                            ) -> dict[str, torch.Tensor]:
    """Tensors ``names`` of a full-checkpoint variant in ``dtype``, each through the dedup registry.

    Stored in ``dtype`` already: looked up from the file bytes, so a tensor the registry holds is
    never copied out of the file (no transient memory for an A/B copy). Otherwise read, converted
    and then looked up.
    """
    from deltazip.formats.safetensors_raw import RawFile
    from deltazip.runtime.share.dedup_registry import TORCH_TO_ST

    ck = Checkpoint(v.path, f"checkpoint {v.name}")
    want = TORCH_TO_ST[dtype]
    pin = torch.cuda.is_available()
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(ck.file_of[n], []).append(n)
    out: dict[str, torch.Tensor] = {}
    for f, group in by_file.items():
        with RawFile(f) as raw:
            for n in group:
                e = raw.entries[n]
                if e.dtype == want:
                    out[n] = tally.share_raw(raw.view(n), e.dtype, e.shape, pin_memory=pin)
                else:
                    out[n] = tally.share(_pin(ck.get(n).to(dtype)))
    return out


def _pin(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if torch.cuda.is_available() and t.device.type == "cpu" else t


def _pin_packed(d: PackedDelta) -> PackedDelta:
    def p(t):
        return None if t is None else _pin(t)

    return PackedDelta(p(d.qweight), p(d.scales), p(d.zeros), p(d.positions), d.bits, d.group_size,
                       d.in_features, d.out_features)


class UnsupportedVariant(InputError):
    """A variant changes something the decoupled runtime cannot apply per row."""


class DeltaModel:
    """Base model with decoupled modules for every tensor some variant changes (paper §5.1).

    Every tensor it keeps goes through ``registry`` (see ``deltazip.runtime.share.dedup_serving``): the
    base's parameters, each variant's decoded tensors on the host, and, on a GPU, the tensors a
    device slot references. Variants can be added and removed while serving
    (:meth:`prepare_variant` in any thread, :meth:`commit_variant` / :meth:`remove_variant` on the
    engine thread between forwards): a variant that changes a module not decoupled yet gets it
    decoupled then.

    Args:
        base: the served base checkpoint (already fingerprint-checked against the variants).
        variants: the variants to serve (artifacts, full checkpoints compared with the base, LoRA
            adapters).
        num_slots: device slots ``N`` (``--max-deltas``).
        device, dtype: where and in what precision the model runs.
        registry, ledger: the dedup registry and the ledger of its savings (new ones by default).
    """

    mode = "delta"

    def __init__(self, base: Checkpoint, variants: list[VariantInfo], num_slots: int, device: torch.device,
                 dtype: torch.dtype, delta_compute: str = "auto", registry: TensorDedupRegistry | None = None,
                 ledger: DedupLedger | None = None):
        self.base, self.device, self.dtype = base, device, dtype
        self.registry = registry if registry is not None else new_serving_registry()
        self.ledger = ledger if ledger is not None else DedupLedger()
        self.variants: dict[str, VariantInfo] = {}
        self.num_slots = num_slots
        if delta_compute not in ("auto", "packed", "dequantized"):
            raise InputError(f"--delta-compute {delta_compute!r} is unknown; use auto, packed or dequantized")
        # auto: packed (SBMM kernel) on CUDA; on CPU there is no fast low-bit kernel, so resident
        # deltas are kept dequantized (see DeltaContext).
        self.delta_compute = ("packed" if device.type == "cuda" else "dequantized") if delta_compute == "auto" \
            else delta_compute
        self.model = self._load_model(base, dtype, device)
        # The base goes through the registry first: later variant tensors identical to a base
        # tensor are answered with it. Its own memory is kept (no copy).
        self._base_held, new, reused = share_parameters(self.model, self.registry)
        self.ledger.base_new_bytes, self.ledger.base_reused_bytes = new, reused
        self.config = self.model.config
        self.ctx = DeltaContext(num_slots, dequantize=self.delta_compute == "dequantized")
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        # Parameters that share storage (tied embeddings): a change to one is a change to all names
        # that the checkpoint does not store separately.
        by_obj: dict[int, list[str]] = {}
        for n, p in self._params.items():
            by_obj.setdefault(id(p), []).append(n)
        self._aliases = {n: [m for m in by_obj[id(p)] if m != n] for n, p in self._params.items()}
        # Linear shapes of the base (LoRA checks), taken before any module is decoupled.
        self._linears = {n: (m.out_features, m.in_features) for n, m in self.model.named_modules()
                         if isinstance(m, nn.Linear)}
        self._targets: dict[str, dict[str, list[tuple[str, str]]]] = {}  # variant -> tensor -> [(module, attr)]
        self._lora: dict[str, Any] = {}  # LoRA variant -> LoraSpec
        self.modules: dict[str, nn.Module] = {}
        wanted: dict[str, str] = {}  # module name -> decoupled kind
        plans = [(v, self.prepare_variant(v, wanted)) for v in variants]
        for mname, kind in sorted(wanted.items()):
            self.modules[mname] = self._replace(mname, kind)
        for v, plan in plans:
            self._register(v, plan)

    # -- building -------------------------------------------------------------------------------
    def _load_model(self, base: Checkpoint, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """The base model on ``device`` (tensor parallel overrides it to shard the model first)."""
        return load_base_model(base, dtype, device)

    def prepare_variant(self, v: VariantInfo, wanted: dict[str, str] | None = None):
        """Check a variant against the model and plan which modules it needs; changes nothing.

        Adds ``module -> kind`` to ``wanted`` for the modules it needs decoupled. Safe to call from
        any thread (it only reads the model).

        Raises:
            UnsupportedVariant / InputError: something the decoupled runtime cannot serve (named).
        """
        wanted = {} if wanted is None else wanted
        if v.kind == "lora":
            from deltazip.runtime.serve.lora_variant import read_lora_spec

            spec = read_lora_spec(v.path, self._linears, type(self.model).__name__)
            for mname in spec.modules:
                wanted[mname] = "linear"
            return spec
        return self._plan_variant(v, self._params, wanted)

    def commit_variant(self, v: VariantInfo, plan, wanted: dict[str, str] | None = None) -> None:
        """Serve a prepared variant (engine thread, between forwards): decouple the modules it needs
        that are not decoupled yet (``wanted`` as filled by :meth:`prepare_variant`), then register it."""
        if wanted is None:
            wanted = {}
            self.prepare_variant(v, wanted)
        for mname, kind in sorted(wanted.items()):
            if mname not in self.modules:
                self.modules[mname] = self._replace(mname, kind)
        self._register(v, plan)

    def _register(self, v: VariantInfo, plan) -> None:
        self.variants[v.name] = v
        if v.kind == "lora":
            self._lora[v.name] = plan
        else:
            self._targets[v.name] = plan
        self.ledger.set_same_as_base(v.name, v.same_as_base_bytes)

    def remove_variant(self, name: str) -> None:
        """Forget a variant (engine thread; its slot must have been cleared). Decoupled modules stay:
        with no slot using them they cost nothing per forward beyond a set check."""
        self.variants.pop(name, None)
        self._targets.pop(name, None)
        self._lora.pop(name, None)
        self.ledger.forget(name)

    def _plan_variant(self, v: VariantInfo, params: dict[str, nn.Parameter],
                      wanted: dict[str, str]) -> dict[str, list[tuple[str, str]]]:
        plan: dict[str, list[tuple[str, str]]] = {}
        for name, e in v.tensors.items():
            if e["kind"] == "same":
                continue
            if e["kind"] == "packed" and (e.get("transposed") or e.get("experts")):
                what = "a fused mixture-of-experts tensor" if e.get("experts") else "a Conv1D weight stored [in, out]"
                raise UnsupportedVariant(f"variant {v.name}: tensor {name} is {what}, which the decoupled runtime does "
                                         f"not apply per request; serve it with --mode swap")
            if name not in params:
                raise UnsupportedVariant(
                    f"variant {v.name}: tensor {name!r} is not a parameter of {type(self.model).__name__} (the "
                    f"checkpoint names differ from the module names for this architecture); the decoupled runtime "
                    f"needs them equal — serve this one with --mode swap")
            if list(params[name].shape) != list(e["shape"]):
                raise UnsupportedVariant(f"variant {v.name}: tensor {name} has shape {e['shape']}, the base has "
                                         f"{list(params[name].shape)}; it cannot share the base model")
            targets = [name] + [a for a in self._aliases.get(name, []) if a not in v.tensors]
            plan[name] = []
            for t in targets:
                mname, attr = t.rsplit(".", 1)
                mod = self.model.get_submodule(mname)
                if isinstance(mod, (nn.Linear, DeltaLinear)) and attr in ("weight", "bias"):
                    kind = "linear"
                elif type(mod) in (nn.Embedding, DeltaEmbedding) and attr == "weight":
                    # Exact type: subclasses (OPT's learned positions, scaled embeddings) change forward().
                    kind = "embedding"
                elif attr == "weight" and (isinstance(mod, DeltaRMSNorm) or is_llama_rmsnorm(mod)):
                    kind = "norm"
                elif attr in ("weight", "bias") and (type(mod) is DeltaLayerNorm or (
                        type(mod) is nn.LayerNorm and mod.weight is not None and len(mod.normalized_shape) == 1)):
                    kind = "layernorm"
                else:
                    raise UnsupportedVariant(
                        f"variant {v.name}: it changes {t} ({type(mod).__name__}.{attr}), which the decoupled runtime "
                        f"cannot apply per request; serve it with --mode swap")
                if e["kind"] == "packed" and (kind != "linear" or attr != "weight"):
                    raise UnsupportedVariant(f"variant {v.name}: tensor {t} is stored packed but is not a linear weight")
                wanted[mname] = kind
                plan[name].append((mname, attr))
        return plan

    def _replace(self, mname: str, kind: str) -> nn.Module:
        parent_name, _, child = mname.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        old = getattr(parent, child)
        new = {"linear": DeltaLinear, "embedding": DeltaEmbedding, "norm": DeltaRMSNorm,
               "layernorm": DeltaLayerNorm}[kind](old, self.ctx)
        setattr(parent, child, new)
        return new

    # -- variants: disk -> host -> device -------------------------------------------------------
    def load_host(self, name: str) -> HostDelta:
        """Read and decode variant ``name`` (checksums verified) into host memory.

        Every decoded tensor goes through the dedup registry: one bit-identical to a tensor already
        held (the base's, another variant's) is not stored again.
        """
        v = self.variants[name]
        tally = LoadTally(self.registry)
        host = HostDelta(name)
        if v.kind == "lora":
            from deltazip.runtime.serve.lora_variant import load_lora_factors

            for mname, f in load_lora_factors(self._lora[name], self.dtype).items():
                host.modules[mname] = {"lora_a": tally.share(_pin(f.A)), "lora_b": tally.share(_pin(f.B)),
                                       "lora_scale": f.scale}
        elif v.kind == "full":
            for tname, t in load_checkpoint_tensors(v, list(self._targets[name]), self.dtype, tally).items():
                self._put_dense(host, self._targets[name][tname], t)
        else:
            self._load_artifact(v, host, tally)
        self.ledger.record_load(name, tally.shared, tally.added)
        return host

    def _load_artifact(self, v: VariantInfo, host: HostDelta, tally: LoadTally) -> None:
        art = Artifact(v.path)
        # Lossless-packed parts decode on the GPU when serving on one (nvCOMP), then land in
        # pinned host memory, which is what the host tier holds.
        decode_on = self.device if self.device.type == "cuda" and art.lossless != "none" else None
        for tname, targets in self._targets[v.name].items():
            e = art.tensors[tname]
            if e["kind"] == "packed":
                d = _pin_packed(art.packed(tname, device=decode_on).to("cpu"))

                def share(t):
                    return None if t is None else tally.share(t)

                delta = PackedDelta(share(d.qweight), share(d.scales), share(d.zeros), share(d.positions), d.bits,
                                    d.group_size, d.in_features, d.out_features)
                for mname, _ in targets:
                    host.modules.setdefault(mname, {}).update(packed=delta, additive=bool(e["additive"]))
                continue
            tensor = art.reconstruct(tname, self.base.get(tname) if needs_base(e) else None)
            self._put_dense(host, targets, tally.share(_pin(tensor.to(self.dtype))))

    def _put_dense(self, host: HostDelta, targets: list[tuple[str, str]], tensor: torch.Tensor) -> None:
        for mname, attr in targets:
            kw = host.modules.setdefault(mname, {})
            mod = self.modules[mname]
            if isinstance(mod, DeltaLinear):
                kw["dense" if attr == "weight" else "bias"] = tensor
            elif isinstance(mod, DeltaLayerNorm):
                kw[attr] = tensor
            else:
                kw["weight"] = tensor

    def write_slot(self, slot: int, name: str, host: HostDelta) -> None:
        """Put a decoded variant into device slot ``slot`` (engine thread, between forwards).

        Dense replacements (linears, embeddings) are referenced by the slot, not copied: on the
        host device they are the host tier's tensors; on a GPU the registry's device copy, which
        slots holding identical tensors share.
        """
        for mname, mod in self.modules.items():
            kw = host.modules.get(mname)
            if kw is None:
                mod.clear_slot(slot)
                continue
            if self.device.type != "cpu":
                kw = {k: share_tensor(self.registry, t, self.device)[0] if k in ("dense", "weight") else t
                      for k, t in kw.items()}
            mod.load_slot(slot, **kw)

    def clear_slot(self, slot: int) -> None:
        for mod in self.modules.values():
            mod.clear_slot(slot)

    def slot_bytes(self, slot: int) -> int:
        """Device bytes that slot ``slot`` occupies across all decoupled modules."""
        return sum(m.resident_bytes(slot) for m in self.modules.values())

    def resident_estimate(self, name: str) -> int:
        """Device bytes a variant will occupy in a slot, from its manifest (before loading it)."""
        v = self.variants[name]
        total = 0
        esize = torch.tensor([], dtype=self.dtype).element_size()
        if v.kind == "lora":
            spec = self._lora[name]
            return sum((a[0] * a[1] + b[0] * b[1]) * esize for a, b in spec.shapes.values())
        for tname, targets in self._targets[name].items():
            e = v.tensors[tname]
            numel = 1
            for d in e["shape"]:
                numel *= d
            packed_here = e["kind"] == "packed" and self.delta_compute == "packed"
            per = int(e.get("stored_bytes", 0)) if packed_here else numel * esize
            total += per * len(targets)
        return total

    def base_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    # -- forward --------------------------------------------------------------------------------
    def forward(self, row_slots: list[int], input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor, kv) -> torch.Tensor:
        """Logits of the last position of every row: ``[B, V]`` fp32.

        Args:
            row_slots: slot of each row (``-1`` base).
            input_ids, position_ids: ``[B, T]``.
            attention_mask: bool ``[B, 1, T, K]`` (True = attend).
            kv: the step's cache object (``deltazip.runtime.serve.engine.StepKV``).
        """
        self.ctx.bind(row_slots, self.device)
        try:
            return run_model(self.model, input_ids, position_ids, attention_mask, kv)
        finally:
            self.ctx.unbind()


def run_model(model: nn.Module, input_ids, position_ids, attention_mask, kv) -> torch.Tensor:
    """One forward of a transformers causal LM over a prepared batch; last-position logits, fp32."""
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                past_key_values=kv, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :].float()


# --------------------------------------------------------------------------------------------------
# Swap mode
# --------------------------------------------------------------------------------------------------


class SwapModels:
    """``N`` whole models on the device; a slot is refilled with a merged fine-tune on a miss.

    The host object of a variant is its full merged state dict in the model dtype (the base's own
    tensors for the base; for a LoRA adapter the base with ``W + scale · B A`` merged into the adapted
    linears; a full checkpoint as stored), which is what swapping a whole model moves. Host state
    dicts go through the dedup registry, so tensors equal across them (and to the base's) are held
    once on the host; a device slot is a whole private model, as in the baseline being modelled.
    """

    mode = "swap"

    def __init__(self, base: Checkpoint, variants: list[VariantInfo], num_slots: int, device: torch.device,
                 dtype: torch.dtype, base_name: str, registry: TensorDedupRegistry | None = None,
                 ledger: DedupLedger | None = None):
        self.base, self.device, self.dtype, self.base_name = base, device, dtype, base_name
        self.registry = registry if registry is not None else new_serving_registry()
        self.ledger = ledger if ledger is not None else DedupLedger()
        self.num_slots = num_slots
        template = load_base_model(base, dtype, device)
        self._base_held, new, reused = share_parameters(template, self.registry)
        self.ledger.base_new_bytes, self.ledger.base_reused_bytes = new, reused
        self.config = template.config
        keys = set(template.state_dict())
        # Fast path: checkpoint names are the module names (Llama family); otherwise go through
        # transformers' loader, which applies the architecture's key renames.
        self._names_match = set(base.names) <= keys
        self._template = template
        self._linears = {n: (m.out_features, m.in_features) for n, m in template.named_modules()
                         if isinstance(m, nn.Linear)}
        self.variants: dict[str, VariantInfo] = {}
        self._lora: dict[str, Any] = {}
        for v in variants:
            self.commit_variant(v, self.prepare_variant(v))
        self.models: list[nn.Module | None] = [None] * num_slots
        self._slot_variant: list[str | None] = [None] * num_slots

    def prepare_variant(self, v: VariantInfo, wanted: dict[str, str] | None = None):
        """Check a variant (LoRA: against the base's linears); nothing else is needed to swap it in."""
        if v.kind == "lora":
            from deltazip.runtime.serve.lora_variant import read_lora_spec

            return read_lora_spec(v.path, self._linears, type(self._template).__name__)
        return None

    def commit_variant(self, v: VariantInfo, plan, wanted: dict[str, str] | None = None) -> None:
        self.variants[v.name] = v
        if v.kind == "lora":
            self._lora[v.name] = plan
        self.ledger.set_same_as_base(v.name, v.same_as_base_bytes)

    def remove_variant(self, name: str) -> None:
        self.variants.pop(name, None)
        self._lora.pop(name, None)
        self.ledger.forget(name)

    def _state_dict_of(self, path: Path, ck: Checkpoint) -> dict[str, torch.Tensor]:
        if self._names_match:
            return {n: ck.get(n) for n in ck.names}
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype).state_dict()

    def load_host(self, name: str) -> dict[str, torch.Tensor]:
        from deltazip.compress.merge import load_merged_model, reconstruct_state_dict

        v = self.variants.get(name)
        if name == self.base_name:
            sd = self._state_dict_of(self.base.path, self.base)
        elif v.kind == "full" and self._names_match:
            # Read through the registry from the file bytes: tensors equal to the base's are never copied.
            tally = LoadTally(self.registry)
            host = _SwapHost(load_checkpoint_tensors(v, list(v.tensors), self.dtype, tally))
            self.ledger.record_load(name, tally.shared, tally.added)
            return host
        elif v.kind == "full":
            sd = self._state_dict_of(v.path, Checkpoint(v.path, f"checkpoint {v.name}"))
        elif v.kind == "lora":
            from deltazip.runtime.serve.lora_variant import load_lora_factors, merged_weight

            sd = {n: t.to(self.dtype) for n, t in self._state_dict_of(self.base.path, self.base).items()}
            for mname, f in load_lora_factors(self._lora[name], self.dtype).items():
                sd[f"{mname}.weight"] = merged_weight(sd[f"{mname}.weight"], f)
        else:
            art = Artifact(v.path)
            if self._names_match:
                sd = reconstruct_state_dict(art, self.base)
            else:
                sd = load_merged_model(art, self.base, dtype=self.dtype).state_dict()
        tally = LoadTally(self.registry)
        host = _SwapHost({n: tally.share(_pin(t.to(self.dtype))) for n, t in sd.items()})
        if name != self.base_name:
            self.ledger.record_load(name, tally.shared, tally.added)
        return host

    def write_slot(self, slot: int, name: str, host: dict[str, torch.Tensor]) -> None:
        model = self.models[slot]
        if model is None:
            model = self.models[slot] = copy.deepcopy(self._template)
        missing, unexpected = model.load_state_dict(host, strict=False)
        tied = {a for names in _tied_names(model) for a in names}
        if unexpected or (set(missing) - tied):
            raise ArtifactError(f"variant {name}: its tensors do not match the model ({len(missing)} missing, "
                                f"{len(unexpected)} unexpected)")
        self._slot_variant[slot] = name

    def clear_slot(self, slot: int) -> None:
        self._slot_variant[slot] = None  # the model object is reused by the next load

    def slot_bytes(self, slot: int) -> int:
        m = self.models[slot]
        return 0 if m is None else sum(p.numel() * p.element_size() for p in m.parameters())

    def resident_estimate(self, name: str) -> int:
        return sum(p.numel() * p.element_size() for p in self._template.parameters())

    def base_bytes(self) -> int:
        return 0

    def forward(self, row_slots: list[int], input_ids, position_ids, attention_mask, kv) -> torch.Tensor:
        """Same contract as :meth:`DeltaModel.forward`; every row must be in the same slot."""
        slots = set(row_slots)
        if len(slots) != 1 or min(slots) < 0:
            raise ValueError(f"swap mode runs one resident model per forward, got slots {sorted(slots)}")
        return run_model(self.models[row_slots[0]], input_ids, position_ids, attention_mask, kv)


class _SwapHost(dict):
    """A merged state dict that reports its size to the cache."""

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.values())


def _tied_names(model: nn.Module) -> list[list[str]]:
    by_obj: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_obj.setdefault(id(p), []).append(n)
    return [v for v in by_obj.values() if len(v) > 1]
