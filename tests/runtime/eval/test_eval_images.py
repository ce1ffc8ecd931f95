"""``deltazip eval`` on tasks with images: an image-text variant runs lm-eval's multimodal model type
over the serving model, and answers what lm-eval's own ``hf-multimodal`` type answers on the merged
checkpoint (batches of two, left-padded, the vision tower run by ``generate`` before the model's
forward); the same task through ``run_eval`` scores the merged checkpoint's own answers 1.0 on the
variant and lower on the base."""

from __future__ import annotations

import shutil

import pytest
import torch
from _images import build_variant, llava_processor, mllama_processor, picture, tokenizer
from _serving import single_thread

pytest.importorskip("lm_eval")

from deltazip.compress.merge import load_merged_model  # noqa: E402
from deltazip.formats.artifact import Artifact  # noqa: E402
from deltazip.models.checkpoint import Checkpoint  # noqa: E402
from deltazip.models.loader import load_causal_lm  # noqa: E402

IMAGES = 6
QUESTIONS = ["what is it?", "and this", "zip?", "how many"]


def _task(root, answers: list[str], placeholder: str = "<image>") -> None:
    """A local generate_until task ``tiny_images``: a question and an image per document."""
    import datasets

    ds = datasets.Dataset.from_dict({"image": [picture(40 + s) for s in range(IMAGES)], "answer": answers,
                                     "question": [QUESTIONS[s % len(QUESTIONS)] for s in range(IMAGES)]})
    ds = ds.cast_column("image", datasets.Image())
    ds.to_parquet(str(root / "images.parquet"))
    (root / "tiny_images.yaml").write_text(f"""task: tiny_images
dataset_path: parquet
dataset_kwargs:
  data_files:
    test: {root / 'images.parquet'}
test_split: test
output_type: generate_until
doc_to_image: [image]
doc_to_text: "{placeholder}{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")


def _answers(result) -> list[str]:
    return [s["resps"][0][0] for s in sorted(result["samples"]["tiny_images"], key=lambda s: s["doc_id"])]


@pytest.mark.parametrize("arch", ["llava", "mllama"])
def test_image_tasks_through_the_serving_model_answer_as_the_merged_checkpoint(tmp_path, arch):
    import lm_eval

    from deltazip.runtime.eval.lm_eval_vlm import DeltazipVLM
    from deltazip.runtime.eval.run import EvalOptions, run_eval, task_manager

    processor = llava_processor(tokenizer()) if arch == "llava" else mllama_processor()
    with single_thread():
        base_dir, arts = build_variant(tmp_path, arch, processor, vision_scale=0.5 if arch == "llava" else 0.05,
                                       vocab=max(128, len(processor.tokenizer)))
        merged = tmp_path / "merged"
        load_merged_model(Artifact(arts / "ft"), Checkpoint(base_dir)).save_pretrained(merged)
        processor.save_pretrained(merged)
        tasks = tmp_path / "tasks"
        tasks.mkdir()
        _task(tasks, ["?"] * IMAGES)
        tm = task_manager(["tiny_images"], [tasks])
        run = dict(tasks=["tiny_images"], task_manager=tm, log_samples=True, bootstrap_iters=0)
        want = lm_eval.simple_evaluate(model="hf-multimodal", batch_size=2,
                                       model_args=f"pretrained={merged},device=cpu,dtype=float32", **run)
        got = lm_eval.simple_evaluate(model=DeltazipVLM(str(arts / "ft"), base=str(base_dir), device="cpu",
                                                        batch_size=2), **run)
        # The fine-tune's vision side matters to the answers: read by the base's, they change.
        blind = tmp_path / "base-vision"
        model = load_merged_model(Artifact(arts / "ft"), Checkpoint(base_dir))
        base_sd = load_causal_lm(base_dir, torch.float32).state_dict()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not name.startswith("model.language_model.") and name != "lm_head.weight":
                    p.copy_(base_sd[name])
        model.save_pretrained(blind)
        processor.save_pretrained(blind)
        other = lm_eval.simple_evaluate(model="hf-multimodal", batch_size=2,
                                        model_args=f"pretrained={blind},device=cpu,dtype=float32", **run)
    assert _answers(got) == _answers(want), (_answers(got), _answers(want))
    assert _answers(other) != _answers(want), _answers(want)
    if arch == "llava":  # prompts rendered with the processor's chat template, as hf-multimodal renders them
        with single_thread():
            chat = dict(run, apply_chat_template=True)
            want_chat = lm_eval.simple_evaluate(model="hf-multimodal", batch_size=2,
                                                model_args=f"pretrained={merged},device=cpu,dtype=float32", **chat)
            got_chat = lm_eval.simple_evaluate(model=DeltazipVLM(str(arts / "ft"), base=str(base_dir),
                                                                 device="cpu", batch_size=2), **chat)
        assert _answers(got_chat) == _answers(want_chat), (_answers(got_chat), _answers(want_chat))
        assert [s["arguments"] for s in got_chat["samples"]["tiny_images"]] != [
            s["arguments"] for s in got["samples"]["tiny_images"]]  # the template changed the prompts

    # End to end: the merged checkpoint's answers are the task's targets.
    shutil.rmtree(tasks)
    tasks.mkdir()
    _task(tasks, _answers(want))
    with single_thread():
        out = run_eval([str(arts / "ft"), str(merged), "base"],
                       EvalOptions(tasks=["tiny_images"], include_path=[tasks], batch_size=2, device="cpu",
                                   base=str(base_dir)))
    (row,) = [r for r in out["summary"]["metrics"] if r["metric"] == "exact_match"]
    assert row["values"]["ft"] == row["values"]["merged"] == 1.0, row
    assert row["values"]["base"] < 1.0, row


def test_a_target_without_an_image_processor_refuses_image_tasks_in_one_line(tmp_path):
    """An image-text variant whose checkpoints were saved without processor files runs lm-eval's text
    type; a task with images is a one-line error that names the target and the fix."""
    from deltazip.formats.errors import InputError
    from deltazip.runtime.eval.run import EvalOptions, run_eval

    with single_thread():
        base_dir, arts = build_variant(tmp_path, "llava", llava_processor(tokenizer()), processor_files=False)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _task(tasks, ["?"] * IMAGES)
    with single_thread(), pytest.raises(InputError) as e:
        run_eval([str(arts / "ft")], EvalOptions(tasks=["tiny_images"], include_path=[tasks], device="cpu",
                                                 base=str(base_dir)))
    assert "ft: a task reads images" in str(e.value) and "processor" in str(e.value) and "\n" not in str(e.value)


def test_the_first_generate_reads_the_images_with_the_targets_weights(tmp_path):
    """``generate`` of an image-text model runs its vision tower before the model's forward (where the
    bank binds a batch's rows): the very first call on a bank's model must already read the images with
    the target's vision weights (it read them with the base's), at a batch of two padded prompts."""
    from deltazip.runtime.eval.targets import EvalBank, parse_targets

    processor = llava_processor(tokenizer())
    processor.tokenizer.padding_side = "left"
    with single_thread():
        base_dir, arts = build_variant(tmp_path, "llava", processor, vision_scale=0.5)
        merged = load_merged_model(Artifact(arts / "ft"), Checkpoint(base_dir))
        bank = EvalBank(parse_targets([str(arts / "ft")]), str(base_dir), device="cpu")
        model = bank.model_for(bank.targets[0])
        image = processor.tokenizer.convert_ids_to_tokens(model.config.image_token_id)
        enc = processor(text=[image + "what is it?", image + "and this"], images=[picture(0), picture(1)],
                        return_tensors="pt", padding=True)
        with torch.no_grad():
            got, want = (m.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=2, output_logits=True,
                                    return_dict_in_generate=True) for m in (model, merged))
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits)) < 1e-4
