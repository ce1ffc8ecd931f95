"""The dispatch table (``deltazip.kernels.dispatch_table``): keys, the on-disk table (a corrupt one ignored,
named for the kernel source it timed), the untuned default. Filling it: tests/runtime/serve/test_kernel_tuning.py."""

from __future__ import annotations

import json

import pytest
import torch
from _sbmm import mma_stack

from deltazip.kernels import cuda_sbmm, dispatch_table


def test_key_rounds_rows_and_deltas_and_names_the_configuration():
    s = mma_stack()
    assert dispatch_table.key(s, torch.bfloat16, 5, 3) == "mma/b4/g128/24/sym/1024x256/bfloat16/r8/d4"
    assert dispatch_table.key(s, torch.bfloat16, 7, 4) == dispatch_table.key(s, torch.bfloat16, 5, 3)
    assert dispatch_table.key(s, torch.bfloat16, 2, 9) == dispatch_table.key(s, torch.bfloat16, 2, 2)  # deltas <= rows
    assert dispatch_table.key(mma_stack(bits=2), torch.bfloat16, 5, 3) != dispatch_table.key(s, torch.bfloat16, 5, 3)


def test_untuned_default_reads_weights_few_times_on_the_kernel_else_dequantizes_once():
    s = mma_stack()
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


def test_the_table_file_is_named_for_the_kernel_source_it_timed(table_dir, monkeypatch):
    """Choices timed on one build of the kernel are not read by another: the file name carries the
    source's hash, so an upgrade that changes the kernel starts an empty table."""
    import hashlib

    tag = dispatch_table.device_tag(torch.device("cpu"))
    assert tag.endswith("-kernel-" + hashlib.sha256(cuda_sbmm.source().encode()).hexdigest()[:8])
    edited = cuda_sbmm.source() + "\n// edited\n"
    monkeypatch.setattr(cuda_sbmm, "source", lambda: edited)
    assert dispatch_table.device_tag(torch.device("cpu")) != tag


def _at_once(n: int, fn) -> list:
    """``fn(i)`` on ``n`` threads released together; their results in thread order."""
    import threading

    barrier, out = threading.Barrier(n), [None] * n

    def run(i):
        barrier.wait()
        out[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_every_thread_gets_the_one_table_of_its_device(table_dir):
    """The engine's first lookup and the tuner's first record may load the table at once: a second copy
    would take choices that are neither looked up nor saved."""
    (table_dir / f"{dispatch_table.device_tag(torch.device('cpu'))}.json").write_text(json.dumps(
        {"version": 1, "entries": {f"k{i}": {"path": "dequant_mm"} for i in range(2000)}}))  # a slow load
    for _ in range(5):
        dispatch_table.forget_loaded()
        tables = _at_once(8, lambda i: dispatch_table.table_for(torch.device("cpu")))
        assert len({id(t) for t in tables}) == 1 and len(tables[0].entries) == 2000


def test_threads_saving_one_table_at_once_each_write_it_whole(table_dir):
    """The start-up thread and the background tuner both save after measuring: each write goes through
    its own temporary file, and the table read back is whole."""
    table = dispatch_table.Table(table_dir / "t.json")
    table.entries = {f"k{i}": dispatch_table.Choice("dequant_mm") for i in range(200)}

    def save_often(i):
        for _ in range(50):
            table.save()
        return True

    assert _at_once(4, save_often) == [True] * 4
    assert set(dispatch_table.Table(table_dir / "t.json").load().entries) == set(table.entries)
    assert [p.name for p in table_dir.iterdir()] == ["t.json"]  # no temporary file left
