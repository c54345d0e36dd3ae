"""Env seed ranges: actors' training groups, demonstrations and held-out evaluation are disjoint."""

import pytest

from tunix_tasks.actor.demonstrations import DEMO_SEED_BASE
from tunix_tasks.actor.runtime import HELD_OUT_SEED_BASE, episode_seed
from tunix_tasks.frontdoor.evaluate import held_out_seeds


def test_training_demonstration_and_held_out_seeds_are_disjoint():
    held_out = held_out_seeds(128)
    assert held_out[0] == HELD_OUT_SEED_BASE and held_out[-1] < DEMO_SEED_BASE
    training = [episode_seed(0, f"actor-{a}/inc", g) for a in range(4) for g in range(5000)]
    assert max(training) < HELD_OUT_SEED_BASE and len(set(training)) == len(training)
    assert max(training) > HELD_OUT_SEED_BASE * 0.99  # the whole training range is used
    with pytest.raises(ValueError, match="held-out seeds"):
        held_out_seeds((1 << 31) - HELD_OUT_SEED_BASE + 1)  # would reach the demonstrations'


def test_seed_range_names_the_three_ranges():
    from tunix_tasks.seeds import seed_range

    assert [seed_range(s) for s in (0, HELD_OUT_SEED_BASE - 1)] == ["train", "train"]
    assert seed_range(HELD_OUT_SEED_BASE) == seed_range(DEMO_SEED_BASE - 1) == "held_out"
    assert seed_range(DEMO_SEED_BASE) == "demonstration"
    with pytest.raises(ValueError, match=">= 0"):
        seed_range(-1)
