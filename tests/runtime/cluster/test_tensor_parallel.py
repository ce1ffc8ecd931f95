"""Tensor-parallel deltas (``deltazip serve --tensor-parallel N``) on CPU with gloo.

Two ranks are spawned once for the module (this process is rank 0); every result is compared with
the single-process model: logits to fp32 rounding, greedy tokens exactly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
from _cli import cli_command, read_json_document, run_cli
from _serving import PROMPTS, VARIANTS, served_set, single_thread

from deltazip.formats.errors import InputError
from deltazip.formats.packing import pack_delta
from deltazip.kernels.reference import delta_weight, sbmm
from deltazip.runtime.cluster.tensor_parallel import check_variants, checkpoint_layers
from deltazip.runtime.cluster.tp_shards import shard_packed, shard_slot_args
from deltazip.runtime.serve.engine import Engine, SamplingParams

# fp32 on both sides; the sharded sums add the same products in another order.
from deltazip.runtime.serve.model_runner import prefill_logits

LOGIT_ATOL = 1e-4
MODELS = ["base", *sorted(VARIANTS)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.getbasetemp() / "serving")


@pytest.fixture(scope="module")
def pair(served):
    """(single-process DeltaModel, rank 0 of a 2-rank group) over the same base and variants."""
    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.cluster.tp_group import start_tensor_parallel
    from deltazip.runtime.serve.model import DeltaModel
    from deltazip.runtime.serve.variant_sources import discover_variants

    variants = discover_variants(served.artifacts)
    base = Checkpoint(served.base_dir)
    with single_thread():
        ref = DeltaModel(base, variants, 3, torch.device("cpu"), torch.float32)
        tp = start_tensor_parallel(base, variants, 3, torch.device("cpu"), torch.float32, 2)
        try:
            yield ref, tp
        finally:
            tp.close()
    assert not any(p.is_alive() for p in tp._processes.processes)


def _engine(served, backend, **cfg) -> Engine:
    from deltazip.runtime.serve.assembly import ServeConfig, engine_for

    return engine_for(backend, ServeConfig(**cfg))


def test_mixed_batch_logits_equal_the_single_process_model(pair, served):
    """One prefill batch of base rows and rows of alpha (4-bit 2:4), beta (2-bit dense, asymmetric)
    and gamma (4-bit 2:4, non-additive): logits within fp32 rounding, same argmax."""
    ref, tp = pair
    with single_thread():
        for slot, name in enumerate(sorted(VARIANTS)):
            ref.write_slot(slot, name, ref.load_host(name))
            tp.write_slot(slot, name, tp.load_host(name))
        tok = served.tokenizer()
        tokens = [tok(p)["input_ids"] for p in PROMPTS[:4]] * 2
        slots = [-1, 0, 1, 2, 2, 1, 0, -1]
        want = prefill_logits(ref, slots, tokens)
        got = prefill_logits(tp, slots, tokens)
    assert (got - want).abs().max().item() < LOGIT_ATOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # Each rank holds half of every sharded linear, of the base and of a resident delta.
    assert tp.slot_bytes(0) < 0.75 * ref.slot_bytes(0)
    layers = sum(p.numel() for n, p in ref.model.named_parameters() if "layers." in n and n.endswith("proj.weight"))
    assert ref.base_bytes() - tp.base_bytes() == layers * 4 // 2


def _run_all(eng, jobs, tok) -> dict:
    done: dict = {}
    for i, (m, p, n) in enumerate(jobs):  # queued before the engine starts: one FCFS walk sees them all
        eng.submit(m, tok(p)["input_ids"], SamplingParams(max_tokens=n, temperature=0.0),
                   lambda ev, i=i: done.setdefault(i, []).append(ev))
    eng.start()
    try:
        deadline = time.time() + 240
        while sum(1 for evs in done.values() if hasattr(evs[-1], "reason")) < len(jobs):
            assert time.time() < deadline, "requests did not finish"
            time.sleep(0.05)
        return {"stats": eng.stats(), **{i: evs[-1] for i, evs in done.items()}}
    finally:
        eng.shutdown()


def test_engine_greedy_text_equals_the_merged_models(pair, served):
    """Continuous batching through 2 slots and a 1-entry host tier (slot churn mirrored on the
    worker, KV caches kept per sequence on both ranks): every text equals the merged model's."""
    _, tp = pair
    jobs = [(m, p, 8) for m in MODELS for p in PROMPTS[:3]]
    with single_thread():
        eng = _engine(served, tp, max_deltas=2, max_cpu_deltas=1, max_num_seqs=8)
        assert eng.paged and eng.graphs is None  # the paged cache on every rank, eager (mirrored) forwards
        out = _run_all(eng, jobs, served.tokenizer())
    for i, (m, p, n) in enumerate(jobs):
        assert out[i].reason in ("stop", "length"), out[i]
        assert out[i].text == served.expected(m, p, n), (m, p)
    assert eng.kv_pool.nbytes() == 0


def test_preempted_sequences_resume_on_every_rank(pair, served):
    """One slot: alpha's long requests skip the line past beta and are preempted when their parent
    ends (rank 0 moves their KV to the host; the worker keeps its own), then resume: same texts."""
    _, tp = pair
    jobs = [("alpha", PROMPTS[0], 4), ("beta", PROMPTS[1], 6), ("alpha", PROMPTS[2], 20), ("alpha", PROMPTS[3], 20)]
    with single_thread():
        out = _run_all(_engine(served, tp, max_deltas=1, max_cpu_deltas=4), jobs, served.tokenizer())
    assert out["stats"]["preempted"] == 2
    for i, (m, p, n) in enumerate(jobs):
        assert out[i].text == served.expected(m, p, n), (m, p)


def test_forked_samples_fork_the_worker_ranks_kv_too(pair, served):
    """n=3 seeded samples of one prompt: forked from its KV cache on rank 0 and on the worker rank
    (whose heads' keys and values the samples read), they equal the single-process engine's."""
    from deltazip.runtime.serve.engine import FinishEvent

    texts = {}
    tok = served.tokenizer()
    for name, backend in zip(("one", "tp"), pair):
        with single_thread():
            eng = _engine(served, backend, max_deltas=2, max_cpu_deltas=1, max_num_seqs=8)
            done: dict = {}
            params = SamplingParams(max_tokens=10, temperature=1.0, seed=21, n=3)
            eng.submit_samples("alpha", tok(PROMPTS[3] * 2)["input_ids"], params,
                               [lambda ev, i=i, d=done: d.__setitem__(i, ev) if isinstance(ev, FinishEvent) else None
                                for i in range(3)])
            eng.start()
            try:
                deadline = time.time() + 120
                while len(done) < 3:
                    assert time.time() < deadline, "samples did not finish"
                    time.sleep(0.05)
            finally:
                eng.shutdown()
            texts[name] = [done[i].text for i in range(3)]
            assert eng.kv_pool.nbytes() == 0
    assert texts["tp"] == texts["one"] and len(set(texts["one"])) == 3


def test_variants_removed_and_added_while_serving_are_mirrored(pair, served):
    """``remove_variant`` / ``commit_variant`` (what DELETE and POST /v1/variants run) reach the worker:
    the re-added variant loads into a slot on both ranks and computes the same logits."""
    ref, tp = pair
    v = tp.variants["beta"]
    with single_thread():
        tp.clear_slot(1)
        tp.remove_variant("beta")
        assert "beta" not in tp.variants
        wanted: dict = {}
        tp.commit_variant(v, tp.prepare_variant(v, wanted), wanted)
        tp.write_slot(1, "beta", tp.load_host("beta"))
        ref.write_slot(1, "beta", ref.load_host("beta"))
        tokens = [served.tokenizer()(p)["input_ids"] for p in PROMPTS[:2]]
        got, want = prefill_logits(tp, [1, -1], tokens), prefill_logits(ref, [1, -1], tokens)
    assert (got - want).abs().max().item() < LOGIT_ATOL
    # Every row-parallel layer, decoupled or not, ends in its all-reduce (one forward hook each).
    from deltazip.runtime.cluster.tensor_parallel import shard_kind

    rows = [m for n, m in tp.model.named_modules() if shard_kind(n) == "row"]
    assert len(rows) == 2 * tp.config.num_hidden_layers
    assert all(getattr(m, "_tp_all_reduce", False) and len(m._forward_hooks) == 1 for m in rows)


