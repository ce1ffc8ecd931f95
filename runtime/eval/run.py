"""``deltazip eval``: lm-eval (and perplexity) on several targets side by side, through the serving path.

For each target (see :mod:`deltazip.runtime.eval.targets`) this runs ``lm_eval.simple_evaluate`` with a
:class:`deltazip.runtime.eval.lm_eval_model.DeltazipLM` over one shared :class:`EvalBank`, optionally the
perplexity protocol of :mod:`deltazip.runtime.eval.perplexity`, and gathers one summary:

- ``targets``: label, kind, path, bytes on disk, seconds taken;
- ``metrics``: one row per (task, metric) with the value of every target, and for every artifact (and
  LoRA adapter, with ``--reference``) the recovery ``100 * value / reference`` where the reference is
  the uncompressed fine-tune (a target whose directory is the artifact's lineage ``finetuned``, or
  ``--reference``);
- ``perplexity``: per target.

The project's own task definitions (``lm_eval_tasks/``: the demo pair's tasks and the quality study's)
are always on the task path, so those tasks run offline with no ``--include-path``.
"""

from __future__ import annotations

import difflib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltazip.formats.errors import InputError
from deltazip.runtime.eval.targets import EvalBank, Target, parse_targets

LOCAL_TASKS = Path(__file__).parent / "lm_eval_tasks"
"""The task YAMLs shipped with deltazip (``deltazip_shift``, ``deltazip_palindrome``, ...)."""


@dataclass
class EvalOptions:
    """What ``deltazip eval`` takes besides the targets (validated on construction)."""

    tasks: list[str] = field(default_factory=list)
    base: str | None = None
    include_path: list[Path] = field(default_factory=list)
    num_fewshot: int | None = None
    limit: float | None = None
    batch_size: int = 8
    device: str = "auto"
    dtype: str = "auto"
    perplexity: Path | None = None
    ppl_window: int | None = None
    reference: str | None = None
    seed: int = 0
    apply_chat_template: bool = False

    def __post_init__(self) -> None:
        self.tasks = [t.strip() for t in self.tasks if t.strip()]
        if not self.tasks and self.perplexity is None:
            raise InputError("nothing to evaluate; pass --tasks T1,T2 and/or --perplexity FILE")
        if self.batch_size < 1:
            raise InputError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise InputError(f"--num-fewshot must be >= 0, got {self.num_fewshot}")
        if self.limit is not None and self.limit <= 0:
            raise InputError(f"--limit must be > 0 (a count, or a fraction below 1), got {self.limit}")
        if self.ppl_window is not None and self.ppl_window < 2:
            raise InputError(f"--ppl-window must be >= 2 tokens, got {self.ppl_window}")
        for p in self.include_path:
            if not Path(p).is_dir():
                raise InputError(f"--include-path {p}: no such directory; pass a directory of lm-eval task YAMLs")


# --------------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------------


def _check_task_files(paths: list[Path]) -> None:
    """Parse every YAML under the user's include paths first, so a broken one is a clear error and
    not a task that silently goes missing."""
    from lm_eval.tasks._yaml_loader import load_yaml

    for root in paths:
        for f in sorted(Path(root).rglob("*.yaml")):
            try:
                load_yaml(f, resolve_func=True)
            except Exception as e:  # yaml syntax, a bad !function target, an include cycle
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise InputError(f"task file {f} does not parse ({type(e).__name__}: {msg}); fix or remove it") from e


