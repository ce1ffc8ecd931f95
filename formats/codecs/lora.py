"""Kind ``lora``: a LoRA adapter's factors of one linear, a *variant* kind (a PEFT adapter directory
served as a variant, ``deltazip.runtime.serve.lora_variant``), never an artifact manifest entry.

Parts ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``, floating point and finite; the entry's
``shape`` is the linear's ``[out, in]`` and ``scale`` its ``alpha / r`` (PEFT's rules). The delta is
``scale · B A``, applied per row by ``deltazip.kernels.dispatch.lora`` or merged into the weight.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deltazip.formats.codecs.base import Codec, Entry, register


class LoraCodec(Codec):
    kind = "lora"
    parts = ("lora_A", "lora_B")
    relative_to_base = True
    variant_only = True

    def additive(self, entry: Entry) -> bool:
        return True

    def layout_problems(self, entry: Entry, parts: Mapping[str, torch.Tensor]) -> list[str]:
        out = []
        for p in self.parts:
            t = parts.get(p)
            if t is None or not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                out.append(f"{p} is not a finite floating-point tensor")
        if out:
            return out
        a, b = parts["lora_A"], parts["lora_B"]
        o, i = entry.shape
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != i or b.shape[0] != o or a.shape[0] != b.shape[1]:
            return [f"lora_A {list(a.shape)} and lora_B {list(b.shape)} do not factor a [{o}, {i}] linear"]
        return []

    @staticmethod
    def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
        """``W + scale · B A`` (``[out, in]``), computed in fp32 and cast back (what PEFT's merge does)."""
        return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)

    def reconstruct(self, src, entry: Entry, base: torch.Tensor | None, device) -> torch.Tensor:
        base = self.check_base(entry, base, entry.shape)
        p = src.parts(entry.name, device)
        return self.merge(base, p["lora_A"], p["lora_B"], float(entry.raw["scale"]))


register(LoraCodec())
