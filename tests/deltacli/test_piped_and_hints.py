"""Issue 25, first hour: hints runnable as printed, piped output never wrapped or cut, the same thread
settings for every command, and calibration windows capped at the model's context and the data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _cli import run_cli, run_cli_process
from _factories import calib_file, make_pair

from deltazip.deltacli import common
from deltazip.deltacli.demo_cmd import closing_hint

ROOT = Path(__file__).resolve().parents[2]


def _result(tmp_path) -> dict:
    art = tmp_path / "artifacts" / "deltazip-4-bit-24"
    return {"workdir": str(tmp_path), "seconds": 30, "rows": [{}, {}, {"artifact": str(art)}]}


def test_demo_hint_names_a_command_that_runs_as_printed(tmp_path, monkeypatch):
    script = Path(sys.prefix) / "bin" / "deltazip"  # what `make demo` runs: .venv/bin/deltazip
    if not script.exists():
        pytest.skip("deltazip is not installed as a script in this environment")
    monkeypatch.setattr(sys, "argv", [str(script), "demo"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # as after `make demo`: the venv is not on PATH
    hint = closing_hint(_result(tmp_path))
    cmd = hint.split("`")[1]
    assert cmd == f"{script.resolve()} inspect {tmp_path}/artifacts/deltazip-4-bit-24"
    assert f"`source {Path(sys.prefix) / 'bin' / 'activate'}`" in hint
    r = subprocess.run(cmd.split()[:1] + ["--version"], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.startswith("deltazip "), r.stderr  # it runs, from anywhere
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")  # activated: plain `deltazip`
    assert closing_hint(_result(tmp_path)).split("`")[1].startswith("deltazip inspect ")
    monkeypatch.setattr(sys, "argv", ["deltazip", "demo"])  # found on PATH
    assert "source" not in closing_hint(_result(tmp_path))


def test_readme_says_how_to_run_deltazip_after_make_demo():
    readme = (ROOT / "README.md").read_text()
    assert ".venv/bin/deltazip" in readme and "source .venv/bin/activate" in readme


def test_piped_tables_keep_every_path_whole(tmp_path):
    """dedup-scan's table, piped: paths longer than 80 columns are printed whole, one row per line (they
    were cut until base and fine-tune looked identical)."""
    deep = tmp_path / ("a-rather-long-directory-name-for-checkpoints-" * 2) / "of-the-fine-tuned-variants"
    deep.mkdir(parents=True)
    base, ft = make_pair(deep)
    assert len(str(base)) > 120
    code, out, err = run_cli_process("dedup-scan", base, ft, env={**os.environ, "COLUMNS": ""})
    assert code == 0, err
    lines = out.splitlines()
    for p in (base, ft):
        assert sum(str(p) in ln for ln in lines) == 1, out
    assert max(len(ln) for ln in lines) > 160  # the table took the width it needed


def test_wide_console_only_when_piped():
    assert common.out_console.size.width == common.PIPE_WIDTH  # pytest captures stdout: not a terminal
    from rich.console import Console

    assert Console(force_terminal=True, width=100).size.width == 100
    assert common._Console(force_terminal=True, width=100).size.width == 100


@pytest.mark.parametrize("argv", [["--version"], ["dedup-scan", "--help"]])
def test_every_command_sets_passive_openmp_waiting(argv):
    code = ("import os, sys\n"
            f"sys.argv = ['deltazip', *{argv!r}]\n"
            "from deltazip.deltacli.app import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), file=sys.stderr)\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.stderr.strip().splitlines()[-1] == "PASSIVE", r.stderr


def test_calibration_windows_are_capped_at_the_context_and_the_data(capsys, monkeypatch, tmp_path):
    """README defaults (--nsamples 256 --seqlen 2048) on a 128-token model: 2048-token windows of a
    few thousand tokens were resampled hundreds of times (429 s on the demo pair)."""
    base, ft = make_pair(tmp_path)
    calib = calib_file(tmp_path, n=40)
    code, out, err = run_cli(capsys, monkeypatch, "compress", "--base", base, "--finetuned", ft, "--calib", calib,
                             "--out", tmp_path / "art", "--group-size", "32", "--json")
    assert code == 0, err
    cal = json.loads(out)["calibration"]
    stream = cal["stream_tokens"]
    assert cal["seqlen"] == 128 and cal["nsamples"] == stream // 128 < 256, cal
    warn = [ln for ln in err.splitlines() if ln.startswith("deltazip: warning:")]
    assert warn == [f"deltazip: warning: calibrating on {stream // 128} windows of 128 tokens instead of --nsamples "
                    f"256 x --seqlen 2048: the model's context is 128 tokens and the data holds {stream} tokens"]


def test_window_plan():
    from deltazip.compress.calibration import window_plan

    assert window_plan(8, 32, 128, 1000) == (8, 32, None)
    assert window_plan(256, 2048, 128, 2176)[:2] == (17, 128)
    assert window_plan(128, 64, 128, 2176)[:2] == (34, 64)
    assert window_plan(4, 64, None, 40)[:2] == (1, 40)


def _help_commands():
    import click
    import typer.main

    from deltazip.deltacli.app import app

    root = typer.main.get_command(app)
    return sorted((name, cmd) for name, cmd in root.commands.items() if not isinstance(cmd, click.Group))


@pytest.mark.parametrize("name", [name for name, _ in _help_commands()])
def test_every_option_help_is_printed_whole(capsys, monkeypatch, name):
    """Rich reads ``[...]`` in a help text as markup and drops it: ``compress --help`` printed "2, 3, 4 or
    8 ." where the source said "[default: 4]". Every option's and argument's help must print in full."""
    cmd = dict(_help_commands())[name]
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run_cli(capsys, monkeypatch, name, "--help")
    assert code == 0
    printed = " ".join(out.replace("│", " ").split())
    for p in cmd.params:
        text = getattr(p, "help", None)
        if text:
            want = " ".join(text.replace("\\[", "[").split())
            assert want in printed, f"deltazip {name} --help lost part of {p.name}'s help: {want!r}"


