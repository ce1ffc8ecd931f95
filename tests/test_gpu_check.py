"""``bash bench/gpu_check.sh --dry-run``: every step of the GPU window's one command, on CPU at toy size.

Marked slow: the two servers, a compression, the step bench and two pytest runs take about 45 s of CPU
(46 s on an idle 2-core machine, up to three minutes when the machine is shared); it is the only check
that the window's script runs end to end before the window.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deltazip.kernels import grouped_lora

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_keeps_at_most_8_files(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PY": sys.executable, "SCRATCH": str(tmp_path / "scratch"),
           "DELTAZIP_CUDA_CACHE": str(tmp_path / "cuda")}
    got = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    summary = (out / "summary.md").read_text()
    log = (out / "gpu_check.log").read_text()
    assert files == ["commands.sh", "compress_memory.json", "gdeflate_decode.json", "gpu_check.log", "serve.json",
                     "step.json", "summary.md"], (files, summary, log[:6000])  # sbmm_table.json needs a GPU
    steps = [ln for ln in summary.splitlines() if ln.startswith("- ") and " in " in ln]
    assert [ln.split(":")[0] for ln in steps] == [
        "- serving bench (zipf-1.5, delta vs swap)", "- compression", "- decode step", "- GDeflate decode, GPU vs CPU",
        "- gpu-marked tests and CUDA kernel parity", "- delta matmul table (--quick)"], summary
    assert all(": exit 0 " in ln for ln in steps[:5]), summary
    assert "needs a CUDA GPU" in steps[5]
    assert sum(ln.startswith("timeout ") for ln in (out / "commands.sh").read_text().splitlines()) == 6

    serve = json.loads((out / "serve.json").read_text())
    assert serve["complete"] and serve["config"]["layers"] == 2 and "pinned" in serve["config"]["swap_weights"]
    rows = {r["mode"]: r for r in serve["results"]}
    for mode in ("delta", "swap"):
        assert rows[mode]["requests"] > 0 and rows[mode]["completed"] == rows[mode]["requests"], rows[mode]
    assert rows["delta/swap"]["throughput_delta_over_swap"] > 0
    step = json.loads((out / "step.json").read_text())
    assert step["complete"] and [r["variants"] for r in step["results"]] == [1, 4]
    assert all(r["layers"] == 2 and r["base_floor_ms"] > 0 and r["generate_ms_per_token"] for r in step["results"])
    comp = json.loads((out / "compress_memory.json").read_text())
    assert comp["complete"] and comp["results"][0]["peak_rss_anon_mib"] > 0
    assert comp["results"][-1]["extrapolated"] and comp["results"][-1]["layers"] == 32
    gd = json.loads((out / "gdeflate_decode.json").read_text())
    assert gd["results"][0]["decode_GBps"] > 0 and gd["results"][1]["skipped"] == "no CUDA device"
    assert not (tmp_path / "scratch").exists()  # the scratch (synthetic models, server logs) is removed


def test_the_second_call_steps_run_the_preview_parity_the_compact_table_and_the_lora_bench(tmp_path):
    """``STEPS="preview compact lora options"``: the GPU parity of the kernel's preview paths and launch
    options, which the first call's parity run leaves out (on CPU every selected test skips, none is
    missing), the compact 2:4 table and the launch options' table (which need a GPU: on CPU they say so)
    and bench/lora.py's JSON."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PY": sys.executable, "SCRATCH": str(tmp_path / "scratch"),
           "STEPS": "preview compact lora options"}
    got = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    line = next(ln for ln in (out / "summary.md").read_text().splitlines() if ln.startswith("- CUDA kernel preview"))
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                             "-k", "preview", str(ROOT / "tests" / "kernels" / "test_cuda_sbmm.py"),
                             str(ROOT / "tests" / "kernels" / "test_launch_options.py")],
                            capture_output=True, text=True, timeout=300, cwd=ROOT).stdout
    selected = sum("::test_preview_paths_match" in ln or "::test_sparse_mma_preview_matches" in ln
                   or "::test_launch_option_preview" in ln for ln in listed.splitlines())
    assert selected >= 72 + 24 + 48 + 4 + 4 and ": exit 0 " in line and f"({selected} skipped" in line, line
    assert "passed" not in line, line
    summary = (out / "summary.md").read_text()
    compact = next(ln for ln in summary.splitlines() if ln.startswith("- compact 2:4 delta matmul table"))
    assert "needs a CUDA GPU" in compact, compact
    assert "sbmm_table.py --quick --bits 4 --compact" in (out / "commands.sh").read_text()
    options = next(ln for ln in summary.splitlines() if ln.startswith("- preview launch options table"))
    assert "needs a CUDA GPU" in options, options
    assert "sbmm_options.py --quick" in (out / "commands.sh").read_text()
    lora = json.loads((out / "lora.json").read_text())
    assert lora["bench"] == "lora" and [r["rows"] for r in lora["results"]] == [1, 32]
    assert all(r["chosen"] in grouped_lora.CANDIDATES for r in lora["results"])


