"""The chunked container: one tensor part's bytes as independently decodable GDeflate chunks.

Layout of a container (see docs/format.md, "Lossless stage"):

- ``stored``: uint8 ``[stored_nbytes]``, the compressed chunks back to back. Chunk ``i`` starts at
  ``offsets[i]``, where ``offsets[0] = 0`` and ``offsets[i] = align_up(offsets[i-1] + sizes[i-1],
  align)``; the gap bytes are zero. ``stored_nbytes = offsets[-1] + sizes[-1]`` (0 with no chunks).
  Aligned starts let nvCOMP decode chunks in place on a GPU.
- the metadata (a JSON object in the manifest), fields:

  ``codec`` ("gdeflate"), ``level`` (0..12, informative), ``filter`` ("none" or "bytegroup"),
  ``dtype`` (torch dtype name of the part), ``shape`` (list of ints), ``nbytes`` (uncompressed bytes =
  numel x element size), ``chunk_bytes`` (1..65536; chunk ``i`` holds uncompressed bytes
  ``[i*chunk_bytes, min((i+1)*chunk_bytes, nbytes))``), ``align`` (power of two 1..4096),
  ``chunks`` (compressed size of every chunk, ``ceil(nbytes / chunk_bytes)`` ints, each
  1..``MAX_CHUNK_STORED``), ``checksum`` (``"xxh3-128:<hex>"`` of the uncompressed bytes; GDeflate
  has no checksum of its own), ``stored_checksum`` (``"xxh3-128:<hex>"`` of ``stored``).

The ``bytegroup`` filter runs before compression: the bytes, seen as ``[numel, w]`` for an element
size ``w``, are transposed to ``[w, numel]`` (all first bytes, then all second bytes, ...). It helps
where the bytes of an element have different statistics (the exponent byte of a float).

Nothing reaches native code before ``validate`` accepted the metadata and the stored bytes matched
``stored_checksum``: the GDeflate decoders assume valid input.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from deltazip.formats import gdeflate
from deltazip.formats.dtypes import ST_OF_NAME, ST_SIZES, parse_dtype

CODECS = ("gdeflate",)
FILTERS = ("none", "bytegroup")
DEFAULT_ALIGN = 16
_HASH_RE = re.compile(r"^xxh3-128:[0-9a-f]{32}$")
_FIELDS = ("codec", "level", "filter", "dtype", "shape", "nbytes", "chunk_bytes", "align", "chunks", "checksum",
           "stored_checksum")


class ContainerError(ValueError):
    """A container whose metadata or bytes are inconsistent (message names what is off)."""


def xxh3(data) -> str:
    """``xxh3-128:<hex>`` of bytes-like ``data``."""
    return "xxh3-128:" + xxhash.xxh3_128_hexdigest(data)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def element_size(dtype: str) -> int:
    return ST_SIZES[ST_OF_NAME[dtype]]


@dataclass(frozen=True)
class Container:
    """Validated metadata of one container (build with ``from_json``)."""

    level: int
    filter: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunk_bytes: int
    align: int
    sizes: np.ndarray  # int64 [n_chunks]
    offsets: np.ndarray  # int64 [n_chunks]
    checksum: str
    stored_checksum: str
    codec: str = "gdeflate"

    @property
    def stored_nbytes(self) -> int:
        return int(self.offsets[-1] + self.sizes[-1]) if len(self.sizes) else 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {"codec": self.codec, "level": self.level, "filter": self.filter, "dtype": self.dtype,
                "shape": list(self.shape), "nbytes": self.nbytes, "chunk_bytes": self.chunk_bytes,
                "align": self.align, "chunks": [int(s) for s in self.sizes], "checksum": self.checksum,
                "stored_checksum": self.stored_checksum}

    @staticmethod
    def from_json(meta: Any) -> Container:
        """Check every field's type and range and the chunk table's consistency.

        Raises:
            ContainerError: naming the first field that is off.
        """
        if not isinstance(meta, dict):
            raise ContainerError("container metadata is not an object")
        missing = [k for k in _FIELDS if k not in meta]
        if missing:
            raise ContainerError(f"container metadata lacks {', '.join(missing)}")
        if meta["codec"] not in CODECS:
            raise ContainerError(f"unknown codec {meta['codec']!r} (this deltazip knows {', '.join(CODECS)}); "
                                 "upgrade deltazip")
        if meta["filter"] not in FILTERS:
            raise ContainerError(f"unknown filter {meta['filter']!r} (known: {', '.join(FILTERS)}); upgrade deltazip")
        if meta["dtype"] not in ST_OF_NAME:
            raise ContainerError(f"unknown dtype {meta['dtype']!r}")
        for k in ("level", "nbytes", "chunk_bytes", "align"):
            if not _is_int(meta[k]) or meta[k] < 0:
                raise ContainerError(f"field {k!r} is not a non-negative integer ({meta[k]!r})")
        if not gdeflate.MIN_LEVEL <= meta["level"] <= gdeflate.MAX_LEVEL:
            raise ContainerError(f"level {meta['level']} outside {gdeflate.MIN_LEVEL}..{gdeflate.MAX_LEVEL}")
        cb, align, nbytes = meta["chunk_bytes"], meta["align"], meta["nbytes"]
        if not 1 <= cb <= gdeflate.PAGE_BYTES:
            raise ContainerError(f"chunk_bytes {cb} outside 1..{gdeflate.PAGE_BYTES}")
        if not 1 <= align <= 4096 or align & (align - 1):
            raise ContainerError(f"align {align} is not a power of two in 1..4096")
        shape = meta["shape"]
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise ContainerError(f"shape {shape!r} is not a list of non-negative integers")
        esize = element_size(meta["dtype"])
        if math.prod(shape) * esize != nbytes:
            raise ContainerError(f"nbytes {nbytes} != {math.prod(shape)} elements x {esize} bytes ({meta['dtype']})")
        for k in ("checksum", "stored_checksum"):
            if not isinstance(meta[k], str) or not _HASH_RE.match(meta[k]):
                raise ContainerError(f"field {k!r} is not 'xxh3-128:<32 hex digits>'")
        chunks = meta["chunks"]
        want = -(-nbytes // cb)
        if not isinstance(chunks, list) or len(chunks) != want:
            raise ContainerError(f"chunk table has {len(chunks) if isinstance(chunks, list) else 'no'} entries, "
                                 f"{want} expected for {nbytes} bytes in chunks of {cb}")
        if not all(_is_int(s) and 1 <= s <= gdeflate.MAX_CHUNK_STORED for s in chunks):
            bad = next(i for i, s in enumerate(chunks) if not (_is_int(s) and 1 <= s <= gdeflate.MAX_CHUNK_STORED))
            raise ContainerError(f"chunk {bad} has compressed size {chunks[bad]!r}, outside "
                                 f"1..{gdeflate.MAX_CHUNK_STORED}")
        sizes = np.asarray(chunks, dtype=np.int64)
        return Container(level=meta["level"], filter=meta["filter"], dtype=meta["dtype"], shape=tuple(shape),
                         nbytes=nbytes, chunk_bytes=cb, align=align, sizes=sizes,
                         offsets=chunk_offsets(sizes, align), checksum=meta["checksum"],
                         stored_checksum=meta["stored_checksum"], codec=meta["codec"])

    def check_stored(self, stored) -> None:
        """Length and checksum of the stored bytes; run before any byte reaches a decoder."""
        n = memoryview(stored).nbytes
        if n != self.stored_nbytes:
            raise ContainerError(f"stored bytes are {n}, the chunk table needs {self.stored_nbytes} (truncated "
                                 "or padded container)")
        if xxh3(stored) != self.stored_checksum:
            raise ContainerError("checksum mismatch of the compressed bytes (corrupt container)")


def chunk_offsets(sizes: np.ndarray, align: int) -> np.ndarray:
    """Start of every chunk: each previous end rounded up to ``align``. int64 ``[n]``."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if not len(sizes):
        return np.zeros(0, dtype=np.int64)
    padded = -(-sizes // align) * align
    return np.concatenate([[0], np.cumsum(padded[:-1])]).astype(np.int64)


def _group(raw: np.ndarray, width: int) -> np.ndarray:
    """``[n, width]`` bytes -> ``[width, n]`` (byte plane ``k`` = byte ``k`` of every element)."""
    return np.ascontiguousarray(raw.reshape(-1, width).T).reshape(-1)


def _ungroup(data: np.ndarray, width: int) -> np.ndarray:
    """Inverse of ``_group``."""
    return np.ascontiguousarray(data.reshape(width, -1).T).reshape(-1)


def tensor_u8(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a CPU tensor as a 1-D uint8 numpy array (zero-copy view of a contiguous tensor)."""
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def encode(t: torch.Tensor, level: int = gdeflate.DEFAULT_LEVEL, filter: str = "none",
           chunk_bytes: int = gdeflate.PAGE_BYTES, align: int = DEFAULT_ALIGN) -> tuple[np.ndarray, dict[str, Any]]:
    """Compress one tensor into a container.

    Args:
        t: any dtype in the container's dtype list; its raw little-endian bytes are stored.
        level: GDeflate level 0..12.
        filter: "none" or "bytegroup" (byte planes of the element width).
    Returns:
        (stored uint8 ``[stored_nbytes]``, metadata dict as written to the manifest).
    """
    name = str(t.dtype).removeprefix("torch.")
    if name not in ST_OF_NAME:
        raise ValueError(f"dtype {name} cannot be stored in a chunked container")
    if filter not in FILTERS:
        raise ValueError(f"unknown filter {filter!r}; use one of {FILTERS}")
    raw = tensor_u8(t)
    width = t.element_size()
    data = _group(raw, width) if filter == "bytegroup" and width > 1 and raw.size else raw
    blobs, sizes = gdeflate.compress_chunks(data, level, chunk_bytes)
    offsets = chunk_offsets(sizes, align)
    total = int(offsets[-1] + sizes[-1]) if len(sizes) else 0
    stored = np.zeros(total, dtype=np.uint8)
    flat = np.frombuffer(b"".join(blobs), dtype=np.uint8) if blobs else np.zeros(0, dtype=np.uint8)
    pos = 0
    for off, s in zip(offsets.tolist(), sizes.tolist()):
        stored[off:off + s] = flat[pos:pos + s]
        pos += s
    meta = Container(level=level, filter=filter, dtype=name, shape=tuple(t.shape), nbytes=raw.size,
                     chunk_bytes=chunk_bytes, align=align, sizes=sizes, offsets=offsets, checksum=xxh3(raw),
                     stored_checksum=xxh3(stored)).to_json()
    return stored, meta


def decode(meta: dict[str, Any] | Container, stored, device: torch.device | str | None = None,
           verify: bool = True) -> torch.Tensor:
    """Rebuild the tensor from its container.

    Args:
        meta: the manifest metadata (validated here) or a Container.
        stored: the stored bytes (bytes-like / numpy uint8 / uint8 CPU tensor).
        device: None or "cpu" decodes with the CPU library; a CUDA device decodes with nvCOMP there.
        verify: check the uncompressed checksum (always on CPU; on a GPU it costs a copy back).
    Returns:
        Tensor of the container's dtype and shape on ``device``.
    Raises:
        ContainerError: bad metadata, wrong stored length or checksum, a chunk that does not decode,
            or decoded bytes whose checksum differs.
    """
    c = meta if isinstance(meta, Container) else Container.from_json(meta)
    if isinstance(stored, torch.Tensor):
        if stored.dtype != torch.uint8 or stored.dim() != 1:
            raise ContainerError(f"stored tensor is {stored.dtype} {list(stored.shape)}, expected 1-D uint8")
        stored = tensor_u8(stored)
    stored = np.frombuffer(stored, dtype=np.uint8) if not isinstance(stored, np.ndarray) else stored
    c.check_stored(stored)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    width = element_size(c.dtype)
    grouped = c.filter == "bytegroup" and width > 1 and c.nbytes > 0
    try:
        if dev.type == "cuda":
            out_t = gdeflate.gpu_decompress_chunks(stored, c.offsets, c.sizes, c.nbytes, c.chunk_bytes, dev)
            if grouped:
                out_t = out_t.reshape(width, -1).t().contiguous().reshape(-1)
            if verify and xxh3(out_t.cpu().numpy()) != c.checksum:
                raise ContainerError("checksum mismatch of the decoded bytes")
        else:
            out = gdeflate.decompress_chunks(stored, c.offsets, c.sizes, c.nbytes, c.chunk_bytes)
            if grouped:
                out = _ungroup(out, width)
            if xxh3(out) != c.checksum:
                raise ContainerError("checksum mismatch of the decoded bytes")
            out_t = torch.from_numpy(out)
    except gdeflate.ChunkDecodeError as e:
        where = f"chunk {e.index} of {len(c.sizes)}" if e.index >= 0 else f"a chunk of {len(c.sizes)}"
        raise ContainerError(f"{where} does not decode ({e.reason})") from e
    return out_t.view(c.torch_dtype).reshape(c.shape) if c.nbytes else torch.empty(c.shape, dtype=c.torch_dtype,
                                                                                    device=out_t.device)
