"""Rebuild the fine-tuned model from base + artifact, in memory or as a plain HF checkpoint."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict

from deltazip.formats.artifact import Artifact
from deltazip.formats.atomic import apply_umask, remove_stale_siblings, temp_sibling
from deltazip.formats.dtypes import parse_dtype
from deltazip.formats.errors import InputError
from deltazip.formats.outputs import check_output, is_no_space, no_space_error, replace_dir
from deltazip.formats.side_files import materialize_side_files
from deltazip.models.checkpoint import Checkpoint
from deltazip.models.loader import load_causal_lm


def open_base(art: Artifact, base_spec: str | Path | None, check_fingerprint: bool = True) -> Checkpoint:
    """The base checkpoint of an artifact: ``base_spec`` or the lineage's, fingerprint-checked."""
    spec = base_spec or art.lineage.get("base")
    if not spec:
        raise InputError(f"{art.path}: the artifact names no base model; pass --base")
    base = Checkpoint(spec, "base")
    want = art.lineage.get("base_fingerprint")
    if check_fingerprint and want and base.fingerprint() != want:
        raise InputError(f"base {base.path} is not the model this artifact was compressed against "
                         f"(fingerprint differs); pass the right --base")
    return base


def reconstruct_state_dict(art: Artifact, base: Checkpoint,
                           progress: Callable[[str, int, int], None] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the fine-tuned model, rebuilt as the compressor produced it (CPU, stored dtypes)."""
    out = {}
    entries = art.entries()
    for i, (name, entry) in enumerate(entries.items()):
        out[name] = art.reconstruct(name, base.get(name) if entry.needs_base else None)
        if progress:
            progress("rebuilding tensors", i + 1, len(entries))
    return out


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
               "GIB": 2**30, "TIB": 2**40}


def parse_shard_size(size: str | int) -> int:
    """``--max-shard-size`` in bytes: a number of bytes or a number with KB/MB/GB/TB (powers of 1000,
    as Hugging Face counts them) or KiB/MiB/GiB/TiB.

    Raises:
        InputError: anything else, naming the option and examples.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _SIZE_UNITS:
            raise InputError(f"--max-shard-size {size!r} is not a size; use e.g. 2GB, 500MB or a number of bytes")
        n = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if n < 1:
        raise InputError(f"--max-shard-size {size!r} must be at least 1 byte; use e.g. 2GB")
    return n


def merge_to_dir(art: Artifact, base: Checkpoint, out_dir: str | Path, overwrite: bool = False,
                 max_shard_size: str = "2GB", progress=None) -> Path:
    """Write ``base + delta`` as a standard HF checkpoint (config, tokenizer, sharded safetensors).

    The side files come first (a base whose referenced side files differ fails before any tensor is
    rebuilt). The write goes to a temporary sibling directory renamed into place at the end.
    """
    out_dir = Path(out_dir)
    shard_bytes = parse_shard_size(max_shard_size)
    need = merged_bytes(art)
    check_output(out_dir, "--out", [("ARTIFACT", art.path), ("--base", base.path)], overwrite, nbytes=need)
    remove_stale_siblings(out_dir)  # temporaries of killed writers of the same output
    tmp = temp_sibling(out_dir)
    tmp.mkdir(parents=True)
    try:
        _write_merged(art, base, tmp, shard_bytes, progress, out_dir, need)
        replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def merged_bytes(art: Artifact) -> int:
    """Bytes of the merged checkpoint's tensors: the fine-tune's, as the lineage recorded them (else
    every entry's shape times its dtype's size)."""
    known = art.lineage.get("finetuned_bytes")
    if known:
        return int(known)
    total = 0
    for e in art.tensors.values():
        n = 1
        for d in e["shape"]:
            n *= d
        total += n * parse_dtype(e["dtype"]).itemsize
    return total


def _write_merged(art: Artifact, base: Checkpoint, tmp: Path, shard_bytes: int, progress, out_dir: Path,
                  need: int) -> None:
    try:
        if "side_files" in art.manifest:
            # The fine-tune's config/tokenizer files: copied ones from hf/, referenced ones from the base (checked).
            materialize_side_files(art, base.path, tmp)
        else:  # an artifact that predates side_files: hf/ holds them all (without hf/, take the base's)
            side = art.hf_dir()
            src = side if side.is_dir() else base.path
            for f in sorted(src.iterdir()):
                if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
                    shutil.copyfile(f, tmp / f.name)
        sd = reconstruct_state_dict(art, base, progress)
        save_torch_state_dict(sd, tmp, max_shard_size=shard_bytes)
        apply_umask(tmp)  # safetensors writes its files 0600
    except Exception as e:
        if not is_no_space(e):
            raise
        raise no_space_error(out_dir, "--out", need) from None


def load_merged_model(art: Artifact, base: Checkpoint, dtype: torch.dtype | None = None):
    """A transformers model of the fine-tune rebuilt from base + artifact.

    Goes through a temporary merged checkpoint so that transformers' own loader applies its
    checkpoint-key conventions (names on disk and module names differ for some architectures).
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="deltazip-merge-") as tmp:
        path = merge_to_dir(art, base, Path(tmp) / "model")
        return load_causal_lm(path, dtype or torch.float32, what=f"the merge of {art.path}")
