"""What can be served as a variant, found on disk: artifacts, full checkpoints and LoRA adapters.

Under the served directory (``deltazip serve ARTIFACTS``) every subdirectory of one of these kinds is
a variant named after its directory:

- ``artifact``: a deltazip artifact (``manifest.json``);
- ``lora``: a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``,
  ``deltazip.runtime.serve.lora_variant``);
- ``full``: a plain Hugging Face checkpoint (``config.json`` + safetensors), e.g. a merged fine-tune
  or an A/B copy, served without a compression step. :func:`compare_full_checkpoint` compares it
  tensor by tensor with the base from the safetensors bytes (the fingerprints of
  ``deltazip dedup-scan``): equal tensors are recorded ``same`` and served from the base's copy,
  the others ``full`` (replaced per row in delta mode, a whole model in swap mode).

Everything nested in a variant's directory belongs to it (an artifact's ``hf/``); hidden directories
are skipped. :func:`resolve_inside` turns a path given over HTTP into one that is guaranteed to lie
inside the served directory (no ``..`` traversal, no symlink leading out).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from deltazip.formats.artifact import MANIFEST, Artifact, file_problem
from deltazip.formats.codecs import Entry, entries
from deltazip.formats.dtypes import ST_FLOATS, ST_TO_TORCH, dtype_name
from deltazip.formats.errors import ArtifactError, InputError
from deltazip.models.checkpoint import Checkpoint
from deltazip.runtime.serve.lora_variant import ADAPTER_CONFIG, ADAPTER_WEIGHTS

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class VariantInfo:
    """One variant found under the served directory (manifest or config only; nothing decoded).

    ``kind``: ``artifact`` (deltazip artifact), ``full`` (plain HF checkpoint; ``tensors`` filled by
    ``deltazip.runtime.serve.variant_sources.compare_full_checkpoint``) or ``lora`` (PEFT adapter;
    ``tensors`` empty, its factors are described by a ``deltazip.runtime.serve.lora_variant.LoraSpec``).
    """

    name: str
    path: Path
    tensors: dict[str, dict[str, Any]]
    lineage: dict[str, Any]
    disk_bytes: int
    kind: str = "artifact"
    same_as_base_bytes: int = 0  # full checkpoints: bytes (served dtype) of tensors equal to the base's
    fingerprints: dict[str, Any] = field(default_factory=dict, repr=False)

    _side_dirs: dict[Path, Path] = field(default_factory=dict, repr=False, compare=False)
    _entries: tuple[int, dict[str, Entry]] = field(default=(0, {}), repr=False, compare=False)

    @property
    def entries(self) -> dict[str, Entry]:
        """``tensors`` as typed entries (kind, scheme, additive...); rebuilt when ``tensors`` is replaced."""
        if self._entries[0] != id(self.tensors):
            self._entries = (id(self.tensors), entries(self.tensors))
        return self._entries[1]

    def side_dir(self, base_dir: Path) -> Path:
        """Where the variant's config/tokenizer/generation files live: for an artifact, every side file
        (those it copied into hf/ and those it keeps by reference to ``base_dir``, checked; see
        ``Artifact.side_file_dir``); for other kinds, the variant's own directory.

        Raises:
            InputError: a side file the artifact references differs in ``base_dir`` (wrong base).
        """
        if self.kind != "artifact":
            return self.path
        key = Path(base_dir).resolve()
        if key not in self._side_dirs:
            self._side_dirs[key] = Artifact(self.path).side_file_dir(base_dir)
        return self._side_dirs[key]

    def tokenizer_dir(self, base_dir: Path) -> Path:
        """The variant's own tokenizer files when it has them, else the base's."""
        side = self.side_dir(base_dir)
        if any((side / f).is_file() for f in _TOKENIZER_FILES):
            return side
        return base_dir


def variant_kind(path: Path) -> str | None:
    """``artifact``, ``lora``, ``full`` or None for a directory that is none of them."""
    if (path / MANIFEST).is_file():
        return "artifact"
    if (path / ADAPTER_CONFIG).is_file():
        return "lora"
    if (path / "config.json").is_file() and (any(path.glob("*.safetensors"))
                                              or (path / "model.safetensors.index.json").is_file()):
        return "full"
    return None


def _weights_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def inspect_variant(path: Path, name: str | None = None) -> VariantInfo:
    """The :class:`VariantInfo` of one variant directory (manifest/config read; no weights decoded).

    Full checkpoints get their per-tensor table later, from :func:`compare_full_checkpoint`.
    """
    path = Path(path)
    kind = variant_kind(path)
    name = name or path.name
    if kind is None:
        raise InputError(f"{path} is not a deltazip artifact (manifest.json), a PEFT adapter ({ADAPTER_CONFIG}) or a "
                         f"Hugging Face checkpoint (config.json + *.safetensors)")
    if kind == "artifact":
        art = Artifact(path, check_tensors=False)
        check_artifact_files(art)
        return VariantInfo(name, path, art.tensors, art.lineage, art.nbytes())
    if kind == "lora":
        import json

        try:
            base = json.loads((path / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            raise InputError(f"adapter {path}: cannot read {ADAPTER_CONFIG} ({e})") from e
        disk = sum(p.stat().st_size for p in (path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS) if p.is_file())
        return VariantInfo(name, path, {}, {"base": base} if base else {}, disk, kind="lora")
    return VariantInfo(name, path, {}, {}, _weights_bytes(path), kind="full")


def check_artifact_files(art: Artifact) -> None:
    """Every file an artifact's manifest lists is there with its size and sha256 (the manifest itself
    was checked against ``manifest.sha256`` on open): a corrupt artifact is refused before it is
    listed or added, not found out by the first request to it.

    Raises:
        ArtifactError: naming the file and pointing to ``deltazip verify``.
    """
    for rel, info in sorted(art.manifest["files"].items()):
        problem = file_problem(art.path, rel, info)
        if problem:
            raise ArtifactError(f"artifact {art.path}: {rel} {problem}; the artifact is corrupt, not served "
                                f"(`deltazip verify {art.path}` lists every problem)")


class VariantRef(NamedTuple):
    """A variant found on disk and not read yet: what listing and routing need (a few hundred bytes).

    ``where``: its directory as a string (a ``Path`` per variant would cost more than the rest);
    ``kind``: ``artifact``, ``lora`` or ``full`` (:func:`variant_kind`).
    """

    name: str
    where: str
    kind: str

    @property
    def path(self) -> Path:
        return Path(self.where)


def find_variants(root: str | Path, allow_empty: bool = False) -> list[VariantRef]:
    """Every variant (artifact, LoRA adapter, full checkpoint) at or under ``root``, sorted by name,
    without reading any of them: one directory listing per level and a file check per directory.

    Raises:
        InputError: ``root`` missing, nothing found (unless ``allow_empty``), or two variants with
            the same directory name.
    """
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"{root}: no such directory; pass the directory that holds your artifacts")
    kind = variant_kind(root)
    found = [VariantRef(root.name, str(root), kind)] if kind is not None else _walk(str(root))
    if not found and not allow_empty:
        raise InputError(f"{root}: no variants found (no artifact manifest.json, PEFT {ADAPTER_CONFIG} or "
                         f"config.json + safetensors); create artifacts with `deltazip compress`")
    out: dict[str, VariantRef] = {}
    for ref in found:
        if ref.name in out:
            raise InputError(f"two variants are named {ref.name!r} ({out[ref.name].where} and {ref.where}); variant "
                             f"names are directory names and must be unique")
        out[ref.name] = ref
    return [out[k] for k in sorted(out)]


def _walk(top: str) -> list[VariantRef]:
    """Variants under ``top`` (not ``top`` itself): hidden directories and symlinked ones are skipped,
    and nothing nested in a variant (an artifact's ``hf/``) is looked into."""
    found, todo = [], [top]
    while todo:
        here = todo.pop()
        try:
            with os.scandir(here) as it:
                dirs = sorted(e.name for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False))
        except OSError:
            continue
        for d in dirs:
            path = os.path.join(here, d)
            kind = _kind_of(path)
            if kind is None:
                todo.append(path)
            else:
                found.append(VariantRef(d, path, kind))
    return found


