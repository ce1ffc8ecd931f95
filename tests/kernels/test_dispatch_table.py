"""Dispatch by measurement (``deltazip.kernels.dispatch_table``): keys, the on-disk table, tuning with an
injected timer (failures skipped and recorded, never raised), the untuned default."""

from __future__ import annotations

import json

import pytest
import torch

from deltazip.kernels import cuda_sbmm, dispatch_table
from deltazip.kernels.dispatch_table import Choice
from deltazip.kernels.stacked import StackedDeltas


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTAZIP_AUTOTUNE_DIR", str(tmp_path))
    dispatch_table.forget_loaded()
    yield tmp_path
    dispatch_table.forget_loaded()


def _stack(**kw) -> StackedDeltas:
    args = dict(bits=4, group_size=128, in_features=1024, out_features=256, sparse=True, asymmetric=False,
                layout="mma")
    args.update(kw)
    return StackedDeltas.allocate(8, **args)


def test_key_rounds_rows_and_deltas_and_names_the_configuration():
    s = _stack()
    assert dispatch_table.key(s, torch.bfloat16, 5, 3) == "mma/b4/g128/24/sym/1024x256/bfloat16/r8/d4"
    assert dispatch_table.key(s, torch.bfloat16, 7, 4) == dispatch_table.key(s, torch.bfloat16, 5, 3)
    assert dispatch_table.key(s, torch.bfloat16, 2, 9) == dispatch_table.key(s, torch.bfloat16, 2, 2)  # deltas <= rows
    assert dispatch_table.key(_stack(bits=2), torch.bfloat16, 5, 3) != dispatch_table.key(s, torch.bfloat16, 5, 3)


def test_candidates_cover_the_launch_configs_and_the_prefill_path():
    s = _stack()
    decode = dispatch_table.candidates(s, 8, 8)
    assert {c.path for c in decode} == {"cuda"}
    assert {(c.config.rb, c.config.kt) for c in decode} == {(1, 1), (2, 1), (1, 2), (2, 2)}
    assert all(1024 // 128 // (c.config.split * c.config.kt) >= 2 for c in decode)
    assert "dequant_mm" in {c.path for c in dispatch_table.candidates(s, 512, 1)}
    eight = dispatch_table.candidates(_stack(bits=8), 8, 8)
    assert {c.config.kt for c in eight} == {1}  # two tiles per stage would spill at 8 bits


def test_a_k_split_is_timed_only_while_the_split_grid_is_within_its_waves():
    """Llama-7B's 4096x4096 at 4 bits on a 132-SM GPU: one delta, one row (64 or 32 CTAs) keeps every split
    that fits K; 16 deltas of 16 rows (1024 / 512 CTAs) keep only split 1 or 2; no SM count, no bound."""
    s = StackedDeltas.allocate(16, bits=4, group_size=128, in_features=4096, out_features=4096, sparse=True,
                               asymmetric=False, layout="mma")

    def splits(rows, d, sms):
        return {(c.config.rb, c.config.split) for c in dispatch_table.candidates(s, rows, d, sms) if c.path == "cuda"}

    assert {sp for _, sp in splits(1, 1, 132)} == {1, 2, 4, 8}
    many = splits(256, 16, 132)  # 16 tiles: 1024 CTAs with rb 1, 512 with rb 2; the bound is 8 x 132 = 1056
    assert many == {(1, 1), (2, 1), (2, 2)}
    assert all(64 // rb * 16 * sp <= dispatch_table.SPLIT_WAVES * 132 for rb, sp in many if sp > 1)
    assert {sp for _, sp in splits(256, 16, None)} == {1, 2, 4, 8}


def test_tune_keeps_the_fastest_skips_failures_and_caches(table_dir):
    s = _stack()
    cands = [Choice("cuda", cuda_sbmm.CudaConfig(2, 4, sp, 1)) for sp in (1, 2, 4)]
    times = {1: 0.030, 2: 0.010, 4: None}

    class OutOfResources(Exception):  # what Triton or a launch raises for a config that does not fit
        pass

    def timer(fn):
        t = times[fn.__defaults__[0].config.split]
        if t is None:
            raise OutOfResources("out of resource: shared memory, Required: 253952, Hardware limit: 232448")
        return t

    got = dispatch_table.tune(s, torch.float16, 4, 2, timer=timer, cands=cands)
    assert got.config.split == 2 and got.us == 10.0
    k = dispatch_table.key(s, torch.float16, 4, 2)
    raw = json.loads(next(table_dir.glob("dispatch-*.json")).read_text())
    assert raw["entries"][k]["split"] == 2
    assert any("OutOfResources" in r and "253952" in r for r in raw["skipped"][k])
    dispatch_table.forget_loaded()
    assert dispatch_table.lookup(s, torch.float16, 3, 2) == got  # read back from disk, same bucket

    def never(fn):
        raise AssertionError("a cached key is not timed again")

    assert dispatch_table.tune(s, torch.float16, 4, 2, timer=never, cands=cands) == got


def test_when_every_candidate_fails_the_default_is_used_with_a_warning(table_dir):
    s = _stack()

    def boom(fn):
        raise RuntimeError("compile error")

    with pytest.warns(UserWarning, match="no dispatch candidate ran"):
        got = dispatch_table.tune(s, torch.float16, 2, 1, timer=boom,
                                  cands=[Choice("cuda", cuda_sbmm.CudaConfig())])
    assert got == dispatch_table.default_choice(s, 2, 1)


def test_untuned_default_reads_weights_few_times_on_the_kernel_else_dequantizes_once():
    s = _stack()
    assert dispatch_table.default_choice(s, 32, 32).path == "cuda"
    assert dispatch_table.default_choice(s, 16, 1).path == "cuda"
    assert dispatch_table.default_choice(s, 1024, 2).path == "dequant_mm"


def test_a_corrupt_table_is_ignored_with_a_warning_and_bad_entries_dropped(table_dir):
    path = table_dir / "t.json"
    path.write_text("{nope")
    with pytest.warns(UserWarning, match="unreadable"):
        assert dispatch_table.Table(path).load().entries == {}
    path.write_text(json.dumps({"version": 1, "entries": {"a": {"path": "cuda", "rb": 2, "stages": 4, "split": 1, "kt": 1},
                                                          "b": {"path": "warp-drive"}, "c": [1]}}))
    t = dispatch_table.Table(path).load()
    assert set(t.entries) == {"a"} and t.entries["a"].config == cuda_sbmm.CudaConfig(2, 4, 1, 1)
