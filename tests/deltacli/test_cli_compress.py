"""The CLI: help/version, --json, and one-line errors (exit 1, nothing left behind) for bad input."""

import json
import subprocess
import sys

import pytest
import torch
from _cli import run_cli, without_progress
from _factories import calib_file, make_pair, perturb, save_model, tiny_model
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    base, ft = make_pair(tmp)
    return tmp, base, ft, calib_file(tmp)


FAST = ["--group-size", "32", "--nsamples", "4", "--seqlen", "32"]


def _no_leftovers(parent, name):
    return not (parent / name).exists() and not list(parent.glob(f".{name}.tmp-*"))


def test_version_and_help(capsys, monkeypatch):
    code, out, _ = run_cli(capsys, monkeypatch, "--version")
    assert code == 0 and out.startswith("deltazip ")
    for cmd in ("compress", "inspect", "merge", "demo"):
        code, out, _ = run_cli(capsys, monkeypatch, cmd, "--help")
        assert code == 0 and "Usage" in out, cmd


def test_compress_json_then_inspect_and_merge(capsys, monkeypatch, pair):
    tmp, base, ft, calib = pair
    out = tmp / "art-json"
    code, stdout, err = run_cli(capsys, monkeypatch, "compress", "--base", base, "--finetuned", ft, "--calib", calib,
                                "--out", out, *FAST, "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["ratio"] > 3 and doc["config"]["bits"] == 4 and doc["stats"]["peak_rss_mib"] > 0
    code, stdout, _ = run_cli(capsys, monkeypatch, "inspect", out, "--json", "--plot", tmp / "p.png")
    assert code == 0 and json.loads(stdout)["artifact_bytes"] == doc["artifact_bytes"]
    assert (tmp / "p.png").stat().st_size > 1000
    code, stdout, _ = run_cli(capsys, monkeypatch, "merge", out, "--out", tmp / "merged", "--json")
    assert code == 0 and "model.safetensors" in json.loads(stdout)["files"]


def _side_files(src, dst):
    """A new model directory ``dst`` with ``src``'s files but its weights (which the test writes)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())


def _expect_error(capsys, monkeypatch, args, match, parent=None, name="out"):
    code, out, err = run_cli(capsys, monkeypatch, *args)
    assert code == 1, (code, err)
    lines = without_progress(err).strip().splitlines()  # progress lines may come first (stderr is piped)
    assert len(lines) == 1 and lines[0].startswith("deltazip: error:"), err
    assert match in lines[0], lines[0]
    assert "Traceback" not in err
    if parent is not None:
        assert _no_leftovers(parent, name)


def test_bad_paths_and_dirs(capsys, monkeypatch, pair):
    tmp, base, ft, calib = pair
    common = ["--calib", calib, "--out", tmp / "out", *FAST]
    _expect_error(capsys, monkeypatch, ["compress", "--base", tmp / "nope", "--finetuned", ft, *common],
                  "does not exist", tmp)
    (tmp / "empty").mkdir(exist_ok=True)
    _expect_error(capsys, monkeypatch, ["compress", "--base", tmp / "empty", "--finetuned", ft, *common],
                  "not a model directory", tmp)


def test_pickle_only_checkpoint_refused(capsys, monkeypatch, pair):
    tmp, base, ft, calib = pair
    pk = tmp / "pickled"
    pk.mkdir(exist_ok=True)
    (pk / "config.json").write_text((ft / "config.json").read_text())
    torch.save({"x": torch.zeros(1)}, pk / "pytorch_model.bin")
    _expect_error(capsys, monkeypatch, ["compress", "--base", base, "--finetuned", pk, "--calib", calib, "--out",
                                        tmp / "out", *FAST], "pickle", tmp)


def test_quantized_checkpoints_refused_wherever_their_weights_are_used(capsys, monkeypatch, pair, tmp_path):
    """An FP8 base (as DeepSeek-V3 and others release theirs: float8 weights beside their scales) is named
    as quantized, by compress and merge alike, instead of failing on tensor names or dtypes."""
    tmp, base, ft, calib = pair
    q8 = tmp_path / "fp8-base"
    _side_files(base, q8)
    sd = load_file(base / "model.safetensors")
    for n in [n for n in sd if n.endswith("proj.weight")]:
        sd[n] = sd[n].to(torch.float8_e4m3fn)
        sd[n.replace(".weight", ".weight_scale_inv")] = torch.ones(1, 1)
    save_file(sd, q8 / "model.safetensors")
    cfg = json.loads((q8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (q8 / "config.json").write_text(json.dumps(cfg))
    _expect_error(capsys, monkeypatch, ["compress", "--base", q8, "--finetuned", ft, "--calib", calib, "--out",
                                        tmp_path / "out", *FAST], "quantized checkpoint (fp8)", tmp_path)
    art = tmp / "art-json"  # written by the compress test above, or now
    if not art.exists():
        code, _, err = run_cli(capsys, monkeypatch, "compress", "--base", base, "--finetuned", ft, "--calib", calib,
                               "--out", art, *FAST)
        assert code == 0, err
    _expect_error(capsys, monkeypatch, ["merge", art, "--base", q8, "--out", tmp_path / "merged"],
                  "quantized checkpoint (fp8)", tmp_path, "merged")


def test_mismatched_pairs(capsys, monkeypatch, pair, tmp_path):
    tmp, base, ft, calib = pair
    common = ["--calib", calib, "--out", tmp_path / "out", *FAST]
    other = save_model(perturb(tiny_model("qwen2")), tmp_path / "qwen")
    _expect_error(capsys, monkeypatch, ["compress", "--base", base, "--finetuned", other, *common], "model_type",
                  tmp_path)
    wider = save_model(tiny_model("llama", intermediate_size=192), tmp_path / "wider")
    _expect_error(capsys, monkeypatch, ["compress", "--base", base, "--finetuned", wider, *common], "shape",
                  tmp_path)
    renamed = tmp_path / "renamed"
    _side_files(ft, renamed)
    sd = load_file(ft / "model.safetensors")
    sd["model.extra.weight"] = torch.zeros(4)
    save_file(sd, renamed / "model.safetensors")
    _expect_error(capsys, monkeypatch, ["compress", "--base", base, "--finetuned", renamed, *common],
                  "different tensor names", tmp_path)


def test_nan_weights(capsys, monkeypatch, pair, tmp_path):
    tmp, base, ft, calib = pair
    bad = tmp_path / "nan"
    _side_files(ft, bad)
    sd = load_file(ft / "model.safetensors")
    sd["model.layers.1.mlp.up_proj.weight"][3, 3] = float("nan")
    save_file(sd, bad / "model.safetensors")
    _expect_error(capsys, monkeypatch, ["compress", "--base", base, "--finetuned", bad, "--calib", calib, "--out",
                                        tmp_path / "out", *FAST], "NaN", tmp_path)


def test_bad_calibration(capsys, monkeypatch, pair, tmp_path):
    tmp, base, ft, _ = pair
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "ab"}\n')
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"foo": "bar baz qux quux"}\n')
    for path, match in ((empty, "is empty"), (short, "too short"), (nofield, "no usable records"),
                        (tmp_path / "missing.jsonl", "does not exist"), (tmp_path / "x.csv", "does not exist")):
        _expect_error(capsys, monkeypatch, ["compress", "--base", base, "--finetuned", ft, "--calib", path, "--out",
                                            tmp_path / "out", *FAST], match, tmp_path)


def test_bad_options(capsys, monkeypatch, pair, tmp_path):
    tmp, base, ft, calib = pair
    common = ["--base", base, "--finetuned", ft, "--calib", calib, "--out", tmp_path / "out"]
    _expect_error(capsys, monkeypatch, ["compress", *common, "--bits", "5"], "--bits 5", tmp_path)
    _expect_error(capsys, monkeypatch, ["compress", *common, "--sparsity", "1:2"], "--sparsity", tmp_path)
    _expect_error(capsys, monkeypatch, ["compress", *common, "--group-size", "6"], "divisible by 4", tmp_path)
    # 64 input features are not divisible by a group of 48: the error names the tensor.
    _expect_error(capsys, monkeypatch, ["compress", *common, "--group-size", "48", "--nsamples", "2"],
                  "model.layers.0.self_attn.q_proj.weight", tmp_path)
    odd = save_model(tiny_model("llama", intermediate_size=130), tmp_path / "odd-base")
    odd_ft = save_model(perturb(tiny_model("llama", intermediate_size=130)), tmp_path / "odd-ft")
    _expect_error(capsys, monkeypatch, ["compress", "--base", odd, "--finetuned", odd_ft, "--calib", calib,
                                        "--out", tmp_path / "out", "--group-size", "-1", "--nsamples", "2"],
                  "mlp.down_proj.weight has 130 input features, not divisible by 4", tmp_path)


def test_existing_output_refused_unless_overwrite(capsys, monkeypatch, pair):
    tmp, base, ft, calib = pair
    out = tmp / "exists"
    out.mkdir(exist_ok=True)
    (out / "keep.txt").write_text("mine")
    args = ["compress", "--base", base, "--finetuned", ft, "--calib", calib, "--out", out, *FAST, "--method", "rtn"]
    code, _, err = run_cli(capsys, monkeypatch, *args)
    assert code == 1 and "--overwrite" in err and (out / "keep.txt").read_text() == "mine"
    code, _, err = run_cli(capsys, monkeypatch, *args, "--overwrite")
    assert code == 0, err
    assert (out / "manifest.json").is_file() and not (out / "keep.txt").exists()


def test_real_process_error_is_one_line(pair, tmp_path):
    tmp, base, ft, calib = pair
    r = subprocess.run([sys.executable, "-m", "deltazip.deltacli.app", "inspect", str(tmp_path / "nothing")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"deltazip: error: {tmp_path / 'nothing'}: no such artifact directory"]
