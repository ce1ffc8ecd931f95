"""What a new user hits in the first hour (issue 17): start-up cost of the CLI, OS errors as one line,
interrupts that clean up, calibration path typos, a busy port, an identical pair."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "datasets", "lm_eval")


def _modules_after(*argv: str) -> set[str]:
    """Heavy modules imported by a real ``deltazip ARGV`` process (reported at exit)."""
    code = ("import atexit, sys\n"
            f"atexit.register(lambda: print('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules)))\n"
            f"sys.argv = ['deltazip', *{list(argv)!r}]\n"
            "from deltazip.deltacli.app import main\n"
            "main()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("HEAVY="))
    return {m for m in line.removeprefix("HEAVY=").split(",") if m}


def test_version_and_help_import_no_heavy_module():
    """``--version`` and ``--help`` must not import torch or transformers (seconds each, issue 17 #11)."""
    assert _modules_after("--version") == set()
    assert _modules_after("--help") == set()
    assert _modules_after("compress", "--help") == set()
