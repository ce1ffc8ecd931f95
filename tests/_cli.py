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
