"""The code base stays ruff-clean (lint and format), as configured in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys

from tests.paths import REPO

RUFF = [sys.executable, "-m", "ruff"]


def test_ruff_check():
    out = subprocess.run([*RUFF, "check", "."], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format():
    out = subprocess.run(
        [*RUFF, "format", "--check", "."], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
