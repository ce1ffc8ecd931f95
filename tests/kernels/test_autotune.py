"""The per-GPU autotune cache (``deltazip.kernels.autotune``): keys, buckets, load/save, corrupt files,
tuning with an injected timer, and the launch options reaching the kernel (interpreter on a CPU)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton`

from _sbmm import assert_matches, magnitude, make_delta, random_index  # noqa: E402

from deltazip.kernels import autotune, reference  # noqa: E402
from deltazip.kernels.stacked import StackedDeltas, repack  # noqa: E402

CFG = {"num_warps": 4, "num_stages": 3, "unroll": 1, "split_k": 2}


@pytest.fixture
def tune_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTAZIP_AUTOTUNE_DIR", str(tmp_path / "tune"))
    autotune.forget_loaded()
    yield tmp_path / "tune"
    autotune.forget_loaded()


def _stack(**kw) -> StackedDeltas:
    args = dict(bits=4, group_size=128, in_features=256, out_features=192, sparse=True, asymmetric=False,
                layout="transposed")
    args.update(kw)
    return StackedDeltas.allocate(2, **args)


def test_rows_bucket_is_the_next_power_of_two():
    assert [autotune.rows_bucket(n) for n in (0, 1, 2, 3, 4, 5, 16, 17, 300)] == [1, 1, 2, 4, 4, 8, 16, 32, 512]


def test_key_names_every_thing_the_kernel_depends_on():
    base = autotune.tune_key(_stack(), torch.float16, 5)
    assert base == "transposed/b4/g128/24/sym/256x192/float16/n8"
    others = [
        autotune.tune_key(_stack(bits=8), torch.float16, 5),
        autotune.tune_key(_stack(group_size=64), torch.float16, 5),
        autotune.tune_key(_stack(sparse=False), torch.float16, 5),
        autotune.tune_key(_stack(asymmetric=True), torch.float16, 5),
        autotune.tune_key(_stack(out_features=128), torch.float16, 5),
        autotune.tune_key(_stack(), torch.bfloat16, 5),
        autotune.tune_key(_stack(), torch.float16, 9),
    ]
    assert len({base, *others}) == 1 + len(others)
    assert autotune.tune_key(_stack(), torch.float16, 7) == base  # same bucket


def test_cache_path_per_gpu_and_triton_version(tune_dir, monkeypatch):
    p = autotune.cache_path("cpu")
    assert p.parent == tune_dir and p.suffix == ".json"
    assert "triton" in p.name and "/" not in p.name and " " not in p.name
    monkeypatch.delenv("DELTAZIP_AUTOTUNE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert str(autotune.cache_path("cpu")).startswith("/xdg/deltazip/autotune/")


def test_save_load_roundtrip_is_atomic(tune_dir):
    c = autotune.TuneCache(tune_dir / "gpu.json")
    assert c.load().entries == {}  # missing file: empty, no warning
    c.put("k1", CFG)
    c.save()
    assert sorted(os.listdir(tune_dir)) == ["gpu.json"]  # no temporary file left behind
    raw = json.loads((tune_dir / "gpu.json").read_text())
    assert raw == {"version": 1, "entries": {"k1": CFG}}
    assert autotune.TuneCache(tune_dir / "gpu.json").load().get("k1") == CFG
    with pytest.raises(ValueError, match="tunable"):
        c.put("k2", {**CFG, "split_k": 3})


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"version": 99, "entries": {}}', '{"version": 1}'])
def test_corrupt_or_foreign_file_is_ignored_with_a_warning_and_rewritten(tune_dir, text):
    tune_dir.mkdir()
    (tune_dir / "gpu.json").write_text(text)
    with pytest.warns(UserWarning, match="autotune cache"):
        c = autotune.TuneCache(tune_dir / "gpu.json").load()
    assert c.entries == {}
    c.put("k", CFG)
    c.save()
    assert autotune.TuneCache(tune_dir / "gpu.json").load().entries == {"k": CFG}


def test_malformed_entries_are_dropped_one_by_one(tune_dir):
    tune_dir.mkdir()
    entries = {"good": CFG, "extra": {**CFG, "x": 1}, "missing": {"num_warps": 4}, "bad_value": {**CFG, "unroll": 3},
               "not_int": {**CFG, "num_stages": "3"}, "bool": {**CFG, "split_k": True}, "list": [1]}
    (tune_dir / "gpu.json").write_text(json.dumps({"version": 1, "entries": entries}))
    c = autotune.TuneCache(tune_dir / "gpu.json").load()
    assert c.entries == {"good": CFG} and c.dropped == len(entries) - 1


def test_tune_picks_the_fastest_caches_it_and_does_not_time_again(tune_dir, monkeypatch):
    calls = []
    monkeypatch.setattr("deltazip.kernels.triton_fast.sbmm_fast",
                        lambda x, index, stack, plan=None, config=None: calls.append((x.shape[0], config)))
    stack = _stack(layout="mma") if _mma_ok() else pytest.skip("no mma layout")
    cands = [dict(CFG, num_stages=s) for s in (2, 3, 4)]
    times = {2: 3.0, 3: 1.0, 4: 2.0}
    cache = autotune.TuneCache(tune_dir / "gpu.json")

    def timer(fn):
        fn()
        return times[calls[-1][1]["num_stages"]]

    got = autotune.tune(stack, torch.float16, 6, cache=cache, timer=timer, candidates=cands)
    assert got == dict(CFG, num_stages=3)
    assert [c[0] for c in calls] == [8, 8, 8]  # the bucket's row count
    assert autotune.TuneCache(tune_dir / "gpu.json").load().get(autotune.tune_key(stack, torch.float16, 6)) == got
    assert autotune.tune(stack, torch.float16, 7, cache=cache, timer=timer, candidates=cands) == got
    assert len(calls) == 3  # cached: no new timing


def test_a_config_that_does_not_fit_is_skipped_and_recorded_not_raised(tune_dir, monkeypatch):
    """The H200 start-up crash: a candidate needing 253,952 B of shared memory (limit 232,448) raised
    OutOfResources out of the model build. Now it is skipped, recorded, and the others compete."""
    monkeypatch.setattr("deltazip.kernels.triton_fast.sbmm_fast",
                        lambda x, index, stack, plan=None, config=None: config)
    stack = _stack(layout="mma") if _mma_ok() else pytest.skip("no mma layout")
    cands = [dict(CFG, num_stages=s) for s in (2, 3, 4)]

    class OutOfResources(Exception):
        pass

    def timer(fn):
        cfg = fn()
        if cfg["num_stages"] == 4:
            raise OutOfResources("out of resource: shared memory, Required: 253952, Hardware limit: 232448")
        return {2: 2.0, 3: 1.0}[cfg["num_stages"]]

    cache = autotune.TuneCache(tune_dir / "gpu.json")
    assert autotune.tune(stack, torch.float32, 64, cache=cache, timer=timer, candidates=cands) == dict(CFG, num_stages=3)
    key = autotune.tune_key(stack, torch.float32, 64)
    assert any("OutOfResources" in r and "253952" in r for r in autotune.SKIPPED[key])

    def always(fn):
        raise OutOfResources("out of resource")

    with pytest.warns(UserWarning, match="no autotune candidate"):
        assert autotune.tune(stack, torch.float32, 2, cache=cache, timer=always, candidates=cands) == {}
    assert cache.get(autotune.tune_key(stack, torch.float32, 2)) is None  # nothing cached: retried next start


def test_candidates_fit_the_k_steps():
    stack = _stack(layout="mma", in_features=128, group_size=128) if _mma_ok() else pytest.skip("no mma layout")
    cands = autotune.candidates_for(stack)  # one K step of 128: no split
    assert cands and all(c["split_k"] == 1 for c in cands) and all(autotune.valid_config(c) for c in cands)


def test_lookup_is_off_the_gpu_and_when_disabled(tune_dir, monkeypatch):
    stack = _stack()
    assert autotune.lookup(stack, torch.float16, 4) is None  # CPU stack: never tuned
    monkeypatch.setenv("DELTAZIP_AUTOTUNE", "0")
    assert not autotune.enabled()


def _mma_ok() -> bool:
    from deltazip.kernels.fast_layout import fast_supported

    return fast_supported(4, 128, 256)


def test_tuned_options_reach_the_kernel_and_keep_the_result(backend):
    """Every candidate gives the reference's answer (options change only speed and summation order)."""
    from deltazip.kernels.triton_fast import sbmm_fast

    gen = torch.Generator().manual_seed(5)
    deltas = [make_delta(64, 256, 4, 128, True, s == 1, gen) for s in range(2)]
    stack = repack(deltas, device=backend, layout="mma")
    index = random_index(9, 2, gen)
    x = torch.randn(9, 256, generator=gen).half()
    ref = reference.sbmm(x, index, deltas)
    mag = magnitude(x, index, [reference.delta_weight(d) for d in deltas])
    for cfg in ({"num_warps": 4, "num_stages": 2, "unroll": 1, "split_k": 2}, {"split_k": 1, "unroll": 2}):
        y = sbmm_fast(x.to(backend), index.to(backend), stack, config=cfg).cpu()
        assert_matches(y, ref, mag)


def test_cache_for_loads_once_per_device_and_reloads_after_forget(tune_dir):
    c = autotune.TuneCache(autotune.cache_path("cpu"))
    c.put("k", CFG)
    c.save()
    first = autotune.cache_for("cpu")
    assert first.get("k") == CFG and autotune.cache_for("cpu") is first
    first.put("k2", CFG)  # in memory only
    autotune.forget_loaded()
    assert autotune.cache_for("cpu").get("k2") is None
