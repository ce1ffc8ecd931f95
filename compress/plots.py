"""``inspect --plot``: delta vs weight magnitudes (paper Figure 3) and per-layer error."""

from __future__ import annotations

from pathlib import Path

import torch

from deltazip.compress.merge import open_base
from deltazip.formats.artifact import Artifact
from deltazip.formats.errors import InputError
from deltazip.formats.outputs import atomic_file

_MAX_VALUES = 2_000_000
PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")
"""File extensions ``--plot`` writes (matplotlib's, without those that need LaTeX or are raw pixels)."""


def plot_format(out: str | Path) -> str:
    """The image format of ``out`` from its extension.

    Raises:
        InputError: an extension that is not one of ``PLOT_FORMATS`` (checked before any work).
    """
    ext = Path(out).suffix.lower().lstrip(".")
    if ext not in PLOT_FORMATS:
        what = f"extension .{ext}" if ext else "no extension"
        raise InputError(f"--plot {out}: {what} is not an image format; end the name with one of "
                         f"{', '.join('.' + f for f in PLOT_FORMATS)} (e.g. delta.png)")
    return ext


def plot_artifact(art: Artifact, base_spec: str | None, out: str | Path) -> Path:
    """Write the figure: log10 |w| histograms of base weights and stored deltas; layer errors; and, for an
    artifact whose tensors got different settings (``--target-ratio``), code bits by layer per tensor kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from deltazip.formats.report import allocation_by_layer

    by_layer = allocation_by_layer(art)
    fig, axes = plt.subplots(1, 3 if by_layer else 2, figsize=(16.5 if by_layer else 11, 4))
    _magnitudes(axes[0], art, base_spec)
    _layer_errors(axes[1], art)
    if by_layer:
        _bits_by_layer(axes[2], by_layer)
    fig.tight_layout()
    out = Path(out)
    with atomic_file(out) as tmp:  # a reader never sees half an image
        fig.savefig(tmp, dpi=110, format=plot_format(out))
    plt.close(fig)
    return out


def _magnitudes(ax, art: Artifact, base_spec: str | None) -> None:
    base = open_base(art, base_spec, check_fingerprint=False)
    g = torch.Generator().manual_seed(0)
    w_vals, d_vals = [], []
    linears = [e for e in art.entries().values() if e.is_matrix]  # compressed linears, of any scheme
    per = max(1, _MAX_VALUES // max(1, len(linears)))
    for e in linears:
        n = e.name
        d = e.codec.dense(e, art.parts(n)).flatten()
        d = d[d != 0]
        w = base.get(n).float().flatten()
        d_vals.append(d[torch.randint(0, d.numel(), (min(per, d.numel()),), generator=g)] if d.numel() else d)
        w_vals.append(w[torch.randint(0, w.numel(), (min(per, w.numel()),), generator=g)])
    for vals, label in ((torch.cat(w_vals), "base weights"), (torch.cat(d_vals), "compressed delta (kept)")):
        v = vals.abs()
        v = v[v > 0]
        ax.hist(torch.log10(v).numpy(), bins=120, alpha=0.6, label=label, density=True)
    ax.set_xlabel("log10 |value|")
    ax.set_ylabel("density")
    ax.set_title("magnitudes: base weights vs delta")
    ax.legend()


def _layer_errors(ax, art: Artifact) -> None:
    layers = art.manifest.get("layers") or []
    xs = [L["index"] for L in layers if L.get("rel_out_err") is not None]
    if xs:
        ax.plot(xs, [L["rel_out_err"] for L in layers if L.get("rel_out_err") is not None], "o-",
                label="layer output")
        ax.plot(xs, [L["rel_update_err"] for L in layers if L.get("rel_update_err") is not None], "s-",
                label="layer update (output - input)")
        ax.set_yscale("log")
        ax.legend()
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("relative error vs fine-tuned")
    ax.set_title("per-layer error on calibration data")


def _bits_by_layer(ax, by_layer: dict[str, dict[int, float]]) -> None:
    """One line per tensor kind: its code bits (0 = dropped) in each decoder layer."""
    for kind, bits in by_layer.items():
        xs = sorted(bits)
        ax.plot(xs, [bits[i] for i in xs], "o-", label=kind, alpha=0.8)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("code bits (0 = delta dropped)")
    ax.set_yticks([0, 2, 3, 4, 8])
    ax.set_title("--target-ratio: bits by layer")
    ax.legend(fontsize=7)
