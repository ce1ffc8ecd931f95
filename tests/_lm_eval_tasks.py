"""Two tiny local lm-eval tasks over the serving tests' character tokenizer (a multiple-choice one
scored by loglikelihood, a generate-until one), and the lm-eval run both the eval and the server
tests compare models with. Nothing reaches the hub."""

from __future__ import annotations

import json
import random
from pathlib import Path

from _serving import single_thread

# A multiple-choice task over the character tokenizer's alphabet: random tiny models give spread-out
# loglikelihoods, so per-sample numbers (not just an accuracy of 0) are compared.
MC_YAML = """\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
metadata:
  version: 1
"""
GEN_YAML = """\
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: [";"]
  do_sample: false
  max_gen_toks: 6
metric_list:
  - metric: exact_match
metadata:
  version: 1
"""


def write_tiny_tasks(d: Path) -> Path:
    """``tiny_mc`` (24 questions, 3 choices) and ``tiny_gen`` (8 prompts) under ``d``."""
    rng = random.Random(0)
    letters = "abcdefghij"
    with open(d / "mc.jsonl", "w") as f:
        for _ in range(24):
            prompt = "".join(rng.choice(letters) for _ in range(5)) + "="
            choices = ["".join(rng.choice(letters) for _ in range(3)) for _ in range(3)]
            f.write(json.dumps({"prompt": prompt, "choices": choices, "label": rng.randrange(3)}) + "\n")
    with open(d / "gen.jsonl", "w") as f:
        for _ in range(8):
            prompt = "".join(rng.choice(letters) for _ in range(4)) + "="
            f.write(json.dumps({"prompt": prompt, "answer": prompt[:2]}) + "\n")
    (d / "tiny_mc.yaml").write_text(MC_YAML.format(data=d / "mc.jsonl"))
    (d / "tiny_gen.yaml").write_text(GEN_YAML.format(data=d / "gen.jsonl"))
    return d


def evaluate(model, tasks_dir, tasks=("tiny_mc", "tiny_gen"), **kw):
    """``lm_eval.simple_evaluate`` of ``tasks`` from ``tasks_dir``, samples logged, no bootstrap."""
    import lm_eval

    from deltazip.runtime.eval.run import task_manager

    with single_thread():
        return lm_eval.simple_evaluate(model=model, tasks=list(tasks), task_manager=task_manager(list(tasks), [tasks_dir]),
                                       log_samples=True, bootstrap_iters=0, random_seed=0, **kw)


def loglikelihoods(res) -> list[list[float]]:
    """Per ``tiny_mc`` question (by doc id), each choice's loglikelihood."""
    return [[r[0][0] for r in s["resps"]] for s in sorted(res["samples"]["tiny_mc"], key=lambda s: s["doc_id"])]


def generations(res) -> list[str]:
    """Per ``tiny_gen`` prompt (by doc id), the generated text."""
    return [s["resps"][0][0] for s in sorted(res["samples"]["tiny_gen"], key=lambda s: s["doc_id"])]
