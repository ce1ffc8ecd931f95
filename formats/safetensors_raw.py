"""Read safetensors tables and raw tensor bytes without torch (header -> offsets -> mmap).

Used where bytes matter and dtypes must not be converted: fingerprints of a base checkpoint and
dedup scans. Every malformed file is reported as an InputError naming the file.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from deltazip.formats.dtypes import ST_SIZES
from deltazip.formats.errors import InputError

_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: absolute byte range ``[start, end)`` in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_table(path: str | Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parse and validate a safetensors header.

    Returns:
        (entries by name with absolute offsets, the ``__metadata__`` dict).
    Raises:
        InputError: unreadable file, bad header JSON, unknown dtype, offsets past the end of the
            file, sizes that disagree with shape x dtype, or overlapping ranges.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InputError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > min(_MAX_HEADER, size - 8):
                raise InputError(f"{path}: not a safetensors file (header length {hlen} past end of file)")
            raw = f.read(hlen)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from e
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: corrupt safetensors header (not valid JSON: {e})") from e
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    data_start = 8 + hlen
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise InputError(f"{path}: corrupt safetensors header entry for tensor {name!r}") from err
        if dtype not in ST_SIZES:
            raise InputError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        numel = 1
        for s in shape:
            numel *= s
        if not (0 <= b <= e) or data_start + e > size:
            raise InputError(f"{path}: tensor {name!r} offsets [{b}, {e}) point past the end of the file")
        if e - b != numel * ST_SIZES[dtype] and dtype != "F4":
            raise InputError(f"{path}: tensor {name!r} has {e - b} bytes but shape {list(shape)} {dtype} needs "
                             f"{numel * ST_SIZES[dtype]}")
        entries[name] = TensorEntry(name, dtype, shape, data_start + b, data_start + e)
    spans = sorted((t.start, t.end, t.name) for t in entries.values() if t.end > t.start)
    for (_, e1, n1), (s2, _, n2) in zip(spans, spans[1:]):
        if s2 < e1:
            raise InputError(f"{path}: tensors {n1!r} and {n2!r} have overlapping byte ranges")
    return entries, dict(meta)


class RawFile:
    """A memory-mapped safetensors file giving zero-copy views of tensor bytes.

    Views handed out by :meth:`view` are released by :meth:`close`: using one afterwards raises
    ``ValueError`` instead of touching unmapped memory. If something else still holds a buffer
    export (e.g. a numpy array made from a view), the mapping is left to the garbage collector,
    which unmaps it once that last export is gone, instead of ``close`` failing with BufferError.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.entries, self.metadata = read_table(self.path)
        try:
            self._f = open(self.path, "rb")
        except OSError as e:
            raise InputError(f"{self.path}: cannot read ({e.strerror or e})") from e
        size = self.path.stat().st_size
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self._base = memoryview(self._mm) if self._mm is not None else None
        self._views: list[memoryview] = []

    def view(self, name: str) -> memoryview:
        """Raw bytes of one tensor (read-only, valid while the file is open)."""
        t = self.entries[name]
        if self._base is None or t.nbytes == 0:
            return memoryview(b"")
        v = self._base[t.start:t.end]
        self._views.append(v)
        return v

    def close(self) -> None:
        for v in self._views:
            try:
                v.release()
            except BufferError:  # re-exported (numpy/torch holds it): it keeps the map alive
                pass
        self._views.clear()
        if self._base is not None:
            try:
                self._base.release()
            except BufferError:
                pass
            self._base = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # an outside export is still alive; the GC unmaps when it goes
            self._mm = None
        self._f.close()

    def __enter__(self) -> RawFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sort_metadata(path: str | Path) -> bool:
    """Rewrite, in place, the ``__metadata__`` object of a safetensors file that this process just wrote
    with its keys sorted; returns whether the header changed.

    safetensors (0.8) serializes the metadata dict from a hash map whose order changes from process to
    process, so two compressions of the same inputs wrote files that differed in those bytes alone.
    Sorting keeps the header's length (the same keys and values, compact JSON) and nothing else moves.
    A header whose metadata is not a flat first object is left as it is."""
    path = Path(path)
    with open(path, "r+b") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        raw = f.read(hlen)
        lead = b'{"__metadata__":'
        end = raw.find(b"}", len(lead))
        if not raw.startswith(lead) or end < 0:
            return False
        span = raw[len(lead):end + 1]
        try:
            meta = json.loads(span)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return False
        canon = json.dumps(meta, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()
        if not isinstance(meta, dict) or len(canon) != len(span) or canon == span:
            return False
        f.seek(8 + len(lead))
        f.write(canon)
    return True
