"""DESIGN.md "Tests and benchmarks": every ``bench/NAME.py`` takes ``--quick`` and ``--out DIR`` and
prints one JSON document whose ``"bench"`` is its name (checked on the source: running them all
would take minutes)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def _options(tree: ast.AST) -> set[str]:
    return {a.value for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument"
            for a in n.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}


def _bench_names(tree: ast.AST) -> set[str]:
    return {v.value for n in ast.walk(tree) if isinstance(n, ast.Dict)
            for k, v in zip(n.keys, n.values)
            if isinstance(k, ast.Constant) and k.value == "bench" and isinstance(v, ast.Constant)}


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_bench_script_follows_the_convention(script: Path):
    tree = ast.parse(script.read_text(), str(script))
    assert {"--quick", "--out"} <= _options(tree), f"{script.name} must take --quick and --out DIR"
    assert _bench_names(tree) == {script.stem}, f'{script.name} must print {{"bench": "{script.stem}", ...}}'
