"""The vision side of an image-text fine-tune: the linears of its vision tower and projector.

A fine-tune that trained them (rather than freezing them, as text fine-tunes do) changes matrices
the text calibration never reaches. With ``--calib-images DIR`` they are compressed like the language
model's linears: each one's Hessian ``H = 2XᵀX/n`` comes from its inputs while the model's own
forward reads the images (the checkpoint's processor turns each image into the model's tensors; the
forward stops where the language model starts, ``models.image_inputs``), then the same OBS solve and
scheme as the text linears. The Hessians are taken in one pass over the fine-tuned vision weights
(not layer by layer on reconstructed ones: the vision tower has no per-layer calibration walk).

Without images they are stored exactly, as before, with a warning when they are a large part of the
fine-tune; ``--method rtn`` rounds them like every other linear.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from deltazip.compress.config import auto_group
from deltazip.compress.experts import Hessians
from deltazip.compress.obs import rtn_compress
from deltazip.formats import codecs
from deltazip.formats.artifact import ArtifactWriter
from deltazip.formats.errors import InputError, first_line
from deltazip.formats.packing import pack_delta
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.image_inputs import language_model, on_model, run_to_language_model
from deltazip.models.loader import is_image_text

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
MAX_IMAGES = 256


def calibration_images(path: str | Path) -> list[Path]:
    """The image files of ``--calib-images`` (sorted, at most ``MAX_IMAGES``); InputError if none."""
    p = Path(path)
    if not p.is_dir():
        raise InputError(f"--calib-images {p}: not a directory; pass a directory of .png/.jpg images")
    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise InputError(f"--calib-images {p}: no image files (.png, .jpg, .jpeg, .webp, .bmp, .gif) in it")
    return files[:MAX_IMAGES]


def vision_linears(model: nn.Module, ckpt_name: dict[str, str], stored: set[str]) -> dict[str, str]:
    """``checkpoint name -> module name`` of the weights of ``model``'s linears outside its language
    model (vision tower, projector) and its output head, for those the checkpoint stores; empty for a
    model without a vision side."""
    if not is_image_text(model.config):
        return {}
    lm_name, _ = language_model(model)
    head = model.get_output_embeddings()
    out = {}
    for mname, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or mod is head or mname == lm_name or mname.startswith(f"{lm_name}."):
            continue
        pname = f"{mname}.weight"
        name = ckpt_name.get(pname, pname)
        if name in stored:
            out[name] = mname
    return out


def _processor(model_dir: Path):
    """The checkpoint's processor and its image placeholder; InputError where it reads no images."""
    from transformers import AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(str(model_dir))
    except Exception as e:  # no processor files, or a package its processor needs
        raise InputError(f"{model_dir}: the image processor could not be loaded for --calib-images "
                         f"({type(e).__name__}: {first_line(e)})") from e
    placeholder = getattr(proc, "image_token", None)
    if not hasattr(proc, "image_processor") or not isinstance(placeholder, str):
        raise InputError(f"{model_dir}: its processor ({type(proc).__name__}) does not read images; drop --calib-images")
    return proc, placeholder


def _read_image(f: Path):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(f) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise InputError(f"--calib-images: {f} is not an image PIL can read ({e}); remove it") from e


def image_hessians(model: nn.Module, modules: dict[str, str], model_dir: Path, images: list[Path],
                   device: torch.device, dtype: torch.dtype) -> Hessians:
    """Hessians (keyed by checkpoint name) of the linears ``modules`` (checkpoint name -> module
    name) from ``images`` read by ``model``'s forward through the processor in ``model_dir``."""
    proc, placeholder = _processor(model_dir)
    hs = Hessians()
    handles = [model.get_submodule(m).register_forward_pre_hook(lambda _m, args, n=n: hs.add(n, None, args[0]))
               for n, m in modules.items()]
    try:
        for f in images:
            rgb = _read_image(f)
            out = dict(proc(text=[placeholder], images=[rgb], return_tensors="pt"))
            ids = out.pop("input_ids").to(device)
            for k in ("attention_mask", "labels"):  # labels: PaliGemma's processor gives training targets
                out.pop(k, None)
            try:
                run_to_language_model(model, ids, on_model({k: v for k, v in out.items() if hasattr(v, "dtype")},
                                                           device, dtype))
            except InputError:
                raise
            except Exception as e:  # a model whose forward does not take its processor's output this way
                raise InputError(f"--calib-images: {type(model).__name__} could not read {f.name} "
                                 f"({type(e).__name__}: {first_line(e)})") from e
    finally:
        for h in handles:
            h.remove()
    return hs


