"""Evaluation targets built on the serving model, so that eval measures exactly what ``serve`` runs.

A *target* is one of:

- a deltazip artifact directory: evaluated through :class:`deltazip.runtime.serve.model.DeltaModel`, the
  decoupled base + delta model of ``deltazip serve`` (same modules, same ``kernels.dispatch`` path),
  with every row of every batch routed to the variant's device slot;
- a PEFT LoRA adapter directory: the same decoupled model with the adapter in the slot (grouped
  LoRA shrink/expand, as ``serve`` runs it);
- the word ``base``: the same decoupled model with every row on the base (slot ``-1``), which is how
  the server answers requests for the base model;
- a plain Hugging Face model directory (e.g. the uncompressed fine-tune, or a merged copy): loaded by
  transformers as is.

:class:`EvalBank` holds one base model for all artifact targets of a run and switches the slot's
contents between targets, so the base weights are loaded once however many artifacts are compared.
The slot routing is a forward pre-hook on the transformers model, so anything that calls the model —
lm-eval's ``HFLM`` (loglikelihood and ``generate``), a perplexity loop — runs the decoupled path.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deltazip.formats.artifact import MANIFEST
from deltazip.formats.errors import InputError
from deltazip.models.checkpoint import Checkpoint
from deltazip.models.devices import check_dtype, resolve_device
from deltazip.models.loader import load_causal_lm
from deltazip.runtime.serve.assembly import ServeConfig, build_model
from deltazip.runtime.serve.lora_variant import ADAPTER_CONFIG
from deltazip.runtime.serve.model import (
    BASE_SLOT,
    DeltaModel,
    UnsupportedVariant,
    VariantInfo,
    load_tokenizer,
    open_served_base,
    served_dtype,
)
from deltazip.runtime.serve.variant_sources import inspect_variant

BASE_TARGET = "base"
log = logging.getLogger("deltazip.eval")


@dataclass
class Target:
    """One thing to evaluate, as named on the command line.

    Attributes:
        spec: what the user typed (a path or ``base``).
        kind: ``artifact``, ``lora``, ``base`` or ``hf``.
        label: column title; unique within a run.
        path: the directory (``None`` for ``base``).
        variant: the artifact's manifest view or the adapter's description (artifact, lora).
    """

    spec: str
    kind: str
    label: str
    path: Path | None = None
    variant: VariantInfo | None = None


def parse_targets(specs: list[str]) -> list[Target]:
    """Classify each TARGET; labels are directory names, made unique with ``#2``, ``#3``...

    Raises:
        InputError: a path that does not exist or is neither an artifact nor an HF model directory.
    """
    if not specs:
        raise InputError("no TARGET given; pass artifact directories, HF model directories or 'base'")
    out: list[Target] = []
    seen: dict[str, int] = {}
    for spec in specs:
        if spec == BASE_TARGET:
            t = Target(spec, "base", BASE_TARGET)
        else:
            path = Path(spec).expanduser()
            if not path.exists():
                raise InputError(f"{spec}: no such file or directory; pass an artifact directory, an HF model "
                                 f"directory or the word 'base'")
            if (path / MANIFEST).is_file():
                t = Target(spec, "artifact", path.resolve().name, path, inspect_variant(path))
            elif (path / ADAPTER_CONFIG).is_file():
                t = Target(spec, "lora", path.resolve().name, path, inspect_variant(path))
            elif (path / "config.json").is_file():
                t = Target(spec, "hf", path.resolve().name, path)
            else:
                raise InputError(f"{spec}: not a deltazip artifact ({MANIFEST}), a PEFT adapter ({ADAPTER_CONFIG}) "
                                 f"or a Hugging Face model directory (config.json)")
        n = seen.get(t.label, 0) + 1
        seen[t.label] = n
        if n > 1:
            t.label = f"{t.label}#{n}"
        out.append(t)
    for t in out:  # variant names key the decoupled model's slots: keep them unique too
        if t.variant is not None:
            t.variant.name = t.label
    return out


def eval_advice(message: str, base: Path) -> str:
    """A serve-side refusal (which points at ``serve --mode swap``) reworded for eval, which has no
    swap mode: evaluate a merged copy of the variant as a plain model directory instead."""
    reason = re.split(r"[;,]?\s*(?:—\s*)?serve (?:it|this one|them) with --mode swap", message)[0].rstrip(" ;,—")
    return (f"{reason}; eval runs the decoupled serving path, so evaluate a merged copy instead: "
            f"`deltazip merge ARTIFACT --base {base} --out MERGED`, then pass MERGED as the target")


def _route_all_rows(model: nn.Module, ctx, get_slot, device: torch.device) -> None:
    """Bind every row of each forward's batch to the bank's current slot (a pre-hook), and between
    forwards every token (one row: ``DeltaContext`` then routes any input shape to it). ``generate``
    of an image-text model runs the vision tower before the model's forward; bound only by the
    pre-hook, that first call would read the images with whatever the previous forward left (or the
    base's weights)."""

    def before(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        x = kwargs.get("input_ids")
        if x is None:
            x = args[0] if args else kwargs.get("inputs_embeds")
        ctx.bind([get_slot()] * int(x.shape[0]), device)
        return None

    def after(module: nn.Module, args: tuple, kwargs: dict[str, Any], output):
        ctx.bind([get_slot()], device)
        return None

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)


class EvalBank:
    """The models of one evaluation run: a shared decoupled base, plus plain HF models on demand.

    Args:
        targets: from :func:`parse_targets`.
        base: ``--base`` (a path or hub id); default: the artifacts' lineage base.
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``.
        dtype: ``auto`` (fp32 on CPU, the checkpoint's half dtype on CUDA), ``float32``, ``float16``,
            ``bfloat16``.
    """

    def __init__(self, targets: list[Target], base: str | None, device: str = "auto", dtype: str = "auto"):
        self.targets = targets
        self.device = resolve_device(device)
        check_dtype(dtype)
        self._dtype_name = dtype
        self._hf: tuple[str, nn.Module] | None = None
        self._processors: dict[str, Any] = {}
        variants = [t.variant for t in targets if t.variant is not None]
        arts = [v for v in variants if v.kind == "artifact"]
        loras = [v for v in variants if v.kind == "lora"]
        self.base: Checkpoint | None = None
        self.delta_model: DeltaModel | None = None
        if variants or any(t.kind == "base" for t in targets):
            if base is None and not arts:
                # An adapter that names a local base directory is enough, as it is for peft.
                named = {v.lineage.get("base") for v in loras} - {None}
                local = [n for n in named if Path(n).expanduser().is_dir()]
                if len(named) != 1 or not local:
                    raise InputError("no artifact among the targets names its base; pass --base")
                base = local[0]
            self.base = open_served_base(arts, base, command="eval") if arts else Checkpoint(base, "base")
            # The model serve builds (LoRA adapters checked against the base there), with one slot:
            # targets are evaluated one after another and take turns in it.
            try:
                asm = build_model(ServeConfig(device=str(self.device), dtype=dtype, max_deltas=1), variants,
                                  base=self.base)
            except UnsupportedVariant as e:
                raise InputError(eval_advice(str(e), self.base.path)) from e
            self.delta_model = asm.backend
            self.dtype = asm.dtype
            self._slot = BASE_SLOT
            self._loaded: str | None = None
            self._vision = contextlib.ExitStack()  # the vision tensors of the slot in use (VisionParams)
            self._vision_slot: int | None = None
            _route_all_rows(self.delta_model.model, self.delta_model.ctx, lambda: self._slot, self.device)
        else:
            self.dtype = None

    @property
    def base_path(self) -> Path | None:
        return None if self.base is None else self.base.path

    def model_for(self, target: Target) -> nn.Module:
        """The transformers model that runs ``target`` (for artifacts and base: the decoupled model,
        routed to the target's slot until the next call)."""
        if target.kind == "hf":
            # One plain model at a time: loading the next one frees the previous.
            if self._hf is None or self._hf[0] != target.label:
                self._hf = None
                self._hf = (target.label, self._load_hf(target.path))
            return self._hf[1]
        assert self.delta_model is not None
        if target.kind == "base":
            self._slot = BASE_SLOT
        else:
            name = target.variant.name
            if self._loaded != name:
                self._hold_vision(None)  # the slot's vision values change with its contents
                self.delta_model.write_slot(0, name, self.delta_model.load_host(name))
                self._loaded = name
            self._slot = 0
        self._hold_vision(self._slot)
        self.delta_model.ctx.bind([self._slot], self.device)  # until a forward binds its batch (_route_all_rows)
        return self.delta_model.model

    def _hold_vision(self, slot: int | None) -> None:
        """Keep slot ``slot``'s vision tensors in place (an image task runs the vision tower in its
        forwards, which the per-row routing does not reach); None: the base's back."""
        if slot == self._vision_slot:
            return
        self._vision.close()
        self._vision = contextlib.ExitStack()
        if slot is not None:
            self._vision.enter_context(self.delta_model.vision_of(slot))
        self._vision_slot = slot

    def processor_for(self, target: Target):
        """The processor serve reads ``target``'s images with (a variant's own files, else its base's),
        or None for a text model or a checkpoint without an image processor (logged: it is evaluated
        on text tasks only). Loaded once per target."""
        if target.label not in self._processors:
            self._processors[target.label] = self._find_processor(target)
        return self._processors[target.label]

    def _find_processor(self, target: Target):
        from deltazip.models.loader import is_image_text
        from deltazip.runtime.serve.images import processor
        from deltazip.runtime.serve.openai_schema import ApiError

        if not is_image_text(self.model_for(target).config):
            return None
        if target.kind == "hf":
            own = base = target.path
        else:
            assert self.base is not None
            base = self.base.path
            own = base if target.variant is None else target.variant.side_dir(base)
        try:  # serve's own lookup: the variant's files, else the base's
            proc = processor(own, base)
        except ApiError as e:  # no processor files, or a package it needs (torchvision)
            log.warning("%s: %s; tasks with images cannot run on it", target.label, e.message)
            return None
        return proc if hasattr(proc, "image_processor") else None

    def tokenizer_for(self, target: Target):
        """The tokenizer ``serve`` would use for ``target`` (an artifact's own, else its base's)."""
        if target.kind == "hf":
            return load_tokenizer(target.path)
        assert self.base is not None
        if target.kind == "base":
            return load_tokenizer(self.base.path)
        return load_tokenizer(target.variant.tokenizer_dir(self.base.path))

    def _load_hf(self, path: Path) -> nn.Module:
        ck = Checkpoint(str(path), "model")  # refuses pickled weights, names the problem
        dtype = self.dtype or served_dtype(self._dtype_name, self.device, ck)
        return load_causal_lm(ck.path, dtype, what="model").to(self.device)