@pytest.mark.slow
def test_the_smoke_call_runs_the_tests_beside_the_benches_and_reports_each(tmp_path):
    """``--smoke``: the GPU tests and every parity test (preview paths included) start at once in the
    background, each under its own limit; their summary lines and logs come back with the benches'.
    On CPU every gpu-marked test fails under ``--require-gpu`` (the smoke call is for a GPU), the kernel
    parity tests included: that failure shows in the summary, not hidden by the background."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PY": sys.executable, "SCRATCH": str(tmp_path / "scratch"),
           "STEPS": "tests preview", "TESTS_LIMIT": "120", "PREVIEW_LIMIT": "120"}
    got = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--smoke"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# GPU check (smoke: one layer, toy traffic): CPU only"), summary
    lines = {ln.split(":")[0]: ln for ln in summary.splitlines() if ln.startswith("- ") and " in " in ln}
    assert set(lines) == {"- gpu-marked tests and CUDA kernel parity", "- CUDA kernel preview-path parity"}, summary
    for line in lines.values():  # no GPU here: every selected test fails under --require-gpu, none skips
        assert ": exit 1 " in line and " errors in " in line and "skipped" not in line.split("(")[1], line
    log = (out / "gpu_check.log").read_text()
    stamps = re.findall(r"=== \[(\d+)s\] (gpu-marked tests|CUDA kernel preview-path parity)", log)
    assert len(stamps) == 2 and abs(int(stamps[0][0]) - int(stamps[1][0])) <= 5, stamps  # started together
    assert log.index("=== background: tests") < log.index("--- CUDA kernel parity") < log.index(
        "=== background: preview"), log[-3000:]
    cmds = (out / "commands.sh").read_text()
    assert cmds.count("timeout 120 ") == 2 and "pytest -q -x" not in cmds, cmds  # every parity failure, not the first
    assert not (tmp_path / "scratch").exists()


def _window(tmp_path, **env):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PY": sys.executable, "SCRATCH": str(tmp_path / "scratch"),
           "DELTAZIP_CUDA_CACHE": str(tmp_path / "cuda"), **env}
    got = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--window", "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=600)
    return got, out


@pytest.mark.slow
def test_a_window_measures_after_its_smoke_phase_in_the_same_command(tmp_path):
    """``--window`` with its default steps (about two minutes here): the smoke phase, then the measuring steps
    in the same command, the second from the caches the first filled (as on the GPU). Both phases write one
    log, summary and commands file (smoke first); every JSON under $OUT is the measuring phase's (the smoke's,
    of toy traffic, stay in the scratch, and so do its tables), and the second phase installs nothing again."""
    got, out = _window(tmp_path, KEEP_SCRATCH="1")
    assert got.returncode == 0, got.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["commands.sh", "compress_memory.json", "gdeflate_decode.json",
                                                     "gpu_check.log", "serve.json", "step.json", "summary.md"]
    summary = (out / "summary.md").read_text()
    heads = [ln for ln in summary.splitlines() if ln.startswith("# GPU check")]
    assert [h.rsplit(":", 1)[0] for h in heads] == ["# GPU check (dry run) (smoke: one layer, toy traffic)",
                                                    "# GPU check (dry run)"], summary
    smoke, measure = (
        [ln.split(":")[0] for ln in part.splitlines() if ln.startswith("- ") and " in " in ln]
        for part in summary.split(heads[1]))
    benches = ["- serving bench (zipf-1.5, delta vs swap)", "- compression", "- decode step",
               "- GDeflate decode, GPU vs CPU"]
    assert sorted(smoke) == sorted(["- gpu-marked tests and CUDA kernel parity", "- CUDA kernel preview-path parity",
                                    *benches]), summary
    assert measure == [*benches, "- delta matmul table (--quick)"], summary
    smoke_part, measure_part = summary.split(heads[1])
    assert smoke_part.count(": exit 0 ") == 6 and measure_part.count(": exit 0 ") == 4, summary
    assert "## " not in smoke_part, smoke_part  # the smoke phase's figures are not reported as figures
    assert "## Decode step" in measure_part and "## GDeflate decode" in measure_part
    cmds = (out / "commands.sh").read_text()
    first, second = cmds.split("# then the measuring phase")
    assert "smoke-json" in first and f"--out {out}" not in first
    assert f"--out {out}" in second and second.count("timeout ") == 5, cmds
    serve = json.loads((out / "serve.json").read_text())
    rows = {r["mode"]: r for r in serve["results"]}
    assert all(rows[m]["completed"] == rows[m]["requests"] > 0 for m in ("delta", "swap")), rows
    for name in ("serve.json", "step.json", "compress_memory.json", "gdeflate_decode.json"):
        kept = tmp_path / "scratch" / "smoke-json" / name
        # each phase wrote its own (the contents may match: toy timings round alike)
        assert kept.exists() and (out / name).stat().st_mtime_ns > kept.stat().st_mtime_ns, name
    log = (out / "gpu_check.log").read_text()
    assert "setup (dry run: nothing installed) (done by the smoke phase)" in log
    assert re.search(r"=== window: \d+s of WINDOW_LIMIT 570s left for the measuring steps", log)


def test_a_smoke_bench_that_errs_stops_the_window_before_it_measures(tmp_path):
    """A bench that errs in the smoke phase would err at full size too: the window stops with exit 1 and a
    summary line naming it, keeps no JSON and removes its scratch. (On CPU the kernel table's bench exits 1:
    it needs a GPU.)"""
    got, out = _window(tmp_path, SMOKE_STEPS="table")
    assert got.returncode == 1, got.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["commands.sh", "gpu_check.log", "summary.md"]
    last = (out / "summary.md").read_text().splitlines()[-1]
    assert last.startswith("- window: stopped before the measuring steps: delta matmul table (--quick) failed"), last
    assert "measuring phase" not in (out / "commands.sh").read_text()
    assert not (tmp_path / "scratch").exists()


def test_a_window_goes_on_past_a_bench_stopped_at_its_short_limit_with_what_is_left(tmp_path):
    """A smoke bench stopped at its limit (toy traffic on a cold machine) does not cost the window its
    figures, nor do failed tests (the summary reports them): the measuring steps run, each within what is
    left of ``WINDOW_LIMIT`` when that is less than its own limit."""
    got, out = _window(tmp_path, SMOKE_STEPS="tests gdeflate", MEASURE_STEPS="gdeflate step", GDEFLATE_LIMIT="1",
                       WINDOW_LIMIT="75", REQUIRE_GPU="1")
    summary = (out / "summary.md").read_text()
    assert got.returncode == 0 and "window: stopped" not in summary, summary
    assert "- gpu-marked tests and CUDA kernel parity: exit 1 " in summary, summary  # no GPU here
    assert summary.count("- GDeflate decode, GPU vs CPU: exit 124 ") == 2, summary  # the measuring one too
    assert "- decode step: exit 0 " in summary and (out / "step.json").exists()
    log = (out / "gpu_check.log").read_text()
    left = int(re.search(r"=== window: (\d+)s of WINDOW_LIMIT 75s left", log).group(1))
    at, limit = map(int, re.search(r"=== \[(\d+)s\] decode step \(limit (\d+)s\)", log).groups())
    assert 15 <= left < 75 and limit in (min(65, left - at), min(65, left - at + 1)), (left, at, limit)
