"""lm-eval model type ``deltazip-multimodal``: an image-text variant evaluated on tasks with images.

lm-eval's tasks with images (``doc_to_image``: MMMU, ChartQA...) run on its ``hf-multimodal`` model
type, which feeds the processor's tensors to the model's own forward and ``generate``. This is that
type over a deltazip target (:class:`deltazip.runtime.eval.targets.EvalBank`): the decoupled serving
model with every row on the variant's slot, its vision tensors that no decoupled module applies per
row put in place for the target (``DeltaModel.vision_of``), and the processor that ``serve`` reads the
variant's images with. Text tasks take lm-eval's text path on the same model, as with ``deltazip``.

lm-eval 0.4 runs ``generate_until`` tasks with images; it refuses loglikelihood ones.
"""

from __future__ import annotations

from lm_eval.api.registry import register_model
from lm_eval.models.hf_vlms import HFMultimodalLM

from deltazip.formats.errors import InputError
from deltazip.runtime.eval.lm_eval_model import OnBank
from deltazip.runtime.eval.targets import EvalBank


@register_model("deltazip-multimodal")
class DeltazipVLM(OnBank, HFMultimodalLM):
    """``hf-multimodal`` over a deltazip target (arguments as :class:`~deltazip.runtime.eval.lm_eval_model.DeltazipLM`).

    Raises:
        InputError: the target has no image processor (a text model, or no processor files).
    """

    def __init__(self, artifact: str, base: str | None = None, device: str | None = "auto", dtype: str = "auto",
                 bank: EvalBank | None = None, **kwargs):
        model = self.attach(artifact, base, device, dtype, bank)
        self._processor = self.bank.processor_for(self.target)
        if self._processor is None:
            raise InputError(f"{self.target.label}: no image processor to read a task's images with; evaluate it on "
                             "text tasks, or save its processor beside the checkpoint")
        kwargs.pop("pretrained", None)
        image = getattr(self._processor, "image_token", None)  # the processor's placeholder for "<image>"
        if isinstance(image, str) and "image_string" not in kwargs:
            kwargs["image_string"] = image
        super().__init__(pretrained=model, backend="causal", **kwargs)

    def _create_tokenizer(self, pretrained, tokenizer, **kwargs) -> None:
        # The target's own processor (lm-eval's would be loaded from the model's name, the base's).
        self.processor = self._processor
        self.tokenizer = self._processor.tokenizer

    def _model_multimodal_call(self, inps, imgs, attn_mask=None, labels=None):
        self.bank.model_for(self.target)
        return super()._model_multimodal_call(inps, imgs, attn_mask=attn_mask, labels=labels)

    def _model_multimodal_generate(self, inputs, max_length, stop, **generation_kwargs):
        self.bank.model_for(self.target)
        return super()._model_multimodal_generate(inputs, max_length, stop, **generation_kwargs)
