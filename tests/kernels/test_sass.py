"""Offline SASS of the Triton SBMM kernels, compiled for sm_80/sm_90 without a GPU, under every Triton
this machine has: the installed one and each extra one ``make install`` puts under
``.venv/triton-<version>`` (3.6.0: what torch 2.11 pins, and what the H200 run used).

Version-independent screens (``deltazip.kernels.sass.screens``): 16-byte global->shared copies, no
shared-memory store in the main loop, at most one barrier per K step. What the first GPU run taught
(docs/kernels.md): instruction counts did not tell a fast build from a slow one, so none is asserted.
A version known to fail a screen is an expected failure (strict: a Triton that fixes it is noticed),
and the runtime never picks the fast Triton kernel on a version that fails them.

Runs ``python -m deltazip.kernels.sass`` in a process of its own (this test session may run Triton in
its interpreter, which replaces ``@triton.jit`` functions). Skipped only where Triton's bundled compiler
or cuobjdump is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltazip.kernels import sass
from deltazip.kernels.availability import KNOWN_BAD_TRITON, VALIDATED_TRITON

pytestmark = pytest.mark.skipif(sass.tools_available() is not None,
                                reason=f"offline SASS needs Triton's compiler and cuobjdump: {sass.tools_available()}")

ROOT = Path(__file__).resolve().parents[2]
EXTRA = sorted(str(p) for p in (ROOT / ".venv").glob("triton-*") if (p / "triton").is_dir())
INSTALLS = [None, *EXTRA]  # None: the installed Triton
VARIANTS = ["fast:4:24:sym:fp16", "fast:4:24:sym:bf16", "fast:4:24:asym:fp16", "fast:2:24:sym:bf16",
            "fast:8:dense:sym:fp16", "transposed:4:24:sym:fp16", "transposed:3:24:sym:fp16"]


def _compile(extra: str | None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if extra:
        env["PYTHONPATH"] = os.pathsep.join([extra, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["TRITON_CACHE_DIR"] = str(Path(extra) / ".cache")  # one cache per version
    cmd = [sys.executable, "-m", "deltazip.kernels.sass", "--arch", "80,90"]
    for v in VARIANTS:
        cmd += ["--variant", v]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module", params=INSTALLS, ids=[Path(p).name if p else "installed" for p in INSTALLS])
def rows(request) -> list[dict]:
    return _compile(request.param)


def test_ci_screens_the_triton_torch_2_11_pins():
    """At least two Triton versions are screened, 3.6.0 among them (``make install`` adds it)."""
    names = [Path(p).name for p in EXTRA]
    assert "triton-3.6.0" in names, f"make install puts Triton 3.6.0 under .venv/triton-3.6.0; found {names}"


def test_fast_kernel_passes_the_screens(rows, request):
    version = rows[0]["triton"]
    if version in KNOWN_BAD_TRITON:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"Triton {version}: {KNOWN_BAD_TRITON[version]}"))
    failed = {(r["bits"], r["dtype"], r["asym"], r["arch"]): [k for k, ok in r["screens"].items() if not ok]
              for r in rows if r["kernel"] == "fast"}
    assert not any(failed.values()), f"Triton {version}: {failed}"


def test_the_alignment_hint_gives_16_byte_copies_on_every_triton(rows):
    """The fast kernel's word loads at ``BLOCK_K`` 128 use an offset Triton 3.6 can prove 16-byte
    aligned: every version screened copies the words 16 bytes at a time (3.6 copied 4 before the hint)."""
    fast = [r for r in rows if r["kernel"] == "fast"]
    assert fast and all(r["screens"]["wide_copies"] for r in fast), [
        (r["triton"], r["bits"], r["dtype"], r["arch"]) for r in fast if not r["screens"]["wide_copies"]]


def test_runtime_never_picks_a_triton_that_fails_the_screens(rows):
    version = rows[0]["triton"]
    passes = all(all(r["screens"].values()) for r in rows if r["kernel"] == "fast")
    assert version not in VALIDATED_TRITON or passes, f"Triton {version} is validated but fails the screens"
    assert not (set(VALIDATED_TRITON) & set(KNOWN_BAD_TRITON))


def test_transposed_kernel_stages_its_dequantized_tile_through_shared_memory(rows):
    """What the transposed layout's kernel is on every version: it stores the dequantized tile."""
    for r in rows:
        if r["kernel"] == "transposed" and r["arch"] == "sm_90":
            assert r["loop_smem_stores"] > 0, r["triton"]


def test_transposed_3_bit_24_fits_in_shared_memory(rows):
    """3-bit 2:4 (no fast kernel) used to need 280 KiB of shared memory at its default tile: more than
    an A100 (164 KiB) or H100 (228 KiB) has, so it could not launch. Under every Triton screened."""
    for r in rows:
        if r["kernel"] == "transposed" and r["bits"] == 3:
            assert r["shared_bytes"] <= 160 * 1024, (r["triton"], r["arch"], r["shared_bytes"])
