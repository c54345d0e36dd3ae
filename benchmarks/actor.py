"""Actor throughput: episodes/s against the number of concurrent environments, and the
batched sampler's policy tokens/s per core.

Part 1: one `Actor` per E in (1, 4, 16, 64, 256) on a file:// run, calculator env with a
fixed 0.5 s simulated latency on every reset and step, "tiny" policy, group_size=1 (so E
independent episode loops), one cache slot per env (the default). The actor warms up
until its sampler has compiled nothing new for `--quiet` s and `--min-episodes` (at least
2E) episodes (every program a steady state uses: prefills with and without a reused
session, decode windows; a persistent XLA cache shares the work between the E values);
then episodes/s is counted over a window of at least `--window` s and `--min-episodes`
episodes. A window in which anything compiled is discarded and measured again; the script
fails rather than report one. The ideal is linear: E / (episode time with one env).

Part 2: `Sampler.sample` on batches of 16/64/256 contexts with the "small" preset, a fixed
number of generated tokens per row (no stop ids), after a warm-up call: tokens/s and
tokens/s per core.

    python benchmarks/actor.py [--envs 1 4 16 64 256] [--window 15] [--quiet 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from tunix_tasks.actor.asynchronous.actor import Actor
from tunix_tasks.config import ModelConfig, config_from_dict
from tunix_tasks.policy.build import build_policy, build_sampler, model_meta
from tunix_tasks.policy.params import flat_params
from tunix_tasks.storage.runs import mark_done, write_config
from tunix_tasks.storage.weights import WeightsPublisher

LATENCY_S = 0.5


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _wait_quiet(actor: Actor, quiet_s: float, episodes: int, limit_s: float) -> None:
    """Return once the actor has compiled nothing for `quiet_s` and for `episodes` finished
    episodes: with few envs, a program a rare episode shape needs (a decode window, a
    prefill bucket) may come up only after several episodes, not seconds."""
    t0 = last_change = time.monotonic()
    seen, since = actor.engine.compile_count, actor.stats.episodes
    while time.monotonic() - last_change < quiet_s or actor.stats.episodes - since < episodes:
        if time.monotonic() - t0 > limit_s:
            raise SystemExit(f"actor still compiling after {limit_s:.0f} s of warm-up")
        time.sleep(0.1)
        if (now := actor.engine.compile_count) != seen:
            seen, last_change, since = now, time.monotonic(), actor.stats.episodes


def _window(actor: Actor, window_s: float, min_episodes: int) -> dict[str, float]:
    """Episodes/s over at least `window_s` and `min_episodes` (at most 8 windows long)."""
    n0, c0, k0, s0 = actor.stats.episodes, actor.policy.calls, actor.engine.compile_count, _cpu_s()
    t0 = time.monotonic()
    while (elapsed := time.monotonic() - t0) < window_s or (
        actor.stats.episodes - n0 < min_episodes and elapsed < 8 * window_s
    ):
        time.sleep(0.05)
    episodes = actor.stats.episodes - n0
    new_calls = actor.policy.calls - c0
    batches = actor.policy.batch_sizes[-new_calls:] if new_calls else []
    latency = actor.policy.latency_s[-new_calls:] if new_calls else []
    return {
        "episodes/s": episodes / elapsed,
        "episodes": episodes,
        "policy batch": float(np.mean(batches)) if batches else 0.0,
        "policy p50 ms": 1000 * float(np.median(latency)) if latency else 0.0,
        "cpu cores busy": (_cpu_s() - s0) / elapsed,
        "compiles": actor.engine.compile_count - k0,
    }


def measure_actor(
    root: str, envs: int, *, window_s: float, quiet_s: float, min_episodes: int
) -> dict[str, float]:
    cfg = config_from_dict(
        {
            "store": root,
            "run_name": f"e{envs}",
            "model": {"preset": "tiny"},
            "env": {"name": "calculator", "latency_s": LATENCY_S},
            "actor": {"envs_per_actor": envs, "group_size": 1, "episodes_per_shard": 64},
            "learner": {"advantage": "batch"},  # groups of one: no group baseline
        }
    )
    store = write_config(cfg)
    _, model = build_policy(cfg.model, seed=1)
    WeightsPublisher(store).publish(
        flat_params(model), version=0, step=0, model=model_meta(cfg.model, model)
    )
    actor = Actor(cfg, store, actor_id=f"bench-{envs}")
    thread = threading.Thread(target=actor.run)
    thread.start()
    try:
        # Quiet for as many episodes as envs too: at E=256, 8 episodes pass in 0.1 s, before
        # the policy's batches have taken the sizes a steady state gives them.
        quiet_episodes = max(min_episodes, 2 * envs)
        _wait_quiet(actor, quiet_s, quiet_episodes, limit_s=300)
        for _ in range(3):
            result = _window(actor, window_s, min_episodes)
            if result["compiles"] == 0 and result["episodes"] > 0:
                return result
            _wait_quiet(actor, quiet_s, quiet_episodes, limit_s=300)
        raise SystemExit(f"E={envs}: every timed window compiled or finished nothing: {result}")
    finally:
        mark_done(store, "benchmark")
        thread.join()


def measure_sampler(batches: list[int], prompt: int, new_tokens: int, repeats: int) -> list:
    chat, sampler = build_sampler(ModelConfig(preset="small"), seed=0)
    tok = chat.tokenizer
    rng = np.random.default_rng(0)
    rows = []
    for b in batches:
        ctx = [
            [tok.bos_id, *rng.integers(8, tok.vocab_size, size=prompt - 1).tolist()]
            for _ in range(b)
        ]

        def call(i: int, ctx=ctx) -> int:
            out = sampler.sample(ctx, max_new_tokens=new_tokens, stop_ids=(), rng=jax.random.key(i))
            return sum(len(s.tokens) for s in out)

        call(0)  # compile
        t0 = time.perf_counter()
        tokens = sum(call(i + 1) for i in range(repeats))
        dt = time.perf_counter() - t0
        rows.append((b, tokens / dt, tokens / dt / _cores(), 1000 * dt / repeats))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--window", type=float, default=15.0, help="seconds per measurement")
    parser.add_argument("--min-episodes", type=int, default=8, help="per measurement")
    parser.add_argument("--quiet", type=float, default=5.0, help="warm-up: s with no compile")
    parser.add_argument("--skip-sampler", action="store_true")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = {
            "jax_compilation_cache_dir": f"{tmp}/xla_cache",
            "jax_persistent_cache_min_compile_time_secs": 0.0,
            "jax_persistent_cache_min_entry_size_bytes": 0,
        }
        old = {k: getattr(jax.config, k) for k in cache}
        for k, v in cache.items():
            jax.config.update(k, v)
        try:
            for e in args.envs:
                results[e] = measure_actor(
                    f"file://{tmp}/runs",
                    e,
                    window_s=args.window,
                    quiet_s=args.quiet,
                    min_episodes=args.min_episodes,
                )
                print(f"E={e}: " + ", ".join(f"{k} {v:.2f}" for k, v in results[e].items()))
        finally:
            for k, v in old.items():
                jax.config.update(k, v)
            compilation_cache.reset_cache()
    base = results[args.envs[0]]["episodes/s"] / args.envs[0]
    cols = list(next(iter(results.values())))
    print(
        f"\nActor, calculator env, {LATENCY_S}s latency per reset/step, tiny policy, group_size=1"
    )
    print(
        f"{'E':>4}"
        + "".join(f"{c:>16}" for c in cols)
        + f"{'speed-up':>10}{'ideal':>8}{'of linear':>11}"
    )
    for e, r in results.items():
        speedup = r["episodes/s"] / results[args.envs[0]]["episodes/s"]
        print(
            f"{e:>4}"
            + "".join(f"{r[c]:>16.2f}" for c in cols)
            + f"{speedup:>9.1f}x{e / args.envs[0]:>7.0f}x{speedup * args.envs[0] / e:>11.2f}"
        )
    print(f"(one env: {1 / base:.2f} s per episode; {_cores()} cores)")
    if not args.skip_sampler:
        print('\nSampler.sample, "small" preset, 64-token prompts, 32 new tokens per row')
        print(f"{'batch':>6}{'tokens/s':>12}{'tokens/s/core':>15}{'ms/call':>10}")
        for b, tps, per_core, ms in measure_sampler([16, 64, 256], 64, 32, repeats=3):
            print(f"{b:>6}{tps:>12.0f}{per_core:>15.0f}{ms:>10.1f}")


if __name__ == "__main__":
    main()
