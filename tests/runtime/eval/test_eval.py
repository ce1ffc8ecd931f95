"""``deltazip eval``: lm-eval through the serving model equals lm-eval's own ``hf`` type on the merged
model; perplexity equals a direct computation; three targets side by side; bad input in one line."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from _cli import run_cli
from _factories import lora_adapter
from _lm_eval_tasks import evaluate, generations, loglikelihoods, write_tiny_tasks
from _serving import served_set, single_thread

pytest.importorskip("lm_eval")

from deltazip.runtime.eval.lm_eval_model import DeltazipLM  # noqa: E402
from deltazip.runtime.eval.perplexity import perplexity  # noqa: E402
from deltazip.runtime.eval.run import task_manager  # noqa: E402
from deltazip.runtime.eval.targets import EvalBank, parse_targets  # noqa: E402

PPL_TEXT = "delta zip model tune 12 + 345 = 357; alpha beta gamma " * 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return write_tiny_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def merged_alpha(served, tmp_path_factory):
    return served.merged_dir("alpha", tmp_path_factory.mktemp("merged") / "alpha-merged")


@pytest.fixture(scope="module")
def hf_reference(merged_alpha, tasks_dir):
    return evaluate("hf", tasks_dir, model_args=f"pretrained={merged_alpha},device=cpu,dtype=float32,batch_size=4")


def test_eval_through_the_serving_model_equals_hf_on_the_merged_model(served, tasks_dir, hf_reference):
    with single_thread():
        lm = DeltazipLM(str(served.variant_dir("alpha")), base=str(served.base_dir), device="cpu", batch_size=4)
    # The model lm-eval runs is the decoupled serving model, not a merged copy.
    from deltazip.runtime.serve.delta_linear import DeltaLinear

    assert any(isinstance(m, DeltaLinear) for m in lm.model.modules())
    ours = evaluate(lm, tasks_dir)
    assert ours["results"]["tiny_mc"]["acc,none"] == hf_reference["results"]["tiny_mc"]["acc,none"]
    assert ours["results"]["tiny_gen"]["exact_match,none"] == hf_reference["results"]["tiny_gen"]["exact_match,none"]
    # Per-sample loglikelihoods agree to fp32 rounding (W x + Δ x vs (W + Δ) x).
    a, b = torch.tensor(loglikelihoods(ours)), torch.tensor(loglikelihoods(hf_reference))
    assert a.shape == (24, 3)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-5), (a - b).abs().max()
    assert a.std() > 0.1  # the numbers compared are informative, not all equal
    assert generations(ours) == generations(hf_reference)


def test_registered_model_type_runs_from_simpleevaluate(served, tasks_dir, hf_reference):
    res = evaluate("deltazip", tasks_dir, model_args=f"artifact={served.variant_dir('alpha')},"
                                                    f"base={served.base_dir},device=cpu,batch_size=4")
    assert res["results"]["tiny_mc"]["acc,none"] == hf_reference["results"]["tiny_mc"]["acc,none"]
    a, b = torch.tensor(loglikelihoods(res)), torch.tensor(loglikelihoods(hf_reference))
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-5)


def _direct_ppl(model, tok, text, window):
    ids = torch.tensor(tok(text)["input_ids"])
    n = ids.numel() // window
    nlls = []
    with torch.no_grad():
        for i in range(n):
            w = ids[i * window:(i + 1) * window][None]
            logits = model(w).logits[0, :-1].float()
            nlls.append(F.cross_entropy(logits, w[0, 1:]).item())
    return math.exp(sum(nlls) / n), n


def test_perplexity_equals_a_direct_computation(served, merged_alpha):
    from transformers import AutoModelForCausalLM

    targets = parse_targets([str(served.variant_dir("alpha")), "base"])
    with single_thread():
        bank = EvalBank(targets, str(served.base_dir), device="cpu")
        tok = bank.tokenizer_for(targets[0])
        got = perplexity(bank.model_for(targets[0]), tok, PPL_TEXT, window=64, batch_size=3)
        want, n = _direct_ppl(AutoModelForCausalLM.from_pretrained(merged_alpha, dtype=torch.float32), tok,
                              PPL_TEXT, 64)
        base_got = perplexity(bank.model_for(targets[1]), tok, PPL_TEXT, window=64).perplexity
        base_want, _ = _direct_ppl(served.model("base"), tok, PPL_TEXT, 64)
    assert got.windows == n >= 4 and got.window == 64
    assert got.perplexity == pytest.approx(want, rel=1e-4)
    assert base_got == pytest.approx(base_want, rel=1e-4)
    assert abs(math.log(got.perplexity) - math.log(base_got)) > 1e-3  # the variant really is applied


def test_cli_three_targets_side_by_side_with_recovery(served, tasks_dir, tmp_path, capsys, monkeypatch):
    text = tmp_path / "ppl.txt"
    text.write_text(PPL_TEXT)
    out = tmp_path / "results.json"
    ft = served.root / "ft-alpha"  # the artifact's lineage fine-tune: the recovery reference
    with single_thread():
        code, stdout, err = run_cli(capsys, monkeypatch, "eval", served.variant_dir("alpha"), ft, "base",
                                    "--tasks", "tiny_mc", "--include-path", tasks_dir, "--perplexity", text,
                                    "--ppl-window", "64", "--batch-size", "4", "--device", "cpu", "--json",
                                    "--output", out)
    assert code == 0, err
    summary = json.loads(stdout)
    assert [t["label"] for t in summary["targets"]] == ["alpha", "ft-alpha", "base"]
    assert [t["kind"] for t in summary["targets"]] == ["artifact", "hf", "base"]
    assert summary["targets"][0]["reference"] == "ft-alpha"
    (row,) = [r for r in summary["metrics"] if r["metric"] == "acc"]
    assert set(row["values"]) == {"alpha", "ft-alpha", "base"}
    if row["values"]["ft-alpha"]:
        assert row["recovery_pct"]["alpha"] == pytest.approx(100 * row["values"]["alpha"] / row["values"]["ft-alpha"])
    assert set(summary["perplexity"]) == {"alpha", "ft-alpha", "base"}
    # The compressed variant is closer to its fine-tune than the base is, in perplexity.
    p = {k: math.log(v["perplexity"]) for k, v in summary["perplexity"].items()}
    assert abs(p["alpha"] - p["ft-alpha"]) < abs(p["base"] - p["ft-alpha"])
    doc = json.loads(out.read_text())
    assert doc["deltazip"]["targets"] == summary["targets"]
    assert doc["lm_eval"]["alpha"]["results"]["tiny_mc"]["acc,none"] == row["values"]["alpha"]
    assert not list(tmp_path.glob(".results.json.tmp-*"))

    # Without --json: a rich table with one column per target.
    with single_thread():
        code, stdout, err = run_cli(capsys, monkeypatch, "eval", served.variant_dir("alpha"), "base",
                                    "--tasks", "tiny_mc", "--include-path", tasks_dir, "--device", "cpu")
    assert code == 0, err
    assert "tiny_mc acc" in stdout and "alpha" in stdout and "base" in stdout


def test_shipped_demo_task_is_available_offline():
    tm = task_manager(["deltazip_shift", "deltazip_palindrome"], [])
    loaded = tm.load(["deltazip_shift"])["tasks"]
    (task,) = loaded.values()
    docs = list(task.test_docs())
    assert len(docs) == 64 and docs[0]["prompt"].startswith("s ") and docs[0]["prompt"].endswith("=")


def _bad(capsys, monkeypatch, *args) -> str:
    code, out, err = run_cli(capsys, monkeypatch, "eval", *args)
    assert code == 1, (code, out, err)
    lines = [ln for ln in err.splitlines() if ln.startswith("deltazip: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_bad_input_is_one_line_exit_1(served, tasks_dir, tmp_path, capsys, monkeypatch):
    alpha = served.variant_dir("alpha")
    msg = _bad(capsys, monkeypatch, alpha, "--tasks", "tiny_mcc", "--include-path", tasks_dir)
    assert "unknown task 'tiny_mcc'" in msg and "tiny_mc" in msg
    # An artifact compressed against another base than --base.
    other = tmp_path / "other-base"
    shutil.copytree(served.root / "ft-beta", other)
    msg = _bad(capsys, monkeypatch, alpha, "--base", other, "--tasks", "tiny_mc", "--include-path", tasks_dir)
    assert "artifact alpha" in msg and "different base" in msg
    # An HF model directory without tokenizer files.
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in (served.root / "ft-beta").iterdir():
        if f.name in ("config.json", "generation_config.json") or f.suffix == ".safetensors":
            shutil.copy(f, bare / f.name)
    msg = _bad(capsys, monkeypatch, bare, "--tasks", "tiny_mc", "--include-path", tasks_dir, "--device", "cpu")
    assert "no usable tokenizer" in msg
    # A task file that does not parse.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "bad.yaml").write_text("task: [unclosed\n")
    msg = _bad(capsys, monkeypatch, alpha, "--tasks", "tiny_mc", "--include-path", broken)
    assert "bad.yaml does not parse" in msg
    msg = _bad(capsys, monkeypatch, tmp_path / "nope", "--tasks", "tiny_mc")
    assert "no such file or directory" in msg
    msg = _bad(capsys, monkeypatch, alpha)
    assert "nothing to evaluate" in msg


def test_lm_eval_command_line_runs_the_deltazip_model_type(served, tasks_dir, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "lm-eval-out"
    r = subprocess.run([sys.executable, "-m", "deltazip.runtime.eval.lm_eval_model", "run", "--model", "deltazip",
                        "--model_args", f"artifact={served.variant_dir('alpha')},base={served.base_dir}",
                        "--tasks", "tiny_mc", "--include_path", str(tasks_dir), "--batch_size", "4",
                        "--output_path", str(out)],
                       capture_output=True, text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    (res_file,) = out.rglob("results*.json")
    acc = json.loads(res_file.read_text())["results"]["tiny_mc"]["acc,none"]
    ours = evaluate(DeltazipLM(str(served.variant_dir("alpha")), base=str(served.base_dir), device="cpu",
                                batch_size=4), tasks_dir)
    assert acc == ours["results"]["tiny_mc"]["acc,none"]


def test_lora_adapter_target_runs_through_the_serving_lora_path(served, tasks_dir, tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with single_thread():
        adapter = tmp_path / "my-lora"
        lora_adapter(AutoModelForCausalLM.from_pretrained(served.base_dir, dtype=torch.float32), adapter, 3,
                     target_modules=["q_proj", "v_proj", "down_proj"])
        merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(served.base_dir, dtype=torch.float32),
                                           adapter).merge_and_unload()
        merged.save_pretrained(tmp_path / "lora-merged", safe_serialization=True)
        served.tokenizer().save_pretrained(tmp_path / "lora-merged")

        (target,) = parse_targets([str(adapter)])
        assert target.kind == "lora"
        lm = DeltazipLM(str(adapter), base=str(served.base_dir), device="cpu", batch_size=4)
    ours = evaluate(lm, tasks_dir)
    ref = evaluate("hf", tasks_dir, model_args=f"pretrained={tmp_path / 'lora-merged'},device=cpu,dtype=float32,"
                                                "batch_size=4")
    a, b = torch.tensor(loglikelihoods(ours)), torch.tensor(loglikelihoods(ref))
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-5), (a - b).abs().max()
    base_ll = torch.tensor(loglikelihoods(evaluate(
        "hf", tasks_dir, model_args=f"pretrained={served.base_dir},device=cpu,dtype=float32,batch_size=4")))
    assert (a - base_ll).abs().max() > 1e-2  # the adapter is really applied
    assert generations(ours) == generations(ref)


def test_eval_is_quiet_when_piped(served, tasks_dir, tmp_path):
    """Issue 17 #15: a real process with stderr piped, outside a git repository, two targets: stderr
    holds our progress lines only: no lm-eval warnings for the targets after the first, no
    ``fatal: not a git repository`` per target, no tqdm bars."""
    import os

    from _cli import run_cli_process

    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "LMEVAL_LOG_LEVEL")}
    code, _, err = run_cli_process("eval", served.variant_dir("alpha"), "base", "--base", served.base_dir, "--tasks",
                                   "tiny_mc,tiny_gen", "--include-path", tasks_dir, "--limit", "4", "--batch-size",
                                   "4", "--device", "cpu", cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"})
    assert code == 0, err
    assert [ln.strip() for ln in err.splitlines() if ln.strip()] == ["evaluating alpha", "evaluating base"], err


def test_eval_with_the_wrong_base_says_what_to_do_in_eval_terms(served, tasks_dir, tmp_path, capsys, monkeypatch):
    other = tmp_path / "other-base"
    shutil.copytree(served.root / "ft-beta", other)
    msg = _bad(capsys, monkeypatch, served.variant_dir("alpha"), "--base", other, "--tasks", "tiny_mc",
               "--include-path", tasks_dir)
    assert f"pass the base it was compressed against as --base (its lineage names {served.base_dir})" in msg
    assert "serve its own base" not in msg


def test_apply_chat_template_renders_prompts_as_hf_does_on_the_merged_model(served, tasks_dir, merged_alpha,
                                                                            hf_reference, tmp_path, capsys,
                                                                            monkeypatch):
    """``--apply-chat-template``: each prompt rendered with the variant's chat template, as lm-eval's own
    ``hf`` type renders it on the merged model (the same per-sample loglikelihoods, generations and
    accuracy); the template changes what is scored. A target without a template is a one-line error
    before any target is evaluated."""
    want = evaluate("hf", tasks_dir, model_args=f"pretrained={merged_alpha},device=cpu,dtype=float32,batch_size=4",
                    apply_chat_template=True)
    with single_thread():
        lm = DeltazipLM(str(served.variant_dir("alpha")), base=str(served.base_dir), device="cpu", batch_size=4)
    ours = evaluate(lm, tasks_dir, apply_chat_template=True)
    a, b = torch.tensor(loglikelihoods(ours)), torch.tensor(loglikelihoods(want))
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-5), (a - b).abs().max()
    assert generations(ours) == generations(want)
    assert not torch.allclose(a, torch.tensor(loglikelihoods(hf_reference)), atol=1e-2)  # the template is applied
    with single_thread():
        code, stdout, err = run_cli(capsys, monkeypatch, "eval", served.variant_dir("alpha"), "--tasks", "tiny_mc",
                                    "--include-path", tasks_dir, "--batch-size", "4", "--device", "cpu",
                                    "--apply-chat-template", "--json")
    assert code == 0, err
    (row,) = [r for r in json.loads(stdout)["metrics"] if r["metric"] == "acc"]
    assert row["values"]["alpha"] == want["results"]["tiny_mc"]["acc,none"]
    assert row["values"]["alpha"] != hf_reference["results"]["tiny_mc"]["acc,none"]  # 0.25 against 0.29: applied

    plain = tmp_path / "no-template"  # the merged model, its tokenizer saved without a chat template
    shutil.copytree(merged_alpha, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    with single_thread():
        code, stdout, err = run_cli(capsys, monkeypatch, "eval", served.variant_dir("alpha"), plain, "--tasks",
                                    "tiny_mc", "--include-path", tasks_dir, "--device", "cpu", "--apply-chat-template")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "no-template: --apply-chat-template" in err and "no chat template" in err, err
