"""Sensitivity, measured while compressing: what each candidate setting of each tensor costs.

Before ΔCompress proper (``--target-ratio``, ``--max-bytes`` or ``--report``), one probe pass walks
the model layer by layer, as the pipeline does, and gives every compressed tensor a
:class:`~deltazip.compress.allocation.Curve`: for each candidate setting the bytes it would store
(after the lossless stage, manifest entry included: ``ArtifactWriter.entry_size``) and the error it
would cause in its layer's output on the calibration data.

**The error of a setting** of a packed tensor (linears, an untied lm_head, experts) starts from the
OBS solver's own objective, ``tr(E H Eᵀ)`` with ``E = Δ - Q⊙M`` and ``H = 2XᵀX/n``: twice the mean
squared error of the linear's output per calibration token. Every tensor's error is put in one unit
so that they add up: the error it causes in the residual stream, per token relative to the stream's
own size there (its mean square over the hidden dimension), averaged over the calibration tokens.

- a linear: ``gain(site) · tr(E H_w Eᵀ)``. ``H_w = 2 Σ_t w_t x_t x_tᵀ / n`` weighs each token by ``w_t =
  1 / mean(h_t²)`` of the stream ``h_t`` entering the layer, so a token whose stream is large (the
  massive activations of attention-sink tokens) counts for less, as the next norm divides it away.
  ``gain`` is how much of an error in the linear's output reaches the layer's output, measured once
  per site: one calibration batch is run with Gaussian noise (``NOISE`` of the output's RMS) added
  to the site's output, ``gain = ||Δ layer output||² / ||noise||²`` (an attention score projection's
  error is damped by the softmax, an output projection's passes whole). Expert sites get gain 1 and
  the layer's mean token weight (per-expert runs would cost a forward per expert).
- the output head (an untied lm_head, or an embedding tied to it): its logit error ``tr(E H_w Eᵀ) /
  gain(head)`` with tokens weighted by the last layer's stream, where ``gain(head) = ||Δ logits||² /
  ||noise||²`` for noise added to the last layer's output (through the final norm): the stream error
  that would move the logits as much.
- an embedding (``rows``): ``2·mean ||E[row]||² / mean(f[row]²)`` over the rows the calibration tokens
  looked up (the stream entering layer 0 is the looked-up row), plus the head term when it is also
  the output head (tied, or stored as its alias; over a fixed sample of ``HEAD_ROWS`` rows).

The probe's OBS solves of linears use ``H_w`` too (routed experts: their unweighted per-expert ``H``),
where ΔCompress uses the unweighted ``H``: each setting is then the one that minimises the very error
it is scored by, and the probe's forward accumulates one ``x xᵀ`` sum per site instead of two.

A dropped delta costs ``E = Δ``. Candidates: ``drop``, bits {2, 3, 4, 8} × {2:4, dense}; embeddings
``drop`` and row bits {2, 3, 4, 8}.

**How the probe keeps near the time of a second compression** (docs/compress.md, "Sensitivity"):
the layer runs on the fine-tuned weights (nothing is reconstructed), so one forward per layer both
gathers every site's (weighted) Hessian and gives the next layer's input (ΔCompress runs six per
layer); the gains are measured on ``GAIN_SEQUENCES`` sequences of one batch; the eight settings of a matrix are solved in ONE run of the OBS column loop with their rows stacked
(``obs.obs_solve`` takes the code width and the 2:4 choice per row; rows are independent given
``H``, so each setting's rows come out exactly as if solved alone); and of a large matrix only a fixed
random sample of ``SAMPLE_ROWS`` rows is solved, its errors and bytes scaled to all rows (the same
rows for every setting, so settings are compared on equal terms); a stacked run's rows are split over
one column loop per intra-op thread (``obs.obs_solve_split``: on CPU two one-thread loops side by side
take half the time of one two-thread loop). Byte counts compress at most ``SAMPLE_BYTES`` of each part,
packed and sized in two threads that run beside the next matrices' solves and the next layer's forward.

A matrix no calibration token reached has no ``H``: its settings are solved by round-to-nearest (as
the pipeline stores it) and weighted by the mean diagonal of its site's other Hessians (0 when there
are none: its measured error is then zero).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from deltazip.compress.allocation import LINEAR_SETTINGS, ROW_SETTINGS, Curve, Setting
from deltazip.compress.experts import HEAD_KEY, Hessians, collect_hessians
from deltazip.compress.host_memory import release_freed_memory
from deltazip.compress.obs import SolveResult, obs_solve_split, rtn_compress
from deltazip.compress.rows_and_exact import exact_stored_size
from deltazip.compress.vision import packed_bytes, vision_scheme
from deltazip.formats import codecs
from deltazip.formats.codecs.rows import (
    MAX_ABS,
    changed_rows,
    dequantize_rows,
    effective_group,
    quantize_rows,
)
from deltazip.formats.codecs.xor import bitwise_equal
from deltazip.formats.packing import pack_delta
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.layer_map import Target
from deltazip.models.model_walk import set_param

SAMPLE_ROWS = 512
"""Rows of each matrix the candidate settings are solved on (all rows of a smaller matrix). Fewer rows
would do for the errors, but their packed parts must fill a lossless chunk or two for the byte counts
to hold within 1%: 256 rows of a 576-column 2-bit matrix overestimated it by 2%, and sampling by
weights instead (192 or 256 rows of SmolLM2's 1536-column down_proj, 4-8 s less probe) left
SmolLM2 artifacts 1.0-1.05% under their budget where 512 rows leave them 0.3-0.7% under."""
SAMPLE_BYTES = 1 << 17
"""Parts larger than this are sized from their leading rows (``ArtifactWriter.entry_size``)."""
HEAD_ROWS = 4096
"""Rows of a tied embedding whose head error is computed (a fixed random sample)."""
SOLVE_ELEMENTS = 1 << 23
"""Elements (rows × columns) per stacked candidate solve: larger matrices solve their settings in turns."""
GAIN_SEQUENCES = 2
"""Calibration sequences each site's gain is measured on (a ratio of noise energies: 2 x 128 tokens of
SmolLM2 give it to about 1%; a whole batch of 8 cost 9 of a SmolLM2 probe's 89 s)."""
NOISE = {torch.float32: 1e-2}
"""Relative noise of the gain runs, by compute dtype (5e-2 for half types, whose rounding is coarser)."""
# Manifest fields every artifact has besides its entries (lineage, config, calibration, stats, files),
# what each side file, each layer's and each compressed tensor's error stats add (measured on tiny Llama
# and SmolLM2 artifacts).
_MANIFEST_BASE, _PER_SIDE_FILE, _PER_LAYER, _PER_TENSOR = 1600, 135, 50, 165
_PER_VISION_TENSOR = 225  # a vision linear's stats (stats.vision.tensors: longer names, the output error)


@dataclass
class Sensitivity:
    """What the probe measured.

    Attributes:
        curves: one per compressed tensor (those bit-identical to the base are stored ``same``, free).
        fixed_bytes: bytes stored whatever the settings: exact tensors, copied side files, the rest of
            the manifest.
        finetuned_bytes: the fine-tuned checkpoint's bytes in its stored dtype (the ratio's numerator).
        seconds: the probe's wall time; tokens: calibration tokens.
        gains: per layer, each site's gain (module docstring).
    """

    curves: list[Curve]
    fixed_bytes: int
    finetuned_bytes: int
    seconds: float = 0.0
    tokens: int = 0
    gains: list[dict[str, float]] = field(default_factory=list)


def candidate_solves(m: torch.Tensor, H: torch.Tensor, settings: list[Setting], group: int, sym: bool,
                     damp: float, pool=None, workers: int = 1):
    """Yield ``(setting, SolveResult)`` for every setting (none dropped) of matrix ``m`` ``[R, C]``, the
    settings' rows stacked into as few OBS runs as ``SOLVE_ELEMENTS`` allows, each run's rows split over
    ``workers`` threads of ``pool`` (``obs.obs_solve_split``)."""
    R = m.shape[0]
    per = max(1, SOLVE_ELEMENTS // max(m.numel(), 1))
    for j in range(0, len(settings), per):
        chunk = settings[j:j + per]
        bits = torch.tensor([s.bits for s in chunk], device=m.device).repeat_interleave(R)
        sparse = torch.tensor([s.sparsity == "2:4" for s in chunk], device=m.device).repeat_interleave(R)
        res = obs_solve_split(m.repeat(len(chunk), 1), H, bits, sparse, group, sym, damp, pool, workers)
        for k, s in enumerate(chunk):
            rows = slice(k * R, (k + 1) * R)
            keep = res.mask[rows] if s.sparsity == "2:4" else None
            yield s, SolveResult(res.codes[rows], res.scales[rows], res.zeros[rows], keep, res.values[rows],
                                 loss=res.loss[rows])


def _tr(E: torch.Tensor, H: torch.Tensor | float) -> float:
    """``tr(E H Eᵀ)`` (``H`` a matrix, or a scalar standing for ``h·I``)."""
    if isinstance(H, torch.Tensor):
        return float(torch.sum((E @ H) * E))
    return H * float(E.pow(2).sum())


def _tr_each(E: torch.Tensor, H: torch.Tensor | float) -> list[float]:
    """``tr(E_k H E_kᵀ)`` of each ``E_k`` of ``E`` ``[K, R, C]``, in one product."""
    if not isinstance(H, torch.Tensor):
        return [H * float(v) for v in E.pow(2).sum((1, 2))]
    K, R, C = E.shape
    return [float(v) for v in ((E.reshape(K * R, C) @ H).reshape(K, R, C) * E).sum((1, 2))]


def _row_sample(rows: int, k: int, seed: int = 0) -> torch.Tensor | None:
    """A fixed random sample of ``k`` of ``rows`` row indices (sorted), None when ``k >= rows``."""
    if k >= rows:
        return None
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed))[:k].sort().values


