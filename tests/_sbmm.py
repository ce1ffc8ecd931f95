"""Shared helpers of the SBMM kernel tests (tests/kernels/).

Tolerance (``assert_matches``): the reference computes in fp32 and rounds once to ``x.dtype``. The
kernels feed integer codes (exact in fp16/bf16) to the tensor core and apply the fp32 scale
afterwards (within a group); a path that dequantizes first (``dequant_mm``) rounds each weight to
``x.dtype`` before the product. So per element ``|y - ref| <= eps * sum_k |x_k w_k| + eps * |ref|``
(weight rounding, then one ulp of the final rounding, ``eps = torch.finfo(dtype).eps``), plus fp32
summation-order noise (``1e-5 * sum``).
"""

from __future__ import annotations

import torch

from deltazip.formats.packing import pack_delta


def make_delta(out_f, in_f, bits, group, sparse, asym, gen):
    g = in_f if group == -1 else group
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=gen)
    scales = (torch.rand(out_f, in_f // g, generator=gen) * 0.02 + 0.002).half()
    zeros = torch.randint(0, 2**bits, (out_f, in_f // g), generator=gen) if asym else None
    mask = None
    if sparse:
        keep = torch.rand(out_f, in_f // 4, 4, generator=gen).argsort(-1)[..., :2]
        mask = torch.zeros(out_f, in_f // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(out_f, in_f)
    return pack_delta(codes, scales, zeros, mask, bits, group)


def magnitude(x, index, weights) -> torch.Tensor:
    """fp32 ``[N, out]``: ``sum_k |x[r, k] * W[index[r]][:, k]|`` (zeros for index -1)."""
    mag = torch.zeros(x.shape[0], weights[0].shape[0])
    for r, i in enumerate(index.tolist()):
        if i >= 0:
            mag[r] = x[r].float().abs() @ weights[i].float().abs().T
    return mag


def assert_matches(y, ref, mag):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    eps = torch.finfo(y.dtype).eps
    diff = (y.float() - ref.float()).abs().cpu()
    bound = eps * mag + eps * ref.float().abs().cpu() + 1e-5 * mag + 1e-6
    worst = (diff - bound).max().item()
    assert worst <= 0, f"max |y - ref| exceeds the bound by {worst:.3g} (max diff {diff.max().item():.3g})"


def lora_magnitude(x, index, a, b, scale) -> torch.Tensor:
    """fp32 ``[N, out]``: ``scale * (|h| @ |B|^T)`` with ``h = x @ A^T`` in fp32. The kernel keeps ``h``
    in fp32 between its two launches and rounds it to ``x.dtype`` for the expand dot, so this is the
    scale of that rounding error."""
    mag = torch.zeros(x.shape[0], b.shape[1])
    for r, i in enumerate(index.tolist()):
        if i >= 0:
            h = x[r].float() @ a[i].float().T
            mag[r] = (h.abs() @ b[i].float().abs().T) * scale[i]
    return mag


def random_index(n, num_slots, gen, unused=(), minus_one=0.2):
    """``[n]`` slot indices, never using the slots in ``unused``, about ``minus_one`` of them -1."""
    pool = torch.tensor([s for s in range(num_slots) if s not in unused])
    index = pool[torch.randint(0, len(pool), (n,), generator=gen)]
    index[torch.rand(n, generator=gen) < minus_one] = -1
    return index


def nvrtc_or_skip():
    """``deltazip.kernels.cuda_rtc`` for a test that compiles kernel builds without a GPU; skips it where
    NVRTC is not installed."""
    import pytest

    from deltazip.kernels import cuda_rtc

    try:
        cuda_rtc.nvrtc()
    except cuda_rtc.CudaCompileError as e:
        pytest.skip(str(e))
    return cuda_rtc


def offline_tools():
    """``(cuda_rtc, cuda_sass)`` for a test that compiles and disassembles kernel builds without a GPU;
    skips it where NVRTC or the SASS tools are not installed."""
    import _sass as cuda_sass
    import pytest

    cuda_rtc = nvrtc_or_skip()
    if cuda_sass.tools_available():
        pytest.skip(cuda_sass.tools_available())
    return cuda_rtc, cuda_sass


def graph_case():
    """A small split-K case for graph-replay tests on a GPU: ``(deltas, stack, x, plan, ref)``: 3 deltas of
    256 x 1024, six rows over them (one of no slot), fp16."""
    from deltazip.kernels import reference
    from deltazip.kernels.row_plan import plan_rows
    from deltazip.kernels.stacked import repack

    gen = torch.Generator().manual_seed(3)
    deltas = [make_delta(256, 1024, 4, 128, True, False, gen) for _ in range(3)]
    stack = repack(deltas, device="cuda", layout="mma")
    rows = [0, 1, 2, 2, 1, -1]
    x = torch.randn(len(rows), 1024, generator=gen).half().cuda()
    return deltas, stack, x, plan_rows(rows, 3, "cuda"), reference.sbmm(x, torch.tensor(rows).cuda(), deltas)


def mma_stack(**kw):
    """An all-zero 8-slot ``mma`` stack for planning and table tests: 4-bit 2:4 groups of 128, 1024 -> 256
    (``kw`` overrides any of ``StackedDeltas.allocate``'s fields)."""
    from deltazip.kernels.stacked import StackedDeltas

    args = dict(bits=4, group_size=128, in_features=1024, out_features=256, sparse=True, asymmetric=False,
                layout="mma")
    args.update(kw)
    return StackedDeltas.allocate(8, **args)
