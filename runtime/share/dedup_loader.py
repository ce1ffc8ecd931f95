"""Build transformers models whose weights come from the tensor dedup registry.

``load_model(path)`` reads a Hugging Face checkpoint directory (single or sharded safetensors)
through a private (copy-on-write) memory map of each file: every tensor is fingerprinted from the
file bytes first and, if the registry already holds an identical tensor on the target device, that
tensor is used as is - no device copy, no new host memory. A new tensor is, on CPU, a zero-copy view
of the mapped file (lazily paged, like ``from_pretrained``; writes could never reach the file), and
on a GPU one host-to-device copy.

The model skeleton is built with parameters on the meta device (no random init, no memory), then
each parameter is set to a read-only ``nn.Parameter`` (``requires_grad=False``) over the registry's
tensor; tied weights are re-tied, non-persistent buffers (rotary tables) are computed as usual.
Two models loaded this way share storage (``data_ptr()``) for every identical tensor and compute
exactly what ``from_pretrained`` computes (same weights bit for bit, same attention implementation).

Limits: checkpoint names must equal the model's state-dict names (no legacy key renaming), weights
keep their stored dtype (no conversion: converting would break identity with other checkpoints).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltazip.formats.checkpoint_files import resolve_checkpoint
from deltazip.formats.errors import InputError
from deltazip.formats.safetensors_raw import read_table
from deltazip.runtime.share.dedup_registry import ST_TO_TORCH, TensorDedupRegistry, get_registry


@dataclass
class LoadReport:
    """What one :func:`load_model` call did.

    tensors: tensors read from the checkpoint; reused / reused_bytes: answered by the registry
    (no new memory); new_bytes: bytes this load allocated for weights; seconds: wall time.
    """

    path: str
    device: str
    tensors: int = 0
    reused: int = 0
    reused_bytes: int = 0
    new_bytes: int = 0
    seconds: float = 0.0
    ignored: list[str] = field(default_factory=list)


@dataclass
class LoadedModel:
    """A model built by :func:`load_model` and the report of its load."""

    model: torch.nn.Module
    report: LoadReport


def load_model(path: str | Path, *, registry: TensorDedupRegistry | None = None, dedup: bool = True,
               device: str | torch.device = "cpu", model_class=None, threads: int | None = None,
               pin_memory: bool = False) -> LoadedModel:
    """Load a transformers model from a local checkpoint directory through the dedup registry.

    Args:
        path: HF model directory with ``config.json`` and safetensors weights (single or sharded).
        registry: the registry to share through; default the process-wide :func:`get_registry`.
        dedup: False loads through the same code path without hashing or sharing (a baseline;
            parameters are ordinary writable tensors over the copy-on-write map).
        device: target device; deduplication happens on the host before any copy to it.
        model_class: a transformers model class; default from ``config.architectures[0]``,
            falling back to ``deltazip.models.loader.causal_lm_class``.
        threads: tensors hashed/copied in parallel (the hashers release the GIL); default
            ``min(8, 2 x cpu count)``, as in ``dedup-scan``.
        pin_memory: stage new tensors through pinned host memory (CUDA targets).
    Returns:
        LoadedModel(model in eval mode, LoadReport).
    Raises:
        InputError: not a HF model directory, bad config, corrupt weights, missing or
            unexpected tensors, shape mismatches.
    """
    import transformers
    from accelerate import init_empty_weights

    t0 = time.perf_counter()
    path = Path(path)
    ck = resolve_checkpoint(path)
    if ck.kind not in ("hf-dir", "hf-sharded") or not (path / "config.json").is_file():
        raise InputError(f"{path}: the dedup loader needs a Hugging Face model directory (config.json + "
                         f"safetensors), got a {ck.kind} checkpoint")
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise InputError(f"{path / 'config.json'}: cannot build a config ({e})") from e
    cls = model_class or _model_class(transformers, config)
    with init_empty_weights(include_buffers=False), _no_init_weights():
        # _from_config picks the attention implementation exactly as from_pretrained does, so the
        # outputs match an independently loaded model bit for bit. Random init is skipped: on
        # meta tensors it computes nothing but still costs ~0.1 s per model in torch's decompositions.
        model = cls._from_config(config)
    dev = torch.device(device)
    nthreads = max(1, threads if threads is not None else min(8, 2 * (os.cpu_count() or 1)))
    reg = (registry if registry is not None else get_registry()) if dedup else None
    report = LoadReport(str(path), str(dev))
    slots = state_slots(model)
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]

    for wf in ck.files:
        entries, _ = read_table(wf.path)
        names = []
        for name, e in entries.items():
            if name not in slots:
                if any(p.search(name) for p in ignore):
                    report.ignored.append(name)
                    continue
                raise InputError(f"{wf.path}: tensor {name!r} has no place in {cls.__name__} (renamed or "
                                 "foreign checkpoint?)")
            want = tuple(slots[name][2].shape)
            if tuple(e.shape) != want:
                raise InputError(f"{wf.path}: tensor {name!r} has shape {list(e.shape)}, {cls.__name__} "
                                 f"expects {list(want)}")
            if e.dtype not in ST_TO_TORCH:
                raise InputError(f"{wf.path}: tensor {name!r} has dtype {e.dtype} that torch cannot load")
            names.append(name)
        whole = _map_file(wf.path)

        def one(name: str, whole=whole, entries=entries) -> tuple[torch.Tensor, bool]:
            e = entries[name]
            raw = whole[e.start:e.end]

            def build() -> torch.Tensor:
                return _typed(raw, e.dtype, e.shape, pin_memory and dev.type == "cuda")

            if reg is None:
                t = build()
                return (t if t.device == dev else t.to(dev)), False
            view = memoryview(raw.numpy()) if e.nbytes else memoryview(b"")
            return reg.acquire_bytes(view, e.dtype, e.shape, device=dev, build=build)

        with ThreadPoolExecutor(max_workers=nthreads) as ex:
            results = list(ex.map(one, names))
        for name, (t, reused) in zip(names, results):
            _assign(slots[name], t)
            nb = t.numel() * t.element_size()
            report.tensors += 1
            if reused:
                report.reused += 1
                report.reused_bytes += nb
            else:
                report.new_bytes += nb

    model.tie_weights()
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if missing:
        raise InputError(f"{path}: {len(missing)} tensors missing from the checkpoint, e.g. {missing[:3]}")
    # Buffers that are not in the checkpoint (rotary tables) were computed on the host.
    for mod in model.modules():
        for bname, b in list(mod._buffers.items()):
            if b is not None and b.device != dev:
                mod._buffers[bname] = b.to(dev)
    model.eval()
    report.seconds = time.perf_counter() - t0
    return LoadedModel(model, report)


def _no_init_weights():
    """transformers' own "skip weight init" context (its location moved in v5), else a no-op."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def _model_class(transformers, config):
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    from deltazip.models.loader import causal_lm_class

    return causal_lm_class(config) or transformers.AutoModelForCausalLM  # the latter raises the clear error


