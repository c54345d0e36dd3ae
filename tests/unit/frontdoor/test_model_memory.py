"""Chip planning (`frontdoor/planning.py`) for published models, and the tables
benchmarks/model_memory.py prints from it (the counts themselves: tests/unit/policy/test_costs.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.paths import REPO
from tunix_tasks.frontdoor import planning
from tunix_tasks.policy.costs import STATE_BYTES_PER_PARAM, activation_bytes, total_params
from tunix_tasks.testing.published import PUBLISHED_CONFIGS, published_spec

SCRIPT = REPO / "benchmarks" / "model_memory.py"
SPECS = {name: published_spec(name) for name in PUBLISHED_CONFIGS}


def test_min_chips_rule():
    hbm = 100
    assert planning.min_chips(80, hbm) == 1  # exactly 80% fits
    assert planning.min_chips(81, hbm) == 2
    assert planning.min_chips(1000, hbm) == 16  # 1000/16 = 62.5 <= 80 < 1000/8
    n = planning.learner_chips(SPECS["Llama-3.1-70B"], planning.ACCELERATORS[0], "fp32")
    assert n & (n - 1) == 0


def test_chip_counts_monotonic_in_model_size():
    by_size = sorted(SPECS.values(), key=total_params)
    for acc in planning.ACCELERATORS:
        for regime in STATE_BYTES_PER_PARAM:
            chips = [planning.learner_chips(m, acc, regime) for m in by_size]
            assert chips == sorted(chips), (acc.name, regime, chips)
        actor = [planning.actor_chips(m, acc) for m in by_size]
        assert actor == sorted(actor), (acc.name, actor)
    big, small = SPECS["Llama-3.1-70B"], SPECS["Qwen3-0.6B"]
    for acc in planning.ACCELERATORS:
        assert planning.learner_chips(big, acc, "bf16") > planning.learner_chips(small, acc, "bf16")
        # more bytes per param never needs fewer chips
        assert planning.learner_chips(big, acc, "fp32") >= planning.learner_chips(big, acc, "bf16")


def test_activation_and_sequence_budgets_are_consistent():
    m = SPECS["Llama-3.1-8B"]
    h200 = planning.ACCELERATORS[2]
    assert planning.sequences_per_replica(m, h200, 4096) >= 8 * planning.sequences_per_replica(
        m, h200, 32768
    )
    rows = planning.rows_per_chip(m, h200, 2048)
    state = 16 * total_params(m) / planning.learner_chips(m, h200, "bf16")
    assert rows * activation_bytes(m, 2048)["total"] <= h200.hbm_bytes - state
    assert planning.rows_per_chip(m, h200, 8192) < rows


def test_script_prints_tables_and_json():
    out = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "| Model |" in out
    for name in PUBLISHED_CONFIGS:
        assert f"| {name} |" in out
    for acc in planning.ACCELERATORS:
        assert acc.name in out
    data = json.loads(
        subprocess.run(
            [sys.executable, str(SCRIPT), "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )
    assert set(data["models"]) == set(PUBLISHED_CONFIGS)
    assert data["models"]["Llama-3.1-8B"]["params"] == 8_030_261_248
    assert data["models"]["Qwen3-0.6B"]["actor"]["kv_bytes_per_token"] == 114_688
