"""The served models: one base model with decoupled delta modules, or whole models to swap.

- :func:`open_served_base` picks the base and refuses artifacts compressed against another one
  (variants are found by ``deltazip.runtime.serve.variant_sources.discover_variants``).
- :class:`DeltaModel` (``--mode delta``, paper §5.1): the base model built by transformers from its
  checkpoint, each module that some variant changes replaced by its decoupled counterpart
  (``deltazip.runtime.serve.delta_linear``), ``N`` device slots. A variant is loaded from disk into a
  :class:`HostDelta` (packed deltas as stored, replaced tensors rebuilt) and from there into a slot.
- :class:`SwapModels` (``--mode swap``, the paper's vLLM-SCB baseline): ``N`` whole models on the
  device, each slot holding one merged fine-tune (or the base), replaced whole on a miss.

Both expose the same small interface to the engine (``load_host``, ``write_slot``, ``clear_slot``,
``forward``) and are driven through a :class:`deltazip.runtime.serve.delta_cache.TieredCache`.

Tensor names: artifacts name tensors as the checkpoint does; they are mapped to module parameter
names by transformers' own loading rules (``deltazip.models.param_names``: GPT-NeoX's
``embed_out`` is ``lm_head``). Per row the decoupled model applies changed ``nn.Linear`` and
``Conv1D`` weights and biases, embedding tables (plain, Gemma's scaled ones, learned positions:
``deltazip.runtime.serve.delta_embedding``), Llama- and Gemma-style RMSNorm and Cohere LayerNorm
weights and ``nn.LayerNorm`` weights and biases, mixture-of-experts routers and fused experts
(``deltazip.runtime.serve.delta_experts``, which also maps per-expert checkpoint names onto the fused
parameters), attention sinks (``deltazip.runtime.serve.delta_sinks``, on the paged attention), and
output scales (``deltazip.runtime.serve.delta_scale``: Gemma 3n's AltUp).
A variant that changes a tensor the runtime cannot apply per row (or one transformers loads through
a converter rather than a rename) is refused with a message naming the tensor and pointing at
``--mode swap``, which goes through transformers' own loader and so serves any causal LM it can load.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deltazip.formats.artifact import Artifact
from deltazip.formats.errors import ArtifactError, InputError
from deltazip.kernels.packed import PackedDelta
from deltazip.kernels.reference import delta_weight
from deltazip.models.checkpoint import Checkpoint
from deltazip.models.devices import resolve_dtype
from deltazip.models.image_inputs import language_model
from deltazip.models.loader import causal_lm_class, is_image_text, load_causal_lm, text_config
from deltazip.models.param_names import module_names, tied_names
from deltazip.runtime.serve.attention import is_paged
from deltazip.runtime.serve.delta_activation import DeltaActivation, is_learned_activation
from deltazip.runtime.serve.delta_embedding import can_decouple, decouple_embedding
from deltazip.runtime.serve.delta_experts import (
    DeltaExperts,
    DeltaRouter,
    ExpertLoraFactors,
    MoeLayout,
    is_own_forward_router,
    lora_key,
    router_tensors,
)
from deltazip.runtime.serve.delta_linear import DeltaContext, DeltaLinear, is_linear
from deltazip.runtime.serve.delta_mixer import DeltaMixer, mixer_of, mixer_pieces
from deltazip.runtime.serve.delta_norms import DeltaLayerNorm, DeltaRMSNorm, layer_norm_offset, norm_function
from deltazip.runtime.serve.delta_scale import DeltaScale, output_scale_param
from deltazip.runtime.serve.delta_sinks import DeltaSinks
from deltazip.runtime.serve.kernel_tuner import LoraJob, Tuner
from deltazip.runtime.serve.kernel_warmup import tune_new_keys
from deltazip.runtime.serve.lora_experts import merged_param
from deltazip.runtime.serve.lora_variant import conv1d_modules, linear_shapes, lora_base
from deltazip.runtime.serve.model_runner import (
    forward_step,
    new_kv_pool,
    new_seq_kv,
    run_model,
)
from deltazip.runtime.serve.projections import merge_projections
from deltazip.runtime.serve.prompt_media import PromptInputs, PromptMedia, is_prefix_lm, read_prompt
from deltazip.runtime.serve.recurrent_state import mark_tokenwise, recurrent_layer_types
from deltazip.runtime.serve.variant_sources import VariantInfo
from deltazip.runtime.serve.vision_params import VisionParams
from deltazip.runtime.share.dedup_registry import TensorDedupRegistry
from deltazip.runtime.share.dedup_serving import (
    DedupLedger,
    LoadTally,
    new_serving_registry,
    share_parameters,
    share_tensor,
)

BASE_SLOT = -1
log = logging.getLogger("deltazip.serve")


# --------------------------------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------------------------------


def open_served_base(variants: list[VariantInfo], base_spec: str | None, command: str = "serve") -> Checkpoint:
    """The base to serve: ``base_spec`` or the artifacts' lineage base, fingerprint-checked.

    Only artifacts carry a lineage with a fingerprint; LoRA adapters and full checkpoints are checked
    against the base when the model is built (names, shapes, ``base_model_name_or_path``).
    ``command`` (``serve`` or ``eval``) picks the wording of the fixes the errors suggest.

    Raises:
        InputError: no base named anywhere, lineages disagree, or an artifact was compressed
            against another base (the message names the artifact).
    """
    spec = base_spec
    variants = [v for v in variants if v.kind == "artifact"]
    if spec is None:
        named = {str(v.lineage.get("base")) for v in variants if v.lineage.get("base")}
        if not named:
            raise InputError("no artifact names its base model; pass --base")
        fps = {v.lineage.get("base_fingerprint") for v in variants}
        if len(fps) > 1:
            raise InputError(f"the artifacts were compressed against {len(fps)} different bases; "
                             + ("serve one base per server (pass --base and point at a directory of its variants)"
                                if command == "serve" else "evaluate the artifacts of one base per run"))
        spec = sorted(named)[0]
        if not Path(spec).expanduser().exists() and len(named) > 1:
            spec = next((s for s in sorted(named) if Path(s).expanduser().exists()), spec)
    base = Checkpoint(spec, "base")
    fp = base.fingerprint()
    for v in variants:
        want = v.lineage.get("base_fingerprint")
        if not want:
            raise InputError(f"artifact {v.name} ({v.path}) records no base fingerprint; it cannot be checked "
                             f"against the base")
        if want != fp:
            fix = ("remove it from the directory or serve its own base" if command == "serve" else
                   "pass the base it was compressed against as --base (its lineage names "
                   f"{v.lineage.get('base')}), or evaluate it in a run of its own")
            raise InputError(f"artifact {v.name} ({v.path}) was compressed against a different base than {base.path} "
                             f"(base fingerprint differs); {fix}")
    return base


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # missing or broken tokenizer files: the server cannot encode prompts
        raise InputError(f"{path}: no usable tokenizer ({type(e).__name__}: {e})") from e
    if not getattr(tok, "chat_template", None):  # an image-text checkpoint's template may be its processor's only
        tok.chat_template = processor_chat_template(path)
    return tok


def processor_chat_template(path: Path) -> str | None:
    """The chat template of a processor's ``chat_template.json`` in ``path`` (``{"chat_template": ...}``,
    which image-text checkpoints ship and the tokenizer does not read), or None."""
    f = Path(path) / "chat_template.json"
    try:
        template = json.loads(f.read_text(encoding="utf-8")).get("chat_template") if f.is_file() else None
    except (OSError, ValueError, AttributeError) as e:
        raise InputError(f"{f}: not a chat template file ({type(e).__name__}: {e}); fix or remove it") from e
    return template if isinstance(template, str) and template else None


def served_dtype(name: str, device: torch.device, base: Checkpoint) -> torch.dtype:
    """The dtype ``base`` is served in for a ``--dtype`` value (``deltazip.models.devices``: ``auto`` is
    fp32 on CPU; on CUDA the checkpoint's half dtype, fp16 for an fp32 checkpoint)."""
    if name != "auto":
        return resolve_dtype(name, device, torch.float32, serving=True)
    first = next((n for n in base.names if base.dtype(n).is_floating_point), None)
    return resolve_dtype(name, device, base.dtype(first) if first else torch.float32, serving=True)


def load_base_model(base: Checkpoint, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The base causal LM through transformers' loader, in eval mode, loaded with the attention
    implementation ``deltazip.runtime.serve.masks.attention_implementation`` picks (SDPA, or eager
    for models SDPA cannot run: no SDPA support, soft-capped attention scores), then switched to the
    paged KV cache's attention (``deltazip.runtime.serve.attention``) where the model class takes
    attention functions and derives no ALiBi bias from the padding mask; the others keep the loaded
    implementation and the engine's contiguous cache with ``masks``.

    Raises:
        InputError: the model cannot be loaded, has layers the engine does not run,
            or fails a few test forwards through the engine's cache and masks (one line, at start-up,
            instead of a server that answers every request with an error).
    """
    from transformers import AutoConfig

    from deltazip.runtime.serve.masks import attention_implementation, unsupported_layer_types
    from deltazip.runtime.share.weight_share import attached_model

    try:
        config = AutoConfig.from_pretrained(str(base.path))
        impl = attention_implementation(causal_lm_class(config), config)
    except Exception as e:  # no or broken config.json, unknown model type
        raise InputError(f"base {base.path} cannot be loaded as a causal LM ({type(e).__name__}: {e})") from e
    # A worker of `deltazip serve --workers K` builds the model over the weight owner's mapped tensors.
    model = attached_model(base.path, dtype, device, attn_implementation=impl)
    if model is None:
        model = load_causal_lm(base.path, dtype, attn_implementation=impl, what="base")
    bad = unsupported_layer_types(model.config)
    if bad:
        raise InputError(f"base {base.path} uses {', '.join(bad)} layers, which the serving engine does not run; serve "
                         f"a model whose layers are full, sliding-window or chunked attention, linear attention, "
                         f"short convolutions or attention beside a state-space mixer")
    model = model.to(device).eval()
    _self_check(model, base.path, device, dtype)
    return model


def _self_check(model: nn.Module, path: Path, device: torch.device, dtype: torch.dtype) -> None:
    """Choose the model's serving attention and check it: the reference is a plain forward of every
    prefix with the attention the model was loaded with; then the model is switched to the paged
    attention where it takes it (``deltazip.runtime.serve.attention.use_paged_attention``) and two
    rows of different lengths run through the engine's cache (paged or contiguous) and masks: a
    prefill, a two-token chunk after a past (chunked prefill) and a one-token decode. A model whose
    recurrent layers ignore their state in a step of several tokens (:func:`_scans_from_zero`) is
    marked to continue states one token at a time first. Refuses the model (one line) when the
    engine's way of calling it fails or disagrees, which would fail every request."""
    from deltazip.runtime.serve.attention import use_paged_attention
    from deltazip.runtime.serve.masks import uses_padding_mask_bias

    text = text_config(model.config)
    vocab = int(getattr(text, "vocab_size", 2) or 2)
    # Longer than a small sliding window (or attention chunk), so its masking is checked too where it is cheap.
    window = getattr(text, "sliding_window", None) or getattr(text, "attention_chunk_size", None) or 0
    n = max(5, window + 2) if window <= 62 else 5
    rows = [[(7 * i + 3) % vocab for i in range(n)], [(5 * i + 1) % vocab for i in range(3)]]
    steps = [rows, [[11 % vocab, 2 % vocab], [13 % vocab, 4 % vocab]], [[17 % vocab], [19 % vocab]]]
    try:
        with torch.inference_mode():
            seqs, want = [[], []], []
            for new in steps:
                seqs = [s + t for s, t in zip(seqs, new)]
                want += [model(input_ids=torch.tensor([s], device=device), **_prompt_types(model, s, r, device)
                               ).logits[:, -1].float() for s, r in zip(seqs, rows)]
            if not uses_padding_mask_bias(model.config):
                use_paged_attention(model)  # the paged KV cache's attention where the model class takes one
            if recurrent_layer_types(model.config) and _scans_from_zero(model, device, dtype):
                mark_tokenwise(model.config)
            got = _engine_logits(model, steps, device, dtype)
    except Exception as e:  # the model's forward does not take the engine's cache/masks
        raise InputError(f"base {path}: {type(model).__name__} cannot run in the serving engine (a test forward "
                         f"failed: {type(e).__name__}: {e}); serve another architecture") from e
    want = torch.cat(want)
    tol = 1e-3 if dtype == torch.float32 else 0.1
    if not torch.allclose(got, want, atol=tol * max(1.0, float(want.abs().max())), rtol=0):
        raise InputError(f"base {path}: {type(model).__name__} gives other logits in the serving engine than in a "
                         f"plain forward (max difference {float((got - want).abs().max()):.3g}); it cannot be served")


def _engine_logits(model: nn.Module, steps: list[list[list[int]]], device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor:
    """Last-position logits ``[len(steps) * B, V]`` of ``steps`` (per step, the new tokens of each of
    the ``B`` rows) run one after the other through the engine's KV pool and step runner for ``model``."""
    pool = new_kv_pool(model)
    caches = [new_seq_kv(pool) for _ in steps[0]]
    be = _BaseRows(model, device, dtype)
    prompts = [PromptInputs.prefix(len(t)) for t in steps[0]] if is_prefix_lm(model.config) else None
    try:
        return torch.cat([forward_step(be, pool, caches, [BASE_SLOT] * len(new), new, [c.length for c in caches],
                                       inputs=prompts if i == 0 else None) for i, new in enumerate(steps)])
    finally:
        for c in caches:
            c.free()


def _prompt_types(model: nn.Module, seq: list[int], prompt: list[int], device: torch.device) -> dict:
    """A prefix language model's ``token_type_ids`` for ``seq``, whose first ``len(prompt)`` tokens
    are the prompt (0: seen both ways) and the rest what follows it (1: causal); else nothing."""
    if not is_prefix_lm(model.config):
        return {}
    types = [0] * len(prompt) + [1] * (len(seq) - len(prompt))
    return {"token_type_ids": torch.tensor([types], device=device)}


class _BaseRows:
    """The step runner's backend contract over the bare base model (start-up checks)."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype):
        self.model, self.config, self.device, self.dtype = model, model.config, device, dtype

    def forward(self, row_slots, input_ids, position_ids, attention_mask, kv) -> torch.Tensor:
        return run_model(self.model, input_ids, position_ids, attention_mask, kv)


def _scans_from_zero(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the model's recurrent layers ignore a sequence's recurrent state in a step of several
    tokens after a past (Mamba-1 style mixers: Jamba, Mamba). A prefilled sequence is forked, the
    fork's recurrent states (not its convolution windows, which such steps do read) are doubled, and
    both take the same two-token step in one forward: equal logits mean the states went unread."""
    pool = new_kv_pool(model)
    be = _BaseRows(model, device, dtype)
    first = new_seq_kv(pool)
    caches = [first]
    try:
        with torch.inference_mode():
            forward_step(be, pool, caches, [BASE_SLOT], [[3, 5, 7]], [0])
            caches.append(first.fork())
            states = pool.states
            row = torch.tensor([caches[1].state_row_in(states)])
            keys = [k for k in states.t if k[1] == "recurrent"]
            if not keys:  # convolution windows only (LFM2): nothing a chunk could drop
                return False
            for k in keys:
                states.scatter(k, row, states.gather(k, row) * 2 + 1)
            out = forward_step(be, pool, caches, [BASE_SLOT] * 2, [[11, 13]] * 2, [c.length for c in caches])
        # A state that is read moves the logits far (every entry doubled, plus one); one that is not
        # leaves the two rows equal up to how the device orders a batched GEMM's rows.
        return bool(torch.allclose(out[0], out[1], rtol=0, atol=1e-4 * max(1.0, float(out[0].abs().max()))))
    finally:
        for c in caches:
            c.free()


def max_context(config) -> int:
    """Longest sequence (prompt + completion) the model's position embeddings allow."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len"):
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 2048


def eos_token_ids(model_dir: Path, tokenizer, config) -> list[int]:
    """Token ids that end a generation: the generation config's, else the model config's, else the
    tokenizer's (what ``generate`` stops on)."""
    ids: Any = None
    gpath = model_dir / "generation_config.json"
    if gpath.is_file():
        try:
            ids = json.loads(gpath.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            ids = None
    if ids is None:
        ids = getattr(config, "eos_token_id", None)
    if ids is None:
        ids = getattr(text_config(config), "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


# --------------------------------------------------------------------------------------------------
# The decoupled model
# --------------------------------------------------------------------------------------------------


@dataclass
class HostDelta:
    """One variant decoded into host memory, ready to be copied into a device slot.

    ``modules`` maps a decoupled module's qualified name to the keyword arguments of its
    ``load_slot`` (packed deltas stay packed; replaced tensors are in the model dtype).
    """

    name: str
    modules: dict[str, dict[str, Any]] = field(default_factory=dict)

    def nbytes(self) -> int:
        total = 0
        for kw in self.modules.values():
            for v in kw.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
                elif isinstance(v, PackedDelta):
                    total += v.nbytes()
                elif isinstance(v, ExpertLoraFactors):
                    total += sum(t.numel() * t.element_size() for t in (v.a, v.b))
        return total


def load_checkpoint_tensors(v: VariantInfo, names: list[str], dtype: torch.dtype, tally: LoadTally
                            ) -> dict[str, torch.Tensor]:
    """Tensors ``names`` of a full-checkpoint variant in ``dtype``, each through the dedup registry.

    Stored in ``dtype`` already: looked up from the file bytes, so a tensor the registry holds is
    never copied out of the file (no transient memory for an A/B copy). Otherwise read, converted
    and then looked up.
    """
    from deltazip.formats.safetensors_raw import RawFile
    from deltazip.runtime.share.dedup_registry import TORCH_TO_ST

    ck = Checkpoint(v.path, f"checkpoint {v.name}")
    want = TORCH_TO_ST[dtype]
    pin = torch.cuda.is_available()
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(ck.file_of[n], []).append(n)
    out: dict[str, torch.Tensor] = {}
    for f, group in by_file.items():
        with RawFile(f) as raw:
            for n in group:
                e = raw.entries[n]
                if e.dtype == want:
                    out[n] = tally.share_raw(raw.view(n), e.dtype, e.shape, pin_memory=pin)
                else:
                    out[n] = tally.share(_pin(ck.get(n).to(dtype)))
    return out


def _pin(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if torch.cuda.is_available() and t.device.type == "cpu" else t


def _pin_packed(d: PackedDelta) -> PackedDelta:
    return d.map_parts(_pin)


class UnsupportedVariant(InputError):
    """A variant changes something the decoupled runtime cannot apply per row."""


class DeltaModel:
    """Base model with decoupled modules for every tensor some variant changes (paper §5.1).

    Every tensor it keeps goes through ``registry`` (see ``deltazip.runtime.share.dedup_serving``): the
    base's parameters, each variant's decoded tensors on the host, and, on a GPU, the tensors a
    device slot references. Variants can be added and removed while serving
    (:meth:`prepare_variant` in any thread, :meth:`commit_variant` / :meth:`remove_variant` on the
    engine thread between forwards): a variant that changes a module not decoupled yet gets it
    decoupled then.

    Args:
        base: the served base checkpoint (already fingerprint-checked against the variants).
        variants: the variants to serve (artifacts, full checkpoints compared with the base, LoRA
            adapters).
        num_slots: device slots ``N`` (``--max-deltas``).
        device, dtype: where and in what precision the model runs.
        registry, ledger: the dedup registry and the ledger of its savings (new ones by default).
    """

    mode = "delta"

    def __init__(self, base: Checkpoint, variants: list[VariantInfo], num_slots: int, device: torch.device,
                 dtype: torch.dtype, delta_compute: str = "auto", registry: TensorDedupRegistry | None = None,
                 ledger: DedupLedger | None = None, tuner: Tuner | None = None):
        self.base, self.device, self.dtype = base, device, dtype
        self.tuner = tuner if tuner is not None else Tuner()  # the delta-matmul tuning (kernel_warmup)
        self.registry = registry if registry is not None else new_serving_registry()
        self.ledger = ledger if ledger is not None else DedupLedger()
        self.variants: dict[str, VariantInfo] = {}
        self.num_slots = num_slots
        if delta_compute not in ("auto", "packed", "dequantized"):
            raise InputError(f"--delta-compute {delta_compute!r} is unknown; use auto, packed or dequantized")
        # auto: packed (SBMM kernel) on CUDA; on CPU there is no fast low-bit kernel, so resident
        # deltas are kept dequantized (see DeltaContext).
        self.delta_compute = ("packed" if device.type == "cuda" else "dequantized") if delta_compute == "auto" \
            else delta_compute
        self.model = self._load_model(base, dtype, device)
        # The base goes through the registry first: later variant tensors identical to a base
        # tensor are answered with it. Its own memory is kept (no copy).
        self._base_held, new, reused = share_parameters(self.model, self.registry)
        self.ledger.base_new_bytes, self.ledger.base_reused_bytes = new, reused
        self.config = self.model.config
        self.ctx = DeltaContext(num_slots, dequantize=self.delta_compute == "dequantized")
        self.ctx.defer_lora = lambda shape: self.tuner.tune_later([LoraJob(shape)])  # never measured in a step
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        # Linear shapes, experts, parameters and ties of the base (LoRA checks), before any module is decoupled.
        self._linears = linear_shapes(self.model)
        self._lora_base = lora_base(self.model)
        # Parameters that share storage (tied embeddings): a change to one is a change to all names
        # that the checkpoint does not store separately.
        self._aliases = self._lora_base.aliases
        self._moe = self._moe_layout()  # fused experts and routers, before any module is decoupled
        self._targets: dict[str, dict[str, list[tuple[str, str]]]] = {}  # variant -> tensor -> [(module, attr)]
        self._lora: dict[str, Any] = {}  # LoRA variant -> LoraSpec
        self.modules: dict[str, nn.Module] = {}
        wanted: dict[str, str] = {}  # module name -> decoupled kind
        plans = [(v, self.prepare_variant(v, wanted)) for v in variants]
        for mname, kind in sorted(wanted.items()):
            self.modules[mname] = self._replace(mname, kind)
        self._merge_projections()
        for v, plan in plans:
            self._register(v, plan)
        # Tuned at start-up once the server answers (kernel_warmup.Startup); the report fills this in.
        self.warmup = {"seconds": 0.0, "launches": 0}

    # -- building -------------------------------------------------------------------------------
    def _load_model(self, base: Checkpoint, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """The base model on ``device`` (tensor parallel overrides it to shard the model first)."""
        return load_base_model(base, dtype, device)

    def _moe_layout(self) -> MoeLayout:
        """Where variants' expert and router tensors land (tensor parallel maps them on full shapes)."""
        return MoeLayout(self.model)

    def prepare_variant(self, v: VariantInfo, wanted: dict[str, str] | None = None):
        """Check a variant against the model and plan which modules it needs; changes nothing.

        Adds ``module -> kind`` to ``wanted`` for the modules it needs decoupled. Safe to call from
        any thread (it only reads the model).

        Raises:
            UnsupportedVariant / InputError: something the decoupled runtime cannot serve (named).
        """
        wanted = {} if wanted is None else wanted
        if v.kind == "lora":
            from deltazip.runtime.serve.lora_variant import read_lora_spec

            spec = read_lora_spec(v.path, self._linears, type(self.model).__name__,
                                  lambda names: module_names(self.model, names), self._lora_base)
            return self._plan_lora(v, spec, wanted)
        return self._plan_variant(v, self._params, wanted)

    def _plan_lora(self, v: VariantInfo, spec, wanted: dict[str, str]):
        """``wanted`` gets the kind of every module a checked adapter (``spec``) changes; returns ``spec``.

        Raises:
            UnsupportedVariant: factors on a module that is neither a linear nor a router.
        """
        recurrent = bool(recurrent_layer_types(self.config))
        for mname in spec.modules:
            mod = self.model.get_submodule(mname)
            mixer = mixer_of(self.model, f"{mname}.weight") if recurrent else None
            if mixer is not None:  # a recurrent mixer reads this weight itself (Mamba's dt_proj): merged, its
                wanted[mixer[0]] = "mixer"  # rows run the mixer with it
                spec.read_by_mixer[mname] = mixer
            elif self._is_router(mname, mod):  # (its own forward; the merged weight replaces the base's per row)
                wanted[mname] = "router"
            elif is_linear(mod):
                wanted[mname] = "linear"
            else:
                raise UnsupportedVariant(f"variant {v.name}: it adapts {mname} ({type(mod).__name__}), which the "
                                         "decoupled runtime cannot apply per request; serve it with --mode swap")
        for x in spec.params.values():
            wanted[x.module] = "experts"
        spec.saved_targets = self._plan_saved(v, spec, wanted)
        self._plan_tokens(v, spec, wanted)
        return spec

    def _is_router(self, mname: str, mod: nn.Module) -> bool:
        """A MoE router (fused experts' router module, or an ``nn.Linear`` router with a forward of its own)."""
        return (isinstance(mod, DeltaRouter) or mname in self._moe.routers
                or is_own_forward_router(self.model, mname, mod))

    def _plan_tokens(self, v: VariantInfo, spec, wanted: dict[str, str]) -> None:
        """``wanted`` gets the kind of each module whose token rows the adapter replaces: an embedding's
        rows are looked up per row, a linear's (a tied ``lm_head``) added as a LoRA term.

        Raises:
            UnsupportedVariant: a module neither applies per request.
        """
        for mname in spec.tokens:
            mod = self.model.get_submodule(mname)
            kind = self._decoupled_kind(mod, "weight")
            if kind not in ("embedding", "linear"):
                raise UnsupportedVariant(f"variant {v.name}: it trains token rows of {mname} ({type(mod).__name__}), "
                                         "which the decoupled runtime cannot apply per request; serve it with --mode "
                                         "swap")
            wanted[mname] = kind

    def _plan_saved(self, v: VariantInfo, spec, wanted: dict[str, str]) -> dict[str, list[tuple[str, str]]]:
        """``parameter -> [(module, attribute)]`` for an adapter's ``modules_to_save`` tensors (with
        ``ensure_weight_tying``, the parameters tied to each that it does not save too: as PEFT, which
        otherwise trains a copy and leaves the tied weights the base's); ``wanted`` gets each module's kind.

        Raises:
            UnsupportedVariant: a tensor no decoupled module applies per request.
        """
        plan: dict[str, list[tuple[str, str]]] = {}
        tie = bool(spec.config.get("ensure_weight_tying"))  # (else PEFT's copy leaves the tied weights the base's)
        for name in spec.saved:
            plan[name] = []
            for t in [name] + [a for a in self._aliases.get(name, []) if tie and a not in spec.saved]:
                mname, attr = t.rsplit(".", 1)
                kind = self._decoupled_kind(self.model.get_submodule(mname), attr)
                if kind is None:
                    raise UnsupportedVariant(f"variant {v.name}: it saves {t} (modules_to_save), which the decoupled "
                                             "runtime cannot apply per request; serve it with --mode swap")
                wanted[mname] = kind
                plan[name].append((mname, attr))
        return plan

    def commit_variant(self, v: VariantInfo, plan, wanted: dict[str, str] | None = None) -> None:
        """Serve a prepared variant (engine thread, between forwards): decouple the modules it needs
        that are not decoupled yet (``wanted`` as filled by :meth:`prepare_variant`), then register it."""
        if wanted is None:
            wanted = {}
            self.prepare_variant(v, wanted)
        for mname, kind in sorted(wanted.items()):
            if mname not in self.modules:
                self.modules[mname] = self._replace(mname, kind)
        self._merge_projections()
        self._register(v, plan)
        tune_new_keys(self)  # queued off the engine thread; the default launch serves the variant meanwhile

    def _merge_projections(self) -> None:
        """One GEMM + one SBMM for Llama-family q/k/v and gate/up (deltazip.runtime.serve.projections)."""
        self.modules.update(merge_projections(self.model, self.modules, self.ctx, self._base_held,
                                              lambda t: share_tensor(self.registry, t)[0]))

    def _register(self, v: VariantInfo, plan) -> None:
        self.variants[v.name] = v
        if v.kind == "lora":
            self._lora[v.name] = plan
        else:
            self._targets[v.name] = plan
        self.ledger.set_same_as_base(v.name, v.same_as_base_bytes)

    def remove_variant(self, name: str) -> None:
        """Forget a variant (engine thread; its slot must have been cleared). Decoupled modules stay:
        with no slot using them they cost nothing per forward beyond a set check."""
        self.variants.pop(name, None)
        self._targets.pop(name, None)
        self._lora.pop(name, None)
        self.ledger.forget(name)

    def _plan_variant(self, v: VariantInfo, params: dict[str, nn.Parameter],
                      wanted: dict[str, str]) -> dict[str, list[tuple[str, str]]]:
        """``checkpoint tensor -> [(module, attribute)]`` of every tensor ``v`` changes (names mapped to
        parameters by transformers' own rules, ``param_names``); ``wanted`` gets each module's kind."""
        plan: dict[str, list[tuple[str, str]]] = {}
        on_moe = self._moe.targets({n: list(x.stored_shape) for n, x in v.entries.items()})  # checkpoint layout
        changed = []
        for name, e in v.entries.items():
            if e.equals_base:  # same, or a dropped delta: nothing to add
                continue
            moe = on_moe.get(name)
            if moe is not None:  # a fused expert parameter (or one expert's rows of it), or a router
                wanted[moe[0]] = moe[1]
                plan[name] = [(moe[0], moe[2])]
            else:
                changed.append(name)
        to_param = module_names(self.model, changed)
        recurrent = bool(recurrent_layer_types(self.config))  # recurrent layers' own parameters: DeltaMixer
        pieces = mixer_pieces(self._layout_model(), {n: list(x.stored_shape) for n, x in v.entries.items()},
                              [n for n in changed if n not in to_param]) if recurrent else {}
        for name in changed:
            e = v.entries[name]
            if name in pieces:  # rows of a recurrent layer's own parameter (a conversion concatenates them)
                wanted[pieces[name][0]] = "mixer"
                plan[name] = [pieces[name]]
                continue
            if e.is_matrix and e.experts:
                raise UnsupportedVariant(f"variant {v.name}: tensor {name} is a fused mixture-of-experts tensor, which "
                                         f"the decoupled runtime does not apply per request; serve it with --mode swap")
            pname = to_param.get(name)
            if pname is None:
                raise UnsupportedVariant(
                    f"variant {v.name}: tensor {name!r} is not a parameter of {type(self.model).__name__} and "
                    f"transformers does not load it into one by a plain rename; the decoupled runtime cannot apply "
                    f"it — serve this one with --mode swap")
            shape = list(e.stored_shape)
            if list(params[pname].shape) != shape:
                raise UnsupportedVariant(f"variant {v.name}: tensor {name} has shape {shape}, the base has "
                                         f"{list(params[pname].shape)}; it cannot share the base model")
            targets = [pname] + [a for a in self._aliases.get(pname, []) if a not in v.tensors]
            plan[name] = []
            for t in targets:
                mixer = mixer_of(self.model, t) if recurrent else None  # a recurrent layer's own parameter
                mname, attr = mixer if mixer is not None else t.rsplit(".", 1)
                mod = self.model.get_submodule(mname)
                kind = ("mixer" if mixer is not None
                        else "router" if attr == "weight" and is_own_forward_router(self.model, mname, mod)
                        else self._decoupled_kind(mod, attr))
                if kind == "sinks" and not is_paged(self.model):  # only the paged attention reads them per row
                    kind = None
                if kind is None and self._vision_side(mname):  # read only with its variant alone (vision_params)
                    kind = "vision"
                if kind is None:
                    raise UnsupportedVariant(
                        f"variant {v.name}: it changes {t} ({type(self.model.get_submodule(mname)).__name__}.{attr}), "
                        f"which the decoupled runtime cannot apply per request; serve it with --mode swap")
                if e.is_matrix and kind != "mixer" and (kind != "linear" or attr != "weight"):
                    raise UnsupportedVariant(f"variant {v.name}: tensor {name} is stored {e.kind} but is not a linear "
                                             "weight")
                wanted[mname] = kind
                plan[name].append((mname, attr))
        return plan

    def _layout_model(self) -> nn.Module:
        """The model whose parameter shapes are the checkpoint's: where a checkpoint tensor's rows
        land in a parameter (a tensor-parallel rank's are cut: its meta skeleton of the full model)."""
        return self.model

    @staticmethod
    def _decoupled_kind(mod: nn.Module, attr: str) -> str | None:
        """Which decoupled module applies a change of ``mod.attr`` per row (None: none can)."""
        if isinstance(mod, DeltaActivation) or is_learned_activation(mod, attr):
            return "activation" if attr in router_tensors(mod) else None  # xIELU's alphas (Apertus)
        if isinstance(mod, DeltaRouter):
            return "router" if attr == "weight" else None  # decoupled by an earlier variant
        if attr == "sinks" and isinstance(getattr(mod, "sinks", None), nn.Parameter) and mod.sinks.dim() == 1:
            return "sinks"  # GPT-OSS's attention sinks
        if is_linear(mod) and attr in ("weight", "bias"):
            return "linear"  # nn.Linear and Conv1D, weights and biases
        if attr == "weight" and can_decouple(mod):
            return "embedding"  # token tables, scaled embeddings, learned positions
        if attr == "weight" and (isinstance(mod, DeltaRMSNorm) or norm_function(mod) is not None):
            return "norm"
        if attr in ("weight", "bias") and (type(mod) is DeltaLayerNorm or layer_norm_offset(mod) is not None):
            return "layernorm"  # nn.LayerNorm, or a subclass computing it or Nemotron's 1 + w form
        if attr == output_scale_param(mod):
            return "scale"  # a forward that is x * p (Gemma 3n's AltUp output scale)
        return None

    def _vision_side(self, mname: str) -> bool:
        """Whether module ``mname`` is outside the language model of an image-text model (its vision
        tower or projector), which runs only when a prompt's images are read."""
        lm = self._language_model_name
        return lm is not None and not (mname == lm or mname.startswith(f"{lm}."))

    @functools.cached_property
    def _language_model_name(self) -> str | None:
        """The language model's module name in an image-text model (None for a text model)."""
        return language_model(self.model)[0] if is_image_text(self.model.config) else None

    def _replace(self, mname: str, kind: str) -> nn.Module:
        parent_name, _, child = mname.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        old = getattr(parent, child)
        if kind == "vision":
            return VisionParams(old)  # attached; the module stays
        if kind == "embedding":
            return decouple_embedding(old, self.ctx)  # in place: the subclass's forward keeps running
        if kind == "sinks":
            return DeltaSinks(old, self.ctx)  # attached to the attention module, which stays
        if kind == "scale":
            return DeltaScale(old, output_scale_param(old), self.ctx)  # attached; the module stays
        new = {"linear": DeltaLinear, "norm": DeltaRMSNorm, "layernorm": DeltaLayerNorm, "experts": DeltaExperts,
               "router": DeltaRouter, "activation": DeltaActivation, "mixer": DeltaMixer}[kind](old, self.ctx)
        if kind == "router":
            new.block_tensors = self._moe.blocks.get(mname, {})
        setattr(parent, child, new)
        return new

    # -- variants: disk -> host -> device -------------------------------------------------------
    def load_host(self, name: str) -> HostDelta:
        """Read and decode variant ``name`` (checksums verified) into host memory.

        Every decoded tensor goes through the dedup registry: one bit-identical to a tensor already
        held (the base's, another variant's) is not stored again.
        """
        v = self.variants[name]
        tally = LoadTally(self.registry)
        host = HostDelta(name)
        if v.kind == "lora":
            from deltazip.runtime.serve.lora_tokens import load_token_rows
            from deltazip.runtime.serve.lora_variant import (
                ADAPTER_WEIGHTS,
                dora_weight,
                load_expert_factors,
                load_lora_factors,
                load_saved_tensors,
                merged_weight,
            )

            spec = self._lora[name]
            for pname, t in load_saved_tensors(spec).items():  # modules_to_save: whole replacements
                self._put_dense(host, spec.saved_targets[pname], tally.share(_pin(t.to(self.dtype))))
            for mname, f in load_lora_factors(spec, self.dtype).items():
                if mname in spec.read_by_mixer:  # its merged weight (and bias), the mixer's tensors for its rows
                    self._put_mixer_lora(host, spec.read_by_mixer[mname], self._whole_weight(mname), f, tally)
                    continue
                kw = host.modules.setdefault(mname, {})  # (a trained bias of it may be there)
                if f.bias is not None:  # lora_bias: scale · b added to the linear's bias
                    bias = kw.get("bias", self._params.get(f"{mname}.bias"))
                    kw["bias"] = tally.share(_pin((bias.detach().to("cpu").float() + f.scale * f.bias).to(self.dtype)))
                router = isinstance(self.modules[mname], DeltaRouter)
                if f.magnitude is not None or router:  # DoRA, or a router's: its whole weight, a dense replacement
                    w = self._whole_weight(mname)
                    w = dora_weight(w, f) if f.magnitude is not None else merged_weight(w, f)
                    kw["weight" if router else "dense"] = tally.share(_pin(w))
                    continue
                kw.update(lora_a=tally.share(_pin(f.A)), lora_b=tally.share(_pin(f.B)), lora_scale=f.scale)
            for mname, (ids, rows) in load_token_rows(spec.path / ADAPTER_WEIGHTS, spec.tokens).items():
                self._put_token_rows(host.modules.setdefault(mname, {}), mname, ids, rows.to(self.dtype), tally)
            for pname, f in load_expert_factors(spec, self.dtype).items():  # LoRA on experts: per-expert factors
                x = spec.params[pname]
                self._put_expert_lora(host, x.module, x.param,
                                      f._replace(a=tally.share(_pin(f.a)), b=tally.share(_pin(f.b))))
        elif v.kind == "full":
            for tname, t in load_checkpoint_tensors(v, list(self._targets[name]), self.dtype, tally).items():
                self._put_dense(host, self._targets[name][tname], t)
        else:
            self._load_artifact(v, host, tally)
        self.ledger.record_load(name, tally.shared, tally.added)
        return host

    def _load_artifact(self, v: VariantInfo, host: HostDelta, tally: LoadTally) -> None:
        art = Artifact(v.path)
        # Lossless-packed parts decode on the GPU when serving on one (nvCOMP), then land in
        # pinned host memory, which is what the host tier holds.
        decode_on = self.device if self.device.type == "cuda" and art.lossless != "none" else None
        for tname, targets in self._targets[v.name].items():
            e = art.entry(tname)
            if e.kernel_ready and not any(isinstance(self.modules[m], DeltaMixer) for m, _ in targets):
                d = _pin_packed(art.packed(tname, device=decode_on).to("cpu"))
                self._put_packed(host, targets, d.map_parts(tally.share), e.additive)
                continue
            tensor = art.reconstruct(tname, self.base.get(tname) if e.needs_base else None)
            self._put_dense(host, targets, tally.share(_pin(tensor.to(self.dtype))))

    def _put_packed(self, host: HostDelta, targets: list[tuple[str, str]], delta: PackedDelta, additive: bool) -> None:
        for mname, attr in targets:
            mod = self.modules[mname]
            if isinstance(mod, DeltaExperts):  # one piece of an expert parameter
                host.modules.setdefault(mname, {})[attr] = delta if additive else mod.host_weight(attr, delta)
            else:
                host.modules.setdefault(mname, {}).update(packed=delta, additive=additive)

    def _put_expert_lora(self, host: HostDelta, mname: str, param: str, f: ExpertLoraFactors) -> None:
        """An adapter's factors ``f`` of experts parameter ``param`` of module ``mname``."""
        host.modules.setdefault(mname, {})[lora_key(param)] = f

    def host_from_packed(self, name: str, deltas: dict[str, PackedDelta]) -> HostDelta:
        """A :class:`HostDelta` of variant ``name`` from packed deltas already in memory (``checkpoint
        tensor -> PackedDelta``, additive, any device), laid out as :meth:`load_host` lays out an
        artifact's: what a bench that draws deltas on the device hands to :meth:`stage_slot` and
        :meth:`write_slot` without reading them from disk. Every packed tensor the variant's plan
        holds must be given."""
        host = HostDelta(name)
        for tname, targets in self._targets[name].items():
            if tname not in deltas:
                raise KeyError(f"variant {name}: no delta given for {tname}")
            self._put_packed(host, targets, deltas[tname], True)
        return host

    def _put_mixer_lora(self, host: HostDelta, mixer: tuple[str, str], weight: torch.Tensor, f, tally: LoadTally
                        ) -> None:
        """An adapted linear that recurrent mixer ``mixer = (module, weight's name in it)`` reads itself:
        its merged weight (PEFT's merge, DoRA's included) and, with ``lora_bias``, its bias, as whole
        tensors of the mixer."""
        from deltazip.runtime.serve.lora_variant import dora_weight, merged_weight

        w = dora_weight(weight, f) if f.magnitude is not None else merged_weight(weight, f)
        self._put_dense(host, [mixer], tally.share(_pin(w)))
        if f.bias is not None:
            name = mixer[1].rpartition(".")[0] + ".bias"
            bias = self._params[f"{mixer[0]}.{name}"].detach().to("cpu").float() + f.scale * f.bias
            self._put_dense(host, [(mixer[0], name)], tally.share(_pin(bias.to(self.dtype))))

    def _whole_weight(self, mname: str) -> torch.Tensor:
        """Linear ``mname``'s whole base weight ``[out, in]`` on the CPU in the model dtype (tensor
        parallel reads the one a rank holds a shard of from the base checkpoint)."""
        return self._params[f"{mname}.weight"].detach().to("cpu", self.dtype)

    def _put_token_rows(self, kw: dict[str, Any], mname: str, ids: torch.Tensor, rows: torch.Tensor,
                        tally: LoadTally) -> None:
        """An adapter's token rows of module ``mname`` (``ids [n]``, ``rows [n, H]``) into its slot
        arguments ``kw``: an embedding looks them up; a linear adds them as a rank-``n`` LoRA term."""
        mod = self.modules[mname]
        if not isinstance(mod, DeltaLinear):
            kw.update(token_ids=_pin(ids), token_rows=tally.share(_pin(rows)))
            return
        from deltazip.runtime.serve.lora_tokens import lora_form

        w = mod.weight.t() if mod.transposed else mod.weight  # [out, in]
        a, b = lora_form(ids, rows, w.detach()[ids.to(w.device)].to("cpu", self.dtype), w.shape[0])
        kw.update(lora_a=tally.share(_pin(a)), lora_b=tally.share(_pin(b)), lora_scale=1.0)

    def _put_dense(self, host: HostDelta, targets: list[tuple[str, str]], tensor: torch.Tensor) -> None:
        for mname, attr in targets:
            kw = host.modules.setdefault(mname, {})
            mod = self.modules[mname]
            if isinstance(mod, DeltaLinear):
                kw["dense" if attr == "weight" else "bias"] = tensor
            elif isinstance(mod, DeltaExperts):  # the variant's rows: held as their delta to the base
                kw[attr] = mod.host_dense(attr, tensor)
            elif isinstance(mod, (DeltaLayerNorm, DeltaRouter, DeltaSinks, DeltaScale, VisionParams)):
                kw[attr] = tensor
            else:
                kw["weight"] = tensor

    def stage_slot(self, host: HostDelta) -> HostDelta:
        """A decoded variant made ready for a ``write_slot`` that only copies (the delta loader runs
        this off the engine thread; on CUDA on its side stream).

        Packed deltas are dequantized when slots keep them so (``--delta-compute dequantized``, the
        CPU default: the costly part of a CPU slot write). On a GPU, packed deltas, LoRA factors,
        norms and biases are copied from pinned host memory, and dense replacements go through the
        dedup registry, as ``write_slot`` would put them.
        """
        if self.device.type == "cpu" and not self.ctx.dequantize:
            return host
        out = HostDelta(host.name)
        for mname, kw in host.modules.items():
            staged = {k: self._stage_value(k, v) for k, v in kw.items()}
            if self.ctx.dequantize and "packed" in staged:
                staged["dequantized"] = delta_weight(staged.pop("packed")).to(self.dtype)
            out.modules[mname] = staged
        return out

    def _stage_value(self, key: str, v: Any) -> Any:
        if self.device.type == "cpu":
            return v
        if isinstance(v, PackedDelta):
            return v.to(self.device)
        if not isinstance(v, torch.Tensor):
            return v
        if key in ("dense", "weight"):
            return share_tensor(self.registry, v, self.device)[0]
        return v.to(self.device, non_blocking=True)

    def write_slot(self, slot: int, name: str, host: HostDelta) -> None:
        """Put a decoded (or staged) variant into device slot ``slot`` (engine thread, between forwards).

        Dense replacements (linears, embeddings) are referenced by the slot, not copied: on the
        host device they are the host tier's tensors; on a GPU the registry's device copy, which
        slots holding identical tensors share.
        """
        for mname, mod in self.modules.items():
            kw = host.modules.get(mname)
            if kw is None:
                mod.clear_slot(slot)
                continue
            if self.device.type != "cpu":
                kw = {k: share_tensor(self.registry, t, self.device)[0]
                      if k in ("dense", "weight") and t.device.type == "cpu" else t for k, t in kw.items()}
            mod.load_slot(slot, **kw)

    def clear_slot(self, slot: int) -> None:
        for mod in self.modules.values():
            mod.clear_slot(slot)

    def slot_bytes(self, slot: int) -> int:
        """Device bytes that slot ``slot`` occupies across all decoupled modules."""
        return sum(m.resident_bytes(slot) for m in self.modules.values())

    def resident_estimate(self, name: str) -> int:
        """Device bytes a variant will occupy in a slot, from its manifest (before loading it)."""
        return self._estimate(name, packed=self.delta_compute == "packed")

    def host_estimate(self, name: str) -> int:
        """Host-tier bytes of a decoded variant, from its manifest: packed deltas as stored, the
        other tensors in the model dtype (an upper bound: the dedup registry may share some)."""
        return self._estimate(name, packed=True)

    def _estimate(self, name: str, packed: bool) -> int:
        v = self.variants[name]
        total = 0
        esize = torch.tensor([], dtype=self.dtype).element_size()
        if v.kind == "lora":
            spec = self._lora[name]
            dense = set(spec.magnitudes) | set(spec.read_by_mixer) | {
                m for m in spec.modules if isinstance(self.modules.get(m), DeltaRouter)}
            return (sum((b[0] * a[1] if m in dense else a[0] * a[1] + b[0] * b[1]) * esize
                        for m, (a, b) in spec.shapes.items())
                    + sum(x.factor_bytes(esize) for x in spec.params.values())
                    + sum(math.prod(shape) * esize * len(spec.saved_targets[n]) for n, (_, shape) in spec.saved.items())
                    + sum(self._token_rows_bytes(m, len(r.indices), esize) for m, r in spec.tokens.items()))
        for tname, targets in self._targets[name].items():
            e = v.entries[tname]
            per = e.stored_bytes if e.kernel_ready and packed else e.numel * esize
            total += per * len(targets)
        return total

    def _token_rows_bytes(self, mname: str, n: int, esize: int) -> int:
        """Slot bytes of ``n`` token rows of module ``mname``: an embedding's rows ``[n, H]`` and its id
        map (``[V]`` int32); a linear's LoRA form, ``A [n, in]`` and the one-hot ``B [out, n]``."""
        rows, width = self._params[f"{mname}.weight"].shape
        if isinstance(self.modules.get(mname), DeltaLinear):
            return n * (rows + width) * esize
        return rows * 4 + n * width * esize

    def base_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    # -- forward --------------------------------------------------------------------------------
    def forward(self, row_slots: list[int], input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor, kv) -> torch.Tensor:
        """Logits of the last position of every row: ``[B, V]`` fp32.

        Args:
            row_slots: slot of each row (``-1`` base).
            input_ids, position_ids: ``[B, T]``.
            attention_mask: the step's mask argument (``deltazip.runtime.serve.masks.attention_masks_for``:
                ``[B, 1, T, K]``, a dict of them per layer type, or ``[B, K]`` for ALiBi models; a
                placeholder with the paged attention, which masks from the step's layout).
            kv: the step's cache object (``kv_cache.PagedStep``, or ``engine.StepKV`` for models
                without the paged attention).
        """
        self.ctx.bind(row_slots, self.device)
        try:
            return run_model(self.model, input_ids, position_ids, attention_mask, kv)
        finally:
            self.ctx.unbind()

    @contextlib.contextmanager
    def vision_of(self, slot: int):
        """Within: the vision tensors that no decoupled module applies per row hold variant ``slot``'s
        values (``VisionParams``; the base's for ``-1``), for a forward that reads images."""
        with contextlib.ExitStack() as held:
            for m in self.modules.values():
                if isinstance(m, VisionParams):
                    held.enter_context(m.applied(slot))
            yield

    def prompt_inputs(self, slot: int, prompt_ids: list[int], media: PromptMedia,
                      keep_states: bool = False) -> PromptInputs:
        """What the model's forward makes of a prompt with images, read with variant ``slot`` bound
        (``-1``: the base), so that a variant's own vision tower and projector read them
        (``keep_states``: ``read_prompt``'s)."""
        with self.vision_of(slot):
            self.ctx.bind([slot], self.device)
            try:
                return read_prompt(self.model, prompt_ids, media, self.device, self.dtype, keep_states)
            finally:
                self.ctx.unbind()


# --------------------------------------------------------------------------------------------------
# Swap mode
# --------------------------------------------------------------------------------------------------


class SwapModels:
    """``N`` whole models on the device; a slot is refilled with a merged fine-tune on a miss.

    The host object of a variant is its full merged state dict in the model dtype (the base's own
    tensors for the base; for a LoRA adapter the base with ``W + scale · B A`` merged into the adapted
    linears; a full checkpoint as stored), which is what swapping a whole model moves. Host state
    dicts go through the dedup registry, so tensors equal across them (and to the base's) are held
    once on the host; a device slot is a whole private model, as in the baseline being modelled.
    """

    mode = "swap"

    def __init__(self, base: Checkpoint, variants: list[VariantInfo], num_slots: int, device: torch.device,
                 dtype: torch.dtype, base_name: str, registry: TensorDedupRegistry | None = None,
                 ledger: DedupLedger | None = None):
        self.base, self.device, self.dtype, self.base_name = base, device, dtype, base_name
        self.registry = registry if registry is not None else new_serving_registry()
        self.ledger = ledger if ledger is not None else DedupLedger()
        self.num_slots = num_slots
        template = load_base_model(base, dtype, device)
        self._base_held, new, reused = share_parameters(template, self.registry)
        self.ledger.base_new_bytes, self.ledger.base_reused_bytes = new, reused
        self.config = template.config
        keys = set(template.state_dict())
        # Fast path: checkpoint names are the module names (Llama family); otherwise go through
        # transformers' loader, which applies the architecture's key renames.
        self._names_match = set(base.names) <= keys
        self._template = template
        self._linears = linear_shapes(template)
        self._conv1d = set(conv1d_modules(template))  # (a LoRA merge into their [in, out] weights transposes)
        self._lora_base = lora_base(template)
        self.variants: dict[str, VariantInfo] = {}
        self._lora: dict[str, Any] = {}
        for v in variants:
            self.commit_variant(v, self.prepare_variant(v))
        self.models: list[nn.Module | None] = [None] * num_slots
        self._slot_variant: list[str | None] = [None] * num_slots

    def prepare_variant(self, v: VariantInfo, wanted: dict[str, str] | None = None):
        """Check a variant (LoRA: against the base's linears); nothing else is needed to swap it in."""
        if v.kind == "lora":
            from deltazip.runtime.serve.lora_variant import read_lora_spec

            spec = read_lora_spec(v.path, self._linears, type(self._template).__name__,
                                  lambda names: module_names(self._template, names), self._lora_base)
            apart = [n for n in spec.saved if self._lora_base.aliases.get(n)]
            if apart and not spec.config.get("ensure_weight_tying"):  # (PEFT trained a copy, leaving the
                # weights tied to it the base's; a swapped-in model ties them again)
                raise UnsupportedVariant(f"variant {v.name}: it saves {apart[0]} apart from the weights this base "
                                         "ties to it (modules_to_save); serve it with --mode delta")
            tied = [m for m in spec.modules if self._lora_base.aliases.get(f"{m}.weight")]
            if tied:  # (PEFT adds each module's term where that module runs; one merged tensor cannot hold both)
                raise UnsupportedVariant(f"variant {v.name}: it adapts {tied[0]}, whose weight this base ties to "
                                         f"{self._lora_base.aliases[f'{tied[0]}.weight'][0]}; a swapped-in model "
                                         "would apply the adapter's term to both: serve it with --mode delta")
            apart = [m for m, r in spec.tokens.items() for a in self._lora_base.aliases.get(f"{m}.weight", [])
                     if spec.tokens.get(a.rsplit(".", 1)[0], r).indices != r.indices]
            if apart:  # (PEFT trained other rows for each of two tied weights, which a whole model cannot hold;
                # with the same ids it ties the two, whether it saves one copy or both)
                raise UnsupportedVariant(f"variant {v.name}: it trains token rows of {apart[0]} apart from those of "
                                         "the weights this base ties to it; serve it with --mode delta")
            return spec
        return None

    def commit_variant(self, v: VariantInfo, plan, wanted: dict[str, str] | None = None) -> None:
        self.variants[v.name] = v
        if v.kind == "lora":
            self._lora[v.name] = plan
        self.ledger.set_same_as_base(v.name, v.same_as_base_bytes)

    def remove_variant(self, name: str) -> None:
        self.variants.pop(name, None)
        self._lora.pop(name, None)
        self.ledger.forget(name)

    def _state_dict_of(self, path: Path, ck: Checkpoint) -> dict[str, torch.Tensor]:
        if self._names_match:
            return {n: ck.get(n) for n in ck.names}
        return load_causal_lm(path, self.dtype, what="checkpoint").state_dict()

    def load_host(self, name: str) -> dict[str, torch.Tensor]:
        from deltazip.compress.merge import load_merged_model, reconstruct_state_dict

        v = self.variants.get(name)
        if name == self.base_name:
            sd = self._state_dict_of(self.base.path, self.base)
        elif v.kind == "full" and self._names_match:
            # Read through the registry from the file bytes: tensors equal to the base's are never copied.
            tally = LoadTally(self.registry)
            host = _SwapHost(load_checkpoint_tensors(v, list(v.tensors), self.dtype, tally))
            self.ledger.record_load(name, tally.shared, tally.added)
            return host
        elif v.kind == "full":
            sd = self._state_dict_of(v.path, Checkpoint(v.path, f"checkpoint {v.name}"))
        elif v.kind == "lora":
            from deltazip.runtime.serve.lora_tokens import load_token_rows
            from deltazip.runtime.serve.lora_variant import (
                ADAPTER_WEIGHTS,
                load_expert_deltas,
                load_lora_factors,
                load_saved_tensors,
                merged_weight,
            )

            spec = self._lora[name]
            sd = {n: t.to(self.dtype) for n, t in self._state_dict_of(self.base.path, self.base).items()}
            sd.update({n: t.to(self.dtype) for n, t in load_saved_tensors(spec).items()})  # modules_to_save, biases
            for mname, f in load_lora_factors(spec, self.dtype).items():
                sd[f"{mname}.weight"] = merged_weight(sd[f"{mname}.weight"], f, transposed=mname in self._conv1d)
                if f.bias is not None:  # lora_bias
                    sd[f"{mname}.bias"] = (sd[f"{mname}.bias"].float() + f.scale * f.bias).to(self.dtype)
            for pname, rows in load_expert_deltas(spec).items():
                sd[pname] = merged_param(sd[pname], spec.params[pname], rows)
            for mname, (ids, rows) in load_token_rows(spec.path / ADAPTER_WEIGHTS, spec.tokens).items():
                if f"{mname}.weight" in sd:  # (a tied weight the checkpoint does not hold takes its table's)
                    w, rows = sd[f"{mname}.weight"], rows.to(self.dtype)
                    sd[f"{mname}.weight"] = (w.t().index_copy(0, ids, rows).t().contiguous()
                                             if mname in self._conv1d else w.index_copy(0, ids, rows))
        else:
            art = Artifact(v.path)
            if self._names_match:
                sd = reconstruct_state_dict(art, self.base)
            else:
                sd = load_merged_model(art, self.base, dtype=self.dtype).state_dict()
        tally = LoadTally(self.registry)
        host = _SwapHost({n: tally.share(_pin(t.to(self.dtype))) for n, t in sd.items()})
        if name != self.base_name:
            self.ledger.record_load(name, tally.shared, tally.added)
        return host

    def write_slot(self, slot: int, name: str, host: dict[str, torch.Tensor]) -> None:
        model = self.models[slot]
        if model is None:
            model = self.models[slot] = copy.deepcopy(self._template)
        missing, unexpected = model.load_state_dict(host, strict=False)
        tied = {a for names in tied_names(model) for a in names}
        if unexpected or (set(missing) - tied):
            raise ArtifactError(f"variant {name}: its tensors do not match the model ({len(missing)} missing, "
                                f"{len(unexpected)} unexpected)")
        self._slot_variant[slot] = name

    def clear_slot(self, slot: int) -> None:
        self._slot_variant[slot] = None  # the model object is reused by the next load

    def slot_bytes(self, slot: int) -> int:
        m = self.models[slot]
        return 0 if m is None else sum(p.numel() * p.element_size() for p in m.parameters())

    def resident_estimate(self, name: str) -> int:
        return sum(p.numel() * p.element_size() for p in self._template.parameters())

    def host_estimate(self, name: str) -> int:
        """A merged state dict in the model dtype (the registry shares tensors equal across them)."""
        return self.resident_estimate(name)

    def base_bytes(self) -> int:
        return 0

    def forward(self, row_slots: list[int], input_ids, position_ids, attention_mask, kv) -> torch.Tensor:
        """Same contract as :meth:`DeltaModel.forward`; every row must be in the same slot."""
        slots = set(row_slots)
        if len(slots) != 1 or min(slots) < 0:
            raise ValueError(f"swap mode runs one resident model per forward, got slots {sorted(slots)}")
        return run_model(self.models[row_slots[0]], input_ids, position_ids, attention_mask, kv)

    def prompt_inputs(self, slot: int, prompt_ids: list[int], media: PromptMedia) -> PromptInputs:
        """What slot ``slot``'s model makes of a prompt with images (``DeltaModel.prompt_inputs``)."""
        return read_prompt(self.models[slot], prompt_ids, media, self.device, self.dtype)


class _SwapHost(dict):
    """A merged state dict that reports its size to the cache."""

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.values())
