"""PEFT LoRA adapters as served variants: read, check against the base, and hand out per-linear factors.

A PEFT adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (never the
pickle ``adapter_model.bin``, which is refused). For every adapted linear ``m`` of the base, PEFT
computes ``y = x W_mᵀ (+ b) + scale_m · (x A_mᵀ) B_mᵀ`` with ``A_m [r, in]``, ``B_m [out, r]`` and
``scale_m = alpha_m / r_m`` (``alpha_m / sqrt(r_m)`` with rsLoRA), ``r_m`` / ``alpha_m`` from
``rank_pattern`` / ``alpha_pattern`` when they name the module. The runtime applies exactly that per
row (``deltazip.runtime.serve.delta_linear.DeltaLinear``, grouped through ``deltazip.kernels.dispatch.lora``)
or, in swap mode, merges ``W + scale · B A`` into a whole model (:func:`merged_weight`). GPT-2's
Conv1D layers (PEFT's ``fan_in_fan_out``) store ``W`` as ``[in, out]``, but their factors are
``A [r, in]`` and ``B [out, r]`` as for any linear and PEFT adds the same term; only the merge
transposes it. LoRA on fused experts parameters (``target_parameters``) is read by
:mod:`deltazip.runtime.serve.lora_experts` and served as a dense delta of each adapted parameter.
The whole tensors of ``modules_to_save`` (a fine-tune's own ``lm_head`` and ``embed_tokens``, say)
replace the base's for the adapter's rows, as a full checkpoint's changed tensors do.

DoRA rescales each output row of ``W + scale · B A`` to a learned magnitude, which is no additive
term: a DoRA linear is served as its whole merged weight (:func:`dora_weight`), a dense replacement
for the adapter's rows.

Trained biases (``bias="all"`` or ``"lora_only"``: the base linears' own, saved whole) replace the
base's as saved modules do; ``lora_bias`` adds ``scale · b`` of ``lora_B``'s bias to the linear's.

Trained token rows (``trainable_token_indices``, and ``TRAINABLE_TOKENS`` adapters) are read by
:mod:`deltazip.runtime.serve.lora_tokens`. Factors on a module that is no ``nn.Linear`` but holds a 2-D
weight (a MoE router PEFT wraps by its parameter) are read as a linear's; the served model plans
routers, and linears a recurrent mixer reads itself, as their merged weights.

What cannot be served this way is refused with a message naming the setting: DoRA on Conv1D layers
or parameters, a saved module whose shape is not the base's (a resized vocabulary), a LoRA bias on a
linear without one, layer replication, LoRA on parameters other than fused experts weights or on
modules without a 2-D weight, and adapter types other than LoRA and trainable tokens.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from deltazip.formats import codecs
from deltazip.formats.errors import InputError
from deltazip.models.model_walk import Conv1D
from deltazip.models.param_names import tied_names
from deltazip.runtime.serve.delta_experts import ExpertLoraFactors
from deltazip.runtime.serve.lora_experts import (
    ExpertLora,
    ExpertsModule,
    delta_rows,
    expert_factors,
    expert_param_table,
    matches_target,
    take_expert_factors,
)
from deltazip.runtime.serve.lora_tokens import TokenRows, read_token_rows, token_module

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
_MAGNITUDE = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector$")  # DoRA's, one per output
_BASE_LAYER = re.compile(r"\.base_layer(?=\.)")  # PEFT's wrapper around an adapted module
_LORA_BIAS = re.compile(r"^(?P<module>.+)\.lora_B\.bias$")  # lora_bias's, one per output


def _factor(name: str) -> tuple[str, str] | None:
    """``(module, part)`` of an adapter tensor name that is a LoRA factor (``A``, ``B``), a DoRA
    magnitude (``M``) or a ``lora_B`` bias (``b``), else None."""
    for pattern, part in ((_KEY, None), (_MAGNITUDE, "M"), (_LORA_BIAS, "b")):
        m = pattern.match(name)
        if m is not None:
            return m["module"], part or m["which"]
    return None


@dataclass
class LoraFactors:
    """One adapted linear: ``A [r, in]``, ``B [out, r]`` (served dtype), its fp32 ``scale``, with DoRA
    its ``magnitude [out]`` and with ``lora_bias`` its ``bias [out]``."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float
    magnitude: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # lora_B's bias [out] (lora_bias), fp32: the linear adds scale · bias

    @property
    def rank(self) -> int:
        return self.A.shape[0]


