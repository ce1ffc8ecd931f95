"""Find the parts of a decoder-only transformers model generically (no per-model table).

The decoder layers are the ``nn.ModuleList`` with ``config.num_hidden_layers`` children of one
class; the compressible linears are the ``nn.Linear`` modules inside a layer; their true-sequential
groups are found by running the layer once and grouping linears that read the same input tensor
(q/k/v, then o, then gate/up, then down for Llama; the same rule yields GPT-NeoX's order).
"""

from __future__ import annotations

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from deltazip.formats.errors import InputError


def empty_model(model_dir, dtype: torch.dtype) -> nn.Module:
    """A causal-LM skeleton: parameters on the meta device, buffers (rotary tables) real."""
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:
        raise InputError(f"{model_dir}: config.json cannot be read by transformers ({e})") from e
    with init_empty_weights(include_buffers=False):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except ValueError as e:
            raise InputError(f"{model_dir}: not a causal language model transformers knows ({e})") from e
    model.eval()
    return model


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Qualified name and module of the decoder layer list."""
    n = getattr(model.config, "num_hidden_layers", None)
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and len({type(m) for m in mod}) == 1:
            if n is not None and len(mod) != n:
                continue
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise InputError(f"cannot find the decoder layers of {type(model).__name__}: not a decoder-only model?")
    return best


def layer_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """Linear modules of one layer by their name relative to the layer."""
    return {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}


def set_param(module: nn.Module, name: str, value: torch.Tensor | None, device="cpu") -> None:
    """Put ``value`` in parameter/buffer ``name`` (``None`` moves it back to meta to free memory)."""
    if value is None:
        set_module_tensor_to_device(module, name, "meta")
    else:
        set_module_tensor_to_device(module, name, device, value=value)


def sequential_groups(layer: nn.Module, run) -> list[list[str]]:
    """True-sequential groups of a layer's linears, in execution order.

    Args:
        layer: decoder layer with real weights.
        run: callable that runs the layer forward once on some input.
    """
    linears = layer_linears(layer)
    seen: list[tuple[torch.Tensor, list[str]]] = []

    def hook(name):
        def fn(_mod, args):
            x = args[0]
            for t, names in seen:
                if t is x or (t.shape == x.shape and t.data_ptr() == x.data_ptr()):
                    names.append(name)
                    return
            seen.append((x, [name]))  # keeping x alive keeps data_ptr from being reused
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    groups = [names for _, names in seen]
    missing = set(linears) - {n for g in groups for n in g}
    if missing:  # linears the forward never called (unused heads): compress them last, on their own
        groups.append(sorted(missing))
    return groups


class StopForward(Exception):
    """Raised by the Catcher once it has the first layer's inputs."""


class Catcher(nn.Module):
    """Stands in for decoder layer 0 to record its inputs, then stops the model's forward."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.captured: list[tuple[torch.Tensor, dict]] = []

    def __getattr__(self, name):  # models read attributes such as attention_type off their layers
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)

    def forward(self, hidden_states, *args, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_value", "past_key_values")}
        if args:
            kwargs["__args__"] = args
        self.captured.append((hidden_states, kwargs))
        raise StopForward
