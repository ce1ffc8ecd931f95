"""Images in chat requests: read from the message parts, and turned into a prompt by the model's
own processor.

OpenAI clients send an image as a content part ``{"type": "image_url", "image_url": {"url": ...}}``
whose URL is a ``data:image/...;base64,...`` URL or an ``http(s)://`` one (fetched with a time and size
limit). The chat template renders each image part as its placeholder (``{"type": "image"}``, as
transformers' processors' templates read it); the processor of the served checkpoint
(``AutoProcessor``, from the variant's files, else the base's) expands each placeholder into the
image's tokens and gives the pixel tensors, which the engine's model reads (``prompt_media``).
:func:`log_images` says at start-up whether the served base reads images.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from deltazip.formats.errors import first_line
from deltazip.models.loader import is_image_text
from deltazip.runtime.serve.openai_schema import ApiError
from deltazip.runtime.serve.prompt_media import PromptMedia

log = logging.getLogger("deltazip.serve")

FETCH_TIMEOUT_S = 10.0
_PROCESSORS: dict[Path, Any] = {}
_LOCK = threading.Lock()


def image_url(part: dict) -> str | None:
    """The URL of an ``image_url`` content part (``{"url": ...}`` or the URL itself), None for other parts."""
    if part.get("type") != "image_url":
        return None
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise ApiError(400, "an image_url content part needs image_url.url (a data: or http(s) URL)", param="messages")
    return url


def read_image(url: str, limit: int):
    """The image at ``url`` as an RGB ``PIL.Image`` (``limit``: most bytes read). 400 on anything else."""
    from PIL import Image, UnidentifiedImageError

    data = _fetch(url, limit)
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ApiError(400, f"image_url {_short(url)} is not an image PIL can read ({type(e).__name__}: {e})",
                       param="messages") from e
    return img.convert("RGB")


def _fetch(url: str, limit: int) -> bytes:
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ApiError(400, "a data: image URL must be base64 (data:image/png;base64,...)", param="messages")
        if len(payload) > limit * 4 // 3 + 4:
            raise ApiError(413, f"an image is larger than this server accepts ({limit} bytes)", param="messages")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ApiError(400, f"a data: image URL is not valid base64 ({e})", param="messages") from e
    if not url.startswith(("http://", "https://")):
        raise ApiError(400, f"image_url {_short(url)}: only data: and http(s) URLs are read", param="messages")
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as r:  # noqa: S310 (scheme checked above)
            data = r.read(limit + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ApiError(400, f"image_url {_short(url)} could not be fetched ({e})", param="messages") from e
    if len(data) > limit:
        raise ApiError(413, f"image_url {_short(url)} is larger than this server accepts ({limit} bytes)",
                       param="messages")
    return data


def _short(url: str) -> str:
    return url if len(url) <= 60 else url[:57] + "..."


# Where a checkpoint keeps its image processor: transformers 5 writes it inside processor_config.json.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def processor(files: Path, base_files: Path):
    """The served checkpoint's processor (its own files where it has an image processor, else the
    base's), loaded once per directory. 400 when it cannot be loaded (e.g. a package it needs)."""
    def has(d: Path) -> bool:
        return any((Path(d) / f).is_file() for f in PROCESSOR_FILES)

    path = Path(files) if has(files) else Path(base_files)
    if not has(path):
        raise ApiError(400, f"this model has no image processor ({' or '.join(PROCESSOR_FILES)} in {path}); send "
                            "text content parts, or serve a checkpoint saved with its processor", param="messages")
    with _LOCK:
        if path not in _PROCESSORS:
            from transformers import AutoProcessor

            try:
                _PROCESSORS[path] = AutoProcessor.from_pretrained(str(path))
            except Exception as e:  # no processor files, or a package its image/video processor needs
                raise ApiError(400, f"this model's image processor could not be loaded from {path} "
                                    f"({type(e).__name__}: {first_line(e)})", param="messages") from e
        return _PROCESSORS[path]


def image_prompt(proc, text: str, images: list) -> tuple[list[int], PromptMedia]:
    """Token ids of a rendered chat prompt with its images expanded, and the tensors the model reads."""
    if not hasattr(proc, "image_processor"):
        raise ApiError(400, "the served model has no image processor; send text content parts", param="messages")
    try:
        out = proc(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    except Exception as e:  # e.g. the template placed fewer image placeholders than there are images
        raise ApiError(400, f"the images do not fit the prompt: {type(e).__name__}: {first_line(e)}",
                       param="messages") from e
    ids = out.pop("input_ids")[0].tolist()
    for k in ("attention_mask", "labels"):  # labels: PaliGemma's processor gives training targets too
        out.pop(k, None)
    return ids, PromptMedia({k: v for k, v in out.items() if hasattr(v, "dtype")}, len(images))


def log_images(engine, base_path: Path) -> dict[str, Any] | None:
    """The ``images`` line of an image-text base: ``{"read": True, "processor": class name}`` (the
    base's processor, loaded now and kept for the first request), or ``{"read": False, "why": line}``;
    None for a text model."""
    if not is_image_text(engine.backend.config):
        return None
    why = engine.images_refused()
    if why is None:
        try:
            proc = processor(base_path, base_path)
        except ApiError as e:  # no processor files, or a package it needs (torchvision) missing here
            why = e.message
        else:
            if not hasattr(proc, "image_processor"):
                why = f"the processor in {base_path} has no image processor"
    if why is not None:
        log.info("images: not read in chat requests (%s); text prompts are served", why)
        return {"read": False, "why": why}
    log.info("images: read in chat requests (image_url parts), by %s from %s", type(proc).__name__, base_path)
    return {"read": True, "processor": type(proc).__name__}