def task_manager(tasks: list[str], include_path: list[Path]):
    """An lm-eval ``TaskManager`` that knows every name in ``tasks``.

    Local task paths are indexed first without lm-eval's built-in catalogue (fast, offline); the
    catalogue is added only when a name is not found locally.

    Raises:
        InputError: an unknown task name, with the closest known names.
    """
    from lm_eval.tasks import TaskManager

    paths = [str(LOCAL_TASKS)] + [str(p) for p in include_path]
    _check_task_files([Path(p) for p in include_path])
    tm = TaskManager(include_path=paths, include_defaults=False)
    if all(t in tm.all_tasks for t in tasks):
        return tm
    tm = TaskManager(include_path=paths)
    for t in tasks:
        if t not in tm.all_tasks:
            close = difflib.get_close_matches(t, tm.all_tasks, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else "; list them with `lm_eval ls tasks`"
            raise InputError(f"unknown task {t!r}{hint}")
    return tm


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------


def _reference_for(target: Target, targets: list[Target], reference: Target | None) -> Target | None:
    if target.kind not in ("artifact", "lora"):
        return None
    if reference is not None:
        return reference
    if target.kind == "lora":  # an adapter records no full fine-tune to compare with
        return None
    ft = target.variant.lineage.get("finetuned")
    if not ft:
        return None
    ft_path = Path(str(ft)).expanduser()
    for t in targets:
        if t.kind == "hf" and ft_path.exists() and t.path.resolve() == ft_path.resolve():
            return t
    return None


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _metric_rows(results: dict[str, dict], targets: list[Target], refs: dict[str, Target | None]) -> list[dict]:
    """One row per (task, metric, filter) that some target reports; stderr columns dropped."""
    rows: dict[tuple[str, str], dict] = {}
    for t in targets:
        res = results[t.label]
        for task, metrics in res["results"].items():
            hib = res.get("higher_is_better", {}).get(task, {})
            for key, value in metrics.items():
                if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                    continue
                metric, filt = key.split(",", 1)
                row = rows.setdefault((task, key), {"task": task, "metric": metric, "filter": filt,
                                                    "higher_is_better": hib.get(metric), "values": {},
                                                    "recovery_pct": {}})
                row["values"][t.label] = float(value)
    for row in rows.values():
        for t in targets:
            ref = refs.get(t.label)
            if ref is None or t.label not in row["values"] or ref.label not in row["values"]:
                continue
            a, r = row["values"][t.label], row["values"][ref.label]
            if row["higher_is_better"] is False:
                row["recovery_pct"][t.label] = 100.0 * r / a if a else None
            else:
                row["recovery_pct"][t.label] = 100.0 * a / r if r else None
    return list(rows.values())


def run_eval(specs: list[str], opts: EvalOptions, progress=None) -> dict[str, Any]:
    """Evaluate every target; returns ``{"summary": ..., "lm_eval": {label: results}}``.

    Args:
        specs: TARGETs as typed (artifact dirs, HF model dirs, ``base``).
        opts: see :class:`EvalOptions`.
        progress: optional ``progress(message)`` called before each target.
    """
    import lm_eval

    from deltazip.runtime.eval.lm_eval_model import DeltazipLM
    from deltazip.runtime.eval.perplexity import perplexity, read_text

    targets = parse_targets(specs)
    reference = None
    if opts.reference is not None:
        (reference,) = parse_targets([opts.reference])
        if reference.kind != "hf":
            raise InputError(f"--reference {opts.reference}: must be the uncompressed fine-tune (an HF model directory)")
        same = [t for t in targets if t.kind == "hf" and t.path.resolve() == reference.path.resolve()]
        if same:
            reference = same[0]
        else:
            reference.label = f"{reference.label} (reference)"
            targets.append(reference)
    text = read_text(opts.perplexity) if opts.perplexity is not None else None
    tm = task_manager(opts.tasks, opts.include_path) if opts.tasks else None
    bank = EvalBank(targets, opts.base, device=opts.device, dtype=opts.dtype)
    refs = {t.label: _reference_for(t, targets, reference) for t in targets}

    if opts.apply_chat_template and tm is not None:  # every target, before the first is evaluated
        for t in targets:
            _check_chat_template(t, bank)
    results: dict[str, dict] = {}
    ppl: dict[str, dict] = {}
    rows_t: list[dict] = []
    _quiet_git_hash()
    for t in targets:
        if progress:
            progress(f"evaluating {t.label}")
        t0 = time.perf_counter()
        # An image-text target with an image processor runs lm-eval's multimodal type (tasks with images;
        # text tasks take the same text path as DeltazipLM's).
        lm_type = DeltazipLM if bank.processor_for(t) is None else _multimodal_type()
        lm = lm_type(t.label, bank=bank, batch_size=opts.batch_size)
        if tm is not None:
            try:
                results[t.label] = lm_eval.simple_evaluate(
                    model=lm, tasks=opts.tasks, num_fewshot=opts.num_fewshot, limit=opts.limit,
                    task_manager=tm, random_seed=opts.seed, numpy_random_seed=opts.seed,
                    torch_random_seed=opts.seed, fewshot_random_seed=opts.seed, bootstrap_iters=0,
                    # lm-eval resets its logger to this level on every call: its warnings about the model
                    # object passed in (expected here) would come back for every target after the first.
                    log_samples=False, verbosity="ERROR", apply_chat_template=opts.apply_chat_template)
            except ValueError as e:
                if "multimodal" not in str(e):
                    raise
                raise InputError(f"{t.label}: a task reads images, and this target has no image processor (a text "
                                 "model, or a checkpoint saved without its processor files); drop that task or "
                                 "save the processor beside the checkpoint") from e
        if text is not None:
            window = opts.ppl_window or min(lm.max_length, 2048)
            ppl[t.label] = perplexity(lm.model, lm.tokenizer, text, window, batch_size=opts.batch_size).to_dict()
        nbytes = None if t.path is None else (t.variant.disk_bytes if t.variant else _dir_bytes(t.path))
        rows_t.append({"label": t.label, "kind": t.kind, "path": None if t.path is None else str(t.path),
                       "bytes": nbytes, "reference": refs[t.label].label if refs[t.label] else None,
                       "seconds": round(time.perf_counter() - t0, 2)})
        del lm
    summary = {
        "base": None if bank.base_path is None else str(bank.base_path),
        "tasks": opts.tasks, "num_fewshot": opts.num_fewshot, "limit": opts.limit,
        "device": str(bank.device), "targets": rows_t,
        "metrics": _metric_rows(results, targets, refs) if results else [],
        "perplexity": ppl,
    }
    return {"summary": summary, "lm_eval": results}


def _check_chat_template(target: Target, bank: EvalBank) -> None:
    """``--apply-chat-template`` needs the target's chat template (its processor's, for an image-text
    target with one, else its tokenizer's)."""
    proc = bank.processor_for(target)
    if not getattr(proc, "chat_template", None) and not getattr(bank.tokenizer_for(target), "chat_template", None):
        raise InputError(f"{target.label}: --apply-chat-template, but its tokenizer has no chat template; drop the "
                         "option for this target, or save the template with its tokenizer")


def _multimodal_type():
    from deltazip.runtime.eval.lm_eval_vlm import DeltazipVLM

    return DeltazipVLM


def _quiet_git_hash() -> None:
    """lm-eval records ``git describe`` of the working directory in its results, and lets git print
    ``fatal: not a git repository`` on stderr once per target outside a repository: ask git the same
    question with its stderr captured (the hash, or None, is what lm-eval stores)."""
    import subprocess

    import lm_eval.evaluator as evaluator

    def git_commit_hash() -> str | None:
        try:
            r = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() or None if r.returncode == 0 else None

    if hasattr(evaluator, "get_git_commit_hash"):
        evaluator.get_git_commit_hash = git_commit_hash


def serialisable(obj: Any) -> Any:
    """lm-eval's results made JSON-safe (numpy scalars, functions in task configs, NaN -> None)."""
    from lm_eval.utils import handle_non_serializable

    if isinstance(obj, dict):
        return {str(k): serialisable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [serialisable(v) for v in obj]
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else obj
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    out = handle_non_serializable(obj)
    return serialisable(out) if isinstance(out, (float, int, list)) else out