def _kind_of(path: str) -> str | None:
    """:func:`variant_kind` on a string path, cheapest check first (a stat per directory)."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return "artifact"
    return variant_kind(Path(path))


def discover_variants(root: str | Path, allow_empty: bool = False) -> list[VariantInfo]:
    """Every variant at or under ``root``, read (:func:`inspect_variant`), sorted by name.

    Raises:
        InputError: as :func:`find_variants`; ArtifactError: a corrupt artifact (named).
    """
    return [inspect_variant(ref.path, ref.name) for ref in find_variants(root, allow_empty)]


def check_variant_name(name: str) -> None:
    if not _NAME.match(name):
        raise InputError(f"variant name {name!r} is not allowed; use up to 128 letters, digits, '.', '_', ':' or '-', "
                         f"starting with a letter or digit")


def resolve_inside(root: Path, given: str) -> Path:
    """The variant directory ``given`` (relative to ``root``, or absolute) resolved inside ``root``.

    Symlinks are followed before the check, so neither ``..`` nor a link can lead out; the files
    inside the directory are checked the same way (a weight file linked from elsewhere is refused).

    Raises:
        InputError: empty path, nothing there, not a directory, or anything resolving outside ``root``.
    """
    if not isinstance(given, str) or not given.strip() or "\x00" in given:
        raise InputError("path must be a non-empty path to a variant directory inside the served directory")
    root_r = Path(root).resolve()
    p = Path(given)
    cand = p if p.is_absolute() else Path(root) / p
    try:
        real = cand.resolve(strict=True)
    except (FileNotFoundError, RuntimeError, OSError):
        raise InputError(f"path {given!r}: nothing there inside the served directory {root}; pass a path relative to "
                         f"it") from None
    if real != root_r and root_r not in real.parents:
        raise InputError(f"path {given!r} resolves outside the served directory {root}; only variants inside it can "
                         f"be registered (copy or move it there)")
    if not real.is_dir():
        raise InputError(f"path {given!r} is not a directory; pass a variant directory")
    for dirpath, _, files in os.walk(real):
        for f in files:
            fr = (Path(dirpath) / f).resolve()
            if root_r not in fr.parents:
                raise InputError(f"path {given!r}: {Path(dirpath, f).relative_to(real)} links outside the served "
                                 f"directory {root}; copy the file in instead")
    return real


# --------------------------------------------------------------------------------------------------
# Full checkpoints against the base
# --------------------------------------------------------------------------------------------------


class BaseTensorIndex:
    """Per-tensor fingerprints of the base checkpoint's safetensors bytes (computed once, lazily)."""

    def __init__(self, base: Checkpoint, fingerprint_bytes: Callable):
        self.base = base
        self._fp_bytes = fingerprint_bytes
        self._fps: dict | None = None

    def fingerprints(self) -> dict:
        if self._fps is None:
            self._fps = checkpoint_fingerprints(self.base, self._fp_bytes)
        return self._fps