@dataclass
class LoraSpec:
    """A checked adapter: its config and, per base module name, the adapter's tensor names."""

    path: Path
    config: dict[str, Any]
    modules: dict[str, tuple[str, str]] = field(default_factory=dict)  # module -> (A key, B key)
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    params: dict[str, ExpertLora] = field(default_factory=dict)  # "module.param" -> an adapted experts weight
    saved: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # modules_to_save: parameter ->
    # (its key in the file, shape)
    magnitudes: dict[str, str] = field(default_factory=dict)  # module -> its DoRA magnitude's key
    lora_biases: dict[str, str] = field(default_factory=dict)  # module -> its lora_B bias's key
    saved_targets: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # parameter -> [(module, attr)]
    # the served model applies it to (set when the model plans the adapter)
    tokens: dict[str, TokenRows] = field(default_factory=dict)  # module -> the token rows it replaces
    read_by_mixer: dict[str, tuple[str, str]] = field(default_factory=dict)  # adapted linear -> (the recurrent
    # mixer that reads its weight itself, its name there): merged and served as the mixer's (set when planned)

    @property
    def base_model(self) -> str | None:
        return self.config.get("base_model_name_or_path")

    def pattern_value(self, pattern_key: str, module: str, default):
        """``rank_pattern``/``alpha_pattern`` lookup as PEFT does it (a key matches a name suffix)."""
        table = self.config.get(pattern_key) or {}
        for key, value in table.items():
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return default

    def scale(self, module: str, rank: int) -> float:
        r = int(self.pattern_value("rank_pattern", module, self.config.get("r", 8)))
        if r != rank:
            raise InputError(f"adapter {self.path}: {module} has rank {rank} in {ADAPTER_WEIGHTS} but {r} in "
                             f"{ADAPTER_CONFIG}; the adapter files do not belong together")
        alpha = float(self.pattern_value("alpha_pattern", module, self.config.get("lora_alpha", 8)))
        return alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.path / ADAPTER_CONFIG, self.path / ADAPTER_WEIGHTS))


def _refusal(path: Path, cfg: dict[str, Any]) -> str | None:
    """Why an adapter config cannot be served, or None."""
    kind = str(cfg.get("peft_type", "LORA")).upper()
    if kind not in ("LORA", "TRAINABLE_TOKENS"):
        return f"it is a {kind} adapter; only LoRA and trainable-tokens adapters are served"
    checks = [
        (cfg.get("use_dora") and (cfg.get("fan_in_fan_out") or cfg.get("target_parameters")),
         "it uses DoRA (use_dora) on Conv1D layers or parameters; merge it with peft (merge_and_unload) and serve "
         "the merged model as a full checkpoint"),
        (cfg.get("layer_replication"), "it replicates layers (layer_replication), which changes the architecture"),
        (cfg.get("megatron_config"), "it targets Megatron parallel layers (megatron_config)"),
    ]
    for bad, why in checks:
        if bad:
            return why
    return None


def _targeted(target_modules, module: str) -> bool:
    """Whether PEFT's ``target_modules`` covers ``module``: a list names module-name suffixes, a
    string is a regular expression over the whole name (``all-linear``: every linear). None: no claim."""
    if target_modules is None or target_modules == "all-linear":
        return True
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in target_modules)


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``module name -> (out, in)`` of every ``nn.Linear`` and Conv1D (weight ``[in, out]``) of a model."""
    out = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return out | {n: tuple(m.weight.shape[::-1]) for n, m in conv1d_modules(model).items()}


def conv1d_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's Conv1D layers (GPT-2's), whose weight is stored ``[in, out]``, by name."""
    return {n: m for n, m in model.named_modules() if Conv1D is not None and isinstance(m, Conv1D)}


