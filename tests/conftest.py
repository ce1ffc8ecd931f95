"""Shared pytest setup: the ``gpu`` marker skips without CUDA and fails under ``--require-gpu``; the
``nvcomp`` marker skips, naming the install command, where nvCOMP's GPU decoder for torch's CUDA major
is missing (even under ``--require-gpu``: that is a package to install, not a missing GPU)."""

from __future__ import annotations

import os

# On a loaded machine OpenMP's spin-waiting threads slow small torch ops by 10x or more; it must be
# set before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--require-gpu", action="store_true", help="fail (not skip) gpu tests without CUDA")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    if config.getoption("--require-gpu"):
        return  # pytest_runtest_setup fails them instead
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


def pytest_runtest_setup(item):
    if "gpu" in item.keywords and not torch.cuda.is_available() and item.config.getoption("--require-gpu"):
        pytest.fail("gpu test run with --require-gpu but no CUDA device is available", pytrace=False)
    if "nvcomp" in item.keywords and torch.cuda.is_available():
        from deltazip.formats.gdeflate import gpu_problem

        problem = gpu_problem()
        if problem:
            pytest.skip(f"nvCOMP's GPU decoder cannot run here: {problem}")


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    """A fresh, empty dispatch table directory (``DELTAZIP_AUTOTUNE_DIR``), no table loaded before or after."""
    from deltazip.kernels import dispatch_table

    monkeypatch.setenv("DELTAZIP_AUTOTUNE_DIR", str(tmp_path))
    dispatch_table.forget_loaded()
    yield tmp_path
    dispatch_table.forget_loaded()
