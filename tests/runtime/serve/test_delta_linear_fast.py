"""DeltaLinear on the ``mma`` layout (the default on CUDA): the runtime's one SBMM call site reaches
the fast kernel through ``dispatch.sbmm`` and matches the reference path, slot loads, the
symmetric-to-asymmetric stack rebuild (``unstack`` from the mma layout) and the shared row plan
included. On a CPU the layout is forced with ``DELTAZIP_SBMM_LAYOUT=mma`` and the kernel runs in the
Triton interpreter."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import
from torch import nn

from deltazip.formats.packing import pack_delta
from deltazip.kernels.reference import delta_weight
from deltazip.runtime.serve.delta_linear import DeltaContext, DeltaLinear


def _packed(out_f, in_f, bits, sparse, asym, seed, group=128):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=g)
    scales = (torch.rand(out_f, in_f // group, generator=g) * 0.02 + 0.002).half()
    zeros = torch.randint(0, 2**bits, (out_f, in_f // group), generator=g) if asym else None
    mask = None
    if sparse:
        keep = torch.rand(out_f, in_f // 4, 4, generator=g).argsort(-1)[..., :2]
        mask = torch.zeros(out_f, in_f // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(out_f, in_f)
    return pack_delta(codes, scales, zeros, mask, bits, group)


def test_delta_linear_on_the_mma_layout_matches_the_reference(monkeypatch):
    from deltazip.kernels.triton_sbmm import interpreter_ready, triton_importable

    if not triton_importable() or not (torch.cuda.is_available() or interpreter_ready()):
        pytest.skip("needs triton on CUDA, or TRITON_INTERPRET=1 set before triton was first imported")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setenv("DELTAZIP_SBMM_LAYOUT", "mma")
    torch.manual_seed(0)
    base = nn.Linear(256, 96, bias=False).half().to(dev)
    ctx = DeltaContext(num_slots=3)
    lin = DeltaLinear(base, ctx)
    d = [_packed(96, 256, 4, True, False, 1), _packed(96, 256, 4, True, False, 2),
         _packed(96, 256, 4, True, True, 3)]  # the asymmetric one makes the stack rebuild itself
    for i in range(3):
        lin.load_slot(i, packed=d[i])
    (group,) = lin.groups.values()
    assert group.stack.layout == "mma" and group.stack.asymmetric
    x = torch.randn(5, 4, 256, device=dev).half()
    slots = [0, 2, -1, 1, 0]
    with torch.no_grad():
        monkeypatch.setenv("DELTAZIP_FORCE_TRITON", "0")
        ctx.bind(slots, dev)
        ref = lin(x)  # reference SBMM over the mma stack (through unstack)
        monkeypatch.setenv("DELTAZIP_FORCE_TRITON", "1")
        ctx.bind(slots, dev)
        got = lin(x)
        assert len(ctx._plans) == 1  # the fast kernel used the step's shared row plan
        ctx.unbind()
    # By hand, in fp32: base term plus each row's own delta.
    w = base.weight.float()
    expect = x.float() @ w.T
    for r, s in enumerate(slots):
        if s >= 0:
            expect[r] += x[r].float() @ delta_weight(d[s]).to(dev).T
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got.float(), expect, rtol=2e-2, atol=2e-2)
