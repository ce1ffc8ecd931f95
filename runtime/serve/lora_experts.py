"""LoRA on fused experts parameters (PEFT's ``target_parameters``): read, check, and the delta each
adapted expert parameter adds.

PEFT adapts a 3-D parameter of ``E`` experts with one ``lora_A [r·E, in]`` and one
``lora_B [out, r·E]``: expert ``e`` adds ``scale · B_e A_e`` with ``A_e`` rows ``[e·r, (e+1)·r)`` of
``lora_A`` and ``B_e`` columns ``e, E + e, 2E + e, ...`` of ``lora_B`` (``lora_B`` is read as
``[out, r, E]``). ``in``/``out`` are the expert's own (``[E, out, in]`` storage, or ``[E, in, out]``
where transformers flags the module ``is_transposed``: GPT-OSS). Two adapted parameters of one module
are nested wrappers, saved under the module's name with one ``.base_layer`` per level: the module's
matched parameters, in their registration order, from the innermost (the most ``.base_layer``) out.

In delta mode the runtime keeps the factors per expert (:func:`expert_factors`) and adds
``scale · (x A_eᵀ) B_eᵀ`` for each routed pair (``DeltaExperts``): a resident adapter costs
``E · r · (in + out)`` values per parameter in the model dtype. Swap mode merges the sum
(:func:`delta_rows`, :func:`merged_param`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from deltazip.formats.errors import InputError
from deltazip.models.model_walk import experts_transposed
from deltazip.runtime.serve.delta_experts import is_fused_experts

_LEVEL = ".base_layer"


@dataclass(frozen=True)
class ExpertLora:
    """One adapted experts parameter: ``module.param`` of ``experts`` experts, each ``[out, in]``;
    its factors' keys in the adapter file and its ``scale``."""

    module: str
    param: str
    experts: int
    out: int
    inp: int
    transposed: bool  # stored [E, in, out]
    keys: tuple[str, str]  # (lora_A, lora_B)
    scale: float
    rank: int

    @property
    def name(self) -> str:
        return f"{self.module}.{self.param}"

    def factor_bytes(self, element_size: int) -> int:
        """Bytes of its factors per resident adapter: ``A [E, r, in]`` and ``B [E, out, r]``."""
        return self.experts * self.rank * (self.out + self.inp) * element_size


class ExpertsModule(NamedTuple):
    """A fused experts module's own parameters ``[(name, shape)]`` in registration order (the order
    PEFT nests its wrappers in), and whether it stores ``[E, in, out]``."""

    params: list[tuple[str, tuple[int, ...]]]
    transposed: bool


def expert_param_table(model: nn.Module) -> dict[str, ExpertsModule]:
    """``module name ->`` :class:`ExpertsModule` of every fused experts module of ``model``."""
    return {n: ExpertsModule([(p, tuple(t.shape)) for p, t in m.named_parameters(recurse=False)],
                             experts_transposed(m))
            for n, m in model.named_modules() if is_fused_experts(m)}


def matches_target(key: str, targets: list[str]) -> bool:
    """PEFT's matching of a parameter name against ``target_parameters`` (the name or a suffix)."""
    return key in targets or any(key.endswith(f".{t}") for t in targets)


def resolve(path, cfg: dict, module_key: str, table: dict[str, ExpertsModule]) -> tuple[str, str] | None:
    """The ``(module, parameter)`` the factors saved under ``module_key`` adapt, or None when
    ``module_key`` is no fused experts module (it is then a linear's).

    Raises:
        InputError: the nesting does not match the module's parameters that ``target_parameters`` names.
    """
    module, depth = module_key, 0
    while module.endswith(_LEVEL):
        module, depth = module[:-len(_LEVEL)], depth + 1
    if module not in table:
        return None
    targets = list(cfg.get("target_parameters") or [])
    matched = [p for p, _ in table[module].params if matches_target(f"{module}.{p}", targets)]
    if depth >= len(matched):
        raise InputError(f"adapter {path}: it holds factors under {module_key}, but target_parameters {targets!r} "
                         f"names {len(matched)} parameter(s) of {module}; the files do not belong together")
    return module, matched[len(matched) - 1 - depth]


