"""Kind ``dense_delta``: ``base + delta`` with the delta stored densely, one ``delta`` part (float16
unless the tensor is wider; its dtype in the entry's ``delta_dtype``)."""

from __future__ import annotations

import torch

from deltazip.formats.codecs.base import Codec, Entry, dtype_name, parse_dtype, part_problem, register


class DenseDeltaCodec(Codec):
    kind = "dense_delta"
    parts = ("delta",)
    relative_to_base = True

    def additive(self, entry: Entry) -> bool:
        return True

    def fields(self, delta: torch.Tensor, dtype: torch.dtype) -> dict:
        """A new entry's fields; ``delta`` in its storage dtype (e.g. fp16), the tensor's own ``dtype``."""
        return {"kind": self.kind, "shape": list(delta.shape), "dtype": dtype_name(dtype),
                "delta_dtype": dtype_name(delta.dtype)}

    def layout_problems(self, entry: Entry, parts) -> list[str]:
        try:
            want = parse_dtype(entry.raw.get("delta_dtype"))
        except Exception:  # a missing or unknown name: reported as a mismatch below
            want = None
        if want is None:
            return [f"delta_dtype {entry.raw.get('delta_dtype')!r} is not a dtype"]
        problem = part_problem(entry, parts, "delta", entry.shape, want)
        return [problem] if problem else []

    def reconstruct(self, src, entry: Entry, base: torch.Tensor | None, device) -> torch.Tensor:
        base = self.check_base(entry, base, entry.shape)
        delta = src.parts(entry.name, device)["delta"].float()
        return (base.float() + delta.to(base.device)).to(entry.dtype)


register(DenseDeltaCodec())