def test_paths_and_names_with_brackets_print_whole(capsys, monkeypatch, tmp_path):
    """Paths and names are text, not rich markup: ``art[v1]`` printed as ``art`` in inspect's title, and
    a dedup-scan table lost ``[...]`` from checkpoint paths."""
    base, ft = make_pair(tmp_path)
    art = tmp_path / "art[v1]"
    code, out, err = run_cli(capsys, monkeypatch, "compress", "--base", base, "--finetuned", ft, "--method", "rtn",
                             "--out", art, "--group-size", "32")
    assert code == 0, err
    assert f"-> {art}" in " ".join(out.split())
    code, out, err = run_cli(capsys, monkeypatch, "inspect", art)
    assert code == 0, err
    assert f"artifact {art}" in out
    odd = tmp_path / "ft[copy]"
    odd.symlink_to(ft, target_is_directory=True)
    code, out, err = run_cli(capsys, monkeypatch, "dedup-scan", base, odd)
    assert code == 0, err
    assert str(odd) in out


def test_eval_table_keeps_filter_names_and_labels():
    """lm-eval filters print in brackets (``gsm8k exact_match [strict-match]``); rich took them for markup."""
    from rich.console import Console

    from deltazip.deltacli.eval_cmd import render_table

    summary = {"targets": [{"label": "v[1]", "kind": "artifact"}],
               "metrics": [{"task": "gsm8k", "metric": "exact_match", "filter": "strict-match", "values": {"v[1]": 0.5},
                            "recovery_pct": {"v[1]": 99.0}}],
               "perplexity": {}}
    summary["targets"][0].update(bytes=None, seconds=1.0)
    con = Console(width=200, record=True)
    con.print(render_table(summary))
    text = con.export_text()
    assert "gsm8k exact_match [strict-match]" in text and "v[1]" in text
