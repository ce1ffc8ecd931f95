"""What log probabilities and the sampling controls cost a decode step, side by side in one run.

    python bench/sampling.py [--rows 8 32] [--layers 30] [--vocab 49152] [--context 128] [--repeats 21]
        [--threads 1] [--quick] [--out DIR]

A Llama with SmolLM2-135M's shapes (hidden 576, 9 heads, 3 KV heads, vocabulary 49,152; random weights,
``--layers`` decoder layers) runs decode steps of ``B`` rows, each with a ``--context``-token past, through
the engine's own paged KV cache and step (``forward_step``) and its own sampling of the rows
(``engine.draw_tokens``: per-row settings as tensors, ``process_logits``, the draw, log probabilities).
Every row samples at temperature 0.8, top_p 0.95; the candidates differ in what the rows ask for:

- ``off``: nothing more (no log probabilities, no penalties): the path of a request that asks for none;
- ``logprobs_all``: every row ``logprobs=5``; ``logprobs_one``: one row of the batch does;
- ``penalties_all``: every row ``presence_penalty`` 0.5, ``frequency_penalty`` 0.5, ``repetition_penalty``
  1.1 (over its context and 64 generated tokens);
- ``legacy``: the sampling function the engine called before log probabilities and penalties existed
  (``sampling.sample_tokens``), kept for this comparison.

Each is timed as a whole step (forward + sampling: ``step_ms``) and as the sampling alone on the same
step's logits (``sample_ms``), interleaved per repeat; medians and p90s, and ratios to ``off`` (a ratio of
``legacy`` near 1 means a request asking for nothing pays nothing for the new features). ``--quick``:
4 layers, 9 repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import emit, machine  # noqa: E402

CANDIDATES = ("off", "legacy", "logprobs_all", "logprobs_one", "penalties_all")


def log(msg: str) -> None:
    print(f"[bench/sampling] {msg}", file=sys.stderr, flush=True)


class _Base:
    """The engine's backend interface over a plain transformers model (no deltas)."""

    def __init__(self, model, device):
        self.model, self.device, self.config, self.dtype = model, device, model.config, next(model.parameters()).dtype

    def forward(self, row_slots, input_ids, position_ids, attention_mask, kv):
        from deltazip.runtime.serve.model_runner import run_model

        return run_model(self.model, input_ids, position_ids, attention_mask, kv)


def build(layers: int, vocab: int, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    from deltazip.runtime.serve.attention import use_paged_attention

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    use_paged_attention(model)
    return _Base(model, device)


def sequences(rows: int, context: int, vocab: int, candidate: str) -> list:
    """The engine's ``Sequence`` objects of one candidate (their KV caches filled by the caller)."""
    from deltazip.runtime.serve.engine import IncrementalDetokenizer, SamplingParams, Sequence

    g = torch.Generator().manual_seed(1)
    out = []
    for r in range(rows):
        kw = {}
        if candidate == "logprobs_all" or (candidate == "logprobs_one" and r == 0):
            kw["logprobs"] = 5
        if candidate == "penalties_all":
            kw.update(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
        prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
        seq = Sequence(f"r{r}", "m", "m", prompt, SamplingParams(max_tokens=10**6, temperature=0.8, top_p=0.95, **kw),
                       lambda ev: None, IncrementalDetokenizer(None, [], []), seed=r, arrival=0.0)
        seq.output_ids = torch.randint(0, vocab, (64,), generator=g).tolist()
        out.append(seq)
    return out


def sample(candidate: str, seqs: list, logits: torch.Tensor) -> list[int]:
    from deltazip.runtime.serve.engine import draw_tokens
    from deltazip.runtime.serve.sampling import sample_tokens

    if candidate == "legacy":
        return sample_tokens(logits, [s.params.temperature for s in seqs], [s.params.top_p for s in seqs],
                             [s.seed for s in seqs], [len(s.output_ids) for s in seqs])
    return [t for _, t, _ in draw_tokens(seqs, logits, [[2]] * len(seqs))]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(be, rows: int, context: int, repeats: int) -> list[dict]:
    from deltazip.runtime.serve.kv_cache import BlockPool, SeqBlocks
    from deltazip.runtime.serve.model_runner import forward_step, prefill_logits

    vocab = be.config.vocab_size
    pool = BlockPool()
    seqs = {c: sequences(rows, context, vocab, c) for c in CANDIDATES}
    caches = [SeqBlocks() for _ in range(rows)]  # one KV cache for all candidates: the same rows' past
    with torch.inference_mode():
        prefill_logits(be, [-1] * rows, [s.prompt_ids for s in seqs["off"]], caches, pool)
    step_ms = {c: [] for c in CANDIDATES}
    sample_ms = {c: [] for c in CANDIDATES}
    tokens = [[s.prompt_ids[-1]] for s in seqs["off"]]
    for rep in range(repeats + 2):  # two warm-up rounds
        for c in CANDIDATES:
            sync(be.device)
            t0 = time.perf_counter()
            logits = forward_step(be, pool, caches, [-1] * rows, tokens, [k.length for k in caches])
            toks = sample(c, seqs[c], logits)
            sync(be.device)
            t1 = time.perf_counter()
            sample(c, seqs[c], logits)  # the sampling alone, on the same logits
            sync(be.device)
            t2 = time.perf_counter()
            if rep >= 2:
                step_ms[c].append((t1 - t0) * 1e3)
                sample_ms[c].append((t2 - t1) * 1e3)
            tokens = [[t] for t in toks]
    off_step, off_sample = statistics.median(step_ms["off"]), statistics.median(sample_ms["off"])
    out = []
    for c in CANDIDATES:
        st, sa = sorted(step_ms[c]), sorted(sample_ms[c])
        out.append({"rows": rows, "candidate": c, "step_ms": round(statistics.median(st), 3),
                    "step_ms_p90": round(st[int(0.9 * (len(st) - 1))], 3),
                    "sample_ms": round(statistics.median(sa), 3), "sample_ms_p90": round(sa[int(0.9 * (len(sa) - 1))], 3),
                    "step_over_off": round(statistics.median(st) / off_step, 3),
                    "sample_over_off": round(statistics.median(sa) / off_sample, 3)})
        log(f"rows {rows} {c:14s} step {out[-1]['step_ms']:8.2f} ms  sample {out[-1]['sample_ms']:7.3f} ms")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M has 30)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    ap.add_argument("--quick", action="store_true", help="4 layers, 9 repeats")
    ap.add_argument("--out", type=Path, default=None, help="also write DIR/sampling.json")
    a = ap.parse_args()
    if a.quick:
        a.layers, a.repeats = 4, 9
    torch.set_num_threads(a.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    be = build(a.layers, a.vocab, device)
    results = [r for rows in a.rows for r in run(be, rows, a.context, a.repeats)]
    emit({"bench": "sampling", "machine": machine(),
          "config": {"rows": a.rows, "layers": a.layers, "vocab": a.vocab, "context": a.context, "repeats": a.repeats,
                     "threads": a.threads, "device": str(device), "dtype": str(be.dtype), "quick": a.quick},
          "results": results}, a.out, "sampling.json")


if __name__ == "__main__":
    main()
