"""Images read by cross-attention layers (Mllama), served: the engine gives what the merged model's
``generate`` gives for the processor's tensors.

Mllama's prompt tokens are text; its cross-attention layers attend to the images' vision states
through keys and values computed once per prompt and kept for the sequence. Covered: a variant that
moved its cross-attention projections (its own keys and values), images between text (a token sees
only the images before it; tokens before the first image see every vision token with their MLP
output masked, as the model's own mask says), text rows in the same steps, chunked prompts, forked
samples, preemption to host memory, swap mode, and a chat request over HTTP with the checkpoint's own
processor.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from _images import (
    N,
    build_variant,
    generate,
    mllama_processor,
    parts_prompt,
    picture,
    png,
    same,
    served_matches_merged,
)
from _serving import ServedSet, engine_runs, running_server, single_thread

from deltazip.compress.merge import load_merged_model
from deltazip.formats.artifact import Artifact
from deltazip.models.checkpoint import Checkpoint
from deltazip.models.loader import load_causal_lm
from deltazip.runtime.serve.model import DeltaModel, SwapModels
from deltazip.runtime.serve.variant_sources import discover_variants

PROMPTS = [["what is it?", picture(0)],  # text before the image: it sees no image yet
           [picture(7, (60, 44)), "and this", picture(8), "one?"]]  # 2 tiles, then 1: each text sees those before it


@pytest.fixture(scope="module")
def mllama(tmp_path_factory):
    """A tiny Mllama base, its fine-tune ``ft`` (text, and its cross-attention projections moved) and
    the merged models' greedy references for :data:`PROMPTS` and a text prompt."""
    root = tmp_path_factory.mktemp("mllama")
    processor = mllama_processor()
    tok = processor.tokenizer
    with single_thread():
        base_dir, arts = build_variant(root, "mllama", processor, vision_scale=0.05, vocab=max(128, len(tok)))
        ck = Checkpoint(base_dir)
        refs = {"ft": load_merged_model(Artifact(arts / "ft"), ck), "base": load_causal_lm(base_dir, torch.float32)}
        prompts = [parts_prompt(processor, p) for p in PROMPTS]
        want = {(m, i): generate(refs[m], *prompts[i], tok=tok) for m in refs for i in range(2)}
        want["ft", "text"] = generate(refs["ft"], tok("zip model tune")["input_ids"], None, tok=tok)
        blind = [generate(refs["ft"], prompts[i][0], None, tok=tok) for i in range(2)]
    # the images matter, and so do the fine-tune's own cross-attention weights
    assert all(max(abs(a - b) for a, b in zip(want["ft", i][1], blind[i][1])) > 1e-2 for i in range(2))
    assert all(max(abs(a - b) for a, b in zip(want["ft", i][1], want["base", i][1])) > 1e-2 for i in range(2))
    return dict(root=root, processor=processor, base=base_dir, arts=arts, ck=ck, prompts=prompts, want=want)


def _delta_model(m, slots: int = 2):
    return DeltaModel(m["ck"], discover_variants(m["arts"]), num_slots=slots, device=torch.device("cpu"),
                      dtype=torch.float32)


@pytest.mark.parametrize("budget", [2048, 12])
def test_mllama_images_give_the_merged_output_beside_text_rows(mllama, budget):
    """Both variants, both prompts and a text prompt queued together (one step holds image rows of
    different vision lengths and a text row); with a 12-token budget each prompt is read in chunks."""
    jobs = [("ft", 0), ("base", 0), ("ft", "text"), ("ft", 1), ("base", 1)]
    with single_thread():
        got = engine_runs(_delta_model(mllama), mllama["processor"].tokenizer,
                          [(m, mllama["prompts"][i] if i != "text" else "zip model tune") for m, i in jobs], N,
                          max_batch_tokens=budget)
    for j, ev in zip(jobs, got):
        assert same(ev, mllama["want"][j]), (j, ev.text, mllama["want"][j])


