"""A tiny base model and three compressed variants for the serving tests, built once per session.

- base: a 2-layer Llama (hidden 64, vocab 128) with the demo's character tokenizer (decodes by
  concatenation) plus a small chat template;
- ``alpha``: ΔCompress 4-bit 2:4, group 32 (every tensor changed: dense-delta norms/embeddings/lm_head);
- ``beta``: RTN 2-bit dense asymmetric, group 32, norms untouched (stored "same");
- ``gamma``: SparseGPT 4-bit 2:4 on the full weights (non-additive: the base term is replaced).

``expected(name, prompt, n)`` is the merged model's greedy ``generate`` text for a variant, the
correctness anchor of every serving test. ``served_set(root, "kernel")`` builds a second set whose every
delta the validated CUDA kernel serves (:data:`KERNEL_VARIANTS`), for the GPU tests of what runs on it.
"""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from _factories import calib_file, perturb, tiny_model

CHAT_TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
                 "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
VARIANTS = {
    "alpha": dict(method="deltazip", bits=4, sparsity="2:4", sym=True, seed=11, scale=0.3, skip=()),
    "beta": dict(method="rtn", bits=2, sparsity="none", sym=False, seed=12, scale=0.3, skip=("norm",)),
    "gamma": dict(method="sparsegpt", bits=4, sparsity="2:4", sym=True, seed=13, scale=0.3, skip=()),
}
PROMPTS = ["alpha beta", "zip model tune", "12 + 345 =", "delta delta gamma zip", "base"]


@dataclass(eq=False)  # hashed by identity: its methods are cached
class ServedSet:
    root: Path
    base_dir: Path
    artifacts: Path

    def variant_dir(self, name: str) -> Path:
        return self.artifacts / name

    @functools.cache  # noqa: B019
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.base_dir)

    @functools.cache  # noqa: B019 - one ServedSet per session; the cache is the point
    def model(self, name: str):
        """The reference model of ``name``: the base itself, or the merged fine-tune (fp32)."""
        from transformers import AutoModelForCausalLM

        from deltazip.compress.merge import load_merged_model
        from deltazip.formats.artifact import Artifact
        from deltazip.models.checkpoint import Checkpoint

        if name == "base":
            return AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32).eval()
        return load_merged_model(Artifact(self.variant_dir(name)), Checkpoint(self.base_dir))

    def merged_dir(self, name: str, out: Path) -> Path:
        """Variant ``name`` merged into a plain checkpoint at ``out`` (what lm-eval's ``hf`` loads)."""
        from deltazip.compress.merge import merge_to_dir
        from deltazip.formats.artifact import Artifact
        from deltazip.models.checkpoint import Checkpoint

        with single_thread():
            merge_to_dir(Artifact(self.variant_dir(name)), Checkpoint(self.base_dir), out)
        return out

    def expected(self, name: str, prompt: str, max_tokens: int) -> str:
        return self.expected_ids(name, tuple(self.tokenizer()(prompt)["input_ids"]), max_tokens)

    @functools.cache  # noqa: B019
    def expected_ids(self, name: str, prompt_ids: tuple[int, ...], max_tokens: int) -> str:
        tok = self.tokenizer()
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = self.model(name).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                            do_sample=False, pad_token_id=tok.pad_token_id)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


_BUILT: dict[str, ServedSet] = {}


# Variants whose every delta the validated CUDA kernel serves in fp16 (4-bit, groups of 32 and of the row;
# linears only: norms, embeddings and the head untouched) over a base whose linears are 128 and 256 wide (no
# padded K tile): a GPU test of what runs on the kernel, CUDA graphs first.
KERNEL_VARIANTS = {
    "alpha": dict(method="deltazip", bits=4, sparsity="2:4", sym=True, seed=11, scale=0.3, group_size=32,
                  skip=("norm", "embed", "lm_head")),
    "beta": dict(method="rtn", bits=4, sparsity="none", sym=False, seed=12, scale=0.3, group_size=-1,
                 skip=("norm", "embed", "lm_head")),
}
KERNEL_SIZES = dict(hidden_size=128, intermediate_size=256)


