"""The two lock files: `make demo` installs requirements-core.lock, `make test` (CI)
requirements.lock. The core lock must be the full lock's pins for a closed set that holds
every core dependency of pyproject.toml, and nothing of Airflow or the test tools."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

from packaging.requirements import Requirement

from tests.paths import REPO


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def _pins(path: str) -> dict[str, str]:
    lines = (REPO / path).read_text().splitlines()
    pins = [line.split("==") for line in lines if line.strip() and not line.startswith("#")]
    return {_name(name): version for name, version in pins}


def test_the_core_lock_is_a_closed_subset_of_the_full_lock():
    core, full = _pins("requirements-core.lock"), _pins("requirements.lock")
    assert {n: full.get(n) for n in core} == core  # same pins as the full lock
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed = {_name(Requirement(r).name) for r in project["dependencies"]}
    assert needed <= set(core), needed - set(core)
    for extra in project["optional-dependencies"].values():  # airflow, test: not in it
        assert not {_name(Requirement(r).name) for r in extra} & set(core)
    # Closed: every requirement of a pinned package (installed here, with the full lock)
    # is pinned too, so pip fetches nothing unpinned for the demo.
    for name in core:
        for text in importlib.metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                assert _name(req.name) in core, f"{name} needs {req.name}, not in the core lock"
