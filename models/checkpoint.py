"""Lazy access to a Hugging Face checkpoint: one tensor at a time, safetensors only.

Tensors are read with plain file reads, not memory maps: a mapped page that was read stays in the
process's resident set until the map goes, so reading every tensor of two mapped checkpoints once
would hold both whole checkpoints in RSS for the length of a compression (the page cache keeps the
bytes either way, outside the process).

A checkpoint is a local directory (``config.json`` + ``model.safetensors`` or sharded safetensors
with ``model.safetensors.index.json``) or a hub id, downloaded only when the hub is reachable.
Pickle checkpoints (``*.bin``, ``*.pt``) are refused: loading them can run arbitrary code. So are
quantized checkpoints (a ``quantization_config`` in ``config.json``: FP8, MXFP4, GPTQ, AWQ,
bitsandbytes, ...) wherever their weights would be used as numbers: their tensors are codes and scales
under names the model's parameters do not have, and a delta of two such checkpoints is meaningless.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import xxhash

from deltazip.formats.checksum import CheckpointFingerprint
from deltazip.formats.dtypes import ST_TO_TORCH
from deltazip.formats.errors import InputError
from deltazip.formats.safetensors_raw import TensorEntry, read_table
from deltazip.models.hub import hub_offline, offline_miss, require_hub

# The safetensors dtypes a checkpoint's tensors may have (float8 and wide unsigned ones are refused).
_HANDLED = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")
_PICKLE_GLOBS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt", "*.bin")
# Side files worth keeping with an artifact so that a merged model is complete.
_READ_CHUNK = 64 << 20
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                 "added_tokens.json", "chat_template.jinja", "chat_template.json",
                 # an image-text model's processor: the merged model keeps reading images
                 "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def resolve_model_dir(spec: str | Path, role: str) -> Path:
    """A local model directory for ``spec`` (a path, or a hub id fetched when the hub answers)."""
    p = Path(spec).expanduser()
    if p.exists():
        if not p.is_dir():
            raise InputError(f"{role} {p} is not a directory; pass a Hugging Face model directory")
        return p
    s = str(spec)
    looks_like_hub_id = s.count("/") == 1 and not s.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise InputError(f"{role} {p} does not exist; pass a model directory or a hub id like org/name")
    require_hub(f"{role} {s!r}", "a local model directory")  # once, now: not 30 s of retries later
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(s, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as e:  # network, auth or missing repo: all end the same way for the user
        if hub_offline():
            raise offline_miss(f"{role} {s!r}", "a local model directory") from e
        raise InputError(f"{role} {s!r} is not a local directory and could not be downloaded from the hub "
                         f"({type(e).__name__}); pass a local model directory") from e
    return Path(local)


def quantization_method(config: dict) -> str | None:
    """The ``quant_method`` of a ``config.json``'s ``quantization_config`` (its text config's too), or None."""
    for c in (config, config.get("text_config") if isinstance(config.get("text_config"), dict) else None):
        q = c.get("quantization_config") if isinstance(c, dict) else None
        if q:
            return str(q.get("quant_method", "quantization_config")) if isinstance(q, dict) else "quantization_config"
    return None


class Checkpoint:
    """Tensor table of a checkpoint plus lazy, validated tensor reads.

    Args:
        spec: model directory or hub id.
        role: word used in error messages ("base", "fine-tuned").
        quantized_ok: accept a quantized checkpoint (only its bytes are read: a fingerprint).
    """

    def __init__(self, spec: str | Path, role: str = "model", quantized_ok: bool = False):
        self.spec = str(spec)
        self.role = role
        self.path = resolve_model_dir(spec, role)
        if not (self.path / "config.json").is_file():
            raise InputError(f"{role} {self.path} is not a model directory (no config.json)")
        if not quantized_ok:
            method = quantization_method(self.config_dict())
            if method is not None:
                raise InputError(f"{role} {self.path} is a quantized checkpoint ({method}); deltazip reads "
                                 f"full-precision weights: pass the model's bf16/fp16/fp32 release, or a dequantized "
                                 f"copy of it saved with save_pretrained")
        self.files = self._weight_files()
        self.table: dict[str, TensorEntry] = {}
        self.file_of: dict[str, Path] = {}
        for f in self.files:
            entries, _ = read_table(f)
            for name, e in entries.items():
                if name in self.table:
                    raise InputError(f"{role} {self.path}: tensor {name!r} appears in two weight files")
                self.table[name] = e
                self.file_of[name] = f
        if not self.table:
            raise InputError(f"{role} {self.path}: the safetensors files hold no tensors")
        self._fds: dict[Path, int] = {}

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise InputError(f"{index}: corrupt safetensors index ({e})") from e
            files = sorted({self.path / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise InputError(f"{self.role} {self.path}: shard {missing[0]} named in the index is missing")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if files:
            return files
        if any(any(self.path.glob(g)) for g in _PICKLE_GLOBS):
            raise InputError(f"{self.role} {self.path} has only pickle weights (.bin/.pt), which deltazip does not "
                             f"load; convert it to safetensors (e.g. save_pretrained(..., safe_serialization=True))")
        raise InputError(f"{self.role} {self.path}: no safetensors weights found")

    # -- table ----------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.table)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.table[name].shape

    def dtype(self, name: str) -> torch.dtype:
        st = self.table[name].dtype
        if st not in _HANDLED:
            raise InputError(f"{self.role} {self.path}: tensor {name} has dtype {st}, which deltazip does not handle")
        return ST_TO_TORCH[st]

    def nbytes(self) -> int:
        """Bytes of all tensors in their stored dtypes."""
        return sum(e.nbytes for e in self.table.values())

    def config_dict(self) -> dict:
        try:
            return json.loads((self.path / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"{self.path / 'config.json'}: invalid JSON ({e})") from e

    # -- reads ----------------------------------------------------------------------------------
    def get(self, name: str, check_finite: bool = True) -> torch.Tensor:
        """Load one tensor (CPU, stored dtype); NaN/Inf in a float tensor is an InputError."""
        f = self.file_of.get(name)
        if f is None:
            raise InputError(f"{self.role} {self.path}: no tensor {name!r}")
        e = self.table[name]
        buf = bytearray(self._read(f, e.start, e.nbytes))
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        t = t.view(self.dtype(name)).reshape(e.shape)
        if check_finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise InputError(f"{self.role} {self.path}: tensor {name} contains NaN or Inf values")
        return t

    def _read(self, f: Path, start: int, n: int) -> bytes:
        fd = self._fds.get(f)
        if fd is None:
            try:
                fd = self._fds[f] = os.open(f, os.O_RDONLY)
            except OSError as err:
                raise InputError(f"{self.role} {f}: cannot read ({err.strerror or err})") from err
        chunks, done = [], 0
        while done < n:
            c = os.pread(fd, min(n - done, _READ_CHUNK), start + done)
            if not c:
                raise InputError(f"{self.role} {f}: file ends inside a tensor (truncated?)")
            chunks.append(c)
            done += len(c)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def fingerprint(self) -> str:
        """xxh3-128 fingerprint over every tensor's raw bytes (see formats.checksum.CheckpointFingerprint),
        hashed from file reads in chunks, so it holds at most one chunk in memory."""
        fp = CheckpointFingerprint()
        for f in self.files:
            entries, _ = read_table(f)
            for name, e in entries.items():
                h = xxhash.xxh3_128()
                for s in range(e.start, e.end, _READ_CHUNK):
                    h.update(self._read(f, s, min(_READ_CHUNK, e.end - s)))
                fp.add_digest(name, e.dtype, e.shape, h.hexdigest())
        return fp.hexdigest()

    def close(self) -> None:
        """Close the open file descriptors (reads reopen them)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def side_files(self) -> list[Path]:
        """Config and tokenizer files present in the directory."""
        return [self.path / n for n in HF_SIDE_FILES if (self.path / n).is_file()]
