"""One --device/--dtype accepted set and one resolver for compress, serve and eval; one dtype table."""

import subprocess
import sys

import pytest
import torch

from deltazip.compress.config import CompressConfig
from deltazip.formats.errors import InputError
from deltazip.models.devices import resolve_device, resolve_dtype
from deltazip.runtime.serve.assembly import ServeConfig


@pytest.mark.parametrize("make", [lambda **kw: CompressConfig(**kw), lambda **kw: ServeConfig(**kw)],
                         ids=["compress", "serve"])
def test_compress_and_serve_accept_and_refuse_the_same_values(make):
    for bad, why in (("gpu", "unknown; use auto, cpu, cuda or cuda:N"), ("cuda:x", "unknown")):
        with pytest.raises(InputError, match=why):
            make(device=bad)
    with pytest.raises(InputError, match="--dtype 'fp8' is unknown; use auto, float32, float16 or bfloat16"):
        make(dtype="fp8")
    if not torch.cuda.is_available():
        for cuda in ("cuda", "cuda:1"):  # accepted names, refused for want of a device
            with pytest.raises(InputError, match=f"--device {cuda} was asked for but no CUDA device is available"):
                make(device=cuda)
    make(device="cpu", dtype="bfloat16")


def test_auto_keeps_half_checkpoints_and_differs_only_for_fp32_on_cuda():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_device("cpu") == cpu
    for serving in (False, True):
        assert resolve_dtype("auto", cpu, torch.bfloat16, serving) == torch.float32
        assert resolve_dtype("auto", cuda, torch.bfloat16, serving) == torch.bfloat16
        assert resolve_dtype("float16", cpu, torch.float32, serving) == torch.float16
    assert resolve_dtype("auto", cuda, torch.float32, serving=False) == torch.float32  # the solver's accuracy
    assert resolve_dtype("auto", cuda, torch.float32, serving=True) == torch.float16  # many slots' memory


def test_the_dtype_table_imports_no_torch():
    """The CPU weight owner of --workers reads it and must not pay for a torch import."""
    code = ("import sys; from deltazip.formats import dtypes; from deltazip.runtime.share import weight_share; "
            "assert dtypes.ST_SIZES['BF16'] == 2 and weight_share.st_dtype('bfloat16') == 'BF16'; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    from deltazip.formats.dtypes import ST_TO_TORCH, TORCH_TO_ST

    assert ST_TO_TORCH["BF16"] is torch.bfloat16 and TORCH_TO_ST[torch.float16] == "F16"
