"""Grouped LoRA (``deltazip.kernels.grouped_lora``): every path against the explicit row-wise product,
the measured choice per key, and a stack changed in place read afresh."""

from __future__ import annotations

import pytest
import torch

from deltazip.kernels import dispatch, grouped_lora


def _lora(num, rank, in_f, out_f, gen, dtype, ranks=None):
    a = (torch.randn(num, rank, in_f, generator=gen) / in_f**0.5)
    b = (torch.randn(num, out_f, rank, generator=gen) / rank**0.5)
    for i, r in enumerate(ranks or []):  # smaller ranks zero-padded, as a server's stack holds them
        a[i, r:] = 0
        b[i, :, r:] = 0
    return a.to(dtype), b.to(dtype), torch.rand(num, generator=gen) + 0.5


def _rowwise(x, index, a, b, scale):
    want = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for r, i in enumerate(index.tolist()):
        if i >= 0:
            want[r] = (x[r].double() @ a[i].double().T) @ b[i].double().T * float(scale[i])
    return want


@pytest.mark.parametrize("path", grouped_lora.CANDIDATES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_matches_the_rowwise_product(path, dtype):
    """Adapters of ranks 8, 3 and 5 in one rank-8 stack, one unused, rows of no adapter (-1) exactly zero,
    a single row and a batch of only -1 rows. Bound: fp32 1e-5 relative; bf16 the rounding of x, the
    factors and the shrink product to bf16 (3 x 2^-8)."""
    gen = torch.Generator().manual_seed(5)
    a, b, scale = _lora(4, 8, 96, 40, gen, dtype, ranks=[8, 3, 8, 5])
    fn = getattr(grouped_lora, path)
    for rows in ([3, -1, 0, 0, 3, 1, -1, 3, 0, 1, 3, 3], [1], [-1, -1]):
        index = torch.tensor(rows)
        x = torch.randn(len(rows), 96, generator=gen).to(dtype)
        y = fn(x, index, a, b, scale)
        assert y.shape == (len(rows), 40) and y.dtype == dtype
        want = _rowwise(x, index, a, b, scale)
        assert torch.equal(y[index < 0], torch.zeros_like(y[index < 0]))
        if (index >= 0).any():
            rel = ((y.double() - want).norm() / want.norm()).item()
            assert rel < (1e-5 if dtype == torch.float32 else 3 * 2**-8), (path, rows, rel)


def test_the_choice_is_measured_once_per_key_and_counted_per_path():
    """The first call of a key measures every candidate (each a time, or why it was not chosen) and keeps
    the fastest; later calls of the key measure nothing; another rows bucket is another key. A dispatch
    call counts the path it took."""
    gen = torch.Generator().manual_seed(6)
    a, b, scale = _lora(6, 16, 128, 64, gen, torch.float32)
    x = torch.randn(7, 128, generator=gen)
    index = torch.tensor([0, 5, -1, 2, 2, 0, 1])
    k = grouped_lora.key(x, a, b)
    grouped_lora.CHOICES.pop(k, None)
    dispatch.CALLS.clear()
    y = dispatch.lora(x, index, a, b, scale)
    times = grouped_lora.MEASURED[k]
    assert set(times) == set(grouped_lora.CANDIDATES)
    ok = {p: t for p, t in times.items() if isinstance(t, float)}
    assert "loop" in ok and "stacked" in ok and all(t > 0 for t in ok.values())
    assert grouped_lora.CHOICES[k] == min(ok, key=ok.get)
    assert dispatch.CALLS == {f"lora_{grouped_lora.CHOICES[k]}": 1}
    rel = ((y.double() - _rowwise(x, index, a, b, scale)).norm() / _rowwise(x, index, a, b, scale).norm()).item()
    assert rel < 1e-5
    measured = grouped_lora.MEASURED[k]
    dispatch.lora(x[:5], index[:5], a, b, scale)  # rows bucket 8 again: the same key
    assert grouped_lora.MEASURED[k] is measured
    dispatch.lora(x[:2], index[:2], a, b, scale)
    assert grouped_lora.key(x[:2], a, b) in grouped_lora.MEASURED and sum(dispatch.CALLS.values()) == 3


def test_a_path_that_cannot_run_the_call_is_not_chosen():
    """fp16 activations over fp32 factors: the stacked GEMM refuses mixed dtypes, so the measurement
    names why and the loop (which computes in fp32) serves."""
    gen = torch.Generator().manual_seed(7)
    a, b, scale = _lora(3, 4, 32, 16, gen, torch.float32)
    x = torch.randn(4, 32, generator=gen).half()
    k = grouped_lora.key(x, a, b)
    grouped_lora.CHOICES.pop(k, None)
    grouped_lora.lora(x, torch.tensor([1, -1, 0, 2]), a, b, scale)
    assert isinstance(grouped_lora.MEASURED[k]["stacked"], str) and "fails" in grouped_lora.MEASURED[k]["stacked"]
    assert grouped_lora.CHOICES[k] == "loop"


def test_a_stack_loaded_in_place_is_read_afresh():
    """A server loads an adapter into its stacks in place: the stacked path's rearranged expand factors
    follow the change (the tensor's version), and a new stack object is rearranged anew."""
    gen = torch.Generator().manual_seed(8)
    a, b, scale = _lora(3, 4, 32, 16, gen, torch.float32)
    x = torch.randn(5, 32, generator=gen)
    index = torch.tensor([0, 1, 2, -1, 1])
    before = grouped_lora.stacked(x, index, a, b, scale)
    b[1].copy_(torch.randn(16, 4, generator=gen))
    after = grouped_lora.stacked(x, index, a, b, scale)
    assert not torch.equal(before[[1, 4]], after[[1, 4]]) and torch.equal(before[[0, 2, 3]], after[[0, 2, 3]])
    assert ((after.double() - _rowwise(x, index, a, b, scale)).abs().max()).item() < 1e-5
    b2 = b.clone()
    b2[0].zero_()
    assert torch.equal(grouped_lora.stacked(x, index, a, b2, scale)[0], torch.zeros(16))


def test_with_autotune_off_nothing_is_measured_and_the_loop_serves(monkeypatch):
    monkeypatch.setenv("DELTAZIP_AUTOTUNE", "0")
    gen = torch.Generator().manual_seed(9)
    a, b, scale = _lora(5, 4, 48, 24, gen, torch.float32)
    x = torch.randn(3, 48, generator=gen)
    k = grouped_lora.key(x, a, b)
    grouped_lora.CHOICES.pop(k, None)
    grouped_lora.MEASURED.pop(k, None)
    y, path = grouped_lora.lora(x, torch.tensor([4, -1, 0]), a, b, scale)
    assert path == "loop" and k not in grouped_lora.MEASURED and k not in grouped_lora.CHOICES
    assert torch.equal(y, grouped_lora.loop(x, torch.tensor([4, -1, 0]), a, b, scale))


def test_a_deferred_key_runs_the_default_path_and_is_handed_over_once(monkeypatch):
    """With ``defer`` (a server's forward) an unmeasured key is not measured: its shape goes to ``defer``
    once, the call runs the default path (the loop on a CPU) and gives the reference's result; measuring
    the shape on random factors (the server's tuner) keeps a choice that the next call takes."""
    for name, empty in (("CHOICES", {}), ("MEASURED", {}), ("QUEUED", set())):
        monkeypatch.setattr(grouped_lora, name, empty)
    gen = torch.Generator().manual_seed(10)
    a, b, scale = _lora(4, 8, 64, 32, gen, torch.float32)
    x = torch.randn(6, 64, generator=gen)
    index = torch.tensor([3, -1, 0, 2, 2, 1])
    handed = []
    y, path = grouped_lora.lora(x, index, a, b, scale, defer=handed.append)
    assert path == grouped_lora.default_path(x.device) == "loop" and not grouped_lora.MEASURED
    assert torch.equal(y, grouped_lora.loop(x, index, a, b, scale))
    grouped_lora.lora(x[:5], index[:5], a, b, scale, defer=handed.append)  # the same rows bucket: the same key
    assert handed == [grouped_lora.Shape(torch.device("cpu"), torch.float32, torch.float32, 4, 8, 64, 32, 8)]
    assert handed[0].key == grouped_lora.key(x, a, b)
    kept = grouped_lora.measure_shape(handed[0])
    times = grouped_lora.MEASURED[handed[0].key]
    assert set(times) == set(grouped_lora.CANDIDATES) and kept == grouped_lora.CHOICES[handed[0].key]
    assert kept == min((p for p in times if isinstance(times[p], float)), key=times.get)
    y2, path2 = grouped_lora.lora(x, index, a, b, scale, defer=handed.append)
    assert path2 == kept and len(handed) == 1
    want = _rowwise(x, index, a, b, scale)
    assert ((y2.double() - want).norm() / want.norm()).item() < 1e-5


def test_the_expand_factors_cache_is_swept_by_one_thread_at_a_time():
    """The engine's forwards and the tuner's measurements both run ``stacked``, whose cache of reshaped
    expand factors drops dead entries as it adds one: two threads dropping the same entry, or one adding
    while another sweeps, raised in a forward. Thread switches are made frequent and factors short-lived,
    so that an unguarded sweep fails here in most runs."""
    import sys
    import threading

    errors, old = [], sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(3):
            barrier = threading.Barrier(4)

            def churn(barrier=barrier):
                barrier.wait()
                try:
                    for _ in range(3000):
                        B = torch.zeros(2, 4, 2)
                        assert grouped_lora._b_by_rank_rows(B).shape == (4, 4)
                except Exception as e:  # noqa: BLE001 - counted below
                    errors.append(repr(e))

            threads = [threading.Thread(target=churn) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == []
