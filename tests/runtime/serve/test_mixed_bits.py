"""Serving mixed settings: a --target-ratio artifact (tensors of different bits, 2:4 and dense, some
deltas dropped) and a variant of other bits in one batch go through the same SBMM dispatch, one stack
per setting, and every greedy output equals its merged model's."""

from __future__ import annotations

import threading

import pytest
from _factories import calib_file, perturb, tiny_model
from _serving import CHAT_TEMPLATE, PROMPTS, ServedSet, single_thread

from deltazip.compress.config import CompressConfig
from deltazip.compress.pipeline import compress_delta
from deltazip.formats.artifact import Artifact
from deltazip.kernels.scheme import DeltaScheme
from deltazip.runtime.serve.delta_linear import DeltaLinear
from deltazip.runtime.serve.engine import FinishEvent, SamplingParams

IDS = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)


class _Finished:
    """The final event of each request; ``wait`` until all have one."""

    def __init__(self):
        self.done: dict = {}
        self.cond = threading.Condition()

    def sink(self, key):
        def fn(ev):
            if isinstance(ev, FinishEvent):
                with self.cond:
                    self.done[key] = ev
                    self.cond.notify_all()
        return fn

    def wait(self, n: int, timeout: float = 300) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.done) == n, timeout), "requests did not finish in time"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Base, ``mixed`` (--max-bytes halfway between the uniform 4- and 2-bit 2:4 sizes) and ``two``
    (uniform 2-bit dense, asymmetric) of two fine-tunes of it."""
    from deltazip.demo.pair import build_char_tokenizer

    root = tmp_path_factory.mktemp("mixed")
    tok = build_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    base_dir = root / "base"
    tiny_model("llama", **IDS).save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    calib = str(calib_file(root / "calib"))
    arts = root / "artifacts"
    fast = dict(nsamples=8, seqlen=32, device="cpu", group_auto=True)
    with single_thread():
        for name, seed in (("mixed", 21), ("two", 22)):
            ft_dir = root / f"ft-{name}"
            perturb(tiny_model("llama", **IDS), scale=0.3, seed=seed, skip=()).save_pretrained(ft_dir)
            tok.save_pretrained(ft_dir)
            if name == "two":
                cfg = CompressConfig(scheme=DeltaScheme(bits=2, sparsity="none", sym=False), **fast)
            else:
                probe = root / "probe"
                compress_delta(base_dir, ft_dir, calib, probe, CompressConfig(scheme=DeltaScheme(), report=True, **fast))
                sizes = {p["setting"]: p["bytes"] for p in Artifact(probe).manifest["sensitivity"]["uniform"]}
                cfg = CompressConfig(scheme=DeltaScheme(), max_bytes=(sizes["4-bit 2:4"] + sizes["2-bit 2:4"]) // 2,
                                     **fast)
            compress_delta(base_dir, ft_dir, calib, arts / name, cfg)
    return ServedSet(root, base_dir, arts)


def test_the_mixed_artifact_has_several_settings(served):
    art = Artifact(served.variant_dir("mixed"))
    settings = {(e.scheme.bits, e.scheme.sparsity) for e in art.entries().values() if e.is_matrix}
    assert len(settings) >= 2, settings
    assert {e.scheme.bits for e in Artifact(served.variant_dir("two")).entries().values() if e.is_matrix} == {2}


@pytest.mark.parametrize("compute", ["packed", "dequantized"])
def test_mixed_bits_in_one_batch_serve_greedy_equal_to_merged(served, compute):
    from deltazip.runtime.serve.assembly import ServeConfig, build_engine

    with single_thread():
        eng = build_engine(ServeConfig(served.artifacts, base=str(served.base_dir), base_name="base", mode="delta",
                                       device="cpu", dtype="float32", max_deltas=2, delta_compute=compute))
        tok = served.tokenizer()
        col = _Finished()
        eng.start()
        try:
            for m in ("base", "mixed", "two"):
                for p in PROMPTS:
                    eng.submit(m, tok(p)["input_ids"], SamplingParams(max_tokens=8, temperature=0.0), col.sink((m, p)))
            col.wait(3 * len(PROMPTS))
        finally:
            eng.shutdown()
        for (m, p), fin in col.done.items():
            assert fin.reason in ("stop", "length") and fin.text == served.expected(m, p, 8), (compute, m, p, fin)
        if compute == "packed":  # one stack per (bits, group, sparsity): several in one linear
            stacks = [set(mod.groups) for mod in eng.backend.modules.values() if isinstance(mod, DeltaLinear)]
            assert max(len(s) for s in stacks) >= 2, stacks
            keys = set().union(*stacks)
            assert {k[0] for k in keys} >= {2} and len({k[0] for k in keys}) >= 2, keys
