"""--target-ratio / --max-bytes end to end on a tiny Llama: the artifact keeps the budget (within 1%),
mixes settings, never has more measured error than the uniform setting of its size, verifies, merges
bit for bit to the compressor's own reconstruction, reads back through inspect, and its one-line errors."""

import json

import pytest
import torch
from _cli import run_cli, without_progress
from _factories import calib_file, perturb, tiny_model

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import merge_to_dir
from deltazip.compress.pipeline import _Run, compress_delta
from deltazip.formats.artifact import Artifact
from deltazip.formats.report import summarize
from deltazip.formats.verify import verify_artifact
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint

IDS = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)
FAST = dict(nsamples=16, seqlen=32, device="cpu")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 2-layer Llama (hidden 128, intermediate 256) and a perturbed copy, fp32; its uniform 4-bit 2:4
    artifact with the measured curve (--report)."""
    from deltazip.demo.pair import build_char_tokenizer

    root = tmp_path_factory.mktemp("target")
    tok = build_char_tokenizer()
    dirs = {}
    for name, model in (("base", tiny_model("llama", hidden_size=128, intermediate_size=256, **IDS)),):
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])
        ft = perturb(model, scale=0.3, seed=5, skip=())
        dirs["ft"] = root / "ft"
        ft.save_pretrained(dirs["ft"])
        tok.save_pretrained(dirs["ft"])
    calib = calib_file(root)
    uniform = root / "uniform4"
    cfg = CompressConfig(scheme=DeltaScheme(bits=4), group_auto=True, report=True, **FAST)
    compress_delta(dirs["base"], dirs["ft"], str(calib), uniform, cfg)
    return root, dirs["base"], dirs["ft"], calib, Artifact(uniform)


def _uniform(art: Artifact, label: str) -> dict:
    return next(p for p in art.manifest["sensitivity"]["uniform"] if p["setting"] == label)


def _labels(art: Artifact) -> set[str]:
    return {t["choice"] for t in art.manifest["allocation"]["tensors"].values()}


def test_target_ratio_keeps_the_budget_and_mixes_settings(pair, tmp_path):
    root, base, ft, calib, uniform = pair
    lo, hi = _uniform(uniform, "4-bit 2:4")["ratio"], _uniform(uniform, "2-bit 2:4")["ratio"]
    target = round((lo * hi) ** 0.5, 2)  # between the uniform 4- and 2-bit sizes
    out = tmp_path / "mixed"
    compress_delta(base, ft, str(calib), out, CompressConfig(scheme=DeltaScheme(), group_auto=True,
                                                             target_ratio=target, **FAST))
    art = Artifact(out)
    rec = art.manifest["allocation"]
    budget = int(art.lineage["finetuned_bytes"] / target)
    assert rec["budget_bytes"] == budget and rec["planned_bytes"] <= budget
    assert 0.99 * budget <= art.nbytes() <= 1.01 * budget, (art.nbytes(), budget)
    assert len(_labels(art)) >= 2, _labels(art)
    # what each entry holds is the setting the allocation chose
    for name, t in rec["tensors"].items():
        e = art.entry(name)
        got = "drop" if e.kind == "drop" else (f"{e.get('bits')}-bit rows" if e.kind == "rows" else
                                               f"{e.scheme.bits}-bit {'2:4' if e.scheme.sparse else 'dense'}")
        assert got == t["choice"], name
    assert verify_artifact(out, Checkpoint(base).fingerprint(), base_dir=base)["ok"]
    s = summarize(art)
    assert s["allocation"]["record"]["budget_bytes"] == budget
    kinds = s["allocation"]["by_kind"]
    assert {"self_attn.q_proj", "mlp.down_proj", "lm_head", "embed_tokens"} <= set(kinds)
    assert sum(k["tensors"] for k in kinds.values()) == len(rec["tensors"])
    assert [L["index"] for L in s["allocation"]["by_layer"]] == [0, 1]
    from deltazip.compress.plots import plot_artifact
    from deltazip.formats.report import allocation_by_layer

    by_layer = allocation_by_layer(art)  # what inspect --plot draws in its third panel
    assert set(by_layer["mlp.down_proj"]) == {0, 1} and all(b in (0, 2, 3, 4, 8) for b in by_layer["mlp.down_proj"].values())
    assert plot_artifact(art, str(base), tmp_path / "bits.png").stat().st_size > 10_000


def test_at_the_size_of_uniform_k_bit_no_more_measured_error(pair, tmp_path):
    root, base, ft, calib, uniform = pair
    for label in ("2-bit 2:4", "4-bit 2:4"):
        u = _uniform(uniform, label)
        out = tmp_path / label.replace(" ", "-").replace(":", "")
        compress_delta(base, ft, str(calib), out, CompressConfig(scheme=DeltaScheme(), group_auto=True,
                                                                 max_bytes=u["bytes"], **FAST))
        rec = Artifact(out).manifest["allocation"]
        assert rec["relative_error"] <= u["relative_error"], (label, rec["relative_error"], u)
        assert rec["planned_bytes"] <= u["bytes"] and Artifact(out).nbytes() <= 1.01 * u["bytes"]


def test_mixed_artifacts_merge_bit_for_bit_to_their_own_reconstruction(pair, tmp_path, monkeypatch):
    root, base, ft, calib, uniform = pair
    recs = {}
    original = _Run._compress_linear

    def spy(self, t, hs, stats):  # the tensor the compressor put back into the layer (W_base + Q⊙M)
        rec = original(self, t, hs, stats)
        recs[t.name] = rec.detach().cpu().clone()
        return rec

    monkeypatch.setattr(_Run, "_compress_linear", spy)
    target = _uniform(uniform, "2-bit 2:4")["ratio"]
    out = tmp_path / "mixed"
    compress_delta(base, ft, str(calib), out, CompressConfig(scheme=DeltaScheme(), group_auto=True,
                                                             target_ratio=target, **FAST))
    art = Artifact(out)
    merged = merge_to_dir(art, Checkpoint(base), tmp_path / "merged")
    from safetensors.torch import load_file

    sd = load_file(merged / "model.safetensors")
    assert set(recs) == {n for n, t in art.manifest["allocation"]["tensors"].items() if t["kind"] == "linear"}
    for name, rec in recs.items():
        assert torch.equal(sd[name], rec.to(sd[name].dtype)), name
    b = Checkpoint(base)
    for name, e in art.entries().items():
        if e.kind == "drop":
            assert torch.equal(sd[name], b.get(name)), name


def test_report_prints_the_curve_and_bad_budgets_are_one_line_errors(pair, tmp_path, capsys, monkeypatch):
    root, base, ft, calib, uniform = pair
    common = ["compress", "--base", base, "--finetuned", ft, "--calib", calib, "--nsamples", "16", "--seqlen", "32"]
    code, out, err = run_cli(capsys, monkeypatch, *common, "--out", tmp_path / "r", "--target-ratio", "6", "--report")
    assert code == 0, err
    assert "measured error vs size" in out and "uniform 2-bit 2:4" in out and "settings by tensor kind" in out
    code, out, err = run_cli(capsys, monkeypatch, *common, "--out", tmp_path / "j", "--target-ratio", "6", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["allocation"]["record"]["target_ratio"] == 6
    points = doc["sensitivity"]["points"]
    assert len(points) == 12 and all(a["bytes"] > b["bytes"] for a, b in zip(points, points[1:]))
    assert all(a["relative_error"] <= b["relative_error"] for a, b in zip(points, points[1:]))
    for args, match in ((["--bits", "2", "--target-ratio", "6"], "--bits and --target-ratio both"),
                        (["--target-ratio", "6", "--max-bytes", "1000"], "pass one of them"),
                        (["--target-ratio", "0.5"], "must be above 1"),
                        (["--target-ratio", "5000"], "ask for at most that ratio"),
                        (["--target-ratio", "6", "--method", "rtn"], "use it with --method deltazip")):
        code, _, err = run_cli(capsys, monkeypatch, *common, "--out", tmp_path / "bad", *args)
        lines = without_progress(err).strip().splitlines()
        assert code == 1 and len(lines) == 1 and match in lines[0], (args, err)
        assert not (tmp_path / "bad").exists()


def test_solve_losses_score_settings_as_the_output_error_product(pair, tmp_path, monkeypatch):
    """The probe scores each candidate with its solve's own loss (``SolveResult.loss``) where the solve's
    Hessian is the one the error is measured with; the same probe scoring every candidate by the
    ``tr(E H_w Eᵀ)`` product gives the same curves (fp32 rounding apart), the lm_head's included."""
    from deltazip.compress import sensitivity

    root, base, ft, calib, uniform = pair
    seen = []
    real_measure, real_solves = sensitivity.measure, sensitivity.candidate_solves

    def spy(run, input_ids, progress=None):
        s = real_measure(run, input_ids, progress)
        seen.append({c.name: c for c in s.curves})
        return s

    def without_loss(*a, **kw):
        for s, r in real_solves(*a, **kw):
            r.loss = None
            yield s, r

    import deltazip.compress.pipeline as pipeline

    monkeypatch.setattr(pipeline, "measure", spy)
    cfg = CompressConfig(scheme=DeltaScheme(bits=4), group_auto=True, report=True, **FAST)
    compress_delta(base, ft, str(calib), tmp_path / "a", cfg)
    monkeypatch.setattr(sensitivity, "candidate_solves", without_loss)
    compress_delta(base, ft, str(calib), tmp_path / "b", cfg)
    by_loss, by_product = seen
    assert by_loss.keys() == by_product.keys() and "lm_head.weight" in by_loss
    for name, c in by_loss.items():
        d = by_product[name]
        assert c.bytes == d.bytes, name
        for s, x, y in zip(c.settings, c.err, d.err):
            assert abs(x - y) <= 1e-4 * abs(y) + 1e-9 * max(d.err), (name, s.label, x, y)
