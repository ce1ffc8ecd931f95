"""Issue 25: failures that came late or as tracebacks. A full disk, an image name matplotlib cannot write,
an unwritable eval output, malformed calibration files and an unreachable hub each end in one line
that names the problem and the fix, before any work where that can be known, leaving nothing behind."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time

import pytest
from _cli import run_cli, run_cli_process, without_progress
from _factories import calib_file, make_pair

from deltazip.formats.errors import InputError
from deltazip.formats.outputs import NoSpace, check_output


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from deltazip.compress.config import CompressConfig
    from deltazip.compress.pipeline import compress_delta
    from deltazip.kernels.scheme import DeltaScheme

    tmp = tmp_path_factory.mktemp("late")
    base, ft = make_pair(tmp)
    art = tmp / "art"
    compress_delta(base, ft, None, art, CompressConfig(scheme=DeltaScheme(group_size=32), method="rtn"), lossless="none")
    return tmp, base, ft, calib_file(tmp), art


@pytest.fixture
def small_fs(tmp_path):
    """A 16 KiB tmpfs (needs root: skipped elsewhere)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def _one_line(code: int, err: str) -> str:
    lines = without_progress(err).strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("deltazip: error: "), (code, err)
    assert "Traceback" not in err
    return lines[0]


def test_full_disk_during_compress_is_one_line_and_leaves_nothing(capsys, monkeypatch, pair, small_fs):
    tmp, base, ft, calib, _ = pair
    out = small_fs / "art"
    code, _, err = run_cli(capsys, monkeypatch, "compress", "--base", base, "--finetuned", ft, "--calib", calib,
                           "--out", out, "--group-size", "32", "--nsamples", "4", "--seqlen", "32", "--lossless", "none")
    line = _one_line(code, err)
    assert f"--out {out}: no space left on the device (needs about " in line, line
    need = int(line.split("(needs about ")[1].split("(")[1].split(" bytes")[0])
    assert need > 16 * 1024  # the bytes written before the disk filled plus the shard that did not fit
    assert list(small_fs.iterdir()) == []


def test_merge_checks_free_space_before_writing(capsys, monkeypatch, pair, small_fs):
    tmp, base, ft, calib, art = pair
    out = small_fs / "merged"
    code, _, err = run_cli(capsys, monkeypatch, "merge", art, "--out", out)
    line = _one_line(code, err)
    ft_bytes = sum(p.stat().st_size for p in ft.glob("*.safetensors"))
    assert f"--out {out}: needs about " in line and "free; free some space or choose another location" in line
    assert int(line.split("(")[1].split(" bytes")[0]) >= 0.99 * ft_bytes  # the merged tensors' bytes
    assert list(small_fs.iterdir()) == []


def test_check_space_counts_a_margin(tmp_path, monkeypatch):
    """The helper's arithmetic (the real file system is exercised above): N bytes need N x 1.02 free."""
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10_200))
    check_output(tmp_path / "a", "--out", nbytes=10_000)  # fits exactly
    with pytest.raises(NoSpace, match=r"--out .*/b: needs about .* \(10201 bytes\) but .* has 10.0 KiB free"):
        check_output(tmp_path / "b", "--out", nbytes=10_001)
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []  # checks write nothing


def test_plot_with_a_non_image_name_is_refused_up_front(capsys, monkeypatch, pair, tmp_path):
    tmp, base, ft, calib, art = pair
    code, _, err = run_cli(capsys, monkeypatch, "inspect", art, "--plot", tmp_path / "x.txt", "--base", tmp / "nope")
    line = _one_line(code, err)  # refused before the (missing) base is opened
    assert "--plot" in line and "extension .txt is not an image format" in line and ".png, .pdf, .svg" in line
    assert list(tmp_path.iterdir()) == []
    code, _, err = run_cli(capsys, monkeypatch, "inspect", art, "--plot", tmp_path / "d.svg")
    assert code == 0, err
    assert (tmp_path / "d.svg").read_text().lstrip().startswith("<?xml")


def test_eval_output_in_an_unwritable_directory_fails_before_evaluating(pair, tmp_path):
    tmp, base, ft, calib, art = pair
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    t = time.time()
    code, _, err = run_cli_process("eval", art, "base", "--tasks", "deltazip_shift", "--limit", "2", "--output",
                                   ro / "r.json", unprivileged=True)
    line = _one_line(code, err)
    assert f"{ro}: permission denied" in line and "evaluating" not in err
    assert time.time() - t < 30 and list(ro.iterdir()) == []


@pytest.mark.parametrize("name,body,where", [
    ("bad.jsonl", '{"text": "one two"}\n{"text": "three" \n{"text": "four"}\n', "line 2, column 18: Expecting ','"),
    ("list.jsonl", '{"text": "one two"}\n["three"]\n', "line 2: a JSON list, where each line must be one record"),
    ("doc.json", '[{"text": "one"},\n {"text": "two"\n]\n', "line 3, column 1: Expecting ','"),
    ("fake.parquet", "this is text, not parquet\n", "byte 0: starts with b'this', not with the parquet magic"),
    ("cut.parquet", "PAR1" + "x" * 40, "byte 40: ends with b'xxxx', not with the parquet footer b'PAR1'"),
])
def test_malformed_calibration_names_the_line_or_byte(capsys, monkeypatch, pair, tmp_path, name, body, where):
    tmp, base, ft, calib, _ = pair
    bad = tmp_path / name
    bad.write_text(body)
    code, _, err = run_cli(capsys, monkeypatch, "compress", "--base", base, "--finetuned", ft, "--calib", bad,
                           "--out", tmp_path / "art", "--nsamples", "4", "--seqlen", "32", "--group-size", "32")
    line = _one_line(code, err)  # no "Failed to load JSON ..." / pyarrow line before it
    assert f"calibration file {bad}: {where}" in line, line
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.tmp-*"))


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("option", ["--calib", "--base"])
def test_unreachable_hub_is_one_line_at_once(pair, tmp_path, option):
    tmp, base, ft, calib, _ = pair
    args = {"--base": base, "--finetuned": ft, "--calib": calib, "--group-size": 32, option: "someorg/somedata"}
    env = {**_env(), "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    t = time.time()
    code, _, err = run_cli_process("compress", *[x for kv in args.items() for x in map(str, kv)], "--out",
                                   tmp_path / "art", env=env, timeout=120)
    line = _one_line(code, err)
    assert "'someorg/somedata' is a hub id, but the Hugging Face hub cannot be reached" in line
    assert "HF_HUB_OFFLINE=1" in line and "local" in line
    assert time.time() - t < 20  # datasets alone retried for ~25 s
    env["HF_HUB_OFFLINE"] = "1"
    code, _, err = run_cli_process("compress", *[x for kv in args.items() for x in map(str, kv)], "--out",
                                   tmp_path / "art", env=env, timeout=120)
    assert "is a hub id that is not in the local Hugging Face cache" in _one_line(code, err)


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))}


def test_json_diagnosis_finds_type_changes(tmp_path):
    from deltazip.compress.calibration import bad_json

    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"text": "a"}) + "\n\n" + json.dumps({"text": 5}) + "\n")
    assert bad_json(p) == "line 3: field 'text' is int, but str on line 1"
    p.write_bytes(b'{"text": "caf\xff"}\n')
    assert bad_json(p) == "byte 13: not UTF-8 text (b'\\xff\"}\\n')"
    with pytest.raises(InputError):
        check_output(p, "--out", [("--calib", p)], overwrite=True, kind="file")
