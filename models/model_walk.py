"""Find the parts of a decoder-only transformers model generically (no per-model table).

The decoder layers are the ``nn.ModuleList`` with ``config.num_hidden_layers`` children of one
class. The compressible weights of a layer are its *sites* (``layer_sites``): ``nn.Linear`` modules,
transformers' ``Conv1D`` (GPT-2; weight stored ``[in, out]``), and the fused 3-D parameters
``[E, out, in]`` of a mixture-of-experts module (Mixtral, Qwen2-MoE in transformers 5), whose expert
``e`` is ``F.linear(x_e, param[e])`` on the tokens routed to it (GPT-OSS stores them ``[E, in, out]``
and runs ``x_e @ param[e]``). Their true-sequential groups are found by running the layer once and
grouping linears that read the same input tensor (q/k/v, then o, then gate/up, then down for Llama;
the same rule yields GPT-NeoX's and GPT-2's order); a fused expert parameter is a group of its own at
its first use (router, then experts' gate/up, then down).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from torch import nn
from transformers import AutoConfig

from deltazip.formats.errors import InputError
from deltazip.models.expert_tap import tap_experts
from deltazip.models.loader import causal_lm_class, text_config

try:  # GPT-2-style linears: weight stored [in, out], forward x @ W + b
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - transformers without it
    Conv1D = None


def empty_model(model_dir, dtype: torch.dtype) -> nn.Module:
    """A causal-LM skeleton: parameters on the meta device, buffers (rotary tables) real."""
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:
        raise InputError(f"{model_dir}: config.json cannot be read by transformers ({e})") from e
    with init_empty_weights(include_buffers=False):
        try:
            # Eager experts: each expert runs as F.linear on its own tokens, which is what
            # deltazip.compress.experts taps to build per-expert Hessians (grouped_mm would hide it).
            cls = causal_lm_class(config)
            if cls is None:
                raise ValueError(f"transformers maps {type(config).__name__} to no causal LM")
            model = cls._from_config(config, dtype=dtype, experts_implementation="eager")
        except ValueError as e:
            raise InputError(f"{model_dir}: not a causal language model transformers knows ({e})") from e
    model.eval()
    return model


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Qualified name and module of the decoder layer list.

    Among the module lists not nested in another one's modules (a layer's own lists, such as
    LongCat-Flash's two attentions, are not the model's layers), in an image-text model those of its
    language model (Qwen2.5-VL's vision tower has more blocks than its decoder has layers): the longest of
    ``num_hidden_layers`` modules where the config says, of one class or several (Jamba's attention
    and Mamba layers, OLMo hybrid's); else the longest of one class."""
    text = text_config(model.config)
    n = getattr(text, "num_hidden_layers", None)
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if text is not model.config:  # an image-text model: its language model's lists, never the vision tower's
        root = next((name for name, m in model.named_modules() if getattr(m, "config", None) is text), None)
        lists = [(name, m) for name, m in lists if root is None or name.startswith(f"{root}.")]
    outer = [(name, m) for name, m in lists if not any(name.startswith(f"{o}.") for o, _ in lists)]
    exact = [c for c in outer if n is not None and len(c[1]) == n]
    uniform = [c for c in outer if len({type(x) for x in c[1]}) == 1]
    best = max(exact or uniform, key=lambda c: len(c[1]), default=None)  # max keeps the first of equals
    if best is None:
        raise InputError(f"cannot find the decoder layers of {type(model).__name__}: not a decoder-only model?")
    return best


@dataclass(frozen=True)
class Site:
    """A place in a decoder layer where a weight matrix multiplies activations (names relative to it).

    kind ``"linear"``: ``nn.Linear``, weight ``[out, in]``; ``"conv1d"``: transformers' ``Conv1D``,
    weight stored ``[in, out]``; ``"experts"``: fused parameter ``[E, out, in]`` of an experts module,
    expert ``e`` applied as ``F.linear(x_e, param[e])`` to the tokens routed to it, or with
    ``transposed`` (GPT-OSS, Llama 4: ``experts_transposed``) ``[E, in, out]`` applied as ``x_e @ param[e]``.

    Attributes:
        key: the module's name (linear, conv1d) or the parameter's name (experts); Hessians and
            groups are keyed by it.
        kind: see above.
        param: the weight parameter's name.
        experts: E for ``"experts"``, else 0.
        transposed: the fused parameter is stored ``[E, in, out]``.
    """

    key: str
    kind: str
    param: str
    experts: int = 0
    transposed: bool = False

    @property
    def module(self) -> str:
        """Name of the module that runs the site (the experts module for fused experts)."""
        return self.key if self.kind != "experts" else self.param.rpartition(".")[0]


