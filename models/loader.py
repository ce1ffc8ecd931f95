"""The one way a causal LM is built from a checkpoint directory (transformers' own loader, so its
checkpoint-key conventions apply), with one error: a directory transformers cannot load as a causal
LM is one line naming it, never a traceback.

Serving wraps it with the attention choice and its start-up self-check
(``deltazip.runtime.serve.model.load_base_model``); merging builds the fine-tune from a merged
checkpoint with it (``deltazip.compress.merge.load_merged_model``); eval loads plain HF targets with
it. ``deltazip.runtime.share.dedup_loader`` is not a third way of reading weights into the same
classes but a registry-backed one (weights shared by identity across models).
"""

from __future__ import annotations

from pathlib import Path

from deltazip.formats.errors import InputError, first_line


def causal_lm_class(config):
    """The transformers class a checkpoint of ``config`` is loaded with: for an image-text model (a
    config with a ``vision_config``: Gemma 3, Mistral 3, Qwen2.5-VL, Llama 4...) its image-text-to-text
    class, else its causal LM. The image-text class holds the whole checkpoint under its own names
    (the causal-LM class transformers maps some of them to holds the language model only), and its
    forward on token ids alone is the language model's. None when transformers maps the config to neither."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    order = (AutoModelForCausalLM, AutoModelForImageTextToText)
    for auto in order[::-1] if getattr(config, "vision_config", None) is not None else order:
        try:
            return auto._model_mapping[type(config)]
        except KeyError:
            continue
    return None


def text_config(config):
    """The language model's config: an image-text model's text config, else ``config`` itself."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def is_image_text(config) -> bool:
    """Whether ``config`` is an image-text model's (a language model's config inside it)."""
    return text_config(config) is not config


def load_causal_lm(path: str | Path, dtype, attn_implementation: str | None = None, what: str = "model"):
    """The checkpoint at ``path`` as :func:`causal_lm_class` of its config, in ``dtype`` (CPU, eval mode).

    Args:
        what: how messages name the directory (``"base"``, ``"checkpoint x"``).
    Raises:
        InputError: unknown architecture, missing or broken weights.
    """
    from transformers import AutoConfig

    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        config = AutoConfig.from_pretrained(str(path))
        cls = causal_lm_class(config)
        if cls is None:
            raise ValueError(f"transformers has no causal LM or image-text-to-text class for {type(config).__name__}")
        model = cls.from_pretrained(str(path), config=config, dtype=dtype, **kw)
    except Exception as e:  # unknown architecture, broken weights
        raise InputError(f"{what} {path} cannot be loaded as a causal LM ({type(e).__name__}: {first_line(e)})") from e
    return model.eval()
