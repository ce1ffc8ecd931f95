"""The import direction of DESIGN.md "Layout": a package never imports one to its left
(deltacli -> demo -> runtime -> compress -> models -> formats -> kernels), runtime/ never imports
demo/, runtime's subpackages import one way too (share < serve < {eval, cluster}), and no two
modules import each other (directly or around a circle).

Imports inside functions count: a lazy import that dodges an import-time cycle is still a cycle of
meaning (the review of 2026-11, §1.3 and §7)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["deltacli", "demo", "runtime", "compress", "models", "formats", "kernels"]
# runtime/ subpackages by floor: a module may import its own subpackage or a lower floor only.
RUNTIME_FLOORS = {"share": 0, "serve": 1, "eval": 2, "cluster": 2}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _module(root: Path, f: Path) -> str:
    parts = list(f.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages=ORDER) -> dict[str, set[str]]:
    """Module -> the project modules it imports (``compress.pipeline`` -> ``{"formats.artifact", ...}``),
    lazy imports included; ``deltazip.`` left off."""
    files = {_module(root, f): f for p in packages if (root / p).is_dir() for f in (root / p).rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, f in files.items():
        for name in _imports(f):
            name = name.removeprefix("deltazip.")
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != mod:
                graph[mod].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(group)

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def runtime_back_arrows(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every runtime module importing a runtime subpackage on its own floor or above."""
    def sub(m: str) -> str | None:
        p = m.split(".")
        return p[1] if len(p) > 2 and p[0] == "runtime" else None

    bad = []
    for a, targets in graph.items():
        for b in targets:
            sa, sb = sub(a), sub(b)
            if sa and sb and sa != sb and RUNTIME_FLOORS[sb] >= RUNTIME_FLOORS[sa]:
                bad.append(f"{a} -> {b}")
    return sorted(bad)


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
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(set(bad)))


def test_runtime_subpackages_import_one_way():
    assert set(RUNTIME_FLOORS) == {d.name for d in (ROOT / "runtime").iterdir() if (d / "__init__.py").is_file()}
    bad = runtime_back_arrows(import_graph(ROOT))
    assert not bad, "runtime imports against share < serve < {eval, cluster}:\n" + "\n".join(bad)


def test_no_import_circles():
    assert circles(import_graph(ROOT)) == []


def test_the_checks_catch_a_reintroduced_arrow(tmp_path):
    """A lazy back-import (share -> serve) and a circle through a function-level import are found."""
    for rel, text in {
        "runtime/__init__.py": "", "runtime/share/__init__.py": "", "runtime/serve/__init__.py": "",
        "runtime/share/front.py": "def f():\n    from deltazip.runtime.serve.server import app\n",
        "runtime/serve/server.py": "from deltazip.runtime.serve.routes import x\napp = 1\n",
        "runtime/serve/routes.py": "def g():\n    from deltazip.runtime.serve import server\nx = 1\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path, ["runtime"])
    assert runtime_back_arrows(graph) == ["runtime.share.front -> runtime.serve.server"]
    assert circles(graph) == [{"runtime.serve.server", "runtime.serve.routes"}]


def test_runtime_is_split_into_its_concerns():
    """Issue 15 #7: runtime/ holds subpackages, not a flat list of modules."""
    flat = [f.name for f in (ROOT / "runtime").glob("*.py") if f.name != "__init__.py"]
    assert flat == []
    assert {"serve", "share", "eval"} <= {d.name for d in (ROOT / "runtime").iterdir() if d.is_dir()}