def is_experts_module(mod: nn.Module) -> bool:
    """A transformers 5 fused-experts module: an int ``num_experts`` and 3-D ``[E, ., .]`` parameters."""
    n = getattr(mod, "num_experts", None)
    return (isinstance(n, int) and not isinstance(n, bool) and n > 0
            and any(p.dim() == 3 and p.shape[0] == n for p in mod.parameters(recurse=False)))


def dense_routed(mod: nn.Module) -> bool:
    """Experts whose forward takes the routed hidden states alone, ``[E * T, H]``: block ``e`` is every
    token scaled by its routing weight for expert ``e`` (zero where it was not routed), and the weights
    ``[E, in, out]`` are applied by ``torch.bmm`` (Llama 4's). transformers' fused experts take
    ``(hidden_states, top_k_index, top_k_weights)`` and carry an ``is_transposed`` flag."""
    if hasattr(mod, "is_transposed"):
        return False
    try:
        sig = inspect.signature(mod.forward)
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional for p in sig.parameters.values()) == 1


def experts_transposed(mod: nn.Module) -> bool:
    """A fused experts module stores ``[E, in, out]`` (applied ``x_e @ W[e]``): transformers' flag
    (GPT-OSS), or a :func:`dense_routed` module (Llama 4)."""
    flag = getattr(mod, "is_transposed", None)
    return bool(flag) if flag is not None else dense_routed(mod)


def _num_experts(mod: nn.Module | None) -> int:
    """E of a mixture-of-experts block's ``experts`` child (a ModuleList or a fused experts module)."""
    experts = getattr(mod, "experts", None)
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    return getattr(experts, "num_experts", 0) if isinstance(experts, nn.Module) and is_experts_module(experts) else 0


def is_router(layer: nn.Module, name: str, m: nn.Module) -> bool:
    """An ``nn.Linear`` router: its ``out_features`` is the E of a sibling ``experts``, or it is the one
    linear of a router module beside the experts (Gemma 4's ``router.proj``). Routers are stored
    exactly, not compressed (their top-k is discrete and they are E x H values), as transformers 5's
    own router modules, which are not ``nn.Linear``, are."""
    if not isinstance(m, nn.Linear):
        return False
    pname = name.rpartition(".")[0]
    parent = layer.get_submodule(pname) if pname else layer
    if parent is not m and m.out_features == _num_experts(parent) > 0:
        return True
    if not pname:
        return False
    grand = layer.get_submodule(pname.rpartition(".")[0]) if "." in pname else layer
    only = [x for x in parent.modules() if isinstance(x, nn.Linear)] == [m]
    return only and m.out_features == _num_experts(grand) > 0


def layer_sites(layer: nn.Module) -> dict[str, Site]:
    """Compressible weights of one layer by site key (see ``Site``), in module order."""
    sites: dict[str, Site] = {}
    for name, m in layer.named_modules():
        if isinstance(m, nn.Linear):
            if not is_router(layer, name, m):
                sites[name] = Site(name, "linear", f"{name}.weight")
        elif Conv1D is not None and isinstance(m, Conv1D):
            sites[name] = Site(name, "conv1d", f"{name}.weight")
        elif is_experts_module(m):
            transposed = experts_transposed(m)
            for pn, p in m.named_parameters(recurse=False):
                if p.dim() == 3 and p.shape[0] == m.num_experts:
                    key = f"{name}.{pn}"
                    sites[key] = Site(key, "experts", key, m.num_experts, transposed)
    return sites