def test_lora_dense_and_bias_shards_add_up():
    """LoRA factors (B rows for column shards, A columns for row shards), dense replacements and
    biases: the per-rank products concatenate / sum to the unsharded ones."""
    g = torch.Generator().manual_seed(0)
    out_f, in_f, r, world = 12, 16, 3, 2
    kw = {"lora_a": torch.randn(r, in_f, generator=g), "lora_b": torch.randn(out_f, r, generator=g), "lora_scale": 0.5,
          "dense": torch.randn(out_f, in_f, generator=g), "bias": torch.randn(out_f, generator=g)}
    x = torch.randn(4, in_f, generator=g)

    def apply(k, xs):
        return (xs @ k["lora_a"].T) @ k["lora_b"].T * k["lora_scale"] + xs @ k["dense"].T + k["bias"]

    want = apply(kw, x)
    cols = torch.cat([apply(shard_slot_args(kw, "column", i, world), x) for i in range(world)], dim=1)
    w = in_f // world
    rows = sum(apply(shard_slot_args(kw, "row", i, world), x[:, i * w:(i + 1) * w]) for i in range(world))
    torch.testing.assert_close(cols, want)
    torch.testing.assert_close(rows, want)  # the bias is added by rank 0 only


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("sym", [True, False])
def test_sharded_packed_delta_products_add_up_to_the_unsharded_one(bits, sparse, sym):
    """Column shards concatenated and row shards summed give ``x Δᵀ`` of the whole packed delta."""
    g = torch.Generator().manual_seed(bits * 10 + sparse * 2 + sym)
    out_f, in_f, group = 24, 128, 32
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=g)
    scales = torch.rand(out_f, in_f // group, generator=g) * 0.1 + 0.01
    zeros = None if sym else torch.randint(0, 2**bits, (out_f, in_f // group), generator=g)
    mask = None
    if sparse:
        keep = torch.rand(out_f, in_f // 4, 4, generator=g).argsort(-1)[..., :2]
        mask = torch.zeros(out_f, in_f // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(out_f, in_f)
    d = pack_delta(codes, scales, zeros, mask, bits, group)
    x = torch.randn(5, in_f, generator=g)
    idx = torch.zeros(5, dtype=torch.int64)
    want = sbmm(x, idx, [d])
    for world in (2, 4):
        cols = torch.cat([sbmm(x, idx, [shard_packed(d, "column", r, world)]) for r in range(world)], dim=1)
        torch.testing.assert_close(cols, want, rtol=0, atol=1e-5)
        w = in_f // world
        rows = sum(sbmm(x[:, r * w:(r + 1) * w], idx, [shard_packed(d, "row", r, world)]) for r in range(world))
        torch.testing.assert_close(rows, want, rtol=1e-5, atol=1e-5)
        # and each row shard is exactly its columns of the dense delta
        dense = delta_weight(d)
        for r in range(world):
            assert torch.equal(delta_weight(shard_packed(d, "row", r, world)), dense[:, r * w:(r + 1) * w])


def test_a_row_shard_that_would_split_a_group_is_refused(served):
    from deltazip.runtime.serve.variant_sources import discover_variants

    d = pack_delta(torch.zeros(8, 64, dtype=torch.long), torch.ones(8, 1), None, None, 4, 64)
    with pytest.raises(InputError, match="cannot be split into 2 shards of 32"):
        shard_packed(d, "row", 0, 2)
    variants = discover_variants(served.artifacts)
    layers = checkpoint_layers(served.base_dir)
    assert layers == "model.layers"
    check_variants(variants, 2, layers)  # shards of 32 (o_proj) and 64 (down_proj) hold whole groups of 32
    with pytest.raises(InputError, match=r"groups of 32 input columns.*--tensor-parallel 4 shards of 16") as e:
        check_variants(variants, 4, layers)
    assert "\n" not in str(e.value)
    check_variants(variants, 4, "vision_tower.layers")  # tensors outside the decoder layers stay whole


def _one_line(code: int, err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 1 and len(lines) == 1, err
    return lines[0]


def test_cli_refuses_what_it_cannot_shard_in_one_line(served, capsys, monkeypatch, tmp_path):
    from _factories import tiny_model

    arts = served.artifacts
    cases = [
        (["--tensor-parallel", "3"], "does not divide the model's attention heads (4)"),
        # (4 ranks would keep each of the 2 KV heads whole on two of them, but would split o_proj's groups)
        (["--tensor-parallel", "4"], "has quantization groups of 32 input columns, which --tensor-parallel 4 shards "
                                     "of 16 columns would split"),
        (["--tensor-parallel", "2", "--mode", "swap"], "does not combine with --mode swap or --workers"),
        (["--tensor-parallel", "2", "--workers", "2"], "does not combine with --mode swap or --workers"),
        (["--tensor-parallel", "0"], "--tensor-parallel must be >= 1"),
    ]
    for extra, msg in cases:
        code, _, err = run_cli(capsys, monkeypatch, "serve", arts, "--base", served.base_dir, "--port", "0", *extra)
        assert msg in _one_line(code, err), err
    dbrx = tmp_path / "dbrx"  # experts stored as flat [E * F, H] parameters
    tiny_model("dbrx").save_pretrained(dbrx, safe_serialization=True)
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(capsys, monkeypatch, "serve", tmp_path / "empty", "--base", dbrx, "--port", "0",
                           "--tensor-parallel", "2")
    line = _one_line(code, err)
    assert "--tensor-parallel does not shard model_type 'dbrx'" in line and "serve_tp2" in line, line


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` (from /proc)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_serve_tensor_parallel_2_answers_like_one_process_and_leaves_no_children(served):
    """``deltazip serve --tensor-parallel 2`` on a loopback port: chat completions equal the
    single-process server's greedy text; SIGTERM stops it and its worker rank."""
    import httpx

    from deltazip.runtime.serve.assembly import ServeConfig, build_runtime
    from deltazip.runtime.serve.server import Metrics, ServerThread, create_app

    messages = [{"role": "user", "content": "zip the model"}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    with single_thread():
        rt = build_runtime(ServeConfig(artifacts=served.artifacts, base=str(served.base_dir)), observer=Metrics())
        with ServerThread(create_app(rt, Metrics())) as one:
            want = {m: httpx.post(one.url + "/v1/chat/completions", json={**body, "model": m}, timeout=120).json()
                    for m in ("tiny-base", "alpha", "beta")}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cli_command("serve", served.artifacts, "--base", served.base_dir, "--port", "0", "--json",
                                        "--tensor-parallel", "2", "--cpu-threads", "1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = read_json_document(proc)["serving"]
        kids = _children(proc.pid)
        assert kids, "the worker rank runs as a child process"
        for m, w in want.items():
            r = httpx.post(url + "/v1/chat/completions", json={**body, "model": m}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == w["choices"][0]["message"]["content"], m
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM, err
    assert "Traceback" not in err
    deadline = time.time() + 10
    while any(_alive(k) for k in kids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(k) for k in kids), "a worker rank outlived the server"
