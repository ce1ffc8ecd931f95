"""Checksums: sha256 of files and of tensor bytes, and the fingerprint of a set of tensors."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import xxhash

_CHUNK = 8 * 1024 * 1024


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a CPU tensor in its own dtype (no conversion), as a zero-copy view."""
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def sha256_file(path: str | Path) -> str:
    """``sha256:<hex>`` of a whole file, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def sha256_tensors(*tensors: torch.Tensor | None) -> str:
    """``sha256:<hex>`` over the concatenated raw bytes of the given tensors (None skipped)."""
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(tensor_bytes(t))
    return "sha256:" + h.hexdigest()


class CheckpointFingerprint:
    """Order-independent fingerprint of named tensors: xxh3-128 over sorted (name, dtype, shape, hash).

    Fast enough to run over a whole base checkpoint at load time (bounded by reading the bytes),
    it answers "is this the base the artifact was made against?", not a security question.
    """

    def __init__(self) -> None:
        self._items: dict[str, str] = {}

    def add(self, name: str, dtype: str, shape: tuple[int, ...], data: memoryview | bytes) -> None:
        self.add_digest(name, dtype, shape, xxhash.xxh3_128_hexdigest(data))

    def add_digest(self, name: str, dtype: str, shape: tuple[int, ...], hexdigest: str) -> None:
        """``add`` with the tensor bytes' xxh3-128 hex digest computed by the caller (streamed)."""
        self._items[name] = f"{dtype}|{','.join(map(str, shape))}|{hexdigest}"

    def hexdigest(self) -> str:
        h = xxhash.xxh3_128()
        for name in sorted(self._items):
            h.update(f"{name}|{self._items[name]}\n".encode())
        return "xxh3-128:" + h.hexdigest()