class LoraBase(NamedTuple):
    """What an adapter is checked against besides the base's linears, taken before any module is
    decoupled (:func:`lora_base`): the fused experts modules (``target_parameters``), every
    parameter's shape and the parameters tied to each (``modules_to_save``)."""

    experts: dict[str, ExpertsModule]
    params: dict[str, tuple[int, ...]]
    aliases: dict[str, list[str]]


def lora_base(model: nn.Module) -> LoraBase:
    """:class:`LoraBase` of ``model`` (tied parameters: those sharing one tensor)."""
    aliases = {n: [m for m in names if m != n] for names in tied_names(model) for n in names}
    return LoraBase(expert_param_table(model), {n: tuple(p.shape) for n, p in model.named_parameters(
        remove_duplicate=False)}, aliases)


def read_adapter_config(path: Path) -> dict[str, Any]:
    """``adapter_config.json`` of adapter directory ``path``, whatever it asks for.

    Raises:
        InputError: unreadable, or not a JSON object.
    """
    try:
        cfg = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"adapter {path}: cannot read {ADAPTER_CONFIG} ({e})") from e
    if not isinstance(cfg, dict):
        raise InputError(f"adapter {path}: {ADAPTER_CONFIG} is not a JSON object")
    return cfg


def _read_config(path: Path) -> dict[str, Any]:
    """``adapter_config.json`` of a servable adapter.

    Raises:
        InputError: unreadable, not an object, or a setting :func:`_refusal` names.
    """
    cfg = read_adapter_config(path)
    why = _refusal(path, cfg)
    if why:
        raise InputError(f"adapter {path} cannot be served: {why}")
    return cfg


def read_lora_spec(path: Path, linears: dict[str, tuple[int, int]], arch: str,
                   rename: Callable[[list[str]], dict[str, str]] | None = None,
                   base: LoraBase | None = None) -> LoraSpec:
    """Read and check an adapter directory against the served base model (module names and shapes).

    Args:
        path: the adapter directory.
        linears: ``module name -> (out, in)`` of the base's linears (:func:`linear_shapes`).
        arch: the base model's class name (for messages).
        rename: checkpoint parameter names -> the model's (``deltazip.models.param_names.module_names``
            over the served model): an adapter trained under an older transformers names modules as
            that version's class did (Qwen2.5-VL's ``model.layers.0...`` is now
            ``model.language_model.layers.0...``).
        base: the base's experts, parameters and ties (:func:`lora_base`), for adapters with
            ``target_parameters`` or ``modules_to_save``.

    Raises:
        InputError: unreadable or unsupported config, pickle-only weights, a key that is not a LoRA
            factor of a base ``nn.Linear`` or Conv1D, or factor shapes that do not fit the module.
    """
    path = Path(path)
    cfg = _read_config(path)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        hint = " (only the pickle adapter_model.bin is there; re-save it with safe_serialization=True)" \
            if (path / "adapter_model.bin").is_file() else ""
        raise InputError(f"adapter {path}: {ADAPTER_WEIGHTS} is missing{hint}")
    from deltazip.formats.safetensors_raw import read_table

    entries, _ = read_table(weights)
    spec = LoraSpec(path, cfg)
    base = base or LoraBase({}, {}, {})
    spec.saved = _saved_tensors(path, cfg, entries, base)
    token_keys = {m: k for k in entries if (m := token_module(k.removeprefix(_PREFIX))) is not None}
    if rename is not None and (old := [f"{m}.weight" for m in token_keys if f"{m}.weight" not in base.params]):
        got = rename(old)  # (a module named as an older transformers named it)
        token_keys = {got.get(f"{m}.weight", f"{m}.weight").removesuffix(".weight"): k for m, k in token_keys.items()}
    spec.tokens = read_token_rows(path, cfg, token_keys, {k: tuple(e.shape) for k, e in entries.items()},
                                  base.params, base.aliases, linears)
    saved_keys = {k for k, _ in spec.saved.values()} | set(token_keys.values())
    pairs: dict[str, dict[str, str]] = {}
    for key in [k for k in entries if k not in saved_keys]:
        m = _factor(key.removeprefix(_PREFIX))
        if m is None:
            raise InputError(f"adapter {path}: tensor {key!r} is not a LoRA factor (lora_A/lora_B weight); this "
                             f"adapter changes more than LoRA can express and cannot be served")
        pairs.setdefault(m[0], {})[m[1]] = key
    if not pairs and not spec.tokens:
        raise InputError(f"adapter {path}: {ADAPTER_WEIGHTS} holds no LoRA factors")
    spec.params = take_expert_factors(path, cfg, pairs, entries, base.experts, spec.scale)
    named = {m: m for m in pairs}  # module of the served model -> module as the adapter names it
    unknown = [f"{m}.weight" for m in pairs if m not in linears]
    if unknown and rename is not None:
        got = rename(unknown)
        named = {got.get(f"{m}.weight", f"{m}.weight").removesuffix(".weight") if m not in linears else m: m
                 for m in pairs}
        pairs = {m: pairs[orig] for m, orig in named.items()}
    for mname, ab in sorted(pairs.items()):
        _add_linear(spec, mname, named[mname], ab, linears, entries, arch, base)
    clash = sorted(set(spec.tokens) & (set(spec.modules) | {n.rsplit(".", 1)[0] for n in spec.saved}))
    if clash:
        raise InputError(f"adapter {path}: it trains token rows of {clash[0]} and also LoRA factors or a whole copy "
                         "of it; merge it with peft and serve the merged model as a full checkpoint")
    return spec


