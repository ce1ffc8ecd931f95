"""CUDA-graph decode steps: the replayed step equals the eager one, graphs are reused per bucket, and
greedy serving with graphs gives the eager server's text.

The GPU tests run fp16 over the ``kernel`` set (tests/_serving.py): every delta on the validated CUDA
kernel, which is what a GPU server captures. A delta on the torch reference (fp32, or a scheme only a
preview build serves) reads the slot index on the host, so its decode step cannot be captured and runs
eagerly; the CPU test here checks that the set's premise holds."""

from __future__ import annotations

import time

import pytest
import torch
from _serving import PROMPTS, served_set


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return served_set(tmp_path_factory.getbasetemp() / "serving-kernel", "kernel")


def test_every_delta_of_the_kernel_set_is_one_the_validated_kernel_serves_in_fp16(served):
    from deltazip.formats.artifact import Artifact
    from deltazip.kernels.dispatch import coverage
    from deltazip.runtime.serve.variant_sources import discover_variants

    names = [v.name for v in discover_variants(served.artifacts)]
    assert names == ["alpha", "beta"]
    for name in names:
        entries = Artifact(served.variant_dir(name)).entries()
        packed = {t: e for t, e in entries.items() if e.scheme is not None}
        assert len(packed) == 7 * 2, (name, sorted(packed))  # the 7 linears of both layers
        for t, e in packed.items():
            assert coverage(e.scheme, e.shape[1], torch.float16) is None, (name, t, e.scheme)
        # everything else is the base's own tensor: nothing served outside the kernel
        assert all(e.kind == "same" for t, e in entries.items() if t not in packed), (
            name, {t: e.kind for t, e in entries.items() if t not in packed})


def _delta_model(served, slots=2):
    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.serve.model import DeltaModel
    from deltazip.runtime.serve.variant_sources import discover_variants

    variants = discover_variants(served.artifacts)
    dm = DeltaModel(Checkpoint(served.base_dir), variants, slots, torch.device("cuda"), torch.float16)
    for i, v in enumerate(variants[:slots]):
        dm.write_slot(i, v.name, dm.load_host(v.name))
    return dm


@pytest.mark.gpu
def test_replayed_decode_steps_equal_eager_steps(served):
    from deltazip.kernels import dispatch
    from deltazip.runtime.serve.cuda_graphs import DecodeGraphs
    from deltazip.runtime.serve.model_runner import forward_step, new_kv_pool, new_seq_kv, prefill_logits

    dm = _delta_model(served)
    tok = served.tokenizer()
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    slots = [0, -1, 1]
    pools = [new_kv_pool(dm), new_kv_pool(dm)]
    caches = [[new_seq_kv(p) for _ in prompts] for p in pools]
    first = [prefill_logits(dm, slots, prompts, c, p).argmax(-1).tolist() for c, p in zip(caches, pools)]
    assert first[0] == first[1]
    graphs = DecodeGraphs(dm, pools[0])
    toks = first[0]
    dispatch.CALLS.clear()
    for i in range(7):
        got = graphs.run(caches[0], slots, toks, ("w",))
        if i == 0:  # a composition met once runs eagerly; the second time it is captured
            assert got is None
            got = forward_step(dm, pools[0], caches[0], slots, [[t] for t in toks], [c.length for c in caches[0]])
        assert got is not None, "the decode step was not captured"
        want = forward_step(dm, pools[1], caches[1], slots, [[t] for t in toks], [c.length for c in caches[1]])
        # the same kernels on the same inputs; the captured attention spans the whole pool (another
        # reduction over the blocks), so equal up to fp16 rounding
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        toks = want.argmax(-1).tolist()
    assert dispatch.CALLS["cuda"] > 0 and dispatch.CALLS["reference"] == 0, dict(dispatch.CALLS)
    # one bucket (4 rows for 3), captured once, replayed from the second step on
    assert graphs.launches == 6 and graphs.captures == 1 and len(graphs.graphs) == 1 and not graphs.failed
    assert [c.length for c in caches[0]] == [c.length for c in caches[1]]


def _serve_greedy(served, cuda_graphs: bool):
    """``({(model, prompt): text}, the engine)``: 8 greedy tokens for base and both variants, served by an
    engine of its own over a model of its own."""
    from deltazip.runtime.serve.assembly import ServeConfig, engine_for
    from deltazip.runtime.serve.engine import SamplingParams

    eng = engine_for(_delta_model(served), ServeConfig(max_deltas=2, cuda_graphs=cuda_graphs))
    assert (eng.graphs is not None) == cuda_graphs
    tok, done = served.tokenizer(), {}

    def sink(key):
        def fn(ev):
            if type(ev).__name__ == "FinishEvent":
                done[key] = ev.text
        return fn

    jobs = [(m, p) for m in ("base", "alpha", "beta") for p in PROMPTS[:2]]
    eng.start()
    try:
        for m, p in jobs:
            eng.submit(m, tok(p)["input_ids"], SamplingParams(max_tokens=8, temperature=0.0), sink((m, p)))
        deadline = time.time() + 300
        while len(done) < len(jobs) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        eng.shutdown()
    assert len(done) == len(jobs), sorted(done)
    return done, eng


@pytest.mark.gpu
def test_greedy_serving_with_cuda_graphs_equals_eager_serving(served):
    eager, _ = _serve_greedy(served, cuda_graphs=False)
    replayed, eng = _serve_greedy(served, cuda_graphs=True)
    assert eng.graphs.launches > 0 and not eng.graphs.failed
    assert replayed == eager
    assert eager["alpha", PROMPTS[0]] != eager["base", PROMPTS[0]] or eager["beta", PROMPTS[0]] != eager["base", PROMPTS[0]]
