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
