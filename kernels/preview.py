"""CUDA kernel paths that are built and checked offline (NVRTC builds, spills, the layout's CPU
round trip) but have not yet passed the parity tests on a GPU. Each is off unless named in
``DELTAZIP_CUDA_PREVIEW`` (comma-separated); the path validated on a GPU stays the default.

Read when a stack's layout is chosen or its launch prepared, never per launch.
"""

from __future__ import annotations

import os

ENV = "DELTAZIP_CUDA_PREVIEW"

# name -> what it enables (docs/kernels.md, "Preview paths")
FEATURES = {
    "padded-k": "in_features that are not a multiple of 128 (a multiple of 8), padded to whole 128-column "
                "tiles in the mma layout, the activations' tail zero-filled by the kernel",
}


def enabled(name: str) -> bool:
    """Whether preview path ``name`` (a key of :data:`FEATURES`) is switched on in the environment."""
    if name not in FEATURES:
        raise KeyError(f"no preview path {name!r}; known: {', '.join(FEATURES)}")
    raw = os.environ.get(ENV, "")
    names = {n.strip().lower() for n in raw.split(",") if n.strip()}
    unknown = names - set(FEATURES) - {"all"}
    if unknown:
        raise ValueError(f"{ENV}={raw!r}: unknown preview path {', '.join(sorted(unknown))}; "
                         f"use a comma-separated list of {', '.join(FEATURES)} (or all)")
    return name in names or "all" in names


def used_by(stack) -> list[str]:
    """The preview paths a ``StackedDeltas``'s CUDA launch depends on (``[]``: only validated ones)."""
    return ["padded-k"] if stack.layout == "mma" and stack.in_features % 128 else []
