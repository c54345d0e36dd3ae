"""Tests for `n` > 1 on the endpoint: n choices of a turn, the client continues one, the
others end as branches of the episode; every branch is an `Episode` of the group with the
exact sampled ids and the learner's log-probs; `rewards` scores the choices one by one."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np

from tests.unit.actor.endpoint.harness import HTTP_TIMEOUT_S, endpoint
from tests.unit.actor.endpoint.test_server import learner_logprobs, open_episode, policy_spans

QUESTION = [{"role": "user", "content": "What is 2+3?"}]


def check_exact(ep, episodes) -> None:
    """Each episode's sampled spans are samples the policy drew, with their log-probs, and
    the learner's recomputation agrees (staleness 0)."""
    sampled = {tuple(t): lp for t, lp in ep.policy.sampled}
    for episode in episodes:
        recomputed = learner_logprobs(ep.sampler.model, episode)
        for a, b in policy_spans(episode):
            logprobs = sampled[tuple(episode.tokens[a:b].tolist())]
            np.testing.assert_array_equal(episode.behavior_logprobs[a:b], logprobs)
            np.testing.assert_allclose(recomputed[a - 1 : b - 1], logprobs, atol=1e-4)


def test_the_client_continues_one_choice_and_the_others_are_branches():
    async def run():
        async with endpoint() as ep, httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
            episode_id, base = await open_episode(http, ep.url, seed=4)
            r = await http.post(f"{base}/chat/completions", json={"messages": QUESTION, "n": 3})
            assert r.status_code == 200, r.text
            body = r.json()
            assert [c["index"] for c in body["choices"]] == [0, 1, 2]
            picked = body["choices"][2]["message"]
            messages = [*QUESTION, picked, {"role": "user", "content": "Are you sure?"}]
            r = await http.post(f"{base}/chat/completions", json={"messages": messages})
            assert r.status_code == 200, r.text
            # The pending choices are resolved: sending another choice now is a mismatch.
            other = [*QUESTION, body["choices"][0]["message"], messages[-1]]
            if body["choices"][0]["message"] != picked:
                r = await http.post(f"{base}/chat/completions", json={"messages": other})
                assert r.status_code == 409 and r.json()["error"]["code"] == "history_mismatch"
            r = await http.post(f"{ep.url}/episodes/{episode_id}/close", json={"reward": 0.5})
            assert r.json() == {"status": "closed"}, r.text
            return ep, episode_id, body

    ep, episode_id, body = asyncio.run(run())
    [episodes] = ep.groups
    assert [e.episode_id for e in episodes] == [episode_id, f"{episode_id}.1", f"{episode_id}.2"]
    main, *branches = episodes
    assert main.num_turns == 2 and [b.num_turns for b in branches] == [1, 1]
    assert {e.reward for e in episodes} == {0.5} and len({e.group_id for e in episodes}) == 1
    assert len(ep.policy.sampled) == 4
    # The three first turns are the request's three samples, after one shared prompt.
    firsts = [policy_spans(e)[0] for e in episodes]
    assert len({a for a, _ in firsts}) == 1
    assert len({tuple(e.tokens[: firsts[0][0]].tolist()) for e in episodes}) == 1
    assert sorted(e.tokens[a:b].tolist() for e, (a, b) in zip(episodes, firsts, strict=True)) == (
        sorted(t for t, _ in ep.policy.sampled[:3])
    )
    assert body["usage"]["completion_tokens"] == sum(len(t) for t, _ in ep.policy.sampled[:3])
    check_exact(ep, episodes)


def test_rewards_score_the_choices_of_a_last_request_one_by_one():
    async def run():
        async with endpoint() as ep, httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
            episode_id, base = await open_episode(http, ep.url, seed=9)
            r = await http.post(f"{base}/chat/completions", json={"messages": QUESTION, "n": 4})
            assert r.status_code == 200, r.text
            close = f"{ep.url}/episodes/{episode_id}/close"
            for bad in ([1.0, 0.0], ["a", 0, 0, 0]):
                r = await http.post(close, json={"rewards": bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == "rewards", r.text
            r = await http.post(close, json={"rewards": [0, 1, 0.5, 1]})
            assert r.json() == {"status": "closed"}, r.text
            # n = 1 then rewards: refused
            single_id, single = await open_episode(http, ep.url)
            r = await http.post(f"{single}/chat/completions", json={"messages": QUESTION})
            r = await http.post(f"{ep.url}/episodes/{single_id}/close", json={"rewards": [1]})
            assert r.status_code == 400 and "n > 1" in r.json()["error"]["message"]
            return ep

    ep = asyncio.run(run())
    episodes = ep.groups[0]
    assert [e.reward for e in episodes] == [0.0, 1.0, 0.5, 1.0]
    assert all(e.num_turns == 1 for e in episodes)
    check_exact(ep, episodes)