def state_slots(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str, torch.Tensor]]:
    """state-dict name -> (owning module, attribute, current tensor), tied aliases included."""
    out = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        for pname, p in mod._parameters.items():
            if p is not None:
                out[prefix + pname] = (mod, pname, p)
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set:
                out[prefix + bname] = (mod, bname, b)
    return out


def _assign(slot: tuple[torch.nn.Module, str, torch.Tensor], t: torch.Tensor) -> None:
    mod, attr, _ = slot
    if attr in mod._parameters:
        mod._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
    else:
        mod._buffers[attr] = t


def _map_file(path: Path) -> torch.Tensor:
    """The whole file as a uint8 tensor over a private (copy-on-write) memory map: zero-copy and
    lazily paged like ``from_pretrained``, and a stray write could never reach the file."""
    size = path.stat().st_size
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    try:
        storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    except RuntimeError as e:
        raise InputError(f"{path}: cannot map file ({e})") from e
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _typed(raw: torch.Tensor, dtype: str, shape, pin: bool) -> torch.Tensor:
    """A file-byte slice as a tensor of its dtype and shape: a view when the offset is aligned
    (safetensors writers align; the format does not promise it), else a copy. ``pin``: a copy
    in pinned memory, for fast host-to-GPU transfers."""
    tdt = ST_TO_TORCH[dtype]
    if pin:
        raw = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=True).copy_(raw)
    elif raw.storage_offset() % tdt.itemsize:
        raw = raw.clone()
    return raw.view(tdt).reshape(tuple(shape))
