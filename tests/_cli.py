"""Run the ``deltazip`` entry point in-process for CLI tests."""

from __future__ import annotations

import sys

from deltazip.deltacli.app import main


def run_cli(capsys, monkeypatch, *args):
    """Run ``deltazip ARGS`` through main() in-process; returns (exit code, stdout, stderr)."""
    capsys.readouterr()  # drop what the test's own setup printed
    monkeypatch.setattr(sys, "argv", ["deltazip", *map(str, args)])
    monkeypatch.delenv("DELTAZIP_DEBUG", raising=False)
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def run_cli_ok(*args) -> None:
    """Run ``deltazip ARGS`` through main() outside a test (module fixtures); fails on a non-zero exit."""
    import pytest

    mp = pytest.MonkeyPatch()
    mp.setattr(sys, "argv", ["deltazip", *map(str, args)])
    try:
        main()
    except SystemExit as e:
        assert not e.code, f"deltazip {' '.join(map(str, args))} exited {e.code}"
    finally:
        mp.undo()


def cli_command(*args, unprivileged: bool = False) -> list[str]:
    """argv of a real ``deltazip ARGS`` process (``python -m deltazip.deltacli.app``).

    ``unprivileged``: without the capabilities that let root ignore file permissions (so a 0555
    directory is read-only for the process even when the tests run as root; needs ``setpriv``).
    """
    import os
    import shutil

    cmd = [sys.executable, "-m", "deltazip.deltacli.app", *map(str, args)]
    if unprivileged and os.geteuid() == 0:
        import pytest

        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot make a directory read-only for the CLI")
        cmd = [setpriv, "--bounding-set=-dac_override,-dac_read_search", *cmd]
    return cmd


def run_cli_process(*args, unprivileged: bool = False, timeout: float = 300, **kwargs):
    """Run ``deltazip ARGS`` as a real process; returns (exit code, stdout, stderr)."""
    import subprocess

    r = subprocess.run(cli_command(*args, unprivileged=unprivileged), capture_output=True, text=True,
                       timeout=timeout, **kwargs)
    return r.returncode, r.stdout, r.stderr


_PROGRESS = None


def without_progress(err: str) -> str:
    """``err`` without the plain progress lines commands print when stderr is not a terminal
    (``deltazip.deltacli.common.PlainProgress``): what is left must be the one-line error."""
    import re

    global _PROGRESS
    if _PROGRESS is None:
        _PROGRESS = re.compile(r"^(?!deltazip: ).+: (\d+/\d+( \(\d+ s\))?|done \(\d+/\d+\) in \d+\.\d s)$")
    return "".join(ln for ln in err.splitlines(keepends=True) if not _PROGRESS.match(ln.rstrip("\n")))


def read_json_document(proc) -> dict:
    """The one JSON document a ``--json`` command prints on stdout (read line by line up to its closing
    brace, so a server started with ``subprocess.Popen`` can keep running); stderr on early exit."""
    import json

    lines: list[str] = []
    while not lines or lines[-1] != "}\n":
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        lines.append(line)
    return json.loads("".join(lines))
