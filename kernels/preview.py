"""CUDA kernel paths that are built and checked offline (NVRTC builds, spills, the layout's CPU
round trip) but have not yet passed the parity tests on a GPU. Each is off unless named in
``DELTAZIP_CUDA_PREVIEW`` (comma-separated); the path validated on a GPU stays the default.

Read when a stack's layout is chosen or its launch prepared, never per launch.
"""

from __future__ import annotations

import os

from deltazip.kernels import mma_layout

ENV = "DELTAZIP_CUDA_PREVIEW"

# name -> what it enables (docs/kernels.md, "Preview paths")
FEATURES = {
    "padded-k": "in_features that are not a multiple of 128 (a multiple of 8), padded to whole 128-column "
                "tiles in the mma layout, the activations' tail zero-filled by the kernel",
    "narrow-groups": "groups of 16 columns (any code width) and 2-bit groups of 32: one scale flush every one "
                     "or two mma steps, a 2-bit code word spanning two groups",
    "three-bit": "3-bit codes, held as two bit planes (the low two bits, then the high bit) in the mma layout",
    "wide-groups": "groups of whole 128-column tiles that are not a power of two of them (384, 640, 768 "
                   "columns): the kernel divides by the tiles per group instead of shifting",
    "sparse-mma": "3-, 4- and 8-bit 2:4 deltas in the compact layout (the kept codes and their positions, 2.5, "
                  "3 and 5 bits per weight instead of 3, 4 and 8) on the sparse tensor-core MMA (mma.sp)",
    "split-groups": "groups of a multiple of 16 columns that neither divide a tile nor are whole tiles (48, 96, "
                    "160, 192 columns): held as sub-groups of 16, 32 or 64 columns that repeat the group's scale",
    # launch options: the tuner times them beside the validated launches and keeps them where they win
    "stream-k": "a persistent grid of one wave of CTAs sharing the (row tile, block, K stage) work evenly, the "
                "units it cuts summed by their last CTA: no wave tail, every SM busy for 1-4 deltas",
    "pdl": "programmatic dependent launch (sm_90+): the kernel's CTAs start while the kernel before them ends "
           "and wait on the device for its results (griddepcontrol), hiding the launch gap",
    "evict-first": "the weight copies carry an L2 evict-first policy: codes read once per step do not push "
                   "the activations and outputs that the next kernels read out of L2",
}
LAUNCH_OPTIONS = {"stream-k": "stream_k", "pdl": "pdl", "evict-first": "evict"}  # name -> CudaConfig field


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


def needed(bits: int, group_size: int, in_features: int) -> dict[str, str]:
    """``{preview path: what of the configuration needs it}`` for a configuration of the mma layout
    (empty: the validated kernel serves it)."""
    g = in_features if group_size == -1 else group_size
    lg = mma_layout.layout_group(group_size, in_features) or g  # the groups the kernel reads
    out = {}
    if in_features % 128:
        out["padded-k"] = f"in_features {in_features} is not a multiple of 128"
    if lg == 16 or (lg == 32 and bits == 2):
        out["narrow-groups"] = f"{bits}-bit groups of {lg} columns" + (f" (of groups of {g})" if lg != g else "")
    if lg != g:
        out["split-groups"] = f"groups of {g} columns (as {g // lg} groups of {lg} in the kernel's layout)"
    if bits == 3:
        out["three-bit"] = "3-bit codes"
    if mma_layout.divided_groups(group_size, in_features):
        out["wide-groups"] = f"groups of {g} columns ({g // 128} tiles)"
    return out


def allowed(bits: int, group_size: int, in_features: int) -> bool:
    """Whether every preview path the configuration needs is switched on."""
    return all(enabled(n) for n in needed(bits, group_size, in_features))


def used_by(stack) -> list[str]:
    """The preview paths a ``StackedDeltas``'s CUDA launch depends on (``[]``: only validated ones)."""
    if stack.layout != "mma":
        return []
    return list(needed(stack.bits, stack.scheme.group_size, stack.in_features)) + (["sparse-mma"] if stack.compact else [])


def launch_options() -> frozenset[str]:
    """The launch-option previews (:data:`LAUNCH_OPTIONS`) switched on in the environment."""
    return frozenset(n for n in LAUNCH_OPTIONS if enabled(n))


def config_options(cfg) -> frozenset[str]:
    """The launch-option previews a ``CudaConfig`` uses."""
    return frozenset(n for n, field in LAUNCH_OPTIONS.items() if getattr(cfg, field))
