"""The OBS solver: exact 2:4, codes in range, better than RTN on the same delta, loud damping."""

import pytest
import torch

from deltazip.compress.obs import obs_compress, output_error, rtn_compress
from deltazip.formats.errors import CompressionError
from deltazip.formats.packing import pack_delta
from deltazip.kernels.reference import delta_weight
from deltazip.kernels.scheme import DeltaScheme


def _problem(rows=96, cols=128, n=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Correlated inputs with uneven scales, as real activations have.
    X = torch.randn(n, cols, generator=g) @ (torch.randn(cols, cols, generator=g) * 0.2) \
        + torch.randn(n, cols, generator=g) * torch.linspace(0.1, 3, cols)
    H = 2 * X.T @ X / n
    W = torch.randn(rows, cols, generator=g) * 1e-2
    return W, H


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sparse", [True, False])
def test_obs_beats_rtn_and_keeps_invariants(bits, sparse):
    W, H = _problem()
    scheme = DeltaScheme(bits=bits, sym=True, group_size=32, sparsity="2:4" if sparse else "none")
    res = obs_compress(W, H, scheme)
    rtn = rtn_compress(W, scheme)
    assert int(res.codes.min()) >= 0 and int(res.codes.max()) < 2**bits
    if sparse:
        kept = res.mask.reshape(W.shape[0], -1, 4).sum(-1)
        assert bool((kept == 2).all()), "exactly two kept per group of four"
        assert bool((res.values[~res.mask] == 0).all()), "pruned entries are exactly zero"
    e_obs = output_error(W - res.values, W, H)
    e_rtn = output_error(W - rtn.values, W, H)
    assert e_obs < 0.9 * e_rtn, (e_obs, e_rtn)
    packed = pack_delta(res.codes, res.scales, None, res.mask, bits, 32)
    assert torch.equal(delta_weight(packed), res.values), "stored form reproduces the solver bit for bit"


def test_asym_and_per_row_groups():
    W, H = _problem(seed=3)
    res = obs_compress(W, H, DeltaScheme(bits=4, sym=False, group_size=-1, sparsity="2:4"))
    assert res.scales.shape == (W.shape[0], 1)
    assert float(res.zeros.min()) >= 0 and float(res.zeros.max()) <= 15
    packed = pack_delta(res.codes, res.scales, res.zeros, res.mask, 4, -1)
    assert torch.equal(delta_weight(packed), res.values)
    assert output_error(W - res.values, W, H) < 0.2


def test_dead_columns_and_damping_retry_are_recorded():
    W, H = _problem(cols=64)
    H[:, 5] = 0
    H[5, :] = 0
    res = obs_compress(W, H, DeltaScheme(bits=4, group_size=32))
    assert res.stats["dead_columns"] == 1
    assert bool((res.values[:, 5] == 0).all())
    # An indefinite Hessian needs more damping: the solver retries and says so.
    H2 = H.clone()
    H2 -= 1.5 * torch.eye(64) * float(torch.diag(H).mean())
    H2 = (H2 + H2.T) / 2
    H2.fill_diagonal_(float(torch.diag(H).mean()) * 0.5)
    res2 = obs_compress(W, H2, DeltaScheme(bits=4, group_size=32))
    assert res2.stats["damp_retries"] >= 1 and res2.stats["damp"] > 0.01


def test_hopeless_hessian_raises():
    W = torch.randn(8, 16)
    H = -torch.eye(16)
    with pytest.raises(CompressionError, match="singular"):
        obs_compress(W, H, DeltaScheme(bits=4, group_size=16))


def _column_loop_as_written(W, Hinv, bits, sym, rows24, group):
    """The column loop as first written, with ``quantize_codes``/``dequantize_codes`` per column and
    fresh tensors for every intermediate: what the in-place loop of ``obs._solve_block`` must equal."""
    from deltazip.compress.quantizer import dequantize_codes, find_params, quantize_codes

    R, C = W.shape
    W = W.clone()
    codes, values, keep = torch.zeros(R, C), torch.zeros(R, C), torch.ones(R, C, dtype=torch.bool)
    for i1 in range(0, C, group):
        i2 = i1 + group
        W1t = W[:, i1:i2].t().contiguous()
        Err1t, Q1t, C1t = torch.zeros_like(W1t), torch.zeros_like(W1t), torch.zeros_like(W1t)
        Hinv1 = Hinv[i1:i2, i1:i2]
        hdiag = torch.diag(Hinv1)
        scale, zero = find_params(W1t.t(), bits, sym)
        pruned1t = torch.zeros_like(W1t, dtype=torch.bool)
        for i in range(group):
            w = W1t[i]
            if i % 4 == 0:
                score = W1t[i:i + 4] ** 2 / hdiag[i:i + 4].unsqueeze(1) ** 2
                drop = torch.topk(score, 2, dim=0, largest=False).indices
                pruned1t[i:i + 4].scatter_(0, drop, True)
                pruned1t[i:i + 4] &= rows24
            c = quantize_codes(w, scale, zero, bits)
            q = dequantize_codes(c, scale, zero).masked_fill(pruned1t[i], 0.0)
            C1t[i], Q1t[i] = c, q
            err = (w - q) / Hinv1[i, i]
            W1t[i:].addr_(Hinv1[i, i:], err, alpha=-1.0)
            Err1t[i] = err
        codes[:, i1:i2], values[:, i1:i2], keep[:, i1:i2] = C1t.t(), Q1t.t(), ~pruned1t.t()
        W[:, i2:] -= Err1t.t() @ Hinv[i1:i2, i2:]
    return codes.long(), values, keep, W


def _column_loop(W, Hinv, bits, sym, rows24, group):
    """``obs._solve_block`` over every block of ``W``: (codes, values, keep, W after the error updates)."""
    from deltazip.compress import obs

    W = W.clone()
    out = obs._Outputs(W.shape[0], W.shape[1], W.shape[1] // group, True, W.device)
    for i1 in range(0, W.shape[1], group):
        obs._solve_block(W, Hinv, i1, i1 + group, bits, sym, True, rows24, out)
    return out.codes, out.values, out.keep, W


@pytest.mark.parametrize("sym", [True, False])
def test_the_column_loop_is_bit_identical_to_the_per_column_functions(sym):
    """Stacked rows of every width, half of them 2:4 (as the sensitivity probe solves them), and one
    width for every row: codes, values, masks and every error update (the weights left after each
    block) equal those of the loop written with fresh tensors per column, to the bit."""
    from deltazip.compress.obs import _inverse_cholesky

    W, H = _problem(rows=64, cols=128, seed=3)
    W[::3, :40] = 0  # unchanged weights: equal scores, where the 2:4 choice falls to topk's tie order
    Hinv, _, _ = _inverse_cholesky(H.clone(), 0.01)
    for bits, rows24 in ((torch.tensor([2, 3, 4, 8] * 16), torch.arange(64) % 2 == 0),
                         (4, torch.ones(64, dtype=torch.bool))):
        got = _column_loop(W, Hinv, bits, sym, rows24, 32)
        want = _column_loop_as_written(W, Hinv, bits, sym, rows24, 32)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_2_4_choice_is_topks_ties_included():
    """Every order of four scores with ties (all 256 of values 0..3), and random columns with many
    equal scores: the same two positions as ``torch.topk(..., largest=False)``."""
    import itertools

    from deltazip.compress.obs import _two_smallest

    def topk(s):
        return torch.zeros_like(s, dtype=torch.bool).scatter_(0, torch.topk(s, 2, dim=0, largest=False).indices, True)

    every = torch.tensor(list(itertools.product(range(4), repeat=4)), dtype=torch.float32).t().contiguous()
    assert torch.equal(_two_smallest(every), topk(every))
    g = torch.Generator().manual_seed(0)
    for s in (torch.randint(0, 3, (4, 4096), generator=g).float(), torch.rand(4, 4096, generator=g)):
        s[:, :300] = 0
        assert torch.equal(_two_smallest(s), topk(s))


def test_split_solve_runs_each_part_as_alone_and_restores_threads():
    """``obs_solve_split`` (the probe's candidate solves): each part of the rows comes out bit for bit as
    that part solved alone on one thread, the whole as the one-loop solve up to the block products'
    summation order, dead columns and damping stats kept, the caller's thread count restored."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from deltazip.compress.obs import SPLIT_MIN_ROWS, obs_solve, obs_solve_split

    R = 2 * SPLIT_MIN_ROWS + 6  # parts of SPLIT_MIN_ROWS + 3 rows
    W, H = _problem(rows=R, cols=64)
    H[5, :], H[:, 5] = 0, 0  # a dead column
    g = torch.Generator().manual_seed(1)
    bits = torch.tensor([2, 3, 4, 8])[torch.randint(0, 4, (R,), generator=g)]
    sparse = torch.rand(R, generator=g) < 0.5
    before = torch.get_num_threads()
    with ThreadPoolExecutor(2) as pool:
        split = obs_solve_split(W, H, bits, sparse, 32, True, 0.01, pool, workers=2)
        small = obs_solve_split(W[:SPLIT_MIN_ROWS], H, bits[:SPLIT_MIN_ROWS], sparse[:SPLIT_MIN_ROWS], 32, True,
                                0.01, pool, workers=2)  # too few rows for two parts: one loop
    seen = []  # the default a new thread starts with (what the parts' one-thread setting would leak into)
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert torch.get_num_threads() == before and seen == [before]
    whole = obs_solve(W, H, bits, sparse, 32, True, 0.01)
    assert split.stats == whole.stats and split.stats["dead_columns"] == 1
    torch.set_num_threads(1)
    try:
        for rows in (slice(0, R // 2), slice(R // 2, R)):
            alone = obs_solve(W[rows], H, bits[rows], sparse[rows], 32, True, 0.01)
            for a, b in ((split.codes, alone.codes), (split.values, alone.values), (split.mask, alone.mask),
                         (split.scales, alone.scales), (split.zeros, alone.zeros)):
                assert torch.equal(a[rows], b)
    finally:
        torch.set_num_threads(before)
    assert torch.allclose(split.values, whole.values, atol=1e-6, rtol=0)
    assert float((split.codes != whole.codes).float().mean()) < 1e-3
    assert torch.equal(split.mask, whole.mask) or float((split.mask != whole.mask).float().mean()) < 1e-3
    ref = obs_solve(W[:SPLIT_MIN_ROWS], H, bits[:SPLIT_MIN_ROWS], sparse[:SPLIT_MIN_ROWS], 32, True, 0.01)
    assert torch.equal(small.values, ref.values) and torch.equal(small.codes, ref.codes)


@pytest.mark.parametrize("bits,sparse", [(2, True), (3, False), (4, True), (8, False)])
def test_loss_is_each_rows_output_error(bits, sparse):
    """``SolveResult.loss``: each row's ``e H eᵀ`` (the undamped Hessian, dead columns counted as H has
    them: not at all), for a full-rank and a rank-deficient ``H``, and through the split solve."""
    from concurrent.futures import ThreadPoolExecutor

    from deltazip.compress.obs import SPLIT_MIN_ROWS, obs_solve, obs_solve_split

    W, H = _problem(rows=2 * SPLIT_MIN_ROWS, cols=64)
    H[3, :], H[:, 3] = 0, 0
    X = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    for h in (H, 2 * X.t() @ X / 16):  # the second of rank 16: the damping carries the solve
        res = obs_solve(W, h, bits, sparse, 32, True, 0.01)
        with ThreadPoolExecutor(2) as pool:
            split = obs_solve_split(W, h, bits, sparse, 32, True, 0.01, pool, workers=2)
        E = W - res.values
        want = ((E @ h) * E).sum(1)
        # E = W - values in fp32 carries a relative error of about eps * |W| / |E| (large at 8 bits, where
        # E is small): the reference itself is no more precise than that, squared in e H eᵀ.
        ref_rel = 4 * torch.finfo(torch.float32).eps * float(W.abs().max() / E.abs().max())
        atol = max(1e-6, ref_rel) * float(want.abs().max())
        assert torch.allclose(res.loss, want, rtol=1e-4, atol=atol), (res.stats, (res.loss - want).abs().max())
        assert torch.allclose(split.loss, want, rtol=1e-4, atol=atol)