def set_param(module: nn.Module, name: str, value: torch.Tensor | None, device="cpu") -> None:
    """Put ``value`` in parameter/buffer ``name`` (``None`` moves it back to meta to free memory)."""
    if value is None:
        set_module_tensor_to_device(module, name, "meta")
    else:
        set_module_tensor_to_device(module, name, device, value=value)


def sequential_groups(layer: nn.Module, run, sites: dict[str, Site] | None = None) -> list[list[str]]:
    """True-sequential groups of a layer's sites (keys), in execution order.

    Args:
        layer: decoder layer with real weights.
        run: callable that runs the layer forward once on some input, or a sequence of such callables
            (one per calibration batch): later ones run only while some site has not been called yet
            (an expert no token of the first batch was routed to).
        sites: the layer's sites (default ``layer_sites(layer)``).
    """
    runs = [run] if callable(run) else list(run)
    sites = layer_sites(layer) if sites is None else sites
    linears = {k: layer.get_submodule(k) for k, s in sites.items() if s.kind != "experts"}
    fused = {k: layer.get_parameter(s.param) for k, s in sites.items() if s.kind == "experts"}
    seen: list[tuple[torch.Tensor | None, list[str]]] = []
    done: set[str] = set()

    def hook(name):
        def fn(_mod, args):
            if name in done:  # a site is placed at its first call
                return
            done.add(name)
            x = args[0]
            for t, names in seen:
                if t is not None and (t is x or (t.shape == x.shape and t.data_ptr() == x.data_ptr())):
                    names.append(name)
                    return
            seen.append((x, [name]))  # keeping x alive keeps data_ptr from being reused
        return fn

    def expert_used(key, _expert, _x):
        if key not in done:
            done.add(key)
            seen.append((None, [key]))  # a fused expert parameter is a group of its own

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        with torch.no_grad(), tap_experts(fused, expert_used):
            for r in runs:
                r()
                if len(done) == len(sites):
                    break
    finally:
        for h in handles:
            h.remove()
    groups = [names for _, names in seen]
    missing = set(sites) - done
    if missing:  # sites the forward never called (unused heads, experts never routed to): last, on their own
        groups.append(sorted(missing))
    return groups


class StopForward(Exception):
    """Raised by the Catcher once it has the first layer's inputs."""


class LayerStandIn(nn.Module):
    """Base of modules put in a decoder layer's place: attributes it lacks come from the layer.

    ``arity``: how the model takes a layer's output: 0, the hidden states themselves; n, a tuple of n
    whose first item is the hidden states (Bamba unpacks ``hidden_states, attn_weights``; Falcon-H1
    indexes ``[0]``). ``wrap`` returns hidden states in that form.
    """

    def __init__(self, inner: nn.Module, arity: int = 0):
        super().__init__()
        self.inner, self.arity = inner, arity

    def wrap(self, hidden_states):
        return (hidden_states, *(None,) * (self.arity - 1)) if self.arity else hidden_states

    def __getattr__(self, name):  # models read attributes such as attention_type off their layers
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)


class Catcher(LayerStandIn):
    """Stands in for a decoder layer to record the arguments the model calls it with.

    Models compute per-layer arguments before their layer loop (Gemma 2/3: the attention mask and
    rotary embeddings of the layer's attention type, sliding or global), so every layer has its
    own. With ``last`` it stops the model's forward (``StopForward``); otherwise it hands its input
    back unchanged so that the model goes on to call the next layer (the values that reach later
    layers do not matter: only their arguments are kept, their inputs come from running the real
    layers). ``keep_hidden``: keep the hidden states too (layer 0's are the calibration inputs).
    """

    def __init__(self, inner: nn.Module, last: bool = True, keep_hidden: bool = True, arity: int = 0):
        super().__init__(inner, arity)
        self.last, self.keep_hidden = last, keep_hidden
        self.captured: list[tuple[torch.Tensor | None, dict]] = []

    def forward(self, hidden_states, *args, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_value", "past_key_values", "cache")}
        if args:
            kwargs["__args__"] = args
        self.captured.append((hidden_states if self.keep_hidden else None, kwargs))
        if self.last:
            raise StopForward
        return self.wrap(hidden_states)
