"""lm-eval model type ``deltazip``: a compressed variant evaluated through the serving path.

Importing this module registers the model type with lm-eval's registry::

    import deltazip.runtime.eval.lm_eval_model  # noqa: F401  (registers "deltazip")
    lm_eval.simple_evaluate(model="deltazip", model_args="artifact=art/,base=base/", tasks=[...])

From the shell, lm-eval's own CLI with the type registered::

    python -m deltazip.runtime.eval.lm_eval_model run --model deltazip \\
        --model_args artifact=art/,base=base/ --tasks deltazip_shift --include_path ...

(``--device`` goes on lm-eval's command line, not in ``--model_args``: lm-eval passes it itself.)

``artifact`` may also be ``base`` (the base model through the same decoupled model) or a plain HF
model directory. Everything else (batching, loglikelihood, ``generate_until``) is lm-eval's ``HFLM``
on the model object that :class:`deltazip.runtime.eval.targets.EvalBank` builds.
"""

from __future__ import annotations

import logging
import os

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from deltazip.runtime.eval.targets import EvalBank, parse_targets

eval_logger = logging.getLogger(__name__)


class OnBank:
    """What the ``deltazip`` model types share: their target on an :class:`EvalBank`, its slot
    re-selected before every model call (another target on the same bank may have run in between),
    and lm-eval's bars honouring ``TQDM_DISABLE``. Mixed in before the lm-eval class."""

    def attach(self, artifact: str, base: str | None, device: str | None, dtype: str, bank: EvalBank | None):
        """Bind the target ``artifact`` (a bank's label, or a path for a bank of its own); returns its model."""
        if bank is None:
            device = device or "auto"
            if device.startswith("cuda") and not torch.cuda.is_available():
                # lm-eval's CLI fills in a CUDA device by default; its own hf type falls back to CPU too.
                eval_logger.warning("no CUDA device is available; evaluating on the CPU")
                device = "cpu"
            (target,) = parse_targets([str(artifact)])
            bank = EvalBank([target], base, device=device, dtype=dtype)
        else:
            target = next(t for t in bank.targets if t.label == artifact)
        self.bank, self.target = bank, target
        return bank.model_for(target)

    # HFLM passes ``disable=False`` to its bars explicitly, which beats TQDM_DISABLE; honour the
    # variable here (``deltazip eval`` sets it under --json and when stderr is not a terminal).
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or _bars_off())

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or _bars_off())

    def generate_until(self, requests, disable_tqdm: bool = False):
        return super().generate_until(requests, disable_tqdm=disable_tqdm or _bars_off())

    def _model_call(self, inps, attn_mask=None, labels=None):
        self.bank.model_for(self.target)
        return super()._model_call(inps, attn_mask=attn_mask, labels=labels)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        self.bank.model_for(self.target)
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


@register_model("deltazip")
class DeltazipLM(OnBank, HFLM):
    """``HFLM`` over a deltazip target.

    Args:
        artifact: artifact directory, HF model directory, or ``base``.
        base: the base model (default: the artifact's lineage base).
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N``.
        dtype: ``auto``, ``float32``, ``float16``, ``bfloat16``.
        bank: an existing :class:`EvalBank` holding the target (used by ``deltazip eval`` so that
            one base model serves every target of a run); ``artifact`` then names the target label.
        **kwargs: passed to ``HFLM`` (``batch_size``, ``max_length``, ...).
    """

    def __init__(self, artifact: str, base: str | None = None, device: str | None = "auto", dtype: str = "auto",
                 bank: EvalBank | None = None, **kwargs):
        model = self.attach(artifact, base, device, dtype, bank)
        kwargs.pop("pretrained", None)
        super().__init__(pretrained=model, tokenizer=self.bank.tokenizer_for(self.target), backend="causal", **kwargs)


def _bars_off() -> bool:
    return os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes")


def main() -> None:
    """lm-eval's command line with the ``deltazip`` model type registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