class Probe:
    """The probe pass over one model (module docstring); ``run`` is the pipeline's run state
    (compress/pipeline.py ``_Run``: the skeleton model, its layer maps, checkpoints, writer, options)."""

    def __init__(self, run):
        self.run, self.cfg = run, run.cfg
        self.curves: list[Curve] = []
        self.fixed = 0
        # Stand-in Hessian scale h (for h·I) of a layer the calibration forward never reaches: the mean
        # diagonal of the last calibrated layer's Hessians (its inputs are hidden states of that size).
        self.h_unreached = 0.0
        self.freq: dict[str, torch.Tensor] = {}
        self.gains: list[dict[str, float]] = []
        # the candidate solves' column loops, one per intra-op thread the user allowed (measure() opens it)
        self.workers, self.pool = max(1, torch.get_num_threads()), None
        self.sizer, self.unsized = None, []  # the byte counts' threads (measure() opens them); curves waiting

    # -- packed tensors ------------------------------------------------------------------------
    def linear_curve(self, t: Target, hs: Hessians | None, layer: int | None, weight: float,
                     hs_err: Hessians | None = None, wbar: float = 1.0) -> None:
        """Append ``t``'s curve, errors ``tr(E H_w Eᵀ)`` (``hs_err``; a matrix it lacks uses ``wbar`` times its
        solve Hessian from ``hs``) times ``weight`` (the site's gain); nothing for a tensor bit-identical to
        the base (it is stored ``same``)."""
        run, n = self.run, t.name
        fb, ff = run.base.get(n), run.ft.get(n)
        if bitwise_equal(fb, ff):
            return
        delta = ff.float().to(run.device) - fb.float().to(run.device)
        group = run.group_of(t.in_features)
        err = dict.fromkeys(LINEAR_SETTINGS, 0.0)
        packed: dict[Setting, list] = {s: [] for s in LINEAR_SETTINGS[1:]}
        rows = scale = 0
        for m, (key, e) in zip(t.matrices(delta), t.hessian_keys()):
            pick = _row_sample(m.shape[0], SAMPLE_ROWS)
            ms = m if pick is None else m[pick.to(m.device)]
            rows, scale = rows + ms.shape[0], scale + m.shape[0]
            H = self._hessian(hs, key, e)
            Hw = hs_err.get(key, e)[0] if hs_err is not None else None
            # A solve's own loss is its error under the H it was solved with: that is H_w itself (sites
            # with a weighted sum), or H_w = wbar·H (routed experts); the head is scored by the product.
            if Hw is None:
                own = wbar
            else:
                src = hs.source(key, e) if hs is not None else None
                own = 1.0 if src is not None and src is hs_err.source(key, e) else None
            Hw = Hw if Hw is not None else H * wbar
            errs = [(LINEAR_SETTINGS[0], ms)]  # E of the settings without a loss (dropped first): one product
            for s, r in self._solves(ms, H, LINEAR_SETTINGS[1:], group):
                if own is not None and r.loss is not None:
                    err[s] += own * float(r.loss.sum()) * m.shape[0] / ms.shape[0]
                else:
                    errs.append((s, ms - r.values))
                # packed in the sizing thread (codes kept as bytes until then: 8 bits at most)
                packed[s].append((r.codes.to(torch.uint8).cpu(), r.scales.cpu(),
                                  None if self.cfg.sym else r.zeros.cpu(), None if r.mask is None else r.mask.cpu()))
            for (s, _), v in zip(errs, _tr_each(torch.stack([E for _, E in errs]), Hw)):
                err[s] += v * m.shape[0] / ms.shape[0]
        # The lossless stage sizes each part in one or two chunks, mostly on one core: the settings go to two
        # sizing threads (the codec releases the GIL) and are collected later (``settle``), so that they
        # run beside the next matrices' solves and the next layer's forward instead of before them.
        sizes = [self.sizer.submit(self._linear_bytes, t, s, packed.get(s), ff.dtype, scale / rows, group)
                 for s in LINEAR_SETTINGS]
        curve = Curve(n, "linear", list(LINEAR_SETTINGS), [], [err[s] * weight for s in LINEAR_SETTINGS],
                      ff.numel(), layer)
        self.curves.append(curve)
        self.unsized.append((curve, sizes))

    def settle(self) -> None:
        """Wait for the byte counts still being computed and put them in their curves."""
        for curve, sizes in self.unsized:
            curve.bytes = [f.result() for f in sizes]
        self.unsized.clear()

    def _hessian(self, hs: Hessians | None, key: str, expert: int | None) -> torch.Tensor | float:
        """The matrix's Hessian; without one (no token reached it) the mean diagonal of its site's other
        Hessians, standing for ``h·I`` (0.0 when there are none)."""
        if hs is None:  # a layer the calibration forward never reaches
            return self.h_unreached
        H, _ = hs.get(key, expert)
        if H is not None:
            return H
        return _mean_diagonal(hs, key)

    def _solves(self, m: torch.Tensor, H: torch.Tensor | float, settings, group: int):
        if isinstance(H, torch.Tensor):
            yield from candidate_solves(m, H, list(settings), group, self.cfg.sym, self.cfg.damp, self.pool,
                                        self.workers)
            return
        for s in settings:  # no Hessian: round-to-nearest, as the pipeline stores such a matrix
            yield s, rtn_compress(m, DeltaScheme(bits=s.bits, group_size=group, sparsity=s.sparsity, sym=self.cfg.sym))

    def _linear_bytes(self, t: Target, s: Setting, solved: list | None, dtype: torch.dtype, rows_scale: float,
                      group: int) -> int:
        """Stored bytes of ``t`` at setting ``s``, from each matrix's solved ``(codes, scales, zeros, mask)``
        of its sampled rows (``rows_scale``: all rows / sampled rows)."""
        w = self.run.writer
        if s.dropped:
            return w.entry_size(t.name, codecs.get("drop").fields(t.shape, dtype), {})
        deltas = [pack_delta(codes, scales, zeros, mask, s.bits, group) for codes, scales, zeros, mask in solved]
        parts = {k: torch.cat([d.parts()[k] for d in deltas]) for k in deltas[0].parts()}
        fields = codecs.get("packed").fields(deltas[0].scheme, t.matrix_shape, dtype, True, t.transposed, t.experts)
        return w.entry_size(t.name, fields, parts, SAMPLE_BYTES, rows_scale)

    # -- embeddings ----------------------------------------------------------------------------
    def rows_curve(self, name: str, head_H: torch.Tensor | None, head_gain: float = 1.0) -> None:
        """Append embedding ``name``'s curve, or count it as fixed when it is stored exactly (unchanged,
        not a matrix, or a delta beyond what a float16 offset holds: ``record_embedding``'s rules)."""
        run = self.run
        b, f = run.base.get(name), run.ft.get(name)
        delta = f.float() - b.float() if f.dim() == 2 and b.shape == f.shape and b.dtype == f.dtype else None
        if bitwise_equal(b, f) or delta is None or not bool(torch.isfinite(delta).all()) \
                or float(delta.abs().max()) > MAX_ABS:
            self.fixed += exact_stored_size(run.writer, name, b, f)
            return
        err = self._rows_error(name, f.float(), head_H, head_gain)
        g = effective_group(f.shape[1], run.row_group_of(f.shape[1]))
        changed = changed_rows(b, f)
        sizes, errs = [], []
        for s in ROW_SETTINGS:
            if s.dropped:
                sizes.append(run.writer.entry_size(name, codecs.get("drop").fields(f.shape, f.dtype), {}))
                errs.append(err(delta))
                continue
            parts = quantize_rows(delta, changed, s.bits, g)
            fields = codecs.get("rows").fields(tuple(f.shape), f.dtype, s.bits, g, int(parts["qweight"].shape[0]), 0.0)
            sizes.append(run.writer.entry_size(name, fields, parts, SAMPLE_BYTES))
            errs.append(err(dequantize_rows(parts, tuple(f.shape), s.bits, g) - delta))
        self.curves.append(Curve(name, "rows", list(ROW_SETTINGS), sizes, errs, f.numel()))

    def _rows_error(self, name: str, f: torch.Tensor, head_H: torch.Tensor | None, head_gain: float):
        """``err(E)`` of an embedding's row error ``E`` ``[V, H]`` (module docstring): each looked-up row's
        squared error relative to its own mean square, averaged over the lookups (times 2), plus the head
        term when it is the output head."""
        weight = self._row_weights(name, f.shape[0])
        weight = 2 * weight / weight.sum() / f.pow(2).mean(1).clamp_min(1e-12)
        pick = _row_sample(f.shape[0], HEAD_ROWS)
        pick = slice(None) if pick is None else pick
        head = f.shape[0] / f[pick].shape[0] / head_gain if head_H is not None else 0.0

        def err(E: torch.Tensor) -> float:
            return float((E.pow(2).sum(1) * weight).sum()) + (_tr(E[pick], head_H) * head if head else 0.0)
        return err

    def _row_weights(self, name: str, rows: int) -> torch.Tensor:
        """Lookups of each row on the calibration data (counted by ``count_lookups``); uniform over all
        rows when the embedding's inputs were not row indices."""
        counts = self.freq.get(name)
        if counts is None or int(counts.sum()) == 0:
            return torch.ones(rows)
        return counts.float()

    def count_lookups(self):
        """Forward pre-hooks that count each embedding's row lookups (``self.freq``); returns the handles."""
        handles = []
        for name in self.run.embeddings:  # checkpoint names; the module by transformers' renaming
            mname = self.run.module_name.get(name, name)
            mod = self.run.model.get_submodule(mname.rsplit(".", 1)[0]) if "." in mname else self.run.model
            if not isinstance(mod, torch.nn.Embedding):
                continue

            def hook(m, args, name=name):
                x = args[0] if args else None
                if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.numel() \
                        and int(x.min()) >= 0 and int(x.max()) < m.num_embeddings:
                    self.freq[name] = self.freq.get(name, 0) + torch.bincount(x.reshape(-1).cpu(),
                                                                              minlength=m.num_embeddings)
            handles.append(mod.register_forward_pre_hook(hook))
        return handles


