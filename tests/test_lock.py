"""Issue 25: CI installs from a committed lock file, so an upstream release cannot break main overnight;
pyproject.toml keeps ranges. The lock must cover every requirement, agree with the ranges, and be what
the test environment actually holds (when it was installed by ``make``)."""

from __future__ import annotations

import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, ver = line.partition("==")
            assert ver, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = ver
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in ("dev", "serve", "eval", "cluster", "cu12"):  # what `make install` installs
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"platform_system": "Linux"})]


def test_lock_pins_every_requirement_inside_its_range():
    pins = _pins()
    assert "torch" not in pins and "deltazip" not in pins  # torch per machine (Makefile), deltazip is us
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        assert name in pins, f"constraints.txt does not pin {req.name}"
        assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])


def test_make_installs_from_the_lock_file_and_can_test_the_latest():
    mk = (ROOT / "Makefile").read_text()
    assert re.search(r"^CONSTRAINTS \?= constraints\.txt$", mk, re.M)
    installs = [ln for ln in mk.splitlines() if "pip install" in ln and "-e " in ln]
    assert installs and all("$(PIN)" in ln or "latest" in ln for ln in installs), installs
    assert re.search(r"^test-latest:", mk, re.M) and ".venv-latest" in mk
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_installed_environment_is_the_locked_one():
    """Under `make test` the venv was installed with -c constraints.txt: every pinned requirement is at
    its pin. Skipped in an environment that was not installed from the lock (`make test-latest`)."""
    pins, wrong = _pins(), []
    for req in _requirements():
        name = canonicalize_name(req.name)
        try:
            have = version(req.name)
        except PackageNotFoundError:
            continue
        if name in pins and have != pins[name]:
            wrong.append(f"{req.name} {have} (lock: {pins[name]})")
    if wrong and Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"not the venv `make` installs from the lock: {', '.join(wrong)}")
    assert not wrong, f"installed versions differ from constraints.txt: {', '.join(wrong)}"