def served_set(tmp_root: Path, kind: str = "set") -> ServedSet:
    """Build (once per process and ``kind``) the base and its variants under ``tmp_root``: ``"set"`` the
    hidden-64 base and :data:`VARIANTS`, ``"kernel"`` the hidden-128 base and :data:`KERNEL_VARIANTS`."""
    if kind in _BUILT:
        return _BUILT[kind]
    from deltazip.compress.config import CompressConfig
    from deltazip.compress.pipeline import compress_delta
    from deltazip.demo.pair import build_char_tokenizer
    from deltazip.kernels.scheme import DeltaScheme

    variants, sizes = (VARIANTS, {}) if kind == "set" else (KERNEL_VARIANTS, KERNEL_SIZES)
    tmp_root.mkdir(parents=True, exist_ok=True)
    # The demo's character tokenizer: <s>=0, </s>=1, <pad>=2; the model config must agree.
    ids = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2, **sizes)
    base = tiny_model("llama", **ids)
    base_dir = tmp_root / "tiny-base"
    base.save_pretrained(base_dir, safe_serialization=True)
    tok = build_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(base_dir)
    calib = calib_file(tmp_root / "calib")
    arts = tmp_root / "artifacts"
    for name, spec in variants.items():
        ft = perturb(tiny_model("llama", **ids), scale=spec["scale"], seed=spec["seed"], skip=spec["skip"])
        ft_dir = tmp_root / f"ft-{name}"
        ft.save_pretrained(ft_dir, safe_serialization=True)
        tok.save_pretrained(ft_dir)
        scheme = DeltaScheme(bits=spec["bits"], sparsity=spec["sparsity"], sym=spec["sym"],
                             group_size=spec.get("group_size", 32))
        cfg = CompressConfig(scheme=scheme, method=spec["method"], nsamples=8, seqlen=32, device="cpu")
        compress_delta(base_dir, ft_dir, str(calib), arts / name, cfg)
    _BUILT[kind] = ServedSet(tmp_root, base_dir, arts)
    return _BUILT[kind]


@contextlib.contextmanager
def running_server(served: ServedSet, **cfg):
    """``deltazip serve`` of ``served``'s artifacts on a loopback port (``ServeConfig`` options
    ``cfg``), on one torch thread; yields the ``ServerThread`` with the runtime as its ``rt``."""
    from deltazip.runtime.serve.assembly import ServeConfig, build_runtime
    from deltazip.runtime.serve.server import Metrics, ServerThread, create_app

    with single_thread():
        metrics = Metrics()
        rt = build_runtime(ServeConfig(artifacts=served.artifacts, **cfg), observer=metrics)
        with ServerThread(create_app(rt, metrics)) as srv:
            srv.rt = rt
            yield srv


class PlainBackend:
    """The engine's backend contract over a plain transformers model (base rows only): what the step
    runner (``forward_step``) needs of ``DeltaModel``/``SwapModels``."""

    def __init__(self, model):
        self.model, self.config, self.device, self.dtype = model, model.config, torch.device("cpu"), model.dtype

    def forward(self, row_slots, input_ids, position_ids, attention_mask, kv):
        from deltazip.runtime.serve.model_runner import run_model

        return run_model(self.model, input_ids, position_ids, attention_mask, kv)


class single_thread:
    """Context manager: torch on one intra-op thread (tiny models on a shared 2-core machine run
    several times faster without OpenMP threads spinning against other processes)."""

    def __enter__(self):
        self.prev = torch.get_num_threads()
        torch.set_num_threads(1)
        return self

    def __exit__(self, *exc):
        torch.set_num_threads(self.prev)


async def send_completion(http, body: dict, header: str, first) -> dict:
    """``POST /v1/completions`` through ``http`` (an ``httpx.AsyncClient``): ``{"status", "server": the
    ``header`` of the answer, "json"}``, or for a stream ``"lines"``: every ``data:`` payload; the
    future ``first`` gets the ``header`` of the first stream that received a chunk."""
    if not body.get("stream"):
        r = await http.post("/v1/completions", json=body)
        return {"status": r.status_code, "server": r.headers.get(header), "json": r.json()}
    lines = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if not first.done():
                    first.set_result(r.headers[header])
    return {"status": r.status_code, "server": r.headers.get(header), "lines": lines}


def stream_outcome(out: dict, want: str, victim: str) -> bool:
    """Checks a stream of :func:`send_completion` whose server ``victim`` was killed: it completes with
    ``want``, or (only from ``victim``) ends with an error event and ``[DONE]`` after chunks with a
    prefix of ``want`` (it had started answering). True for the latter."""
    lines = out["lines"]
    assert out["status"] == 200 and lines[-1] == "[DONE]", out
    events = [json.loads(x) for x in lines[:-1]]
    text = "".join(c["text"] for e in events if "choices" in e for c in e["choices"])
    if "error" not in events[-1]:
        assert text == want and not any("error" in e for e in events), (out, want)
        return False
    assert events[-1]["error"]["code"] == "worker_failed" and out["server"] == victim, out
    assert len(events) >= 2 and want.startswith(text), (out, want)
    return True