def token_weights(h: torch.Tensor) -> torch.Tensor:
    """``1 / mean(h_t²)`` of each token's stream ``h`` ``[..., H]`` -> ``[...]`` (module docstring)."""
    return 1.0 / h.float().pow(2).mean(-1).clamp_min(1e-12)


class WeightedHessians:
    """``H_w = 2 Σ_t w_t x_t x_tᵀ / n`` of a layer's non-expert sites, gathered by forward pre-hooks while the
    layer runs (``self.w``: token weights ``[B, T]`` of the batch running). Use as a context manager."""

    def __init__(self, layer, sites):
        self.hs, self.w, self.handles, self.last = Hessians(), None, [], (None, None)
        self.sites = sites
        for key in sites:
            if self.covers(key):
                self.handles.append(layer.get_submodule(key).register_forward_pre_hook(self._hook(key)))

    def covers(self, key: str) -> bool:
        """Whether site ``key`` gets a weighted sum (not routed experts: their inputs are token subsets)."""
        return self.sites[key].kind != "experts" and "experts" not in key.split(".")

    def _hook(self, key: str):
        def fn(_m, args):
            x = args[0]
            if x is self.last[0]:  # q/k/v (gate/up) read one tensor: accumulate it once
                self.hs.share(key, self.last[1])
            elif self.w is not None and tuple(x.shape[:-1]) == tuple(self.w.shape):
                self.last = (x, key)
                self.hs.add(key, None, x.float() * self.w.sqrt().unsqueeze(-1))
        return fn

    def __enter__(self) -> WeightedHessians:
        return self

    def __exit__(self, *exc) -> None:
        self.last = (None, None)
        for h in self.handles:
            h.remove()


