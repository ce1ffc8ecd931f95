"""Kind ``drop``: the delta was left out (``--target-ratio``); the tensor is rebuilt as the base's.

The byte allocator (deltazip.compress.allocation) gives every compressed tensor one setting from its
measured error-vs-bytes curve; for a tensor whose delta changes the calibration outputs least per
byte, storing nothing can be the best use of the budget. Unlike ``same`` (bit-identical to the base,
exact), ``drop`` is lossy: the manifest's ``allocation`` records the error it was measured to cost.
Nothing is stored; rebuilding reads the base tensor of the entry's name, and a served variant adds no
delta for it.
"""

from __future__ import annotations

import torch

from deltazip.formats.codecs.base import Codec, Entry, dtype_name, register


class DropCodec(Codec):
    kind = "drop"
    stores_bytes = False
    relative_to_base = True
    equals_base = True

    def fields(self, shape, dtype: torch.dtype) -> dict:
        return {"kind": self.kind, "shape": list(shape), "dtype": dtype_name(dtype), "stored_bytes": 0}

    def reconstruct(self, src, entry: Entry, base: torch.Tensor | None, device) -> torch.Tensor:
        return self.check_base(entry, base, entry.shape).to(entry.dtype)


register(DropCodec())
