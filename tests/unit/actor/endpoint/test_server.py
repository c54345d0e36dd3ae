"""Tests for tunix_tasks.actor.endpoint (service, server, episodes): the real `openai`
client against the real endpoint (uvicorn on loopback, the tiny Qwen3 checkpoint's
continuously batched sampler), and every refusal as an OpenAI error body."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import openai
import pytest
from flax import nnx

from tests.unit.actor.endpoint.harness import (
    HTTP_TIMEOUT_S,
    MAX_EPISODE_TOKENS,
    TEMPERATURE,
    endpoint,
)
from tunix_tasks.policy.distribution import sampling_log_probs, token_logprobs

CALCULATE = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def policy_spans(episode) -> list[tuple[int, int]]:
    mask = episode.loss_mask.astype(int)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return list(zip(edges[::2], edges[1::2], strict=True))


def learner_logprobs(model, episode) -> np.ndarray:
    """The learner's recomputation over the whole episode (staleness 0): lp[t-1] scores t."""
    tokens = episode.tokens[None]
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    logits = nnx.jit(lambda m, t, p, s: m(t, p, s))(model, tokens, positions, np.ones_like(tokens))
    return np.asarray(token_logprobs(logits, tokens, TEMPERATURE))[0]


async def open_episode(http: httpx.AsyncClient, url: str, **body) -> tuple[str, str]:
    r = await http.post(f"{url}/episodes", json=body)
    assert r.status_code == 200, r.text
    return r.json()["episode_id"], r.json()["base_url"]


def test_openai_client_multi_turn_with_tools_keeps_the_sampled_tokens():
    """Three turns through `openai.AsyncOpenAI`: the episode's policy tokens are exactly
    the sampled ids, turn by turn (never re-encoded), and their behaviour log-probs are
    the learner's recomputation at staleness 0; `logprobs=True` returns the same values."""

    async def run():
        async with endpoint() as ep, httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
            episode_id, base_url = await open_episode(http, ep.url, seed=11)
            client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
            assert (await client.models.list()).data[0].id == "tiny-qwen3"
            messages = [
                {"role": "system", "content": "You are a calculator."},
                {"role": "user", "content": "What is 23+45?"},
            ]
            returned, prompt_tokens = [], []
            for turn in range(3):
                r = await client.chat.completions.create(
                    model="tiny-qwen3", messages=messages, tools=[CALCULATE], logprobs=True
                )
                msg = r.choices[0].message
                returned.append([c.logprob for c in r.choices[0].logprobs.content])
                assert r.usage.completion_tokens == len(returned[-1])
                prompt_tokens.append(r.usage.prompt_tokens)
                messages.append(msg.model_dump(exclude_none=True))
                if msg.tool_calls:
                    for call in msg.tool_calls:
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": "68"})
                else:
                    messages.append({"role": "user", "content": f"Turn {turn}: check it."})
            r = await http.post(f"{ep.url}/episodes/{episode_id}/close", json={"reward": 1.0})
            assert r.json() == {"status": "closed"}
            return ep, returned, prompt_tokens

    ep, returned, prompt_tokens = asyncio.run(run())
    [[episode]] = ep.groups
    assert episode.reward == 1.0 and episode.num_turns == 3 and episode.seed == 11
    assert episode.group_id.startswith("actor-t/x/") and episode.actor_id == "actor-t"
    spans = policy_spans(episode)
    assert len(spans) == 3 == len(ep.policy.sampled)
    assert [int(start) for start, _ in spans] == prompt_tokens  # usage: the context sampled after
    for (start, end), (tokens, logprobs), wire in zip(
        spans, ep.policy.sampled, returned, strict=True
    ):
        assert episode.tokens[start:end].tolist() == tokens  # the sampled ids, exactly
        np.testing.assert_array_equal(episode.behavior_logprobs[start:end], logprobs)
        np.testing.assert_allclose(wire, logprobs, rtol=0, atol=1e-6)
    recomputed = learner_logprobs(ep.sampler.model, episode)
    for start, end in spans:
        np.testing.assert_allclose(
            recomputed[start - 1 : end - 1], episode.behavior_logprobs[start:end], atol=1e-4
        )
    # The prompt the tools rendered is in the episode (loss-masked), once.
    text = ep.chat.tokenizer.decode(episode.tokens.tolist())
    assert text.count('"name": "calculate"') == 1 and text.count("You are a calculator.") == 1


def test_streamed_turns_are_the_recorded_turns():
    """`stream=True` through the real client: the deltas add up to the turn the episode
    recorded (the next request, carrying the assembled message, passes the history check)
    and the usage chunk counts its sampled tokens."""

    async def run():
        async with endpoint() as ep, httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
            episode_id, base_url = await open_episode(http, ep.url, seed=3)
            client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
            messages = [{"role": "user", "content": "What is 2+2?"}]
            for turn in range(2):
                stream = await client.chat.completions.create(
                    model="m",
                    messages=messages,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                chunks = [c async for c in stream]
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                usage = chunks[-1].usage
                messages += [
                    {"role": "assistant", "content": content},
                    {"role": "user", "content": f"Turn {turn}: again."},
                ]
            await http.post(f"{ep.url}/episodes/{episode_id}/close", json={"reward": 0.5})
            return ep, usage

    ep, usage = asyncio.run(run())
    [[episode]] = ep.groups
    assert episode.num_turns == 2 and episode.reward == 0.5
    assert usage.completion_tokens == len(ep.policy.sampled[-1][0])


def _error(
    r: httpx.Response, status: int, code: str | None = None, param: str | None = None
) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in r.text
    assert code is None or err["code"] == code, err
    assert param is None or err["param"] == param, err
    return err["message"]


def test_bad_input_gets_openai_error_bodies_and_frees_nothing_it_should_not():
    async def run():
        async with (
            endpoint(max_request_bytes=4096) as ep,
            httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http,
        ):
            episode_id, base = await open_episode(http, ep.url)
            chat = f"{base}/chat/completions"
            user = [{"role": "user", "content": "hi"}]
            _error(await http.post(chat, content=b"{not json"), 400)
            # Nesting past the parser's recursion limit: a 400, not a 500 (RecursionError).
            deep = b"[" * 2000 + b"]" * 2000
            for url in (chat, f"{ep.url}/episodes"):
                assert "nested too deeply" in _error(await http.post(url, content=deep), 400)
            _error(
                await http.post(chat, json={"messages": user, "temperature": "hot"}),
                400,
                param="temperature",
            )
            _error(await http.post(chat, json={"messages": "hi"}), 400, param="messages")
            _error(await http.post(chat, json={"messages": user, "n": 17}), 400, param="n")
            msg = _error(
                await http.post(chat, json={"messages": user, "temperature": 0.2}),
                400,
                param="temperature",
            )
            assert str(TEMPERATURE) in msg
            _error(
                await http.post(chat, json={"messages": [{"role": "robot", "content": "x"}]}),
                400,
                param="messages",
            )
            _error(await http.post(chat, content=b"x" * 5000), 413)
            _error(
                await http.post(
                    f"{ep.url}/episodes/nope/v1/chat/completions", json={"messages": user}
                ),
                404,
                "episode_not_found",
            )
            _error(await http.get(f"{ep.url}/nowhere"), 404)
            _error(
                await http.post(f"{ep.url}/episodes", json={"group_size": "four"}),
                400,
                param="group_size",
            )
            _error(
                await http.post(f"{ep.url}/episodes/{episode_id}/close", json={}),
                400,
                param="reward",
            )

            # Context longer than the limit: named, and the episode is still usable after.
            big = [{"role": "user", "content": "9 " * 1500}]
            msg = _error(
                await http.post(chat, json={"messages": big}),
                400,
                "context_length_exceeded",
                "messages",
            )
            assert str(MAX_EPISODE_TOKENS) in msg and "actor.max_episode_tokens" in msg

            # A history that does not extend the episode's: 409, the index named.
            r = await http.post(chat, json={"messages": user, "max_tokens": 4})
            answer = r.json()["choices"][0]["message"]
            edited = [
                {"role": "user", "content": "HI"},
                answer,
                {"role": "user", "content": "and?"},
            ]
            _error(
                await http.post(chat, json={"messages": edited}),
                409,
                "history_mismatch",
                "messages[0]",
            )
            again = [*user, answer, {"role": "user", "content": "and?"}]
            _error(
                await http.post(chat, json={"messages": again, "tools": [CALCULATE]}),
                409,
                "history_mismatch",
                "tools",
            )
            r = await http.post(chat, json={"messages": again, "max_tokens": 4})
            assert r.status_code == 200, r.text  # the refusals recorded nothing
            assert ep.service.refused["history_mismatch"] == 2

    asyncio.run(run())


def test_bearer_token_when_configured():
    async def run():
        async with (
            endpoint(api_key="s3cret") as ep,
            httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http,
        ):
            _error(await http.get(f"{ep.url}/v1/models"), 401, "invalid_api_key")
            _error(
                await http.get(f"{ep.url}/v1/models", headers={"Authorization": "Bearer nope"}), 401
            )
            r = await http.get(f"{ep.url}/v1/models", headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny-qwen3"

    asyncio.run(run())


def test_load_abandoned_and_disconnected_episodes_are_dropped_and_free_their_slots():
    async def run():
        async with (
            # No real idle timeout: b must stay open through the requests below however
            # slow the host; c's abandonment is the sweep's, on a clock moved past it (the
            # periodic sweep is test_runner's).
            endpoint(max_concurrent_requests=1, timeout_s=3600.0) as ep,
            httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http,
        ):
            ep.policy.gate = asyncio.Event()  # hold requests before the sampler
            _, base_a = await open_episode(http, ep.url, group="g", group_size=3)
            b, base_b = await open_episode(http, ep.url, group="g", group_size=3)
            c, base_c = await open_episode(http, ep.url, group="g", group_size=3)
            _error(
                await http.post(f"{ep.url}/episodes", json={"group": "g", "group_size": 3}),
                409,
                "group_full",
            )
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            first = asyncio.create_task(http.post(f"{base_a}/chat/completions", json=body))
            while ep.service.in_flight == 0:
                await asyncio.sleep(0.01)
            # Too many concurrent requests: 429, nothing recorded on b.
            _error(
                await http.post(f"{base_b}/chat/completions", json=body),
                429,
                "too_many_concurrent_requests",
            )
            # The client of a goes away mid-request: a is dropped, the slot is freed.
            first.cancel()
            while ep.registry.dropped["disconnected"] == 0:
                await asyncio.sleep(0.05)
            assert ep.service.in_flight == 0
            _error(await http.post(f"{base_a}/chat/completions", json=body), 409, "episode_ended")
            ep.policy.gate.set()
            r = await http.post(f"{base_b}/chat/completions", json=body)
            assert r.status_code == 200, r.text
            await http.post(f"{ep.url}/episodes/{b}/close", json={"reward": 0.5})
            # c never comes back: abandoned after the timeout; the group is handed over without it.
            assert ep.registry.sweep(now=time.monotonic() + 3601) == [c]
            assert ep.registry.dropped["abandoned"] == 1
            _error(await http.post(f"{base_c}/chat/completions", json=body), 409, "episode_ended")
            assert len(ep.registry) == 0
            return ep

    ep = asyncio.run(run())
    [[kept]] = ep.groups
    assert kept.reward == 0.5 and ep.registry.dropped["disconnected"] == 1


def test_256_concurrent_episodes_on_one_endpoint_without_errors():
    """256 episodes at once through the real openai client: every request answered, every
    episode closed and handed over, none refused or dropped."""

    async def one(http: httpx.AsyncClient, url: str, i: int) -> None:
        episode_id, base_url = await open_episode(http, url, seed=i)
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", http_client=http)
        messages = [{"role": "user", "content": f"{i}?"}]
        r = await client.chat.completions.create(model="m", messages=messages, max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
        r = await http.post(f"{url}/episodes/{episode_id}/close", json={"reward": 1.0})
        assert r.status_code == 200, r.text

    async def run():
        # Small pools: one pool of 256 connections costs httpcore quadratic time.
        pools = [httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) for _ in range(32)]
        async with endpoint(max_concurrent_requests=512) as ep:
            await asyncio.gather(*(one(pools[i % 32], ep.url, i) for i in range(256)))
        for pool in pools:
            await pool.aclose()
        return ep

    ep = asyncio.run(run())
    assert len(ep.groups) == 256 and all(len(g) == 1 for g in ep.groups)
    assert ep.service.requests == 256 and not ep.service.refused
    assert not any(ep.registry.dropped.values()) and len(ep.registry) == 0
    assert all(e.num_turns == 1 for [e] in ep.groups)


def test_stop_strings_end_the_turn_at_the_token_that_completes_one():
    """The kept ids are the shortest prefix of the sample whose text holds a stop string
    (their log-probs unchanged), the turn is closed after them, the content leaves it out."""
    stops = ["e", "a", "o", " "]

    async def run():
        async with (
            endpoint(max_new_tokens=32) as ep,
            httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http,
        ):
            episode_id, base = await open_episode(http, ep.url)
            body = {"messages": [{"role": "user", "content": "Say something."}], "stop": stops}
            r = await http.post(f"{base}/chat/completions", json=body)
            assert r.status_code == 200, r.text
            await http.post(f"{ep.url}/episodes/{episode_id}/close", json={"reward": 0.0})
            return ep, r.json()["choices"][0]

    ep, choice = asyncio.run(run())
    [[episode]] = ep.groups
    [(sampled, logprobs)] = ep.policy.sampled
    decode = ep.chat.tokenizer.decode
    [(start, end)] = policy_spans(episode)
    kept = episode.tokens[start:end].tolist()
    assert kept == sampled[: len(kept)]
    np.testing.assert_array_equal(episode.behavior_logprobs[start:end], logprobs[: len(kept)])
    if any(s in decode(sampled) for s in stops):
        assert any(s in decode(kept) for s in stops)
        assert not any(s in decode(kept[:-1]) for s in stops)
        assert choice["finish_reason"] == "stop"
        assert episode.tokens[end] == ep.chat.eot_id  # the turn closed after the cut
        assert not any(s in (choice["message"]["content"] or "") for s in stops)
    else:
        assert kept == sampled


def test_top_logprobs_are_the_learners_most_likely_tokens():
    """`top_logprobs: 3`: per sampled token, the three most likely tokens of the run's
    distribution at that position, as the learner computes it over the episode; the sampled
    token's own log-prob is unchanged. Without `logprobs: true` it is a 400."""

    async def run():
        async with endpoint() as ep, httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
            episode_id, base_url = await open_episode(http, ep.url)
            client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
            messages = [{"role": "user", "content": "What is 2+3?"}]
            with pytest.raises(openai.BadRequestError, match="top_logprobs"):
                await client.chat.completions.create(model="m", messages=messages, top_logprobs=3)
            r = await client.chat.completions.create(
                model="m", messages=messages, logprobs=True, top_logprobs=3
            )
            await http.post(f"{ep.url}/episodes/{episode_id}/close", json={"reward": 0.0})
            return ep, r.choices[0].logprobs.content

    ep, content = asyncio.run(run())
    [[episode]] = ep.groups
    [(start, end)] = policy_spans(episode)
    tokens = episode.tokens[None]
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    logits = nnx.jit(lambda m, t, p, s: m(t, p, s))(
        ep.sampler.model, tokens, positions, np.ones_like(tokens)
    )
    full = np.asarray(sampling_log_probs(logits, TEMPERATURE))[0]
    decode = ep.chat.tokenizer.decode
    assert len(content) == end - start
    for t, entry in zip(range(start, end), content, strict=True):
        row = full[t - 1]  # the distribution the token at t was drawn from
        best = np.argsort(-row)[:3]
        assert [alt.token for alt in entry.top_logprobs] == [decode([i]) for i in best]
        np.testing.assert_allclose(
            [alt.logprob for alt in entry.top_logprobs], row[best], atol=1e-4
        )
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6
        np.testing.assert_allclose(entry.logprob, row[episode.tokens[t]], atol=1e-4)