def char_greedy(model, tok, prompt: str, n: int) -> str:
    """``generate``'s greedy text for ``prompt`` with the demo's character tokenizer (pad 2, EOS 1)."""
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=2, eos_token_id=1)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def engine_texts(dm, tok, jobs, n: int, **config) -> list[str]:
    """Greedy texts of ``jobs`` (model, prompt) submitted together to an engine over ``dm`` (one mixed
    batch; a slot for every variant of ``dm``; the demo's character tokenizer, EOS 1). A prompt may
    be ``(token ids, PromptMedia)``, a prompt with images. ``config``: more ``EngineConfig`` fields."""
    return [ev.text for ev in engine_runs(dm, tok, jobs, n, **config)]


def engine_runs(dm, tok, jobs, n: int, samples: int = 1, stats: dict | None = None, **config) -> list:
    """:func:`engine_texts`' finish events, each with its drawn tokens' log probabilities; with
    ``samples``, that many greedy samples per job (``n`` of the request), job by job. A job may be
    ``(model, prompt, max_tokens)`` to ask for other than ``n`` tokens; ``stats`` gets the engine's
    stats once every job has finished; ``config`` may set ``max_deltas`` below one slot per variant."""
    import threading

    from deltazip.runtime.serve.engine import Engine, EngineConfig, FinishEvent, SamplingParams, ServedVariant

    table = {"base": ServedVariant("base", tok, [1], None)}
    table.update({v: ServedVariant(v, tok, [1], "base") for v in dm.variants})
    k = max(2, len(dm.variants))
    eng = Engine(dm, table, "base", EngineConfig(**{"max_deltas": k, "max_cpu_deltas": k, **config}))
    done, cond = {}, threading.Condition()

    def sink(i):
        def fn(ev):
            with cond:
                if isinstance(ev, FinishEvent):
                    done[i] = ev
                    cond.notify_all()
        return fn

    for i, (m, p, *size) in enumerate(jobs):  # queued before the engine starts: the first step batches them all
        ids, media = p if isinstance(p, tuple) else (tok(p)["input_ids"], None)
        params = SamplingParams(max_tokens=size[0] if size else n, temperature=0.0, logprobs=0, n=samples)
        eng.submit_samples(m, ids, params, [sink(i * samples + k) for k in range(samples)], media)
    jobs = [j for j in jobs for _ in range(samples)]
    eng.start()
    try:
        with cond:
            assert cond.wait_for(lambda: len(done) == len(jobs), 120), "requests did not finish"
        if stats is not None:
            stats.update(eng.stats())
    finally:
        eng.shutdown()
    assert all(ev.reason in ("stop", "length") for ev in done.values()), done
    return [done[i] for i in range(len(jobs))]


def adapter_rows(ck, v, ids: torch.Tensor) -> torch.Tensor:
    """Delta-mode logits of one batch of ``ids [2, T]``: row 0 served as variant ``v`` (on base
    checkpoint ``ck``), row 1 as the base; ``[2, T, V]``."""
    from deltazip.runtime.serve.model import DeltaModel

    model = DeltaModel(ck, [v], num_slots=2, device=torch.device("cpu"), dtype=torch.float32)
    model.write_slot(1, v.name, model.load_host(v.name))
    model.ctx.bind([1, -1], "cpu")
    try:
        with torch.no_grad():  # (no cache of the model's own: a recurrent mixer runs per group of rows)
            return model.model(input_ids=ids, use_cache=False).logits
    finally:
        model.ctx.unbind()


def swap_logits(ck, v, ids: torch.Tensor) -> torch.Tensor:
    """Swap-mode logits of ``ids`` served as variant ``v`` (its whole model swapped in)."""
    from deltazip.runtime.serve.model import SwapModels

    sm = SwapModels(ck, [v], num_slots=1, device=torch.device("cpu"), dtype=torch.float32, base_name="base")
    sm.write_slot(0, v.name, sm.load_host(v.name))
    with torch.no_grad():
        return sm.models[0](input_ids=ids).logits


def peft_logits(pm, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A PEFT model's logits of ``ids`` with its adapter and without (the base's, unless the adapter
    trained base parameters in place)."""
    with torch.no_grad():
        with_adapter = pm(input_ids=ids).logits
        with pm.disable_adapter():
            return with_adapter, pm(input_ids=ids).logits
