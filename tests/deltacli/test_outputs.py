"""Issue 25: no command writes over or into one of its own inputs (same path, a parent of an input, a path
inside one, a symlink to one), even with --overwrite; nothing existing is replaced without --overwrite.

The test enumerates every command's options from the Typer app: each path-typed option must be listed
below as an output or an input, so a new output option cannot skip these checks unnoticed."""

from __future__ import annotations

import hashlib
import os
import typing
from pathlib import Path

import pytest
from _cli import run_cli, without_progress
from _factories import calib_file, make_pair

from deltazip.deltacli.app import app

# command -> output option -> "file" or "dir"
OUTPUTS = {
    "compress": {"--out": "dir"},
    "merge": {"--out": "dir"},
    "dedup-scan": {"--manifest": "file"},
    "eval": {"--output": "file"},
    "inspect": {"--plot": "file"},
    "pack": {"--out": "dir"},
    "unpack": {"--out": "dir"},
    "demo": {"--workdir": "dir"},
}
# Path-typed parameters that are read, never written.
INPUTS = {
    "compress": {"calib_images"},  # --base/--finetuned/--calib are strings (hub ids allowed)
    "merge": {"artifact"},
    "dedup-scan": {"checkpoints"},
    "eval": {"include_path", "perplexity"},
    "inspect": {"artifact"},
    "pack": {"artifact"},
    "unpack": {"artifact"},
    "verify": {"artifact"},
    "serve": {"artifacts", "chat_template"},
    "tune": {"artifacts"},
    "demo": set(),
}


def _commands() -> dict[str, dict[str, object]]:
    """command name -> parameter name -> annotation, from the functions registered on the Typer app."""
    out = {}
    for info in app.registered_commands:
        name = info.name or info.callback.__name__.replace("_", "-")
        out[name] = typing.get_type_hints(info.callback, include_extras=True)
        out[name].pop("return", None)
    return out


def _is_path(annotation) -> bool:
    return "Path" in repr(typing.get_args(annotation)[0] if typing.get_origin(annotation) else annotation)


