"""The demo model pair: a tiny Llama base and a full fine-tune of it, built on the spot on CPU.

``make_demo_pair`` pretrains a small ``LlamaForCausalLM`` on a ``copy`` + ``decrement`` mixture, saves
it, then fully fine-tunes a copy (every weight trainable, small learning rate) on ``shift`` (each digit
+1), a task the base cannot do. The pair is what ``deltazip demo`` and the tests compress: the fine-tune's delta is small relative
to the weights and touches every tensor, like a real full fine-tune, and the task accuracy gap makes
"the compressed delta still works" measurable.

Everything is deterministic for a given seed (bit-identical safetensors on the same machine and
library versions) and never touches the hub.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
import shutil
import string
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from deltazip.formats.atomic import apply_umask, temp_sibling
from deltazip.formats.outputs import replace_dir, write_text_atomic
from deltazip.runtime.eval.generated_tasks import (
    DEMO_DIGITS,
    TERMINATOR,
    Task,
    exact_match_accuracy,
    get_task,
)

Progress = Callable[[str, int, int], None]

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = (BOS, EOS, PAD, UNK)
VOCAB_SIZE = 128
"""Tokenizer (and model) vocabulary size: a multiple of 128 so lm_head's out features are, too."""

# Printable ASCII plus newline and tab; reserved filler entries pad the vocabulary to VOCAB_SIZE.
ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n\t"


def _vocab() -> dict[str, int]:
    tokens = list(SPECIAL_TOKENS) + list(ALPHABET)
    tokens += [f"<reserved_{i}>" for i in range(VOCAB_SIZE - len(tokens))]
    assert len(tokens) == VOCAB_SIZE and len(set(tokens)) == VOCAB_SIZE, "alphabet does not fit the vocab"
    return {tok: i for i, tok in enumerate(tokens)}


DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}" + TERMINATOR + "{% endif %}{% endfor %}"
)
"""The demo pair's chat template: a user message is a task prompt as the models were trained on it
(``<s>s 3918=``), an assistant message its answer closed by the terminator; system messages are
dropped. With it, ``/v1/chat/completions`` works on the demo's models and artifacts."""


