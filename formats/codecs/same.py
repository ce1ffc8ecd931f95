"""Kind ``same``: bit-identical to the base tensor of the same name; nothing stored."""

from __future__ import annotations

import torch

from deltazip.formats.codecs.base import Codec, Entry, dtype_name, register


class SameCodec(Codec):
    kind = "same"
    stores_bytes = False
    relative_to_base = True
    equals_base = True

    def fields(self, shape, dtype: torch.dtype) -> dict:
        return {"kind": self.kind, "shape": list(shape), "dtype": dtype_name(dtype), "stored_bytes": 0}

    def reconstruct(self, src, entry: Entry, base: torch.Tensor | None, device) -> torch.Tensor:
        return self.check_base(entry, base, entry.shape).to(entry.dtype)


register(SameCodec())