def expert_lora(path, module: str, param: str, table: dict[str, ExpertsModule], a: tuple[int, ...],
                b: tuple[int, ...], keys: tuple[str, str], scale_of) -> ExpertLora:
    """Check one adapted experts parameter's factor shapes (``lora_A`` ``a``, ``lora_B`` ``b``) against
    the base; ``scale_of(name, rank)`` gives its scale (validating the rank against the config).

    Raises:
        InputError: a bias or other non-3-D parameter, or shapes that do not fit it.
    """
    shape = dict(table[module].params)[param]
    if len(shape) != 3 or param.endswith("_bias"):
        raise InputError(f"adapter {path}: it adapts {module}.{param} {list(shape)}, not an experts weight; only "
                         "fused experts weights are served among target_parameters")
    transposed = table[module].transposed
    e, out, inp = (shape[0], shape[2], shape[1]) if transposed else shape
    if len(a) != 2 or len(b) != 2 or a[1] != inp or b[0] != out or a[0] != b[1] or a[0] % e:
        raise InputError(f"adapter {path}: {module}.{param} has lora_A {list(a)} and lora_B {list(b)}, the base "
                         f"parameter is {list(shape)}; the adapter belongs to another base model")
    return ExpertLora(module, param, e, out, inp, transposed, keys, scale_of(f"{module}.{param}", a[0] // e), a[0] // e)


def take_expert_factors(path, cfg: dict, pairs: dict[str, dict[str, str]], entries: dict, table: dict[str, ExpertsModule],
                        scale_of) -> dict[str, ExpertLora]:
    """Take out of ``pairs`` (``saved module -> {"A": key, "B": key}``) the factors of fused experts
    weights and check them (``entries``: the adapter file's tensors, with ``shape``); the rest are
    linears'. Returns ``"module.param" ->`` :class:`ExpertLora`.

    Raises:
        InputError: one factor of a pair missing, or as :func:`resolve` and :func:`expert_lora`.
    """
    out: dict[str, ExpertLora] = {}
    for key in [k for k in pairs if cfg.get("target_parameters")]:
        target = resolve(path, cfg, key, table)
        if target is None:
            continue
        ab = pairs.pop(key)
        if set(ab) != {"A", "B"}:
            raise InputError(f"adapter {path}: {key} has only lora_{next(iter(ab))}; the adapter file is incomplete")
        x = expert_lora(path, *target, table, tuple(entries[ab["A"]].shape), tuple(entries[ab["B"]].shape),
                        (ab["A"], ab["B"]), scale_of)
        out[x.name] = x
    return out


def expert_factors(x: ExpertLora, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's factors in the ``[E, out, in]`` view: ``A_e`` as ``[E, r, in]`` and ``B_e`` as
    ``[E, out, r]`` (PEFT's interleaved columns gathered), in ``a``'s dtype.

    Args:
        a: ``lora_A [r·E, in]``.
        b: ``lora_B [out, r·E]``.
    """
    r = a.shape[0] // x.experts
    return a.reshape(x.experts, r, x.inp), b.reshape(x.out, r, x.experts).permute(2, 0, 1).contiguous()


def delta_rows(x: ExpertLora, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``scale · B_e A_e`` of every expert as rows ``[E·out, in]`` (the ``[E, out, in]`` view), fp32
    (``a``, ``b``: as :func:`expert_factors`)."""
    a3, b3 = expert_factors(x, a.float(), b.float())
    return (x.scale * torch.bmm(b3, a3)).reshape(x.experts * x.out, x.inp)


def merged_param(weight: torch.Tensor, x: ExpertLora, rows: torch.Tensor) -> torch.Tensor:
    """The experts parameter ``weight`` (its storage layout) plus ``rows`` (:func:`delta_rows`),
    computed in fp32 and cast back (what PEFT's merge does)."""
    delta = rows.reshape(x.experts, x.out, x.inp)
    if x.transposed:
        delta = delta.transpose(1, 2)
    return (weight.float() + delta).to(weight.dtype)