def test_mllama_samples_and_preempted_sequences_keep_their_images(mllama, tmp_path):
    """``n=2`` of an image prompt (the second sample forked after the prompt), and with one device slot
    and a copy ``ft2`` of the variant, ``ft``'s long requests preempted to host memory and resumed:
    each still attends to its own images."""
    arts = tmp_path / "arts"
    shutil.copytree(mllama["arts"] / "ft", arts / "ft")
    shutil.copytree(mllama["arts"] / "ft", arts / "ft2")
    p0, p1 = mllama["prompts"]
    tok = mllama["processor"].tokenizer
    with single_thread():
        merged = load_merged_model(Artifact(arts / "ft"), mllama["ck"])
        want = [generate(merged, *p, n=n, tok=tok) for p, n in ((p0, 2), (p0, 3), (p0, 24), (p1, 24))]
        twice = engine_runs(_delta_model(mllama), tok, [("ft", p1)], N, samples=2)
        dm = DeltaModel(mllama["ck"], discover_variants(arts), num_slots=1, device=torch.device("cpu"),
                        dtype=torch.float32)
        stats: dict = {}
        got = engine_runs(dm, tok, [("ft", p0, 2), ("ft2", p0, 3), ("ft", p0, 24), ("ft", p1, 24)], N, stats=stats,
                          max_deltas=1, max_cpu_deltas=4)
    assert len(twice) == 2 and all(same(ev, mllama["want"]["ft", 1]) for ev in twice), [ev.text for ev in twice]
    assert stats["preempted"] >= 1, stats
    for j, (ev, w) in enumerate(zip(got, want)):
        assert same(ev, w), (j, ev.text, w)


def test_swap_mode_reads_mllama_images_with_the_variants_whole_model(mllama):
    with single_thread():
        sm = SwapModels(mllama["ck"], discover_variants(mllama["arts"]), 2, torch.device("cpu"), torch.float32, "base")
        got = engine_runs(sm, mllama["processor"].tokenizer, [("ft", mllama["prompts"][1]), ("base", mllama["prompts"][1])], N)
    assert same(got[0], mllama["want"]["ft", 1]) and same(got[1], mllama["want"]["base", 1])


def test_mllama_images_over_http_with_the_checkpoints_processor(mllama):
    """The processor saved beside the weights, loaded by the server (AutoProcessor): a chat request
    with images between text answers what the merged model generates for the processor's tensors."""
    from openai import OpenAI

    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": png(p)}}
               for p in PROMPTS[1]]
    with running_server(ServedSet(mllama["root"], mllama["base"], mllama["arts"]), base=str(mllama["base"])) as srv:
        assert srv.rt.images == {"read": True, "processor": "MllamaProcessor"}, srv.rt.images
        got = OpenAI(base_url=f"{srv.url}/v1", api_key="x").chat.completions.create(
            model="ft", messages=[{"role": "user", "content": content}], max_tokens=N, temperature=0)
    assert got.choices[0].message.content == mllama["want"]["ft", 1][0]
    assert got.usage.prompt_tokens == len(mllama["prompts"][1][0])



def test_the_kv_cache_bytes_count_the_images_cross_attention_keys(mllama):
    """While an image request decodes, ``kv_cache_bytes`` (``deltazip_kv_cache_bytes``) is the paged
    pool's bytes plus its images' keys and values: per cross-attention layer ``2 · H_kv · N · D``
    elements (N: 2 images of up to 4 tiles of 5 vision tokens = 40)."""
    import threading

    from deltazip.runtime.serve.engine import Engine, EngineConfig, FinishEvent, SamplingParams, ServedVariant

    tok = mllama["processor"].tokenizer
    seen, done = [], threading.Event()
    with single_thread():
        dm = _delta_model(mllama)
        eng = Engine(dm, {"ft": ServedVariant("ft", tok, [1], "base"), "base": ServedVariant("base", tok, [1], None)},
                     "base", EngineConfig(max_deltas=2, max_cpu_deltas=2))

        def sink(ev):
            if isinstance(ev, FinishEvent):
                done.set()
            elif len(seen) < 3:  # the engine thread, between steps: the pool is as the last step left it
                seen.append((eng.stats()["kv_cache_bytes"], eng.kv_pool.nbytes()))

        ids, media = mllama["prompts"][1]
        eng.submit("ft", ids, SamplingParams(max_tokens=4, temperature=0.0), sink, media)
        eng.start()
        try:
            assert done.wait(120)
        finally:
            eng.shutdown()
    text = dm.model.config.text_config
    head = text.hidden_size // text.num_attention_heads
    cross = len(text.cross_attention_layers) * 2 * text.num_key_value_heads * 40 * head * 4  # fp32
    assert seen[-1][0] - seen[-1][1] == cross, (seen, cross)


def test_mllama_images_served_in_bf16_give_the_merged_output_in_bf16(tmp_path):
    """bf16, as GPUs serve: the cross-attention keys, the padded step tensors and the masks in bf16,
    against the merged model's bf16 ``generate``; texts equal, log probabilities within 0.05."""
    served_matches_merged(tmp_path, "mllama", mllama_processor(), images_per_prompt=2, vision_scale=0.05,
                          dtype=torch.bfloat16, tol=0.05)
