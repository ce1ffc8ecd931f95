"""The served models: one base model with decoupled delta modules, or whole models to swap.

- :func:`discover_artifacts` finds every artifact under a directory (variant name = directory name);
  :func:`open_served_base` picks the base and refuses artifacts compressed against another one.
- :class:`DeltaModel` (``--mode delta``, paper §5.1): the base model built by transformers from its
  checkpoint, each module that some variant changes replaced by its decoupled counterpart
  (``deltazip.runtime.delta_linear``), ``N`` device slots. A variant is loaded from disk into a
  :class:`HostDelta` (packed deltas as stored, replaced tensors rebuilt) and from there into a slot.
- :class:`SwapModels` (``--mode swap``, the paper's vLLM-SCB baseline): ``N`` whole models on the
  device, each slot holding one merged fine-tune (or the base), replaced whole on a miss.

Both expose the same small interface to the engine (``load_host``, ``write_slot``, ``clear_slot``,
``forward``) and are driven through a :class:`deltazip.runtime.delta_cache.TieredCache`.

Tensor names: artifacts name tensors as the checkpoint does. The decoupled model needs those names
to be module parameter names, which holds for the Llama family (Llama, Mistral, Qwen2, ...); a
variant that changes a tensor the runtime cannot apply per row (or whose name is not a parameter
name) is refused with a message naming the tensor and pointing at ``--mode swap``, which goes
through transformers' own loader and so serves any causal LM it can load.
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
from deltazip.formats.artifact import MANIFEST, Artifact
from deltazip.formats.errors import ArtifactError, InputError
from deltazip.kernels.packed import PackedDelta
from deltazip.runtime.delta_linear import (
    DeltaContext,
    DeltaEmbedding,
    DeltaLinear,
    DeltaRMSNorm,
    is_llama_rmsnorm,
)

BASE_SLOT = -1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# --------------------------------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------------------------------


@dataclass
class VariantInfo:
    """One artifact found under the served directory (manifest only; nothing decoded)."""

    name: str
    path: Path
    tensors: dict[str, dict[str, Any]]
    lineage: dict[str, Any]
    disk_bytes: int

    @property
    def hf_dir(self) -> Path:
        return self.path / "hf"

    def tokenizer_dir(self, base_dir: Path) -> Path:
        """The artifact's own tokenizer files when it kept them, else the base's."""
        if any((self.hf_dir / f).is_file() for f in _TOKENIZER_FILES):
            return self.hf_dir
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


def open_served_base(variants: list[VariantInfo], base_spec: str | None) -> Checkpoint:
    """The base to serve: ``base_spec`` or the artifacts' lineage base, fingerprint-checked.

    Raises:
        InputError: no base named anywhere, lineages disagree, or an artifact was compressed
            against another base (the message names the artifact).
    """
    spec = base_spec
    if spec is None:
        named = {str(v.lineage.get("base")) for v in variants if v.lineage.get("base")}
        if not named:
            raise InputError("no artifact names its base model; pass --base")
        fps = {v.lineage.get("base_fingerprint") for v in variants}
        if len(fps) > 1:
            raise InputError(f"the artifacts were compressed against {len(fps)} different bases; serve one base "
                             f"per server (pass --base and point at a directory of its variants)")
        spec = sorted(named)[0]
        if not Path(spec).expanduser().exists() and len(named) > 1:
            spec = next((s for s in sorted(named) if Path(s).expanduser().exists()), spec)
    base = Checkpoint(spec, "base")
    fp = base.fingerprint()
    for v in variants:
        want = v.lineage.get("base_fingerprint")
        if not want:
            raise InputError(f"artifact {v.name} ({v.path}) records no base fingerprint; it cannot be checked "
                             f"against the served base")
        if want != fp:
            raise InputError(f"artifact {v.name} ({v.path}) was compressed against a different base than {base.path} "
                             f"(base fingerprint differs); remove it from the directory or serve its own base")
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

    try:
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

    Args:
        base: the served base checkpoint (already fingerprint-checked against the variants).
        variants: the artifacts to serve.
        num_slots: device slots ``N`` (``--max-deltas``).
        device, dtype: where and in what precision the model runs.
    """

    mode = "delta"

    def __init__(self, base: Checkpoint, variants: list[VariantInfo], num_slots: int, device: torch.device,
                 dtype: torch.dtype, delta_compute: str = "auto"):
        self.base, self.device, self.dtype = base, device, dtype
        self.variants = {v.name: v for v in variants}
        self.num_slots = num_slots
        if delta_compute not in ("auto", "packed", "dequantized"):
            raise InputError(f"--delta-compute {delta_compute!r} is unknown; use auto, packed or dequantized")
        # auto: packed (SBMM kernel) on CUDA; on CPU there is no fast low-bit kernel, so resident
        # deltas are kept dequantized (see DeltaContext).
        self.delta_compute = ("packed" if device.type == "cuda" else "dequantized") if delta_compute == "auto" \
            else delta_compute
        self.model = load_base_model(base, dtype, device)
        self.config = self.model.config
        self.ctx = DeltaContext(num_slots, dequantize=self.delta_compute == "dequantized")
        params = dict(self.model.named_parameters(remove_duplicate=False))
        # Parameters that share storage (tied embeddings): a change to one is a change to all names
        # that the checkpoint does not store separately.
        by_obj: dict[int, list[str]] = {}
        for n, p in params.items():
            by_obj.setdefault(id(p), []).append(n)
        self._aliases = {n: [m for m in by_obj[id(p)] if m != n] for n, p in params.items()}
        self._targets: dict[str, dict[str, list[tuple[str, str]]]] = {}  # variant -> tensor -> [(module, attr)]
        wanted: dict[str, str] = {}  # module name -> decoupled kind
        for v in variants:
            self._targets[v.name] = self._plan_variant(v, params, wanted)
        self.modules: dict[str, nn.Module] = {}
        for mname, kind in sorted(wanted.items()):
            self.modules[mname] = self._replace(mname, kind)

    # -- building -------------------------------------------------------------------------------
    def _plan_variant(self, v: VariantInfo, params: dict[str, nn.Parameter],
                      wanted: dict[str, str]) -> dict[str, list[tuple[str, str]]]:
        plan: dict[str, list[tuple[str, str]]] = {}
        for name, e in v.tensors.items():
            if e["kind"] == "same":
                continue
            if name not in params:
                raise UnsupportedVariant(
                    f"variant {v.name}: tensor {name!r} is not a parameter of {type(self.model).__name__} (the "
                    f"checkpoint names differ from the module names for this architecture); the decoupled runtime "
                    f"supports Llama-family models — serve this one with --mode swap")
            if list(params[name].shape) != list(e["shape"]):
                raise UnsupportedVariant(f"variant {v.name}: tensor {name} has shape {e['shape']}, the base has "
                                         f"{list(params[name].shape)}; it cannot share the base model")
            targets = [name] + [a for a in self._aliases.get(name, []) if a not in v.tensors]
            plan[name] = []
            for t in targets:
                mname, attr = t.rsplit(".", 1)
                mod = self.model.get_submodule(mname)
                if isinstance(mod, nn.Linear) and attr in ("weight", "bias"):
                    kind = "linear"
                elif isinstance(mod, nn.Embedding) and attr == "weight":
                    kind = "embedding"
                elif attr == "weight" and is_llama_rmsnorm(mod):
                    kind = "norm"
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
        new = {"linear": DeltaLinear, "embedding": DeltaEmbedding, "norm": DeltaRMSNorm}[kind](old, self.ctx)
        setattr(parent, child, new)
        return new

    # -- variants: disk -> host -> device -------------------------------------------------------
    def load_host(self, name: str) -> HostDelta:
        """Read and decode variant ``name`` (checksums verified) into host memory."""
        v = self.variants[name]
        art = Artifact(v.path)
        # Lossless-packed parts decode on the GPU when serving on one (nvCOMP), then land in
        # pinned host memory, which is what the host tier holds.
        decode_on = self.device if self.device.type == "cuda" and art.lossless != "none" else None
        host = HostDelta(name)
        for tname, targets in self._targets[name].items():
            e = art.tensors[tname]
            if e["kind"] == "packed":
                delta = _pin_packed(art.packed(tname, device=decode_on).to("cpu"))
                for mname, _ in targets:
                    host.modules.setdefault(mname, {}).update(packed=delta, additive=bool(e["additive"]))
                continue
            needs_base = e["kind"] == "dense_delta"
            tensor = art.reconstruct(tname, self.base.get(tname) if needs_base else None)
            tensor = _pin(tensor.to(self.dtype))
            for mname, attr in targets:
                kw = host.modules.setdefault(mname, {})
                if isinstance(self.modules[mname], DeltaLinear):
                    kw["dense" if attr == "weight" else "bias"] = tensor
                else:
                    kw["weight"] = tensor
        return host

    def write_slot(self, slot: int, name: str, host: HostDelta) -> None:
        """Copy a decoded variant into device slot ``slot`` (engine thread, between forwards)."""
        for mname, mod in self.modules.items():
            kw = host.modules.get(mname)
            if kw is None:
                mod.clear_slot(slot)
            else:
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
            kv: the step's cache object (``deltazip.runtime.engine.StepKV``).
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
    tensors for the base), which is what swapping a whole model moves.
    """

    mode = "swap"

    def __init__(self, base: Checkpoint, variants: list[VariantInfo], num_slots: int, device: torch.device,
                 dtype: torch.dtype, base_name: str):
        self.base, self.device, self.dtype, self.base_name = base, device, dtype, base_name
        self.variants = {v.name: v for v in variants}
        self.num_slots = num_slots
        template = load_base_model(base, dtype, device)
        self.config = template.config
        keys = set(template.state_dict())
        # Fast path: checkpoint names are the module names (Llama family); otherwise go through
        # transformers' loader, which applies the architecture's key renames.
        self._names_match = set(base.names) <= keys
        self._template = template
        self.models: list[nn.Module | None] = [None] * num_slots
        self._slot_variant: list[str | None] = [None] * num_slots

    def load_host(self, name: str) -> dict[str, torch.Tensor]:
        from deltazip.compress.merge import load_merged_model, reconstruct_state_dict

        if name == self.base_name:
            if self._names_match:
                sd = {n: self.base.get(n) for n in self.base.names}
            else:
                from transformers import AutoModelForCausalLM

                sd = AutoModelForCausalLM.from_pretrained(str(self.base.path), dtype=self.dtype).state_dict()
        else:
            art = Artifact(self.variants[name].path)
            if self._names_match:
                sd = reconstruct_state_dict(art, self.base)
            else:
                sd = load_merged_model(art, self.base, dtype=self.dtype).state_dict()
        return _SwapHost({n: _pin(t.to(self.dtype)) for n, t in sd.items()})

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