def _add_linear(spec: LoraSpec, mname: str, named: str, ab: dict[str, str], linears: dict[str, tuple[int, int]],
                entries: dict, arch: str, base: LoraBase) -> None:
    """Check one adapted linear's tensors (``ab``: ``A``, ``B``, with DoRA ``M``, with ``lora_bias``
    ``b``: their keys; ``named``: the module as the adapter names it) and add them to ``spec``.

    Raises:
        InputError: a factor missing, not a linear of the base, shapes that do not fit it, a module
            ``target_modules`` does not name, a DoRA magnitude missing or where DoRA is off, a LoRA
            bias on a linear without one.
    """
    path, cfg = spec.path, spec.config
    if not {"A", "B"} <= set(ab):
        raise InputError(f"adapter {path}: {mname} has only {', '.join(sorted(ab))} of lora_A and lora_B; the "
                         "adapter file is incomplete")
    shape = linears.get(mname) or base.params.get(f"{mname}.weight")  # (a router's [E, H] weight: PEFT wraps
    if shape is None or len(shape) != 2:  # the module's parameter, as a linear's)
        raise InputError(f"adapter {path}: it adapts {mname}, which is not a linear layer of the served base "
                         f"({arch}); the adapter was trained on another architecture")
    out_f, in_f = shape
    a, b = tuple(entries[ab["A"]].shape), tuple(entries[ab["B"]].shape)
    if len(a) != 2 or len(b) != 2 or a[1] != in_f or b[0] != out_f or a[0] != b[1]:
        raise InputError(f"adapter {path}: {mname} has lora_A {list(a)} and lora_B {list(b)}, the base linear is "
                         f"[{out_f}, {in_f}]; the adapter belongs to another base model")
    if not (_targeted(cfg.get("target_modules"), named)
            or matches_target(f"{named}.weight", list(cfg.get("target_parameters") or []))):
        raise InputError(f"adapter {path}: {ADAPTER_WEIGHTS} adapts {named}, which target_modules "
                         f"{cfg.get('target_modules')!r} in {ADAPTER_CONFIG} does not name; the files do not "
                         f"belong together")
    if bool(cfg.get("use_dora")) != ("M" in ab):
        raise InputError(f"adapter {path}: {mname} {'lacks' if cfg.get('use_dora') else 'has'} a DoRA magnitude "
                         f"(lora_magnitude_vector) but use_dora is {bool(cfg.get('use_dora'))}; the files do not "
                         "belong together")
    if "M" in ab:
        if tuple(entries[ab["M"]].shape) != (out_f,):
            raise InputError(f"adapter {path}: {mname}'s DoRA magnitude is {list(entries[ab['M']].shape)}, the base "
                             f"linear has {out_f} outputs; the adapter belongs to another base model")
        spec.magnitudes[mname] = ab["M"]
    if "b" in ab:
        if f"{mname}.bias" not in base.params or tuple(entries[ab["b"]].shape) != (out_f,):
            raise InputError(f"adapter {path}: {mname} has a LoRA bias (lora_bias) {list(entries[ab['b']].shape)}, "
                             "but the base linear has no bias of that size to add it to; merge it with peft and "
                             "serve the merged model as a full checkpoint")
        spec.lora_biases[mname] = ab["b"]
    spec.modules[mname] = (ab["A"], ab["B"])
    spec.shapes[mname] = (a, b)
    spec.scale(mname, a[0])  # validates the config's rank against the file


