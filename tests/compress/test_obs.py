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
