"""--group-size auto (the default): the largest of 128/64/32 dividing every compressed input dimension,
per tensor when none divides them all; recorded per entry and in the config, shown by inspect; an
explicit group that does not divide keeps its one-line error."""

import json
import re
from pathlib import Path

import pytest
from _cli import run_cli, without_progress
from _factories import calib_file, make_pair

from deltazip.compress.config import AUTO_GROUPS, auto_group, parse_group_size
from deltazip.formats.artifact import Artifact
from deltazip.formats.errors import InputError

ROOT = Path(__file__).resolve().parents[2]


def test_auto_group_rule():
    assert AUTO_GROUPS == (128, 64, 32)
    assert auto_group([576, 1536]) == 64  # SmolLM2-135M: hidden 576, intermediate 1536
    assert auto_group([960, 2560]) == 64  # SmolLM2-360M
    assert auto_group([4096, 11008]) == 128 and auto_group([96, 128]) == 32
    assert auto_group([48, 128]) == -1 and auto_group([48]) == -1
    assert parse_group_size("auto") == (128, True) and parse_group_size("-1") == (-1, False)
    with pytest.raises(InputError, match="--group-size 'x' is not a number"):
        parse_group_size("x")


def _compress(capsys, monkeypatch, tmp, name, *extra, **model):
    base, ft = make_pair(tmp / name, num_hidden_layers=1, **model)
    out = tmp / f"art-{name}"
    code, stdout, err = run_cli(capsys, monkeypatch, "compress", "--base", base, "--finetuned", ft, "--calib",
                                calib_file(tmp), "--out", out, "--nsamples", "4", "--seqlen", "32", *extra)
    return code, stdout, err, out


def _groups(out: Path) -> dict[str, int]:
    return {n: e.scheme.group_size for n, e in Artifact(out).entries().items() if e.is_matrix}


def test_hidden_576_compresses_with_the_defaults(capsys, monkeypatch, tmp_path):
    code, _, err, out = _compress(capsys, monkeypatch, tmp_path, "h576", hidden_size=576, intermediate_size=1536,
                                  num_attention_heads=9, num_key_value_heads=3)
    assert code == 0, err
    groups = _groups(out)
    assert len(groups) == 8 and set(groups.values()) == {64}, groups  # 7 linears and lm_head
    cfg = Artifact(out).config
    assert cfg["group_size"] == 64 and cfg["group_auto"] is True
    code, stdout, _ = run_cli(capsys, monkeypatch, "inspect", out)
    assert code == 0 and re.search(r"group: 64 \(auto\)", stdout), stdout
    code, stdout, _ = run_cli(capsys, monkeypatch, "inspect", out, "--json")
    assert json.loads(stdout)["groups"] == {"64": 8}


def test_per_tensor_groups_when_none_divides_every_dimension(capsys, monkeypatch, tmp_path):
    # hidden 48: no group of 128/64/32 divides it, the intermediate 128 takes 128
    code, _, err, out = _compress(capsys, monkeypatch, tmp_path, "h48", hidden_size=48, intermediate_size=128,
                                  num_attention_heads=4, num_key_value_heads=2)
    assert code == 0, err
    groups = _groups(out)
    assert groups.pop("model.layers.0.mlp.down_proj.weight") == 128
    assert set(groups.values()) == {-1}, groups
    code, stdout, _ = run_cli(capsys, monkeypatch, "inspect", out)
    assert code == 0 and "group: auto: -1 x7, 128 x1" in stdout, stdout


def test_an_explicit_group_that_does_not_divide_keeps_its_error(capsys, monkeypatch, tmp_path):
    code, _, err, out = _compress(capsys, monkeypatch, tmp_path, "h576x", "--group-size", "128", hidden_size=576,
                                  intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    lines = without_progress(err).strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert "576 input features, not divisible by --group-size 128" in lines[0] and not out.exists()


def test_the_support_bench_compresses_with_the_automatic_group():
    """The matrix's compress check picks groups as a user's ``--group-size auto`` would; the one named
    group is the tensor-parallel check's own artifact (groups a shard of a 64-wide o_proj holds whole)."""
    src = (ROOT / "bench" / "support.py").read_text()
    compress = src.split("    def compress(self)")[1].split("\n    def ")[0]
    assert "group_auto=True" in compress and "group_size=" not in compress
    tp = src.split("    def tp_artifact(self)")[1].split("\n    def ")[0]
    assert src.count("group_size=") == 1 and "group_size=16" in tp and "--group-size" not in src


@pytest.mark.parametrize("art", ["v1/art-deltazip", "v2/art-llama", "v2/art-gpt2"])
def test_v1_and_v2_artifacts_read_with_their_one_group_and_no_allocation(art):
    from deltazip.formats.report import summarize

    a = Artifact(ROOT / "tests" / "fixtures" / art)
    s = summarize(a)
    packed = sum(1 for e in a.tensors.values() if e["kind"] == "packed")
    assert s["groups"] == {str(a.config["group_size"]): packed} and packed > 0
    assert "allocation" not in s and "sensitivity" not in s