def _saved_tensors(path: Path, cfg: dict[str, Any], entries: dict, base: LoraBase
                   ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The adapter file's whole tensors of ``modules_to_save`` modules: ``parameter -> (key, shape)``
    (a module whose name is, or ends with, one ``modules_to_save`` names; with ``ensure_weight_tying``,
    also a parameter tied to one, which PEFT saves beside it), and the base biases it trained (``bias``).

    Raises:
        InputError: such a tensor whose shape is not the base parameter's (a resized vocabulary).
    """
    names = list(cfg.get("modules_to_save") or [])
    whole = {_BASE_LAYER.sub("", key.removeprefix(_PREFIX)): key for key in entries
             if _factor(key.removeprefix(_PREFIX)) is None}  # (an adapted linear's bias: X.base_layer.bias)
    named = {n for n in whole if n in base.params and any(
        n.rpartition(".")[0] == m or n.rpartition(".")[0].endswith(f".{m}") for m in names)}
    if cfg.get("bias", "none") != "none":  # the base's biases it trained ("all", or "lora_only")
        named |= {n for n in whole if n in base.params and n.endswith(".bias")}
    if cfg.get("ensure_weight_tying"):
        named |= {n for n in whole if n in base.params and set(base.aliases.get(n, [])) & named}
    out = {}
    for name in sorted(named):
        shape = tuple(entries[whole[name]].shape)
        if shape != base.params[name]:
            raise InputError(f"adapter {path}: it saves {name} {list(shape)} (modules_to_save), the base's is "
                             f"{list(base.params[name])}; a resized vocabulary does not share the base: merge it with "
                             "peft and serve the merged model as a full checkpoint")
        out[name] = (whole[name], shape)
    return out


def load_saved_tensors(spec: LoraSpec) -> dict[str, torch.Tensor]:
    """The whole tensors of the adapter's ``modules_to_save`` (CPU, as stored), by parameter name."""
    from safetensors import safe_open

    with safe_open(str(spec.path / ADAPTER_WEIGHTS), framework="pt") as f:
        return {name: f.get_tensor(key) for name, (key, _) in spec.saved.items()}


def check_lora_base(adapter: Path, named: str | None, base_path: Path, base_fingerprint) -> None:
    """Refuse an adapter whose ``base_model_name_or_path`` names another model than the served base.

    A name that is a local directory must hold the same weights (fingerprint); a hub id or a
    missing path must end in the served base's directory name (``org/SmolLM2-135M`` matches a local
    ``.../SmolLM2-135M``). An adapter that names no base is checked by shapes only.

    Args:
        adapter: the adapter directory (for messages).
        named: its ``base_model_name_or_path``.
        base_path: the served base's directory.
        base_fingerprint: ``() -> str``, the served base's fingerprint (computed only when needed).
    """
    if not named:
        return
    local = Path(named).expanduser()
    if local.is_dir() and (local / "config.json").is_file():
        if local.resolve() == Path(base_path).resolve():
            return
        from deltazip.models.checkpoint import Checkpoint

        if Checkpoint(local, "adapter base", quantized_ok=True).fingerprint() == base_fingerprint():
            return
        raise InputError(f"adapter {adapter} was trained on {named}, whose weights differ from the served base "
                         f"{base_path}; serve it with its own base")
    if named.rstrip("/").rsplit("/", 1)[-1] != Path(base_path).resolve().name:
        raise InputError(f"adapter {adapter} was trained on {named!r}, not on the served base {base_path}; serve it "
                         f"with its own base, or set base_model_name_or_path in {ADAPTER_CONFIG} if it is the same "
                         f"model")


def load_lora_factors(spec: LoraSpec, dtype: torch.dtype) -> dict[str, LoraFactors]:
    """Every adapted module's factors in ``dtype`` (CPU), keyed by base module name."""
    from safetensors import safe_open

    out: dict[str, LoraFactors] = {}
    codec = codecs.get("lora")
    with safe_open(str(spec.path / ADAPTER_WEIGHTS), framework="pt") as f:
        for mname, (ka, kb) in spec.modules.items():
            a, b = f.get_tensor(ka), f.get_tensor(kb)
            shape = [b.shape[0], a.shape[-1]] if a.dim() == 2 and b.dim() == 2 else [0, 0]
            entry = codecs.Entry(mname, {"kind": "lora", "shape": shape, "dtype": "float32"})
            for problem in codec.layout_problems(entry, {"lora_A": a, "lora_B": b}):
                key = ka if problem.startswith("lora_A") else kb
                raise InputError(f"adapter {spec.path}: {key} {problem.split(' ', 1)[1]}")
            m = f.get_tensor(spec.magnitudes[mname]).float() if mname in spec.magnitudes else None
            bias = f.get_tensor(spec.lora_biases[mname]).float() if mname in spec.lora_biases else None
            out[mname] = LoraFactors(a.to(dtype), b.to(dtype), spec.scale(mname, a.shape[0]), m, bias)
    return out


def dora_weight(weight: torch.Tensor, f: LoraFactors) -> torch.Tensor:
    """A DoRA adapter's whole weight ``[out, in]``: ``V = W + scale · B A`` with each output row scaled
    to the adapter's magnitude, ``m / ‖V_row‖ · V`` (PEFT's merge; fp32, cast back to ``weight``'s dtype)."""
    v = weight.float() + f.scale * (f.B.float() @ f.A.float())
    return (v * (f.magnitude / v.norm(dim=1)).unsqueeze(1)).to(weight.dtype)


def load_expert_factors(spec: LoraSpec, dtype: torch.dtype) -> dict[str, ExpertLoraFactors]:
    """Every adapted experts parameter's factors per expert (:func:`~deltazip.runtime.serve.lora_experts.expert_factors`,
    in ``dtype``, CPU), keyed ``module.param``."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(spec.path / ADAPTER_WEIGHTS), framework="pt") as f:
        for name, x in spec.params.items():
            a, b = expert_factors(x, f.get_tensor(x.keys[0]).to(dtype), f.get_tensor(x.keys[1]).to(dtype))
            out[name] = ExpertLoraFactors(a, b, x.scale)
    return out


def load_expert_deltas(spec: LoraSpec) -> dict[str, torch.Tensor]:
    """Every adapted experts parameter's delta rows ``[E·out, in]`` (fp32, CPU), keyed ``module.param``
    (:func:`deltazip.runtime.serve.lora_experts.delta_rows`)."""
    from safetensors import safe_open

    with safe_open(str(spec.path / ADAPTER_WEIGHTS), framework="pt") as f:
        return {name: delta_rows(x, f.get_tensor(x.keys[0]), f.get_tensor(x.keys[1])) for name, x in spec.params.items()}


def merged_weight(weight: torch.Tensor, f: LoraFactors, transposed: bool = False) -> torch.Tensor:
    """``W + scale · B A`` (``[out, in]``; with ``transposed``, a Conv1D's ``[in, out]`` weight plus the
    term transposed): the ``lora`` codec's merge (what PEFT's merge does); with DoRA, :func:`dora_weight`."""
    if f.magnitude is not None:  # (DoRA on Conv1D layers is refused)
        return dora_weight(weight, f)
    if transposed:
        return codecs.get("lora").merge(weight.t(), f.A, f.B, f.scale).t().contiguous()
    return codecs.get("lora").merge(weight, f.A, f.B, f.scale)
