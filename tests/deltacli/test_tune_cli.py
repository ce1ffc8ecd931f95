"""``deltazip tune``: the kernel tuning a server does before it reports ready, done ahead of time.

On CPU the command refuses in one line (there is nothing to tune: CPU serving keeps deltas dequantized);
on a GPU it fills the on-disk dispatch table, which a second process then finds complete."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _cli import run_cli, run_cli_process
from _factories import calib_file, make_pair


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A base whose linears take the CUDA kernel's layout (hidden 256, MLP 512, group 128) and one
    RTN 4-bit 2:4 variant of it."""
    from deltazip.compress.config import CompressConfig
    from deltazip.compress.pipeline import compress_delta
    from deltazip.kernels.scheme import DeltaScheme

    tmp = tmp_path_factory.mktemp("tune")
    base, ft = make_pair(tmp, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4)
    cfg = CompressConfig(scheme=DeltaScheme(bits=4, group_size=128, sparsity="2:4"), method="rtn", nsamples=4,
                         seqlen=16, device="cpu")
    compress_delta(base, ft, str(calib_file(tmp / "calib", n=8)), tmp / "arts" / "v0", cfg, lossless="none")
    return tmp / "arts", base


def test_a_missing_directory_is_named_in_one_line(capsys, monkeypatch, tmp_path):
    code, out, err = run_cli(capsys, monkeypatch, "tune", tmp_path / "nope")
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / "nope") in lines[0] and "no such directory" in lines[0], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_without_a_gpu_it_says_there_is_nothing_to_tune_in_one_line(served, capsys, monkeypatch):
    arts, base = served
    code, out, err = run_cli(capsys, monkeypatch, "tune", arts, "--base", base)
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "needs a GPU" in lines[0] and "nothing to tune" in lines[0], err


@pytest.mark.gpu
def test_tune_fills_the_table_that_a_later_process_then_finds_complete(served, tmp_path):
    """Two real processes: the first times the keys of every served stack; the second, over the same
    table directory, times none (the table on disk, not a per-process memo, is what makes it fast)."""
    arts, base = served
    env = dict(os.environ, DELTAZIP_AUTOTUNE_DIR=str(tmp_path / "autotune"))
    runs = []
    for _ in range(2):
        code, out, err = run_cli_process("tune", arts, "--base", base, "--max-deltas", 4, "--json", env=env,
                                         timeout=600)
        assert code == 0, err
        runs.append(json.loads(out))
    first, second = runs
    assert first["keys_timed"] > 0 and first["table_entries"] >= first["keys_timed"], first
    assert second["keys_timed"] == 0 and second["table_entries"] == first["table_entries"], second
    assert first["table"] == second["table"] and first["table"].startswith(str(tmp_path / "autotune"))
