"""The one place ``--device`` and ``--dtype`` values are accepted and resolved (compress, serve, eval).

Accepted: devices ``auto``, ``cpu``, ``cuda``, ``cuda:N``; dtypes ``auto``, ``float32``, ``float16``,
``bfloat16`` (``deltazip.formats.dtypes.COMPUTE``). ``auto`` means:

- device: CUDA when there is one, else the CPU;
- dtype: float32 on the CPU; on CUDA the checkpoint's half dtype (float16 or bfloat16) when it is
  stored in one; an fp32 checkpoint runs in float32 when compressing (the solver's accuracy) and in
  float16 when serving (the memory of many slots).

torch is imported inside the functions: the CLI reads :data:`DEVICES` and :data:`DTYPES` for its
help text, and ``deltazip --help`` must not import torch.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from deltazip.formats.dtypes import COMPUTE, compute_dtype
from deltazip.formats.errors import InputError

DEVICES = "auto, cpu, cuda or cuda:N"
DTYPES = "auto, " + ", ".join(COMPUTE[:-1]) + " or " + COMPUTE[-1]
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")

if TYPE_CHECKING:
    import torch


def check_device(name: str, option: str = "--device") -> None:
    """Raises InputError for a name outside :data:`DEVICES`, or CUDA asked for where there is none."""
    import torch

    if not isinstance(name, str) or not _DEVICE.match(name):
        raise InputError(f"{option} {name!r} is unknown; use {DEVICES}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"{option} {name} was asked for but no CUDA device is available; use {option} cpu")


def resolve_device(name: str, option: str = "--device") -> torch.device:
    """The torch device of a ``--device`` value (checked)."""
    import torch

    check_device(name, option)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_dtype(name: str, option: str = "--dtype") -> None:
    """Raises InputError for a name outside :data:`DTYPES`."""
    compute_dtype(name, option)


def resolve_dtype(name: str, device: torch.device, stored: torch.dtype, serving: bool,
                  option: str = "--dtype") -> torch.dtype:
    """The compute dtype of a ``--dtype`` value on ``device`` for a checkpoint stored in ``stored``
    (``auto``: module docstring; ``serving`` picks fp16 over fp32 for an fp32 checkpoint on CUDA)."""
    import torch

    chosen = compute_dtype(name, option)
    if chosen is not None:
        return chosen
    if torch.device(device).type != "cuda":
        return torch.float32
    if stored in (torch.float16, torch.bfloat16):
        return stored
    return torch.float16 if serving else torch.float32
