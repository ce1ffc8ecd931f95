"""The import direction of DESIGN.md "Layout": a package never imports one to its left
(deltacli -> demo -> runtime -> compress -> formats -> kernels), and runtime/ never imports demo/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["deltacli", "demo", "runtime", "compress", "formats", "kernels"]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_no_package_imports_one_to_its_left():
    bad = []
    for rank, pkg in enumerate(ORDER):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for mod in _imports(f):
                parts = mod.split(".")
                if parts[0] != "deltazip" or len(parts) < 2 or parts[1] not in ORDER:
                    continue
                if ORDER.index(parts[1]) < rank:
                    bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_runtime_is_split_into_its_concerns():
    """Issue 15 #7: runtime/ holds subpackages, not a flat list of modules."""
    flat = [f.name for f in (ROOT / "runtime").glob("*.py") if f.name != "__init__.py"]
    assert flat == []
    assert {"serve", "share", "eval"} <= {d.name for d in (ROOT / "runtime").iterdir() if d.is_dir()}
