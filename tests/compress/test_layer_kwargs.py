"""Calibration runs each decoder layer with its own arguments: on a Gemma 3 that mixes sliding-window
and global layers (window 8, calibration windows of 32 tokens), the sliding layers get the sliding mask
and local rotary tables, the global ones the causal mask and global tables, as in the model's own
forward; and the compressed model's per-layer error does not go up against calibrating every layer
with layer 0's arguments (what the pipeline did before)."""

from __future__ import annotations

import torch
from _factories import calib_file, finetune, save_model, tiny_model
from _serving import single_thread
from transformers import AutoModelForCausalLM

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import load_merged_model
from deltazip.compress.pipeline import _Run, compress_delta
from deltazip.formats.artifact import Artifact
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint

TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
ARCH = dict(layer_types=TYPES, num_hidden_layers=4, sliding_window=8)
CFG = dict(method="deltazip", scheme=DeltaScheme(bits=2, group_size=32, sparsity="none"), nsamples=8, seqlen=32,
           batch_size=4, device="cpu")


def same(a, b) -> bool:
    """Equal arguments: tensors bit for bit, tuples/lists element-wise, anything else by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def layer_errors(merged, ft, ids) -> list[float]:
    """Relative error of every decoder layer's output hidden states, merged vs fine-tuned model."""
    with torch.no_grad():
        hm = merged(input_ids=ids, output_hidden_states=True).hidden_states[1:]
        hf = ft(input_ids=ids, output_hidden_states=True).hidden_states[1:]
    return [float((a - b).norm() / b.norm()) for a, b in zip(hm, hf)]


def test_each_layer_is_calibrated_with_its_own_mask_and_rotary(tmp_path, monkeypatch):
    with single_thread():
        base_dir = save_model(tiny_model("gemma3", **ARCH), tmp_path / "base")
        ft_model = finetune(tiny_model("gemma3", **ARCH), steps=30, seqlen=32)
        ft_dir = save_model(ft_model, tmp_path / "ft")
        calib = calib_file(tmp_path / "calib", n=32)
        seen: dict = {}
        run_layer, first_inputs = _Run.run_layer, _Run.first_inputs

        def spy_first(self, input_ids):
            seen["ids"] = input_ids
            seen["layers"] = list(self.layers)
            return first_inputs(self, input_ids)

        def spy_run(self, layer, h, kw):
            seen.setdefault(id(layer), kw)  # the first batch's arguments of each layer
            return run_layer(self, layer, h, kw)

        monkeypatch.setattr(_Run, "first_inputs", spy_first)
        monkeypatch.setattr(_Run, "run_layer", spy_run)
        compress_delta(base_dir, ft_dir, str(calib), tmp_path / "own", CompressConfig(**CFG))
        got = [seen[id(m)] for m in seen["layers"]]

        # what the model's own forward passes each layer on the same batch
        ref_model = AutoModelForCausalLM.from_pretrained(ft_dir, dtype=torch.float32).eval()
        want: list[dict] = []
        hooks = [m.register_forward_pre_hook(lambda _m, _a, kw: want.append(dict(kw)), with_kwargs=True)
                 for m in ref_model.model.layers]
        with torch.no_grad():
            ref_model(input_ids=seen["ids"][:CFG["batch_size"]], use_cache=False)
        for h in hooks:
            h.remove()
        for i, (g, w) in enumerate(zip(got, want)):
            for key in ("attention_mask", "position_embeddings"):
                assert same(g.get(key), w.get(key)), (i, TYPES[i], key)
        # the test is not vacuous: sliding and global layers really get different arguments
        assert not same(got[1]["attention_mask"], got[0]["attention_mask"])
        assert not same(got[1]["position_embeddings"], got[0]["position_embeddings"])

        # before: every layer calibrated with layer 0's arguments
        monkeypatch.setattr(_Run, "layer_kwargs", lambda self, i, k: self.layer_kw[0][k])
        compress_delta(base_dir, ft_dir, str(calib), tmp_path / "layer0", CompressConfig(**CFG))
        ck = Checkpoint(base_dir)
        ids = seen["ids"][:8]
        own = layer_errors(load_merged_model(Artifact(tmp_path / "own"), ck), ref_model, ids)
        old = layer_errors(load_merged_model(Artifact(tmp_path / "layer0"), ck), ref_model, ids)
        assert own[0] == old[0]  # layer 0 had its own arguments either way
        for i in range(1, len(TYPES)):
            assert own[i] <= old[i] * 1.01, (i, own, old)