class CrossAttentionImages:
    """Calibration windows that a model's cross-attention layers read (Mllama): window ``i`` starts
    with the placeholder of image ``i mod len(images)`` (its other tokens moved right by one, the last
    dropped), which every token of it sees, as the processor's ``cross_attention_mask`` marks a text
    after its image. :meth:`batch` gives the tensors the model's forward takes beside the ids.

    Memory: the forward's vision states of every window are kept for the layer-by-layer walk, ``[N,
    H]`` per window (Llama 3.2 11B: 4 tiles of 1,601 tokens, hidden 4,096: 52 MB per window in bf16).
    """

    def __init__(self, model_dir: Path, images: list[Path], input_ids: torch.Tensor):
        proc, placeholder = _processor(model_dir)
        token = proc.tokenizer.convert_tokens_to_ids(placeholder)
        per_image = []
        for f in images:
            out = dict(proc(text=[placeholder], images=[_read_image(f)], return_tensors="pt"))
            ids = out.pop("input_ids")[0].tolist()
            mask = out.pop("cross_attention_mask", None)
            if mask is None or token not in ids:
                raise InputError(f"--calib-images: the processor in {model_dir} gives no cross_attention_mask for "
                                 f"{f.name}; its model's cross-attention layers cannot be calibrated on images")
            per_image.append(({k: v for k, v in out.items() if hasattr(v, "dtype") and k != "attention_mask"},
                              mask[0, ids.index(token)]))  # [images, tiles]: what a text after the image sees
        n, t = input_ids.shape
        self.input_ids = torch.cat([torch.full((n, 1), token, dtype=input_ids.dtype), input_ids[:, :-1]], dim=1)
        self.samples = [per_image[i % len(per_image)] for i in range(n)]
        self.seqlen = t

    def batch(self, start: int, end: int, device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The forward's image tensors of windows ``[start, end)`` (pixel values, aspect ratios, and
        ``cross_attention_mask`` ``[B, T, 1, tiles]``), on ``device`` (floating ones in ``dtype``)."""
        rows = self.samples[start:end]
        out = {k: torch.cat([r[0][k] for r in rows]) for k in rows[0][0]}
        out["cross_attention_mask"] = torch.stack([r[1].expand(self.seqlen, *r[1].shape) for r in rows])
        return on_model(out, device, dtype)


def vision_scheme(scheme: DeltaScheme, in_features: int) -> DeltaScheme | None:
    """The scheme of a vision linear with ``in_features`` inputs: the options' one, its group the
    largest of 128/64/32 dividing them where the options' does not (vision widths such as 3420 are
    not multiples of 128); None (stored exactly) where 2:4 cannot tile them."""
    if scheme.sparsity == "2:4" and in_features % 4:
        return None
    g = scheme.group_size
    if g != -1 and in_features % g:
        g = auto_group([in_features])
    return scheme if g == scheme.group_size else scheme.replace(group_size=g)


def packed_bytes(writer: ArtifactWriter, name: str, base: torch.Tensor, ft: torch.Tensor, scheme: DeltaScheme,
                 additive: bool) -> int:
    """Bytes of ``name`` stored packed with ``scheme``, sized from its round-to-nearest codes (the
    byte budget of ``--target-ratio`` counts the vision linears at their scheme, not exact)."""
    target = ft.float() - base.float() if additive else ft.float()
    r = rtn_compress(target, scheme)
    d = pack_delta(r.codes.to(torch.uint8).cpu(), r.scales.cpu(), None if scheme.sym else r.zeros.cpu(),
                   None if r.mask is None else r.mask.cpu(), scheme.bits, scheme.group_size)
    return writer.entry_size(name, codecs.get("packed").fields(d.scheme, list(ft.shape), ft.dtype, additive), d.parts())
