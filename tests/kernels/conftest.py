"""Fixtures of the kernel tests: where the Triton parity tests run."""

from __future__ import annotations

import pytest
import torch

from deltazip.kernels.triton_sbmm import interpreter_ready, triton_importable


@pytest.fixture
def backend(monkeypatch) -> str:
    """Device for the parity tests: compiled kernels on CUDA, else the CPU interpreter; dispatch is
    forced onto the Triton path either way."""
    if not triton_importable():
        pytest.skip("triton is not installed (the 'kernels' extra)")
    monkeypatch.setenv("DELTAZIP_FORCE_TRITON", "1")
    if torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        return "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not interpreter_ready():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run tests/kernels/test_sbmm.py "
                    "in its own process or export TRITON_INTERPRET=1")
    return "cpu"


@pytest.fixture
def native(monkeypatch):
    """Compiled kernels on the GPU (the interpreter explicitly off)."""
    if not triton_importable():
        pytest.skip("triton is not installed (the 'kernels' extra)")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("DELTAZIP_FORCE_TRITON", raising=False)
