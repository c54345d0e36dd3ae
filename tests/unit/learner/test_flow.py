"""Flow policies: the exact ready / drop / publish semantics, and impossible settings."""

from __future__ import annotations

import numpy as np
import pytest

from tunix_tasks.config import load_config
from tunix_tasks.episode import DropReason, Episode, EpisodeStatus
from tunix_tasks.learner.flow import AsyncFlow, SyncFlow, flow_from_config, stale_mask
from tunix_tasks.learner.staleness import staleness


def _ep(version: int, status: str = "ok") -> Episode:
    return Episode("e", [1, 2], [0, 1], [0, -1], policy_version=version, status=status)


def test_staleness_maths():
    versions = np.array([10, 9, 6, 11])
    np.testing.assert_array_equal(staleness(10, versions), [0, 1, 4, -1])
    np.testing.assert_array_equal(stale_mask(10, versions, 3), [False, False, True, False])
    np.testing.assert_array_equal(stale_mask(10, versions, 0), [False, True, True, False])


def test_statuses_are_normalised_to_the_enum_and_unknown_ones_rejected():
    assert _ep(1, "truncated").status is EpisodeStatus.TRUNCATED  # a shard read's string
    assert _ep(1).status is EpisodeStatus.OK
    with pytest.raises(ValueError, match=r"status 'weird' not in \['ok', 'truncated', 'env_"):
        _ep(1, "weird")


def _reasons(flow, cases, version):
    """The reason each (policy_version, status) case is dropped for (the first mask that
    holds it, as the batcher reads them), or None."""
    versions, statuses = zip(*cases, strict=True)
    masks = flow.drop_masks(np.array(versions), np.array(statuses, object), version)
    assert all(m.shape == (len(cases),) for m in masks.values())
    return [next((r for r, m in masks.items() if m[i]), None) for i in range(len(cases))]


def test_async_flow_semantics():
    flow = AsyncFlow(min_episodes=2, max_staleness=2, publish_every=3)
    cases = [(8, "ok"), (7, "ok"), (10, "env_error"), (10, "env_timeout"), (10, "truncated")]
    cases += [(12, "ok"), (7, "env_error")]
    reasons = _reasons(flow, cases, 10)
    # truncated: the token/turn budget, trained; 12: a newer snapshot after a restore (IS
    # handles it); a stale env_error is dropped as stale, the first reason.
    assert reasons == [None, "stale", "env_error", "env_timeout", None, None, "stale"]
    # Typed, and spelled as the ledgers and metrics spell them (the strings above).
    assert reasons[2] is DropReason.ENV_ERROR
    assert not flow.ready([10], 10) and flow.ready([10, 3], 10)
    assert [flow.publish_due(s, [], 0) for s in range(1, 7)] == [False, False, True] * 2
    assert flow.publish_at_end(4) and not flow.publish_at_end(6)
    assert not flow.flush


def test_sync_flow_trains_a_whole_version_then_publishes():
    flow = SyncFlow(episodes_per_version=3)
    assert flow.flush
    cases = [(4, "ok"), (6, "ok"), (5, "ok"), (5, "env_timeout")]
    assert _reasons(flow, cases, 5) == ["stale", "stale", None, "env_timeout"]
    assert not flow.ready([5, 5], 5)  # 2 of 3 episodes of v5 arrived
    assert flow.ready([5] * 3, 5) and not flow.ready([4] * 3, 5)
    flow.trained([_ep(5)] * 2)  # first batch trained, one episode of v5 still buffered
    assert flow.ready([5], 5)
    assert not flow.publish_due(1, [5], 5)
    flow.trained([_ep(5)])
    assert flow.publish_due(2, [], 5) and flow.publish_due(2, [4], 5)
    flow.published()
    assert not flow.ready([6], 6)
    assert not flow.publish_at_end(2)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: AsyncFlow(min_episodes=0, max_staleness=1, publish_every=1), "min_episodes"),
        (lambda: AsyncFlow(min_episodes=1, max_staleness=-1, publish_every=1), "max_staleness"),
        (lambda: AsyncFlow(min_episodes=1, max_staleness=1, publish_every=0), "publish_every"),
        (lambda: SyncFlow(episodes_per_version=0), "episodes_per_version"),
    ],
)
def test_impossible_settings_are_rejected(make, needle):
    with pytest.raises(ValueError, match=needle):
        make()


def test_flow_from_config():
    assert isinstance(flow_from_config(load_config(None, ["mode=sync"])), SyncFlow)
    flow = flow_from_config(load_config(None, ["learner.max_staleness=7"]))
    assert isinstance(flow, AsyncFlow) and flow.max_staleness == 7