def _outside(probe: Probe) -> None:
    """Load every tensor outside the decoder layers into the skeleton (fine-tuned values) and count the
    bytes of those stored exactly. Embeddings get curves later (they need the head's Hessian)."""
    run = probe.run
    for n, mod in run.outside():
        f = run.ft.get(n)
        if run.head_alias_of and n == run.head_alias_name:
            probe.fixed += run.writer.entry_size(n, codecs.get("alias").fields(run.head_alias_of, f.shape, f.dtype), {})
            continue
        scheme = vision_scheme(run.cfg.scheme, f.shape[1]) if n in run.vision and run.compresses_vision else None
        if scheme is not None and not bitwise_equal(run.base.get(n), f):  # the vision side: at its scheme,
            probe.fixed += packed_bytes(run.writer, n, run.base.get(n), f, scheme, run.cfg.additive) \
                + _PER_VISION_TENSOR  # and its stats in the manifest
        elif n not in run.embeddings or f.dim() != 2 or not f.is_floating_point():
            probe.fixed += exact_stored_size(run.writer, n, run.base.get(n), f)
        if mod is not None:
            set_param(run.model, mod, f.to(run.cdtype), run.device)


# Keyword arguments whose rows are ``k`` per sequence, batch-major: Mllama's vision states
# ``[B · images · tiles, P, H]``, which its cross-attention views as ``[B, images · tiles · P, H]``.
_PER_SEQUENCE_ROWS = frozenset({"cross_attention_states"})