def checkpoint_fingerprints(ck: Checkpoint, fingerprint_bytes: Callable) -> dict:
    """``name -> TensorFingerprint`` of every tensor of ``ck`` from its file bytes (as ``dedup-scan``)."""
    from deltazip.formats.safetensors_raw import RawFile

    out = {}
    for f in ck.files:
        with RawFile(f) as raw:
            for name, e in raw.entries.items():
                v = raw.view(name)
                out[name] = fingerprint_bytes(v, e.dtype, e.shape)
                v.release()
    return out


_ARCH_KEYS = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim", "tie_word_embeddings")


def compare_full_checkpoint(v: VariantInfo, index: BaseTensorIndex, served_itemsize: int) -> None:
    """Fill ``v.tensors`` of a full-checkpoint variant: ``same`` where its bytes equal the base's.

    Also sets ``v.same_as_base_bytes`` (bytes of the ``same`` tensors in the served dtype, whose
    element size is ``served_itemsize`` for floating tensors) and ``v.fingerprints``.

    Raises:
        InputError: another architecture (config keys, tensor names or shapes differ from the base).
    """
    base = index.base
    ck = Checkpoint(v.path, f"checkpoint {v.name}")
    cfg, bcfg = ck.config_dict(), base.config_dict()
    for key in _ARCH_KEYS:
        if cfg.get(key) != bcfg.get(key):
            raise InputError(f"checkpoint {v.name} ({v.path}) has {key}={cfg.get(key)!r}, the served base "
                             f"{bcfg.get(key)!r}; it is not a fine-tune of this base (serve it with its own base)")
    missing = sorted(set(base.names) - set(ck.names))
    extra = sorted(set(ck.names) - set(base.names))
    if missing or extra:
        which = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which the base does not"
        raise InputError(f"checkpoint {v.name} ({v.path}) {which} ({len(missing)} missing, {len(extra)} extra "
                         f"tensors); it is not a fine-tune of the served base")
    base_fps = index.fingerprints()
    fps = checkpoint_fingerprints(ck, index._fp_bytes)
    tensors, same_bytes = {}, 0
    for name in ck.names:
        e, be = ck.table[name], base.table[name]
        if tuple(e.shape) != tuple(be.shape):
            raise InputError(f"checkpoint {v.name} ({v.path}): tensor {name} has shape {list(e.shape)}, the base "
                             f"{list(be.shape)}; it is not a fine-tune of the served base")
        same = e.dtype == be.dtype and fps[name] == base_fps[name]
        tensors[name] = {"kind": "same" if same else "full", "shape": list(e.shape),
                         "dtype": dtype_name(ST_TO_TORCH[e.dtype]) if e.dtype in ST_TO_TORCH else e.dtype}
        if same:
            numel = 1
            for d in e.shape:
                numel *= d
            same_bytes += numel * (served_itemsize if e.dtype in ST_FLOATS else e.nbytes // max(numel, 1))
    v.tensors, v.same_as_base_bytes, v.fingerprints = tensors, same_bytes, fps