def test_every_path_option_is_classified_and_outputs_take_overwrite():
    commands = _commands()
    assert set(OUTPUTS) < set(commands) and set(INPUTS) == set(commands)
    for name, params in commands.items():
        outs = {o.lstrip("-").replace("-", "_") for o in OUTPUTS.get(name, {})}
        paths = {p for p, ann in params.items() if _is_path(ann)}
        assert paths == outs | INPUTS[name], (name, paths)
        if outs:
            assert "overwrite" in params, f"{name} writes but has no --overwrite"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Inputs of every command: a model pair, calibration and perplexity text, an artifact (its lineage
    base is the pair's base), a task directory."""
    from deltazip.compress.config import CompressConfig
    from deltazip.compress.pipeline import compress_delta
    from deltazip.kernels.scheme import DeltaScheme

    tmp = tmp_path_factory.mktemp("outputs")
    base, ft = make_pair(tmp)
    calib = calib_file(tmp / "data")
    art = tmp / "art"
    compress_delta(base, ft, None, art, CompressConfig(scheme=DeltaScheme(group_size=32), method="rtn"), lossless="none")
    text = tmp / "data" / "ppl.txt"
    text.write_text("alpha beta gamma " * 50)
    tasks = tmp / "tasks"
    tasks.mkdir()
    (tasks / "t.yaml").write_text("task: t\n")
    return {"tmp": tmp, "base": base, "ft": ft, "calib": calib, "art": art, "ppl": text, "tasks": tasks}


def _argv(cmd: str, w: dict, out) -> tuple[list, dict]:
    """argv of ``cmd`` writing ``out``, and its inputs (label -> path)."""
    b, f, a = w["base"], w["ft"], w["art"]
    table = {
        "compress": (["compress", "--base", b, "--finetuned", f, "--calib", w["calib"], "--out", out],
                     {"base": b, "ft": f, "calib": w["calib"]}),
        "merge": (["merge", a, "--out", out], {"art": a, "base": b}),
        "dedup-scan": (["dedup-scan", b, f, "--manifest", out],
                       {"base": b, "ft": f, "weights": b / "model.safetensors"}),
        "eval": (["eval", a, "base", "--tasks", "t", "--include-path", w["tasks"], "--perplexity", w["ppl"],
                  "--output", out], {"art": a, "base": b, "ppl": w["ppl"], "tasks": w["tasks"]}),
        "inspect": (["inspect", a, "--plot", out], {"art": a, "base": b}),
        "pack": (["pack", a, "--out", out], {"art": a}),
        "unpack": (["unpack", a, "--out", out], {"art": a}),
        "demo": (["demo", "--workdir", out], {}),
    }
    return table[cmd]


def _snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root`` with its content hash (files) or kind: what must not change."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith("link-")]  # the test's own symlinks
        filenames = [f for f in filenames if not f.startswith("link-")]
        for d in dirnames:
            snap[os.path.join(dirpath, d)] = "dir"
        for fn in filenames:
            p = os.path.join(dirpath, fn)
            snap[p] = "link" if os.path.islink(p) else hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return snap


def _refused(capsys, monkeypatch, argv, match) -> str:
    code, _, err = run_cli(capsys, monkeypatch, *argv)
    lines = without_progress(err).strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("deltazip: error:"), (argv, code, err)
    assert match in lines[0], lines[0]
    return lines[0]


def _targets(inp: Path, tmp: Path, tag: str) -> dict[str, Path]:
    """Output paths that touch ``inp``: the input itself, its directory, a path inside it, a symlink to it."""
    link = tmp / f"link-{tag}{inp.suffix}"
    if not link.is_symlink():
        link.symlink_to(inp)
    return {"same": inp, "parent": inp.parent, "inside": inp / "sub.png", "symlink": link}


@pytest.mark.parametrize("cmd", [c for c in OUTPUTS if c != "demo"])
def test_no_output_touches_an_input_even_with_overwrite(capsys, monkeypatch, world, cmd):
    tmp = world["tmp"]
    before = _snapshot(tmp)
    _, inputs = _argv(cmd, world, "x")
    assert inputs
    tried = 0
    for label, inp in inputs.items():
        for how, out in _targets(inp, tmp, label).items():
            if cmd in ("pack", "unpack") and how in ("same", "symlink"):
                continue  # in place is what pack/unpack do without --out (atomically; tested elsewhere)
            argv, _ = _argv(cmd, world, out)
            line = _refused(capsys, monkeypatch, [*argv, "--overwrite"], "the input")
            assert "--overwrite" in line and str(out) in line, line
            tried += 1
    assert tried >= 2 * len(inputs)
    assert _snapshot(tmp) == before  # nothing changed, nothing left behind


@pytest.mark.parametrize("cmd", list(OUTPUTS))
def test_an_existing_output_is_kept_without_overwrite(capsys, monkeypatch, world, tmp_path, cmd):
    out = tmp_path / ("taken.png" if OUTPUTS[cmd][next(iter(OUTPUTS[cmd]))] == "file" else "taken")
    if out.suffix:
        out.write_text("precious\n")
    else:
        out.mkdir()
        (out / "keep.txt").write_text("precious\n")
    before = _snapshot(tmp_path)
    argv, _ = _argv(cmd, world, out)
    _refused(capsys, monkeypatch, argv, "already exists; pass --overwrite")
    assert _snapshot(tmp_path) == before


def test_dedup_manifest_never_replaces_a_checkpoints_weights(capsys, monkeypatch, world):
    """The issue's case: --manifest pointed at a checkpoint's model.safetensors (1.38 MB of weights became
    a 19 KB JSON file)."""
    w = world["base"] / "model.safetensors"
    digest = hashlib.sha256(w.read_bytes()).hexdigest()
    for extra in ([], ["--overwrite"]):
        _refused(capsys, monkeypatch, ["dedup-scan", world["base"], world["ft"], "--manifest", w, *extra],
                 "input")
    assert hashlib.sha256(w.read_bytes()).hexdigest() == digest


def test_outputs_are_written_atomically_with_the_umask(capsys, monkeypatch, world, tmp_path):
    """--manifest and --plot: written through a temporary sibling (none left), replacing with --overwrite,
    mode 0666 & ~umask."""
    old = os.umask(0o022)
    try:
        man, plot = tmp_path / "dedup.json", tmp_path / "delta.png"
        for extra in ([], ["--overwrite"]):
            code, _, err = run_cli(capsys, monkeypatch, "dedup-scan", world["base"], world["ft"], "--manifest", man,
                                   *extra)
            assert code == 0, err
            code, _, err = run_cli(capsys, monkeypatch, "inspect", world["art"], "--plot", plot, *extra)
            assert code == 0, err
    finally:
        os.umask(old)
    assert man.read_text().startswith("{") and plot.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dedup.json", "delta.png"]
    assert (man.stat().st_mode & 0o777, plot.stat().st_mode & 0o777) == (0o644, 0o644)