def build_char_tokenizer(save_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over a fixed alphabet, built locally (no hub, no training).

    Every character is one token (``WordLevel`` over single characters); unknown characters map to
    ``<unk>``. Encoding with special tokens prepends ``<s>`` (as Llama tokenizers do), decoding
    concatenates characters back. Vocabulary size is ``VOCAB_SIZE`` (128).

    Args:
        save_dir: if given, ``save_pretrained`` there so ``AutoTokenizer.from_pretrained`` loads it.

    Returns:
        The tokenizer, right-padding with ``<pad>``.
    """
    vocab = _vocab()
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # [\s\S] rather than "." so newlines are single tokens too.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="right",
        model_max_length=512,
    )
    if save_dir is not None:
        tok.save_pretrained(str(save_dir))
    return tok


@dataclass(frozen=True)
class ToyConfig:
    """Sizes and schedule of the demo pair; the defaults build in well under a minute on 2 CPU cores.

    Every linear's in/out features (hidden, intermediate, heads * head_dim, vocab) is a multiple of 128,
    so 128-wide quantization groups and 2:4 sparsity apply to all of them. Choices that are not obvious:

    - ``init_std`` 0.06 (Llama's default 0.02 is tuned for width 4096; 1/sqrt(128) is 0.088): weights
      large enough that a fine-tune moves them by a few percent, as real fine-tunes do, not tens.
    - Fixed 6-digit strings: a constant copy offset is learned in ~100 steps; variable lengths need
      ~3x the steps for the same accuracy, which would blow the time budget.
    - Pretraining on two tasks (copy, decrement) teaches the base to read the task letter, so the
      fine-tune only has to add a new digit map. It reaches 100% within ~30 steps; the remaining
      steps drive the loss down so that the fine-tune is robust, not on the edge of working (seeds
      0-5 all keep >= 99% accuracy even with a crude round-to-nearest 2:4 + 4-bit delta).
    """

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    init_std: float = 0.06
    pretrain_tasks: tuple[str, ...] = ("copy", "decrement")
    finetune_task: str = "shift"
    min_digits: int = DEMO_DIGITS
    max_digits: int = DEMO_DIGITS
    batch_size: int = 64
    pretrain_steps: int = 120
    pretrain_lr: float = 3e-3
    pretrain_warmup: int = 20
    finetune_steps: int = 80
    finetune_lr: float = 3e-4
    finetune_warmup: int = 10
    weight_decay: float = 0.01
    n_calib: int = 128
    n_eval: int = 256
    save_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) % 128:
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of 128 (group size, 2:4)")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must divide hidden_size, and num_kv_heads must divide num_heads")
        if (self.hidden_size // self.num_heads) * self.num_kv_heads % 128:
            raise ValueError("k/v projection width (num_kv_heads * head_dim) must be a multiple of 128")
        if not self.pretrain_tasks or self.finetune_task in self.pretrain_tasks:
            raise ValueError("need at least one pretraining task, and the fine-tune task must not be one")
        if min(self.pretrain_steps, self.finetune_steps, self.batch_size, self.n_calib, self.n_eval) < 1:
            raise ValueError("steps, batch_size, n_calib and n_eval must all be positive")
        if self.save_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"save_dtype must be float32, float16 or bfloat16, got {self.save_dtype}")

    def task(self, name: str) -> Task:
        """The registered task ``name`` with this config's digit-string lengths."""
        return dataclasses.replace(get_task(name), min_len=self.min_digits, max_len=self.max_digits)

    def to_dict(self) -> dict:
        """JSON-ready view (dtype as its name)."""
        d = dataclasses.asdict(self)
        d["save_dtype"] = str(self.save_dtype).removeprefix("torch.")
        d["pretrain_tasks"] = list(self.pretrain_tasks)
        return d


@dataclass
class DemoPair:
    """Paths of a built demo pair and what was measured while building it.

    ``info`` holds: ``pretrain_steps``, ``finetune_steps``, ``seconds`` (per stage and total),
    ``base_accuracy`` / ``finetuned_accuracy`` (held-out exact match on ``task_name``, measured on the
    stored weights, fp32 compute), ``base_pretrain_accuracy`` (the base on its own task), ``relative_delta``
    (||W_ft - W_base|| / ||W_base|| per tensor type, aggregated over layers) and ``config``.
    """

    base_dir: Path
    finetuned_dir: Path
    calib_path: Path
    eval_path: Path
    task_name: str
    info: dict = field(default_factory=dict)


def _llama(cfg: ToyConfig, tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=128,
        initializer_range=cfg.init_std,
        tie_word_embeddings=False,  # lm_head is its own tensor, as in Llama-2/3 checkpoints
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(config)


def _batch(tasks: Sequence[Task], rng: random.Random, n: int, tok, exclude: set[str], mask_prompt: bool):
    """A right-padded batch of ``n`` fresh examples from ``tasks`` (uniform mixture), none in ``exclude``.

    Returns:
        ``(input_ids [n, T], labels [n, T])``; labels are -100 on padding and, with ``mask_prompt``, on
        the prompt (supervised fine-tuning trains on the answer only). Each text ends with EOS.
    """
    pairs: list[tuple[Task, str, str]] = []
    while len(pairs) < n:
        task = rng.choice(tasks)
        prompt, answer = task.sample(rng)
        if prompt not in exclude:
            pairs.append((task, prompt, answer))
    texts = tok([t.render(p, a) for t, p, a in pairs])["input_ids"]
    width = max(map(len, texts)) + 1
    ids = torch.full((n, width), tok.pad_token_id)
    labels = torch.full((n, width), -100)
    for i, ((_, prompt, _), row) in enumerate(zip(pairs, texts)):
        row = torch.tensor(row + [tok.eos_token_id])
        ids[i, : len(row)] = row
        labels[i, : len(row)] = row
        if mask_prompt:
            labels[i, : len(prompt) + 1] = -100  # one token per character, plus BOS
    return ids, labels


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to 10% of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * t))


def _train(
    model: LlamaForCausalLM,
    tok,
    tasks: Sequence[Task],
    *,
    steps: int,
    lr: float,
    warmup: int,
    cfg: ToyConfig,
    rng: random.Random,
    exclude: set[str],
    mask_prompt: bool,
    progress: Progress | None,
    description: str,
) -> float:
    """Train ``model`` in place with AdamW on fresh examples every step; returns the last batch loss.

    Every parameter is trainable (a full fine-tune when called on a pretrained model).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    warmup = min(warmup, steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: _lr_factor(step, steps, warmup))
    model.train()
    loss_value = float("nan")
    report_every = max(1, steps // 20)
    for step in range(steps):
        ids, labels = _batch(tasks, rng, cfg.batch_size, tok, exclude, mask_prompt)
        # No attention mask: padding is on the right, so causal attention never lets a real token see
        # it, and padded positions carry no loss. Skipping the mask keeps the step cheaper.
        logits = model(input_ids=ids).logits  # [B, T, V]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
        if progress is not None and ((step + 1) % report_every == 0 or step + 1 == steps):
            progress(description, step + 1, steps)
    return loss_value


def _tensor_type(name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``q_proj``; top-level tensors keep their module name."""
    parts = name.split(".")
    return parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]


