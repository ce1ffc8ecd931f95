"""The README's user install, done: a fresh venv, ``pip install '.[serve]'`` (and ``'.[eval]'``,
``'.[cluster]'``; not editable) of the files a clone has, then the installed ``deltazip`` runs
(``--version``, ``demo --help``, and the extra's command: ``serve --help``, ``eval --help``).

What makes it fast without making it a different install: the fresh venv is given the packages that
``deltazip[serve]`` needs, and only those, as links to the ones this environment already installed
(CPU torch, transformers, fastapi, ... at the lock file's versions: the dependency closure is walked
here from the requirements' metadata, markers evaluated), plus pip and setuptools to build with.
Then pip, with no index, builds deltazip's wheel from the copied tree with its declared backend and
installs it: it refuses if a requirement of ``deltazip[EXTRA]`` is not satisfied by what is there, so a
range in pyproject.toml that the lock's versions miss, a package or data file left out of the wheel, a
broken entry point, or a command that imports a package only another extra brings (the serve install
links no lm-eval, Ray or pytest) fails here. What it does not do is download: `make install`
(editable, CI's first step) resolves and downloads the same requirements from the index.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import defaultdict
from importlib.metadata import distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
BUILD_TOOLS = ("pip", "setuptools", "wheel")
# Each user recipe of the README: the extra, the command whose --help must run, an option it shows,
# and a module the extra brings (imported from the installed copy). The GPU recipe's nvCOMP extras need
# a CUDA torch and are not installed here.
RECIPES = {
    "serve": ("serve", "--max-deltas", "deltazip.runtime.serve.server"),
    "eval": ("eval", "--tasks", "deltazip.runtime.eval.lm_eval_model"),
    "cluster": ("serve", "--ray", "ray.serve"),
}


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _installed() -> dict:
    """Canonical name -> the newest installed distribution of that name on sys.path."""
    best: dict = {}
    for d in distributions():
        name = canonicalize_name(d.metadata["Name"] or "")
        if not name or name == "deltazip":
            continue
        if name not in best or Version(d.version) > Version(best[name].version):
            best[name] = d
    return best


def closure(requirements: list[str], extras: tuple[str, ...], installed: dict) -> tuple[set[str], list[str]]:
    """(names of the distributions ``requirements`` need, transitively, with ``extras``; missing ones)."""
    need, missing = set(), []
    todo = [(Requirement(r), extras) for r in requirements]
    while todo:
        req, with_extras = todo.pop()
        envs = [{"extra": e} for e in with_extras] or [{"extra": ""}]
        if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
            continue
        name = canonicalize_name(req.name)
        dist = installed.get(name)
        if dist is None:
            missing.append(str(req))
            continue
        key = (name, tuple(sorted(req.extras)))
        if key in need:
            continue
        need.add(key)
        todo += [(Requirement(r), tuple(req.extras)) for r in (dist.requires or [])]
    return {n for n, _ in need}, missing


def link_site_packages(keep: set[str], installed: dict, dest: Path) -> int:
    """Link the files of the distributions in ``keep`` into ``dest``: a top-level entry whole when only
    kept distributions own it, else (a shared namespace folder, ``nvidia/``) a folder of its own whose
    entries are linked the same way. Returns the number of links."""
    owners: dict = defaultdict(set)  # (site dir, path parts prefix) -> owning distribution names
    for name, d in installed.items():
        site = Path(d.locate_file(""))
        for f in d.files or []:
            parts = Path(f).parts
            if parts and parts[0] != "..":
                for k in range(1, len(parts) + 1):
                    owners[(site, parts[:k])].add(name)
    children: dict = defaultdict(set)
    for site, parts in owners:
        children[(site, parts[:-1])].add(parts)
    links = 0

    def place(site: Path, prefix: tuple) -> None:
        nonlocal links
        for parts in sorted(children[(site, prefix)]):
            who = owners[(site, parts)]
            if not who & keep:
                continue
            target, src = dest.joinpath(*parts), site.joinpath(*parts)
            if who <= keep or not src.is_dir():
                if not target.exists() and src.exists():
                    target.symlink_to(src)
                    links += 1
            else:
                target.mkdir(exist_ok=True)
                place(site, parts)

    for site in {Path(installed[n].locate_file("")) for n in keep}:
        place(site, ())
    return links


def _run(cmd: list, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PYTHONNOUSERSITE="1")
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _clone_files(dest: Path) -> None:
    """The files a clone has (tracked, plus new ones git does not ignore), copied to ``dest``."""
    if shutil.which("git") and (ROOT / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode()
        for rel in filter(None, out.split("\0")):
            src = ROOT / rel
            if src.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    else:
        shutil.copytree(ROOT, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".venv*", "venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache"))


@pytest.mark.slow
@pytest.mark.parametrize("extra", list(RECIPES))
def test_user_install_into_a_fresh_venv_runs_the_cli(tmp_path, extra):
    project = _project()
    installed = _installed()
    keep, missing = closure(project["dependencies"] + project["optional-dependencies"][extra], (extra,), installed)
    assert not missing, f"this environment lacks {missing}, which deltazip[{extra}] needs: run `make install`"
    assert "torch" in keep and "pytest" not in keep and "ruff" not in keep
    assert ("lm-eval" in keep) == (extra == "eval") and ("ray" in keep) == (extra == "cluster")
    assert extra != "serve" or "fastapi" in keep
    src, venv = tmp_path / "clone", tmp_path / "venv"
    _clone_files(src)
    r = _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)
    assert r.returncode == 0, r.stderr
    py = venv / "bin" / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).stdout.strip())
    links = link_site_packages(keep | {n for n in BUILD_TOOLS if n in installed}, installed, site)
    assert links > len(keep)

    r = _run([py, "-m", "pip", "install", "--no-index", "--no-build-isolation", "--quiet", f".[{extra}]"], src)
    assert r.returncode == 0, f"pip install '.[{extra}]' failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"

    deltazip = venv / "bin" / "deltazip"
    r = _run([deltazip, "--version"], tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"deltazip {project['version']}", r.stdout + r.stderr
    command, shows, module = RECIPES[extra]
    for cmd, option in (("demo", "--workdir"), (command, shows)):
        r = _run([deltazip, cmd, "--help"], tmp_path)
        assert r.returncode == 0 and option in r.stdout, f"deltazip {cmd} --help:\n{r.stdout}\n{r.stderr}"
    # The installed copy (not the clone, not this checkout) runs, with its data files and the server's
    # packages: the wheel holds every package, the lm-eval task YAMLs and the CUDA source.
    probe = (f"import pathlib, importlib, deltazip.deltacli, deltazip.runtime.eval as e, "
             f"deltazip.kernels as k; importlib.import_module({module!r}); "
             "print(pathlib.Path(deltazip.deltacli.__file__).parent.parent); "
             "print(len(list(pathlib.Path(e.__file__).parent.glob('lm_eval_tasks/*.yaml')))); "
             "print(len(list(pathlib.Path(k.__file__).parent.glob('cuda/*.cu'))))")
    r = _run([py, "-c", probe], tmp_path)
    assert r.returncode == 0, r.stderr
    where, yamls, cu = r.stdout.split()
    assert Path(where).resolve() == (site / "deltazip").resolve(), where
    assert int(yamls) == len(list((ROOT / "runtime/eval/lm_eval_tasks").glob("*.yaml"))) > 0
    assert int(cu) == len(list((ROOT / "kernels/cuda").glob("*.cu"))) > 0
