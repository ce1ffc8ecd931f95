"""What an image-text model's own forward hands its language model.

An image-text model turns a prompt with images into its language model's inputs in its own forward
(vision tower, projector, feature layers, patch merging, positions: each model its own way). Both the
server (the image rows of a prompt) and compression (the vision side's Hessians from calibration
images) need that part of the forward and nothing after it: :func:`run_to_language_model` runs it and
stops where the language model starts.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from deltazip.formats.errors import InputError
from deltazip.models.loader import text_config


def language_model(model: nn.Module) -> tuple[str, nn.Module]:
    """``(qualified name, module)`` of an image-text model's language model (the module holding its
    text config); InputError for a model that has none apart from itself."""
    text = text_config(model.config)
    found = next(((n, m) for n, m in model.named_modules() if m is not model and getattr(m, "config", None) is text),
                 None)
    if found is None:
        raise InputError(f"{type(model).__name__} has no language model apart from its vision tower")
    return found


def cross_attention_layers(config) -> tuple[int, ...]:
    """The indices of the decoder layers that read images by cross-attention (Mllama); empty for
    other models."""
    return tuple(getattr(text_config(config), "cross_attention_layers", None) or ())


_LANGUAGE_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def language_model_of(model: nn.Module) -> nn.Module:
    """:func:`language_model`'s module, found once per model (the engine asks every step)."""
    lm = _LANGUAGE_MODELS.get(model)
    if lm is None:
        lm = _LANGUAGE_MODELS[model] = language_model(model)[1]
    return lm


@contextlib.contextmanager
def handing(model: nn.Module, kwargs: dict):
    """While it lasts, ``model``'s language model is called with ``kwargs`` over what its caller hands
    it (Qwen3-VL's DeepStack features, which its forward computes only from pixels)."""
    if not kwargs:
        yield
        return
    hook = language_model_of(model).register_forward_pre_hook(lambda _m, args, kw: (args, {**kw, **kwargs}), with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()


class _Reached(Exception):
    """Raised by the hook on the language model: the forward has made its inputs."""


def run_to_language_model(model: nn.Module, input_ids: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict:
    """Run ``model``'s forward on ``input_ids [1, T]`` with its processor's other ``tensors`` (on the
    model's device and dtype) until its language model is called; returns what the language model
    was handed (its keyword arguments, and its positional ones under ``"_args"``). Exceptions of the
    forward before that point propagate."""
    _, lm = language_model(model)
    seen: dict = {}

    def stop(_mod, args, kwargs):
        seen.update(kwargs, _args=args)
        raise _Reached

    hook = lm.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.inference_mode():
            model(input_ids=input_ids, use_cache=False, **tensors)
    except _Reached:
        pass
    finally:
        hook.remove()
    return seen


def on_model(tensors: dict[str, torch.Tensor], device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A processor's tensors on the model's device, floating ones in its compute dtype."""
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in tensors.items()}