def relative_delta_norms(base: torch.nn.Module, finetuned: torch.nn.Module) -> dict[str, float]:
    """||W_ft - W_base|| / ||W_base|| per tensor type, Frobenius norms summed over layers, in fp32."""
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    ft = dict(finetuned.named_parameters())
    for name, w in base.named_parameters():
        kind = _tensor_type(name)
        w32, f32 = w.detach().float(), ft[name].detach().float()
        num[kind] = num.get(kind, 0.0) + float((f32 - w32).pow(2).sum())
        den[kind] = den.get(kind, 0.0) + float(w32.pow(2).sum())
    return {k: round((num[k] / den[k]) ** 0.5, 5) for k in sorted(num)}


def _write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def _save(model: LlamaForCausalLM, tok, out: Path, dtype: torch.dtype) -> LlamaForCausalLM:
    """Save ``model`` in ``dtype`` with the tokenizer.

    Returns:
        The saved weights upcast to fp32 (what ``from_pretrained(out, dtype=torch.float32)`` gives):
        evaluation sees exactly the stored values, and fp32 matmuls are ~5x faster than bf16 on CPU.
    """
    saved = copy.deepcopy(model).to(dtype).eval()
    tmp = temp_sibling(out)
    try:  # atomic, and with the modes the umask gives (safetensors writes its files 0600)
        saved.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        apply_umask(tmp)
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return saved.float()


