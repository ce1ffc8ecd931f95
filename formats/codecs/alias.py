"""Kind ``alias`` (format v2): the same tensor as entry ``of`` (tied weights stored once); nothing stored.

The writer emits it only when both the fine-tune's and the base's two tensors are bit-identical, so
rebuilding reads the base tensor of ``of``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from deltazip.formats.codecs.base import Codec, Entry, dtype_name, register


class AliasCodec(Codec):
    kind = "alias"
    stores_bytes = False
    relative_to_base = True

    def fields(self, of: str, shape, dtype: torch.dtype) -> dict:
        return {"kind": self.kind, "of": of, "shape": list(shape), "dtype": dtype_name(dtype), "stored_bytes": 0}

    def field_problems(self, name: str, raw: Mapping[str, Any]) -> list[str]:
        if not isinstance(raw.get("of"), str) or raw["of"] == name:
            return [f"tensor {name!r}: alias entry without the name of another tensor in 'of'"]
        return []

    def manifest_problems(self, entry: Entry, tensors: Mapping[str, Mapping[str, Any]]) -> list[str]:
        target = tensors.get(entry.of)
        if target is None or target.get("kind") == self.kind or target.get("shape") != list(entry.shape):
            return [f"tensor {entry.name!r}: alias of {entry.of!r}, which is not a non-alias entry of the same shape"]
        return []

    def reconstruct(self, src, entry: Entry, base: torch.Tensor | None, device) -> torch.Tensor:
        return src.reconstruct(entry.of, base)


register(AliasCodec())