def _leading(batch, y0: torch.Tensor, n: int):
    """The first ``n`` sequences of a calibration ``batch`` (``(hidden [B, T, H], kwargs)``) and of its
    output ``y0``: every tensor of two or more dimensions whose first is ``B`` is cut. Unchanged when
    ``B <= n``, or when ``T == B`` (a ``[T, ...]`` tensor could not be told from a batch-major one)."""
    h, kw = batch
    B = h.shape[0]
    if B <= n or h.dim() < 2 or h.shape[1] == B:
        return batch, y0

    def cut(x, key=None):
        if isinstance(x, torch.Tensor):
            if x.dim() >= 2 and x.shape[0] == B:
                return x[:n]
            if key in _PER_SEQUENCE_ROWS and x.shape[0] % B == 0:
                return x[:n * (x.shape[0] // B)]
            return x
        if isinstance(x, (tuple, list)):
            return type(x)(cut(v) for v in x)
        if isinstance(x, dict):
            return {k: cut(v, k) for k, v in x.items()}
        return x
    return (h[:n], cut(kw)), y0[:n]


def site_gains(run, layer, sites, batch, y0: torch.Tensor) -> dict[str, float]:
    """Per site key: ``||Δ layer output||² / ||noise||²`` with Gaussian noise (``NOISE`` of the RMS) added to
    the site's output on the first ``GAIN_SEQUENCES`` sequences of one calibration ``batch``
    (``(hidden, kwargs)``; ``y0`` its clean output)."""
    (h, kw), y0 = _leading(batch, y0, GAIN_SEQUENCES)
    rel = NOISE.get(y0.dtype, 5e-2)
    gains = {}
    for key, site in sites.items():
        if site.kind == "experts" or "experts" in key.split("."):
            gains[key] = 1.0
            continue
        gen = torch.Generator(device=y0.device).manual_seed(0)
        added = []

        def hook(_m, _args, out, gen=gen, added=added):
            d = torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype)
            d = d * (rel * float(out.float().pow(2).mean().sqrt()))
            added.append(float(d.float().pow(2).sum()))
            return out + d
        handle = layer.get_submodule(key).register_forward_hook(hook)
        try:
            with torch.no_grad():
                y = run.run_layer(layer, h, kw)
        finally:
            handle.remove()
        gains[key] = float((y - y0).float().pow(2).sum()) / sum(added) if sum(added) else 1.0
    return gains


def _mean_diagonal(hs: Hessians, key: str | None = None) -> float:
    """Mean diagonal of the Hessians in ``hs`` (of site ``key`` only, when given); 0.0 when there are none."""
    diags = [float(torch.diag(H).mean()) for H in (hs.get(k, e)[0] for k, e in hs.counts if key is None or k == key)
             if H is not None]
    return sum(diags) / len(diags) if diags else 0.0


def _probe_layer(probe: Probe, i: int, batches):
    """One decoder layer on the fine-tuned weights: every site's Hessian and the layer's outputs in one
    pass over the calibration batches, the sites' gains on one batch, then a curve per tensor."""
    run = probe.run
    prefix, layer, lmap = run.layer_prefix(i), run.layers[i], run.maps[i]
    for n in [n for n in run.ft.names if n.startswith(prefix)]:
        f = run.ft.get(n)
        if n not in lmap.targets:
            probe.fixed += exact_stored_size(run.writer, n, run.base.get(n), f)
        lmap.put(layer, n, f, run.cdtype, run.device)
    lmap.finish()
    if not run.runs_layer(i):  # never reached by the calibration forward: errors under h·I (stored RTN)
        probe.gains.append({})
        probe.settle()
        for t in lmap.targets.values():
            probe.linear_curve(t, None, i, 1.0)
        for n, _ in layer.named_parameters():
            set_param(layer, n, None)
        return batches
    batches = [(h, run.layer_kwargs(i, k)) for k, (h, _) in enumerate(batches)]
    outs = []
    hw = WeightedHessians(layer, lmap.sites)
    with hw:
        def forward():
            with torch.no_grad():
                for h, kw in batches:
                    hw.w = token_weights(h)
                    outs.append((run.run_layer(layer, h, kw), kw))

        # Sites outside the experts are solved with the token-weighted Hessian their errors are measured
        # with (one x xᵀ sum per site instead of two: the sums, not the layer, were most of this forward);
        # routed experts keep the plain per-expert sums.
        hs = collect_hessians(layer, lmap.sites, [k for k in lmap.sites if not hw.covers(k)], forward)
        hs.update(hw.hs)
    wbar = float(torch.cat([token_weights(h).reshape(-1) for h, _ in batches]).mean()) if batches else 1.0
    gains = site_gains(run, layer, lmap.sites, batches[0], outs[0][0]) if batches else {}
    probe.gains.append({k: round(v, 5) for k, v in gains.items()})
    probe.settle()  # the previous layer's byte counts ran beside this layer's forward: at most one layer waits
    for t in lmap.targets.values():
        probe.linear_curve(t, hs, i, gains.get(t.site.key, 1.0), hw.hs, wbar)
    probe.h_unreached = _mean_diagonal(hs) or probe.h_unreached
    del hs
    for n, _ in layer.named_parameters():
        set_param(layer, n, None)
    return outs


def _side_file_bytes(run) -> int:
    """Bytes of the fine-tune's side files that differ from the base's (copied into the artifact)."""
    total = 0
    for f in run.ft.side_files():
        ref = run.base.path / f.name
        data = f.read_bytes()
        if not (ref.is_file() and ref.read_bytes() == data):
            total += len(data)
    return total


def head_gain(run, input_ids: torch.Tensor, batches, W: torch.Tensor) -> float:
    """``||Δ logits||² / ||noise||²``: Gaussian noise (``NOISE`` of the RMS) added to the last layer's output
    on the first calibration batch, logits of a fixed sample of ``HEAD_ROWS`` rows of the head ``W``
    ``[V, H]`` scaled to all ``V`` (1.0 without calibration batches)."""
    if not batches:
        return 1.0
    clean, noisy, added = [], [], []
    gen = torch.Generator(device=batches[0][0].device).manual_seed(0)

    def perturb(out):
        d = torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype)
        d = d * (NOISE.get(out.dtype, 5e-2) * float(out.float().pow(2).mean().sqrt()))
        added.append(float(d.float().pow(2).sum()))
        return out + d

    run.replay_to_head(input_ids, batches, clean.append, only=0)
    run.replay_to_head(input_ids, batches, noisy.append, only=0, change=perturb)
    pick = _row_sample(W.shape[0], HEAD_ROWS)
    Ws = (W if pick is None else W[pick]).to(clean[0].device, torch.float32)
    dz = (noisy[0] - clean[0]).float().reshape(-1, Ws.shape[1]) @ Ws.t()
    return float(dz.pow(2).sum()) * W.shape[0] / Ws.shape[0] / sum(added) if sum(added) else 1.0


