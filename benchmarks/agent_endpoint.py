"""The agent endpoint's cost: episodes/s through the OpenAI-compatible endpoint (the real
`openai` client over loopback HTTP, `actor.kind: agent`'s path) against the in-process
async rollout (`play_episode`, `actor.kind: async`'s path), same sampler, same
concurrency, same env latency; and the per-request overhead in ms.

Workload: every episode is `--turns` policy turns of at most `--new-tokens` tokens, each
followed by one env step that sleeps `--latency` s (the reset too). In-process: E
`play_episode` loops over a `BatchingPolicy`. Endpoint: E copies of an agent program that
makes the same turns with `client.chat.completions.create` and steps the env through the
task's `grade` after each one. Every sampler program
the runs use is compiled first, by one unmeasured pass of each path at each E (what a
steady state meets: admissions, session-reuse prefills, decode windows); both then run
`--warmup` s, and episodes/s is counted
over `--window` s. Overhead: at concurrency 1, the median latency of one chat completion
through HTTP minus the median of the same call made on the policy in-process, and the
endpoint's own bookkeeping (matching, rendering, recording; no HTTP) per request.

    python benchmarks/agent_endpoint.py [--envs 16 64 256] [--latency 0.5] [--window 15]
    python benchmarks/agent_endpoint.py --smoke      # every code path, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from tunix_tasks.actor.asynchronous.batching import BatchingPolicy
from tunix_tasks.actor.asynchronous.rollout import EpisodeLimits, play_episode
from tunix_tasks.actor.endpoint.episodes import EpisodeRegistry
from tunix_tasks.actor.endpoint.runner import AgentRunner
from tunix_tasks.actor.endpoint.server import EndpointServer, build_app
from tunix_tasks.actor.endpoint.service import EndpointLimits, EndpointService
from tunix_tasks.actor.episodes import EpisodeBuilder
from tunix_tasks.config import ModelConfig
from tunix_tasks.envs.base import StepResult
from tunix_tasks.policy.build import build_sampler

MAX_EPISODE_TOKENS = 192


class TurnsEnv:
    """Done after `turns` steps; every reset and step sleeps `latency` s."""

    name = "turns"
    tools = ()

    def __init__(self, turns: int, latency: float) -> None:
        self.turns, self.latency, self.n = turns, latency, 0

    async def reset(self, seed: int) -> str:
        self.n = 0
        await asyncio.sleep(self.latency)
        return f"task {seed % 10}"

    async def step(self, action) -> StepResult:
        self.n += 1
        await asyncio.sleep(self.latency)
        return StepResult("go on", 1.0 / self.turns, self.n >= self.turns, {})


def turns_agent(turns: int):
    """The agent program: the same turns through the OpenAI client."""

    async def run(client, task) -> float:
        messages = [{"role": "user", "content": task["prompt"]}]
        reward = 0.0
        for _ in range(turns):
            r = await client.chat.completions.create(model="policy", messages=messages)
            content = r.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": content})
            reward += await task["grade"](content)  # the env step
            messages.append({"role": "user", "content": "go on"})
        return reward

    return run


def _policy(sampler, args) -> BatchingPolicy:
    return BatchingPolicy(sampler, max_new_tokens=args.new_tokens, temperature=1.0, seed=0)


async def _count(loop_once, envs: int, warmup: float, window: float) -> float:
    """Episodes/s of `envs` loops of `loop_once(i, n)` over `window` s after `warmup` s."""
    done = [0]
    stop = time.monotonic() + warmup + window

    async def loop(i: int) -> None:
        # Staggered starts: loops in step would finish in bursts of `envs`, and a window
        # would count a whole number of bursts.
        await asyncio.sleep(warmup / 2 * i / envs)
        n = 0
        while time.monotonic() < stop:
            await loop_once(i, n)
            n += 1
            done[0] += 1

    tasks = [asyncio.create_task(loop(i)) for i in range(envs)]
    await asyncio.sleep(warmup)
    start = done[0]
    await asyncio.sleep(window)
    rate = (done[0] - start) / window
    await asyncio.gather(*tasks)
    return rate


async def in_process(chat, sampler, envs: int, args) -> float:
    limits = EpisodeLimits(
        max_turns=args.turns + 1,
        max_episode_tokens=MAX_EPISODE_TOKENS,
        max_new_tokens=args.new_tokens,
    )
    async with _policy(sampler, args) as policy:

        async def once(i: int, n: int) -> None:
            env = TurnsEnv(args.turns, args.latency)
            await play_episode(env, policy, seed=i * 100_000 + n, limits=limits, chat=chat)

        return await _count(once, envs, args.warmup, args.window)


class _Endpoint:
    """The endpoint and runner over one `BatchingPolicy`, on the running loop."""

    def __init__(self, chat, policy, envs: int, args) -> None:
        self.registry = EpisodeRegistry(
            EpisodeBuilder(env="turns"),
            end_ids=tuple(chat.end_ids),
            on_group=lambda *_: None,
            timeout_s=600,
            max_open=4096,
        )
        limits = EndpointLimits(
            model="tiny",
            max_episode_tokens=MAX_EPISODE_TOKENS,
            max_new_tokens=args.new_tokens,
            temperature=1.0,
            top_k=0,
            max_concurrent_requests=4096,
        )
        self.service = EndpointService(chat, policy, self.registry, limits)
        self.server = EndpointServer(
            build_app(self.service), host="127.0.0.1", port=0, registry=self.registry
        )
        self.envs, self.args = envs, args

    async def __aenter__(self):
        await self.server.__aenter__()
        self.runner = AgentRunner(
            turns_agent(self.args.turns), self.registry, self.server.base_url, connections=self.envs
        )
        return self

    async def __aexit__(self, *exc):
        await self.runner.aclose()
        await self.server.__aexit__(*exc)


async def through_endpoint(chat, sampler, envs: int, args) -> tuple[float, dict]:
    async with _policy(sampler, args) as policy, _Endpoint(chat, policy, envs, args) as ep:

        async def once(i: int, n: int) -> None:
            env = TurnsEnv(args.turns, args.latency)
            await ep.runner.play_group(f"{i}/{n}", seed=i * 100_000 + n, envs=[env])

        rate = await _count(once, envs, args.warmup, args.window)
        dropped = {k: v for k, v in ep.registry.dropped.items() if v}
        return rate, {"refused": dict(ep.service.refused), "dropped": dropped}


async def overhead(chat, sampler, args, repeats: int) -> tuple[float, float, float]:
    """(HTTP request ms, in-process policy call ms, endpoint bookkeeping ms), medians."""
    messages = [{"role": "user", "content": "task 1"}]
    context = chat.start(messages)
    async with _policy(sampler, args) as policy, _Endpoint(chat, policy, 1, args) as ep:
        direct, http_ms = [], []
        async with httpx.AsyncClient() as http:
            for _ in range(repeats + 2):  # the first two: warm-up
                t0 = time.perf_counter()
                await policy(context, max_new_tokens=args.new_tokens)
                direct.append(time.perf_counter() - t0)
                opened = ep.registry.open()
                url = f"{ep.server.base_url}/episodes/{opened.id}/v1/chat/completions"
                t0 = time.perf_counter()
                r = await http.post(url, json={"messages": messages, "max_tokens": args.new_tokens})
                http_ms.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
                ep.registry.close(opened.id, reward=0.0)
        book = ep.service.overhead_s[2:]

    def median_ms(values: list[float]) -> float:
        return 1000 * statistics.median(values)

    return median_ms(http_ms[2:]), median_ms(direct[2:]), median_ms(book)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--envs", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--latency", type=float, default=0.5, help="env reset / step seconds")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--warmup", type=float, default=8.0)
    p.add_argument("--window", type=float, default=15.0)
    p.add_argument("--repeats", type=int, default=30, help="overhead: requests measured")
    p.add_argument("--smoke", action="store_true", help="toy sizes: every code path in seconds")
    args = p.parse_args()
    if args.smoke:
        args.envs, args.latency, args.warmup, args.window, args.repeats = [4], 0.05, 3.0, 2.0, 3
    chat, sampler = build_sampler(ModelConfig(preset="tiny"), seed=0, max_sequences=max(args.envs))
    rows = []
    for envs in args.envs:
        # Both paths once, unmeasured: every program they use (admissions, session-reuse
        # prefills, decode windows, batch shapes) compiles here, not inside a measurement.
        brief = argparse.Namespace(**{**vars(args), "warmup": 0.0, "window": args.warmup})
        asyncio.run(in_process(chat, sampler, envs, brief))
        asyncio.run(through_endpoint(chat, sampler, envs, brief))
        base = asyncio.run(in_process(chat, sampler, envs, args))
        rate, problems = asyncio.run(through_endpoint(chat, sampler, envs, args))
        rows.append((envs, base, rate, problems))
        print(
            f"E={envs}: in-process {base:.2f} ep/s, endpoint {rate:.2f} ep/s {problems}", flush=True
        )
    http_ms, direct_ms, book_ms = asyncio.run(overhead(chat, sampler, args, args.repeats))

    print(
        f"\nEpisodes/s, tiny preset, {args.turns} turns x <= {args.new_tokens} tokens, "
        f"{args.latency}s per env reset/step (goal: endpoint >= 0.8x in-process)"
    )
    print(f"{'E':>5}{'in-process':>12}{'endpoint':>10}{'ratio':>8}  refusals / drops")
    for envs, base, rate, problems in rows:
        ratio = f"{rate / base:.2f}x" if base > 0 else "-"  # no episode ended in the window
        print(f"{envs:>5}{base:>12.2f}{rate:>10.2f} {ratio:>7}  {problems}")
    print(
        f"\nPer request, concurrency 1 (medians of {args.repeats}): HTTP chat completion "
        f"{http_ms:.1f} ms, the same policy call in-process {direct_ms:.1f} ms: overhead "
        f"{http_ms - direct_ms:.1f} ms, of which endpoint bookkeeping {book_ms:.2f} ms"
    )


if __name__ == "__main__":
    main()
