"""DeltaLinear on the ``mma`` layout (the default on CUDA): the runtime's one SBMM call site reaches
the CUDA kernel on a GPU and matches the merged weights by hand, slot loads, the symmetric-to-asymmetric
stack rebuild (``unstack`` from the mma layout) and the shared row plan included. On a CPU the layout
is forced with ``DELTAZIP_SBMM_LAYOUT=mma`` and the reference reads it."""

from __future__ import annotations

import torch
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
        ctx.bind(slots, dev)
        got = lin(x)
        assert len(ctx._plans) == (1 if dev == "cuda" else 0)  # the CUDA kernel used the step's shared plan
        ctx.unbind()
    # By hand, in fp32: base term plus each row's own delta.
    w = base.weight.float()
    expect = x.float() @ w.T
    for r, s in enumerate(slots):
        if s >= 0:
            expect[r] += x[r].float() @ delta_weight(d[s]).to(dev).T
    torch.testing.assert_close(got.float(), expect, rtol=2e-2, atol=2e-2)