def make_demo_pair(
    workdir: str | Path,
    seed: int = 0,
    progress: Progress | None = None,
    config: ToyConfig | None = None,
) -> DemoPair:
    """Build the demo pair under ``workdir``: ``base/``, ``finetuned/``, ``calib.jsonl``, ``eval.jsonl``.

    Steps: pretrain a fresh tiny Llama on the ``config.pretrain_tasks`` mixture (full-text LM loss) and
    save it as the base; fully fine-tune a copy of the saved base on ``config.finetune_task``
    (answer-only loss, small learning rate, so the delta is a few percent of each weight) and save it;
    measure both on held-out examples. Held-out prompts never appear in training or calibration data.

    Args:
        workdir: created if missing; existing files of the pair are overwritten.
        seed: the only source of randomness (init, data order); same seed -> identical files.
        progress: optional ``progress(description, done, total)`` called during training.
        config: sizes and schedule; ``ToyConfig()`` by default.

    Returns:
        A ``DemoPair`` with paths and build-time measurements (see ``DemoPair.info``).
    """
    cfg = config or ToyConfig()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    pre_tasks = [cfg.task(n) for n in cfg.pretrain_tasks]
    ft_task = cfg.task(cfg.finetune_task)
    tok = build_char_tokenizer()
    tok.chat_template = DEMO_CHAT_TEMPLATE  # saved with both models, so chat works on the demo's output

    # Held-out prompts first, so both training streams can exclude them.
    eval_examples = ft_task.examples(cfg.n_eval, seed=10_000 + seed)
    pre_eval = {t.name: t.examples(cfg.n_eval, seed=20_000 + seed) for t in pre_tasks}
    exclude = {p for p, _ in eval_examples} | {p for exs in pre_eval.values() for p, _ in exs}
    calib = [
        ex for ex in ft_task.examples(cfg.n_calib + cfg.n_eval, seed=30_000 + seed) if ex[0] not in exclude
    ]
    calib = calib[: cfg.n_calib]

    base_dir, ft_dir = workdir / "base", workdir / "finetuned"
    # fork_rng leaves the caller's global RNG state untouched; init is seeded, data has its own RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _llama(cfg, tok)
        pre_loss = _train(
            model,
            tok,
            pre_tasks,
            steps=cfg.pretrain_steps,
            lr=cfg.pretrain_lr,
            warmup=cfg.pretrain_warmup,
            cfg=cfg,
            rng=random.Random(f"pretrain:{seed}"),
            exclude=exclude,
            mask_prompt=False,
            progress=progress,
            description="pretrain base",
        )
    base_saved = _save(model, tok, base_dir, cfg.save_dtype)
    t_pre = time.perf_counter()

    # The fine-tune starts from exactly the saved base weights, as a real one starts from a checkpoint;
    # it trains in fp32 (base_saved is the stored weights upcast) and is saved in the base's dtype.
    ft_model = copy.deepcopy(base_saved)
    ft_loss = _train(
        ft_model,
        tok,
        [ft_task],
        steps=cfg.finetune_steps,
        lr=cfg.finetune_lr,
        warmup=cfg.finetune_warmup,
        cfg=cfg,
        rng=random.Random(f"finetune:{seed}"),
        exclude=exclude,
        mask_prompt=True,
        progress=progress,
        description=f"fine-tune ({ft_task.name})",
    )
    ft_saved = _save(ft_model, tok, ft_dir, cfg.save_dtype)
    t_ft = time.perf_counter()

    calib_path, eval_path = workdir / "calib.jsonl", workdir / "eval.jsonl"
    _write_jsonl(calib_path, [{"text": ft_task.render(p, a)} for p, a in calib])
    _write_jsonl(
        eval_path, [{"prompt": p, "answer": a, "text": ft_task.render(p, a)} for p, a in eval_examples]
    )

    info = {
        "pretrain_steps": cfg.pretrain_steps,
        "finetune_steps": cfg.finetune_steps,
        "pretrain_final_loss": round(pre_loss, 4),
        "finetune_final_loss": round(ft_loss, 4),
        "base_pretrain_accuracy": {
            n: exact_match_accuracy(base_saved, tok, ex) for n, ex in pre_eval.items()
        },
        "base_accuracy": exact_match_accuracy(base_saved, tok, eval_examples),
        "finetuned_accuracy": exact_match_accuracy(ft_saved, tok, eval_examples),
        "relative_delta": relative_delta_norms(base_saved, ft_saved),
        "n_params": sum(p.numel() for p in base_saved.parameters()),
        "save_dtype": str(cfg.save_dtype).removeprefix("torch."),
        "seed": seed,
        "config": cfg.to_dict(),
    }
    t_end = time.perf_counter()
    info["seconds"] = {
        "pretrain": round(t_pre - t0, 2),
        "finetune": round(t_ft - t_pre, 2),
        "total": round(t_end - t0, 2),
    }
    return DemoPair(base_dir, ft_dir, calib_path, eval_path, ft_task.name, info)
