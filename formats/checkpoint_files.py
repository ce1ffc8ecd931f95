"""Resolve a checkpoint argument into weight files and read their tensor tables without torch.

A checkpoint is any of:

- a single ``.safetensors`` file;
- a Hugging Face model directory, single file (``model.safetensors``) or sharded
  (``model.safetensors.index.json`` + ``model-0000i-of-0000n.safetensors``);
- a diffusers pipeline directory (``model_index.json`` and one sub-folder per component, each a
  model directory as above); tensor names are qualified as ``<component>/<name>``;
- a GGUF file (or a directory of GGUF files), read through the optional ``gguf`` package.

Resolution never guesses silently: files that exist but are not used (another dtype variant such
as ``diffusion_pytorch_model.fp16.safetensors`` next to the default one, or a ``consolidated``
file next to an index) are listed in :attr:`CheckpointFiles.skipped`. Every problem is an
:class:`InputError` naming the file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from deltazip.formats.errors import InputError
from deltazip.formats.safetensors_raw import TensorEntry, read_table

_SHARD_RE = re.compile(r"-\d{5}-of-\d{5}$")
_GGUF_SPLIT_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class WeightFile:
    """One file of weights.

    Attributes:
        path: the file.
        component: "" for a plain model; the diffusers sub-folder (``text_encoder``) or, for a
            directory of unrelated GGUF files, the file stem. Tensor names get ``component/``.
        format: ``"safetensors"`` or ``"gguf"``.
    """

    path: Path
    component: str = ""
    format: str = "safetensors"


@dataclass(frozen=True)
class CheckpointFiles:
    """A resolved checkpoint argument.

    Attributes:
        path: the argument as given.
        kind: ``safetensors-file``, ``hf-dir``, ``hf-sharded``, ``diffusers``, ``gguf``.
        files: weight files in a stable order (component, then file name).
        skipped: weight files present but deliberately not read (other variants, duplicates of
            an index's shards).
    """

    path: Path
    kind: str
    files: tuple[WeightFile, ...]
    skipped: tuple[Path, ...] = field(default_factory=tuple)


def resolve_checkpoint(path: str | Path) -> CheckpointFiles:
    """Find the weight files of one checkpoint argument (see the module docstring).

    Raises:
        InputError: missing path, a pickle checkpoint, a directory without weights, an index
            that names missing shards or is not valid JSON.
    """
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file or directory")
    if p.is_file():
        return _resolve_file(p)
    if not p.is_dir():
        raise InputError(f"{p}: not a regular file or directory")
    files, skipped, sharded = _weights_in_dir(p, component="")
    if (p / "model_index.json").is_file():
        # A diffusers pipeline: every sub-folder with weights is a component.
        for sub in sorted(d for d in p.iterdir() if d.is_dir() and not d.name.startswith(".")):
            f, s, _ = _weights_in_dir(sub, component=sub.name)
            files += f
            skipped += s
        if not files:
            raise InputError(f"{p}: diffusers pipeline (model_index.json) without any *.safetensors "
                             "weights in its component folders")
        return CheckpointFiles(p, "diffusers", tuple(files), tuple(skipped))
    if files:
        return CheckpointFiles(p, "hf-sharded" if sharded else "hf-dir", tuple(files), tuple(skipped))
    ggufs = sorted(q for q in p.iterdir() if q.is_file() and q.suffix == ".gguf")
    if ggufs:
        split = all(_GGUF_SPLIT_RE.search(q.name) for q in ggufs)
        comps = [""] * len(ggufs) if (split or len(ggufs) == 1) else [q.stem for q in ggufs]
        return CheckpointFiles(p, "gguf", tuple(WeightFile(q, c, "gguf") for q, c in zip(ggufs, comps)))
    pickles = sorted(q.name for q in p.iterdir() if q.suffix in _PICKLE_SUFFIXES)
    hint = (f" (found {', '.join(pickles[:3])}: pickle checkpoints are not read; convert them to "
            "safetensors)") if pickles else ""
    raise InputError(f"{p}: no weights found (no *.safetensors, no diffusers components, no *.gguf){hint}")


def _resolve_file(p: Path) -> CheckpointFiles:
    if p.suffix in _PICKLE_SUFFIXES:
        raise InputError(f"{p}: pickle checkpoints are not read; convert it to safetensors")
    if p.name.endswith(".index.json"):
        files, skipped = _files_from_index(p, component="")
        return CheckpointFiles(p, "hf-sharded", tuple(files), tuple(skipped))
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise InputError(f"{p}: cannot read ({e.strerror or e})") from e
    if magic == b"GGUF":
        return CheckpointFiles(p, "gguf", (WeightFile(p, "", "gguf"),))
    if p.suffix == ".gguf":
        raise InputError(f"{p}: not a GGUF file (bad magic {magic!r})")
    # Anything else must be safetensors; read_table validates it later and names the file.
    return CheckpointFiles(p, "safetensors-file", (WeightFile(p, "", "safetensors"),))


def _variant_of(name: str) -> str:
    """``model.fp16-00001-of-00002.safetensors`` -> "fp16"; ``model.safetensors`` -> ""."""
    stem = _SHARD_RE.sub("", name[: -len(".safetensors")])
    return stem.rsplit(".", 1)[1] if "." in stem else ""


def _index_variant(name: str) -> str:
    """``model.safetensors.index.json`` -> ""; ``x.safetensors.index.fp16.json`` -> "fp16"."""
    rest = name.split(".safetensors.index", 1)[1]  # ".json" or ".fp16.json"
    return rest[1:-len(".json")] if rest != ".json" else ""


def _weights_in_dir(d: Path, component: str) -> tuple[list[WeightFile], list[Path], bool]:
    """(files to read, files skipped, sharded?) of one model directory (not recursive)."""
    try:
        entries = sorted(d.iterdir())
    except OSError as e:
        raise InputError(f"{d}: cannot list directory ({e.strerror or e})") from e
    st = [q for q in entries if q.name.endswith(".safetensors") and q.is_file()]
    idx = [q for q in entries if ".safetensors.index" in q.name and q.name.endswith(".json") and q.is_file()]
    if not st and not idx:
        return [], [], False
    by_variant: dict[str, list[Path]] = {}
    for q in st:
        by_variant.setdefault(_variant_of(q.name), []).append(q)
    idx_by_variant: dict[str, list[Path]] = {}
    for q in idx:
        idx_by_variant.setdefault(_index_variant(q.name), []).append(q)
    variants = sorted(set(by_variant) | set(idx_by_variant))
    # The default (no-variant) weights win; otherwise the first variant in name order.
    chosen = "" if "" in variants else variants[0]
    if idx_by_variant.get(chosen):
        files: list[WeightFile] = []
        for q in idx_by_variant[chosen]:
            f, _ = _files_from_index(q, component)
            files += f
        used = {w.path for w in files}
        skipped = [q for q in st if q not in used]
        return files, skipped, True
    files = [WeightFile(q, component) for q in by_variant.get(chosen, [])]
    skipped = [q for q in st if _variant_of(q.name) != chosen]
    return files, skipped, len(files) > 1


def _files_from_index(index: Path, component: str) -> tuple[list[WeightFile], list[Path]]:
    """Shard files named by a ``*.safetensors.index.json`` weight map, validated to exist."""
    try:
        doc = json.loads(index.read_text())
    except OSError as e:
        raise InputError(f"{index}: cannot read ({e.strerror or e})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{index}: shard index is not valid JSON ({e})") from e
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise InputError(f"{index}: shard index has no valid 'weight_map' object")
    names = sorted(set(wmap.values()))
    for n in names:
        if not (index.parent / n).is_file():
            raise InputError(f"{index}: shard {n!r} listed in weight_map is missing")
    return [WeightFile(index.parent / n, component) for n in names], []


def read_weight_table(wf: WeightFile) -> dict[str, TensorEntry]:
    """Tensor table of one weight file, names NOT yet qualified by component.

    Returns:
        name -> TensorEntry with absolute byte offsets in ``wf.path``. For GGUF the dtype is the
        GGML type name (``F16``, ``Q4_K``...) and the shape is in row-major order (GGUF stores
        it reversed).
    Raises:
        InputError: corrupt header/table, offsets past end of file, overlapping ranges.
    """
    if wf.format == "gguf":
        return read_gguf_table(wf.path)
    entries, _ = read_table(wf.path)
    return entries


def read_gguf_table(path: str | Path) -> dict[str, TensorEntry]:
    """Tensor table of a GGUF file through the ``gguf`` package (the ``deltazip[gguf]`` extra)."""
    path = Path(path)
    try:
        import gguf  # optional: only GGUF checkpoints need it
    except ImportError as e:
        raise InputError(f"{path}: reading GGUF needs the 'gguf' package (pip install 'deltazip[gguf]')") from e
    try:
        size = path.stat().st_size
        reader = gguf.GGUFReader(path, "r")
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from e
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError/IndexError/struct.error on corrupt files
        raise InputError(f"{path}: corrupt GGUF file ({type(e).__name__}: {e})") from e
    entries: dict[str, TensorEntry] = {}
    for t in reader.tensors:
        start, nbytes = int(t.data_offset), int(t.n_bytes)
        if start + nbytes > size:
            raise InputError(f"{path}: tensor {t.name!r} offsets [{start}, {start + nbytes}) point past the end "
                             "of the file")
        if t.name in entries:
            raise InputError(f"{path}: tensor {t.name!r} appears twice in the GGUF tensor table")
        shape = tuple(int(s) for s in reversed(list(t.shape)))
        entries[t.name] = TensorEntry(t.name, t.tensor_type.name, shape, start, start + nbytes)
    spans = sorted((e.start, e.end, e.name) for e in entries.values() if e.end > e.start)
    for (_, e1, n1), (s2, _, n2) in zip(spans, spans[1:]):
        if s2 < e1:
            raise InputError(f"{path}: tensors {n1!r} and {n2!r} have overlapping byte ranges")
    del reader  # drop the np.memmap before the caller re-opens the file
    return entries