def _head_curves(probe: Probe, input_ids: torch.Tensor, batches) -> None:
    """The untied lm_head's curve and the embeddings' (which need the head's Hessian when tied)."""
    run = probe.run
    head_H = head_Hw = None
    gain = 1.0
    if run.head or run.tied_names:
        hs, hsw, k = Hessians(), Hessians(), [0]

        def take(x):  # the head's input of batch k, plain and weighted by the last layer's stream
            hs.add(HEAD_KEY, None, x)
            hsw.add(HEAD_KEY, None, x.float() * token_weights(batches[k[0]][0]).sqrt().unsqueeze(-1))
            k[0] += 1

        run.replay_to_head(input_ids, batches, take)
        (head_H, _), (head_Hw, _) = hs.get(HEAD_KEY), hsw.get(HEAD_KEY)
        W = run.ft.get(run.head or next(iter(run.tied_names)))
        gain = head_gain(run, input_ids, batches, W) or 1.0
        probe.gains.append({"lm_head": round(gain, 5)})
    if run.head:
        probe.linear_curve(run.head_target(tuple(run.ft.shape(run.head))), _head_hessians(head_H), None, 1.0 / gain,
                           _head_hessians(head_Hw))
    for name in sorted(run.embeddings & set(run.ft.names)):
        probe.rows_curve(name, head_Hw if name in run.tied_names else None, gain)


