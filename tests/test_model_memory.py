"""benchmarks/model_memory.py: param counts vs published sizes, KV formula, chip monotonicity."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "model_memory.py"


def _load():
    spec = importlib.util.spec_from_file_location("model_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


mm = _load()
SHAPES = {m.name: m for m in mm.shapes()}


@pytest.mark.parametrize("name", list(mm.CONFIGS))
def test_param_count_matches_published_size(name):
    params = SHAPES[name].params
    published = mm.PUBLISHED_PARAMS[name]
    assert abs(params - published) / published < 0.02, (name, params, published)


def test_param_counts_exact():
    # Known totals of the released checkpoints (tied lm_head counted once).
    assert SHAPES["Llama-3.1-8B"].params == 8_030_261_248
    assert SHAPES["Llama-3.1-70B"].params == 70_553_706_496
    qwen = SHAPES["Qwen3-0.6B"]
    assert qwen.params == 596_049_920
    assert round(qwen.non_embedding_params / 1e9, 2) == 0.44  # model card: 0.44B
    assert round(SHAPES["Qwen3-8B"].non_embedding_params / 1e9, 2) == 6.95  # card: 6.95B


def test_llama_head_dim_defaults_to_hidden_over_heads():
    assert "head_dim" not in mm.CONFIGS["Llama-3.1-8B"]
    assert SHAPES["Llama-3.1-8B"].head_dim == 4096 // 32 == 128
    assert SHAPES["Qwen3-0.6B"].head_dim == 128  # explicit, != 1024 // 16
    assert SHAPES["Qwen3-0.6B"].qk_norm and not SHAPES["Llama-3.1-8B"].qk_norm


def test_kv_cache_bytes_hand_example():
    # Llama-3.1-8B: 2 (K,V) * 32 layers * 8 kv heads * 128 head_dim * 2 bytes = 128 KiB/token
    m = SHAPES["Llama-3.1-8B"]
    assert mm.kv_bytes(m, 1) == 2 * 32 * 8 * 128 * 2 == 131_072
    assert mm.kv_bytes(m, 4096) == 512 * 2**20
    # Qwen3-0.6B: 2 * 28 * 8 * 128 * 2 = 114,688 bytes/token; fp32 cache doubles it.
    q = SHAPES["Qwen3-0.6B"]
    assert mm.kv_bytes(q, 32768) == 114_688 * 32768
    assert mm.kv_bytes(q, 10, bytes_per_value=4) == 2 * mm.kv_bytes(q, 10)


def test_min_chips_rule():
    hbm = 100
    assert mm.min_chips(80, hbm) == 1  # exactly 80% fits
    assert mm.min_chips(81, hbm) == 2
    assert mm.min_chips(1000, hbm) == 16  # 1000/16 = 62.5 <= 80 < 1000/8
    n = mm.learner_chips(SHAPES["Llama-3.1-70B"], mm.ACCELERATORS[0], "fp32")
    assert n & (n - 1) == 0


def test_chip_counts_monotonic_in_model_size():
    by_size = sorted(SHAPES.values(), key=lambda m: m.params)
    for acc in mm.ACCELERATORS:
        for regime in mm.STATE_BYTES_PER_PARAM:
            chips = [mm.learner_chips(m, acc, regime) for m in by_size]
            assert chips == sorted(chips), (acc.name, regime, chips)
        actor = [mm.actor_chips(m, acc) for m in by_size]
        assert actor == sorted(actor), (acc.name, actor)
    big, small = SHAPES["Llama-3.1-70B"], SHAPES["Qwen3-0.6B"]
    for acc in mm.ACCELERATORS:
        assert mm.learner_chips(big, acc, "bf16") > mm.learner_chips(small, acc, "bf16")
        # more bytes per param never needs fewer chips
        assert mm.learner_chips(big, acc, "fp32") >= mm.learner_chips(big, acc, "bf16")


def test_activation_and_sequence_budgets_are_consistent():
    m = SHAPES["Llama-3.1-8B"]
    a = mm.activation_bytes(m, 2048)
    assert a["total"] == a["residuals"] + a["layer"] + a["logits"]
    assert a["residuals"] == 32 * 2048 * 4096 * 2
    assert mm.activation_bytes(m, 8192)["total"] > a["total"]
    h200 = mm.ACCELERATORS[2]
    assert mm.sequences_per_replica(m, h200, 4096) >= 8 * mm.sequences_per_replica(m, h200, 32768)


def test_script_prints_tables_and_json():
    out = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "| Model |" in out
    for name in mm.CONFIGS:
        assert f"| {name} |" in out
    for acc in mm.ACCELERATORS:
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
    assert set(data["models"]) == set(mm.CONFIGS)
    assert data["models"]["Llama-3.1-8B"]["params"] == 8_030_261_248
