"""Where things are, for tests at any depth: the repository root and the committed fixtures."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
HF_FIXTURES = FIXTURES / "hf"