def measure(run, input_ids: torch.Tensor, progress=None) -> Sensitivity:
    """The probe pass (module docstring) with the pipeline's run state ``run`` (a fresh ``_Run``: the
    probe leaves the fine-tuned weights in its skeleton).

    Args:
        input_ids: int64 ``[N, T]`` calibration windows.
        progress: ``progress(description, done, total)``.
    Returns:
        The curves, the fixed bytes and the fine-tuned checkpoint's bytes.
    """
    t0 = time.time()
    progress = progress or (lambda *a: None)
    probe = Probe(run)
    with ThreadPoolExecutor(max_workers=probe.workers) as probe.pool, ThreadPoolExecutor(max_workers=2) as probe.sizer:
        _probe_all(probe, input_ids, progress)
        probe.settle()
    return Sensitivity(probe.curves, probe.fixed, run.ft.nbytes(), round(time.time() - t0, 3),
                       int(input_ids.numel()), probe.gains)


def _probe_all(probe: Probe, input_ids: torch.Tensor, progress) -> None:
    """measure()'s walk: the tensors outside the layers, each layer, then the head and embeddings."""
    run = probe.run
    _outside(probe)
    handles = probe.count_lookups()
    try:
        batches = run.first_inputs(input_ids)
    finally:
        for h in handles:
            h.remove()
    n = len(run.layers)
    progress("measuring sensitivity", 0, n)
    for i in range(n):
        batches = _probe_layer(probe, i, batches)
        release_freed_memory()
        progress("measuring sensitivity", i + 1, n)
    _head_curves(probe, input_ids, batches)
    probe.fixed += _side_file_bytes(run) + _MANIFEST_BASE + _PER_SIDE_FILE * len(run.ft.side_files()) \
        + _PER_LAYER * n + _PER_TENSOR * len(probe.curves)


def _head_hessians(H: torch.Tensor | None) -> Hessians:
    hs = Hessians()
    if H is not None:
        hs.sums[(HEAD_KEY, None)] = H / 2
        hs.counts[(HEAD_KEY, None)] = 1
    return hs
