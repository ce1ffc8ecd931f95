"""Hessians of a layer's sites, per expert for mixture-of-experts layers, and solving a target.

Inputs are gathered where the weight is applied, so each expert's Hessian comes only from the
tokens the router sent to it:

- ``nn.Linear`` and ``Conv1D``: a forward pre-hook on the module (``H`` of its input).
- fused expert parameters ``[E, out, in]``: transformers 5's eager experts forward runs
  ``F.linear(x_e, param[e])`` (``x_e @ param[e]`` for GPT-OSS's ``[E, in, out]``) for every expert
  that got tokens, with ``x_e`` the routed tokens' hidden states (gate/up) or the expert's own
  intermediate activations (down). ``ExpertTap`` (a
  ``TorchFunctionMode``) sees those calls and tells the expert by where the weight view starts in the
  parameter's storage. An expert nobody routes to is never called and gets no Hessian.
- per-expert ``nn.Linear`` modules (an experts ``ModuleList``): their own pre-hooks; an expert with no
  token is never called either.

A matrix without a Hessian (no calibration token reached it) is compressed by round-to-nearest on
its delta (``obs.rtn_compress``) and flagged in the manifest's per-layer stats; never a crash.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from deltazip.compress.obs import SolveResult
from deltazip.formats.errors import CompressionError
from deltazip.formats.packing import pack_delta
from deltazip.kernels.packed import PackedDelta
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.expert_tap import tap_experts
from deltazip.models.layer_map import Target
from deltazip.models.model_walk import Site

HEAD_KEY = "lm_head"  # the Hessian key of the output projection (it is not inside a decoder layer)
NO_TOKENS = "none: no routed tokens, rtn"
NO_INPUT = "none: no calibration input reached it, rtn"


class Hessians:
    """Running sums of ``x xᵀ`` (fp32) of each site's input, per expert for fused experts."""

    def __init__(self):
        self.sums: dict[tuple[str, int | None], torch.Tensor] = {}
        self.counts: dict[tuple[str, int | None], int] = {}
        self.alias: dict[str, str] = {}  # site key -> the key whose (identical) input it shares

    def share(self, key: str, of: str) -> None:
        """Site ``key`` reads the very tensor site ``of`` reads (q/k/v, gate/up): one sum serves both."""
        if key != of:
            self.alias[key] = self.alias.get(of, of)

    def add(self, key: str, expert: int | None, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        if x.shape[0] == 0:
            return
        k = (key, expert)
        s = self.sums.get(k)
        if s is None:
            s = self.sums[k] = torch.zeros(x.shape[1], x.shape[1], device=x.device)
        s.addmm_(x.t(), x)
        self.counts[k] = self.counts.get(k, 0) + x.shape[0]

    def update(self, other: Hessians) -> None:
        """Take ``other``'s sums, counts and shared inputs as well (keys in both: ``other``'s win)."""
        self.sums.update(other.sums)
        self.counts.update(other.counts)
        self.alias.update(other.alias)

    def source(self, key: str, expert: int | None = None) -> torch.Tensor | None:
        """The running sum ``get`` reads for ``(key, expert)`` (shared inputs resolved), or None."""
        return self.sums.get((self.alias.get(key, key), expert))

    def get(self, key: str, expert: int | None = None) -> tuple[torch.Tensor | None, int]:
        """``(H = 2 XᵀX / n, n)``, or ``(None, 0)`` when no token reached it."""
        key = self.alias.get(key, key)
        n = self.counts.get((key, expert), 0)
        return (2 * self.sums[(key, expert)] / n, n) if n else (None, 0)


def collect_hessians(layer: nn.Module, sites: dict[str, Site], keys: list[str], run: Callable[[], None]) -> Hessians:
    """Run ``run`` (the layer's forward on every calibration batch) and gather the Hessians of
    the sites ``keys``.

    Raises:
        CompressionError: an experts module received tokens but none of its expert matrices was
            applied through ``F.linear`` (an experts implementation other than transformers'
            eager one, which would leave every expert uncalibrated).
    """
    hs = Hessians()
    handles = []
    fused: dict[str, torch.Tensor] = {}
    entered: dict[str, int] = {}

    last: list = [None, None]  # the input the previous site hook saw, and its key

    def site_hook(key):
        def fn(_m, args):
            if args[0] is last[0]:  # q/k/v (gate/up) read one tensor: accumulate it once
                hs.share(key, last[1])
                return
            last[0], last[1] = args[0], key
            hs.add(key, None, args[0])
        return fn

    def entered_hook(key):
        def fn(_m, args):
            if args and isinstance(args[0], torch.Tensor):
                entered[key] += args[0].numel() // max(args[0].shape[-1], 1)
        return fn

    try:
        for k in keys:
            s = sites[k]
            if s.kind == "experts":
                fused[k] = layer.get_parameter(s.param)
                entered[k] = 0
                handles.append(layer.get_submodule(s.module).register_forward_pre_hook(entered_hook(k)))
            else:
                handles.append(layer.get_submodule(k).register_forward_pre_hook(site_hook(k)))
        with tap_experts(fused, hs.add):
            run()
    finally:
        for h in handles:
            h.remove()
    last[0] = None
    for k in fused:
        if entered[k] and not any(kk == k for kk, _ in hs.counts):
            raise CompressionError(f"experts {k}: {entered[k]} tokens entered the experts module but no expert "
                                   "matrix was applied with F.linear (or x @ W); ΔCompress calibrates "
                                   "transformers' eager experts implementation only")
    return hs


@dataclass
class TargetResult:
    """One compressed target: its packed delta, its values in the checkpoint's layout, and stats."""

    packed: PackedDelta
    values: torch.Tensor
    stats: dict


def _stack(results: list[SolveResult]) -> SolveResult:
    if len(results) == 1:
        return results[0]
    masks = [r.mask for r in results]
    st = [r.stats for r in results if r.stats]
    stats = {"damp": max(s["damp"] for s in st), "damp_retries": sum(s["damp_retries"] for s in st),
             "dead_columns": sum(s["dead_columns"] for s in st)} if st else {}
    return SolveResult(torch.cat([r.codes for r in results]), torch.cat([r.scales for r in results]),
                       torch.cat([r.zeros for r in results]),
                       None if masks[0] is None else torch.cat(masks), torch.cat([r.values for r in results]), stats)


def solve_target(t: Target, target: torch.Tensor, hs: Hessians | None,
                 solve: Callable[[torch.Tensor, torch.Tensor | None], SolveResult], scheme: DeltaScheme) -> TargetResult:
    """Compress one target, matrix by matrix (one per expert for a fused tensor).

    Args:
        t: the target.
        target: fp32 tensor in the checkpoint's shape (the delta, or the full weight for SparseGPT).
        hs: the Hessians of its group, or None for an uncalibrated method (RTN).
        solve: ``solve(matrix [out, in], H or None) -> SolveResult`` (None: round-to-nearest).
        scheme: the grid, for packing.
    Returns:
        The packed delta (rows of the E experts stacked, ``[E*out, in]``, for a fused tensor), the
        compressed values in the checkpoint's shape, and per-tensor stats: the solver's, plus for
        expert tensors the calibration tokens (``tokens``, or ``expert_tokens`` per expert), and
        ``calibration`` (with ``rtn_experts`` for a fused tensor) where a matrix fell back to RTN.
    """
    results, tokens, rtn = [], [], []
    num = den = 0.0
    for j, (m, (key, e)) in enumerate(zip(t.matrices(target), t.hessian_keys())):
        H, n = hs.get(key, e) if hs is not None else (None, 0)
        if hs is not None and H is None:
            rtn.append(j)
        r = solve(m, H)
        if H is not None:
            err = m - r.values
            num += float(torch.sum((err @ H) * err))
            den += float(torch.sum((m @ H) * m))
        results.append(r)
        tokens.append(n)
    res = _stack(results)
    packed = pack_delta(res.codes.cpu(), res.scales.cpu(), None if scheme.sym else res.zeros.cpu(),
                        None if res.mask is None else res.mask.cpu(), scheme.bits, scheme.group_size)
    stats = dict(res.stats)
    if hs is not None:
        if den > 0 or num > 0:
            stats["rel_out_err"] = num / den if den > 0 else 0.0
        # per-expert nn.Linear modules (an experts ModuleList) count as experts too
        expert = t.site.kind == "experts" or "experts" in t.site.key.split(".")
        if t.experts:
            stats["expert_tokens"] = tokens
        elif expert:
            stats["tokens"] = tokens[0]
        if rtn:
            why = NO_TOKENS if expert else NO_INPUT
            stats["calibration"] = why
            if t.experts:
                stats["rtn_experts"] = rtn
    return TargetResult(packed, t.stored(res.values), stats)


@dataclass
class EncodedTarget:
    """One target compressed by a solver-free scheme: its codec's parts, their matrix ``shape`` as the
    manifest states it (``[out, in]`` or ``[E, out, in]``), the values in the checkpoint's layout."""

    parts: dict[str, torch.Tensor]
    shape: list[int]
    values: torch.Tensor
    stats: dict = field(default_factory=dict)


def encode_target(t: Target, target: torch.Tensor, codec, scheme: DeltaScheme) -> EncodedTarget:
    """Compress a target with ``codec.encode`` (a ``deltazip.formats.codecs.MatrixCodec`` that needs no
    solver): the ``[out, in]`` matrices stacked along rows, as the packed kind stacks fused experts.

    Args:
        target: fp32 tensor in the checkpoint's shape (the delta, or the full weight).
    """
    rows = torch.cat(t.matrices(target)).float().cpu()  # [E*out, in]
    parts, values = codec.encode(rows, scheme)
    shape = [t.experts, rows.shape[0] // t.experts, rows.shape[1]] if t.experts else list(rows.shape)
    return EncodedTarget(parts, shape, t.stored(values.to(target.device)))

