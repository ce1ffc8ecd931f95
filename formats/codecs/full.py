"""Kind ``full``: the fine-tuned tensor stored as it is, one ``data`` part (a tensor the base lacks, a
changed shape, or the smallest exact form)."""

from __future__ import annotations

import torch

from deltazip.formats.codecs.base import Codec, Entry, dtype_name, part_problem, register


class FullCodec(Codec):
    kind = "full"
    parts = ("data",)

    def fields(self, tensor: torch.Tensor) -> dict:
        return {"kind": self.kind, "shape": list(tensor.shape), "dtype": dtype_name(tensor.dtype)}

    def layout_problems(self, entry: Entry, parts) -> list[str]:
        problem = part_problem(entry, parts, "data", entry.shape, entry.dtype)
        return [problem] if problem else []

    def reconstruct(self, src, entry: Entry, base: torch.Tensor | None, device) -> torch.Tensor:
        return src.parts(entry.name, device)["data"]


register(FullCodec())
