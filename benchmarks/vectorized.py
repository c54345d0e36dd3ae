"""The vectorized actor against the asynchronous one: same task, same model, one run.

For each E in `--envs` (default 64, 256, 1024, 4096), an `Actor` (`actor.kind=async`:
E calculator envs on an asyncio loop, the continuously batched sampler) and a
`VectorizedActor` (`actor.kind=vectorized`: the JAX calculator and the policy in one
jitted loop) run on a file:// run with the same published weights (the "tiny" preset's
random init), `group_size` 4, 3 turns, 8 new tokens a turn, 96-token episodes. After the
first committed shard, and once no new program was compiled for `--warmup` s (the
asynchronous sampler compiles a program per new shape it meets), each actor is measured
for `--window` s:

* trained-ready episodes/s: episodes committed to shards (whole GRPO groups), the rate the
  learner can be fed at;
* env steps/s: the turns of those episodes (each turn is one env step);
* x async: the vectorized actor's episodes/s over the asynchronous actor's at the same E;
* of decode limit: the vectorized loop's row steps/s (every row feeds one token per
  step) over a bare decode loop at batch E with the same model and cache (one
  `forward_with_cache` per step and nothing else), measured in the same run: what the
  environments, sampling and bookkeeping cost on top of the model.

Then bf16 sampling (`model.dtype=bfloat16`) against float32 at one E: episodes/s, and the
mismatch a float32 learner would see at staleness 0 (mean k3 KL and max |log-prob diff|
over the recorded policy tokens, rescored by one full float32 forward pass).

    python benchmarks/vectorized.py [--envs 64 256 1024 4096] [--warmup 5] [--window 15]
        [--async-max 4096] [--precision-envs 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_tasks.actor.asynchronous.actor import Actor
from tunix_tasks.actor.runtime import ActorRuntime
from tunix_tasks.actor.vectorized.actor import VectorizedActor
from tunix_tasks.config import RunConfig, config_from_dict
from tunix_tasks.episode import Episode
from tunix_tasks.learner.source import EpisodeSource
from tunix_tasks.policy.build import build_policy, model_meta
from tunix_tasks.policy.distribution import token_logprobs
from tunix_tasks.policy.params import flat_params
from tunix_tasks.storage.runs import mark_done, write_config
from tunix_tasks.storage.weights import WeightsPublisher
from tunix_tasks.testing.shard_factory import block_episodes


def _config(root: str, name: str, kind: str, envs: int, dtype: str = "float32") -> RunConfig:
    return config_from_dict(
        {
            "store": root,
            "run_name": name,
            "model": {"preset": "tiny", "dtype": dtype},
            "env": {"name": "calculator", "max_turns": 3, "kwargs": {"difficulty": 1}},
            "actor": {
                "kind": kind,
                "envs_per_actor": envs,
                "group_size": 4,
                "episodes_per_shard": max(32, envs),
                "shard_interval_s": 2.0,
                "max_new_tokens": 8,
                "max_episode_tokens": 96,
                "kv_cache_slots": min(envs, 1024),
            },
        }
    )


def _start(cfg: RunConfig, cls: type[ActorRuntime]) -> tuple[ActorRuntime, threading.Thread]:
    store = write_config(cfg)
    _, model = build_policy(cfg.model, seed=cfg.seed)
    WeightsPublisher(store).publish(
        flat_params(model), version=0, step=0, model=model_meta(cfg.model, model)
    )
    actor = cls(cfg, store, actor_id="bench")
    thread = threading.Thread(target=actor.run, daemon=True)
    thread.start()
    return actor, thread


def _committed(actor: ActorRuntime) -> tuple[int, int]:
    """(episodes, env steps) the actor committed so far: whole groups, ready to train."""
    return actor.stats.episodes, actor.stats.env_steps


def measure(cfg: RunConfig, cls: type[ActorRuntime], warmup_s: float, window_s: float) -> dict:
    actor, thread = _start(cfg, cls)
    t0 = time.monotonic()
    while not actor.writer.shards_written:  # compiles, the first groups
        if not thread.is_alive():
            raise RuntimeError(f"{cls.__name__} died before its first shard")
        time.sleep(0.05)
    first_shard_s = time.monotonic() - t0
    # The asynchronous sampler compiles a program per new (batch, chunk, window) shape as
    # it meets them: measure once no new program came for `warmup_s` (at most 3 min).
    compiles = -1
    while actor.engine.compile_count != compiles and time.monotonic() - t0 < 180:
        compiles = actor.engine.compile_count
        time.sleep(warmup_s)
    (eps0, steps0), t1 = _committed(actor), time.monotonic()
    rows0 = (getattr(actor, "row_steps", 0), getattr(actor, "collected_at", 0.0))
    time.sleep(window_s)
    (eps1, steps1), t2 = _committed(actor), time.monotonic()
    # whole segments only: row steps between two segment ends, over the time between them
    rows1 = (getattr(actor, "row_steps", 0), getattr(actor, "collected_at", 0.0))
    mark_done(actor.store, "benchmark")
    thread.join(120)
    dt = t2 - t1
    return {
        "episodes_per_s": (eps1 - eps0) / dt,
        "env_steps_per_s": (steps1 - steps0) / dt,
        "first_shard_s": first_shard_s,
        "row_steps_per_s": (rows1[0] - rows0[0]) / max(rows1[1] - rows0[1], 1e-9),
        "actor": actor,
    }


def decode_limit(cfg: RunConfig, envs: int, steps: int = 64) -> float:
    """Row steps/s of a bare decode loop: batch `envs`, the actor's cache length."""
    _, model = build_policy(cfg.model, seed=0)
    graphdef, state = nnx.split(model)
    t = cfg.actor.max_episode_tokens

    @jax.jit
    def run(state, cache):
        m = nnx.merge(graphdef, state)

        def body(i, carry):
            cache, tok = carry
            pos = jnp.full((envs, 1), i % t, jnp.int32)
            logits, cache = m.forward_with_cache(tok, pos, cache)
            return cache, jnp.argmax(logits[:, :, :8], -1).astype(jnp.int32)

        return jax.lax.fori_loop(0, steps, body, (cache, jnp.ones((envs, 1), jnp.int32)))

    cache = model.init_cache(envs, t)
    jax.block_until_ready(run(state, cache))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(run(state, cache))
        best = min(best, time.perf_counter() - t0)
    return envs * steps / best


def mismatch(cfg: RunConfig, actor: ActorRuntime, limit: int = 256) -> dict[str, float]:
    """Recorded (sampler) vs float32 rescored log-probs of committed policy tokens."""
    fp32 = cfg.model.model_copy(update={"dtype": "float32"})
    chat, model = build_policy(fp32, seed=cfg.seed)  # the published weights (the init)
    source = EpisodeSource(actor.store, vocab_size=chat.tokenizer.vocab_size)
    episodes: list[Episode] = block_episodes(source.poll(max_shards=64))[:limit]
    width = cfg.actor.max_episode_tokens
    tokens = np.zeros((len(episodes), width), np.int32)
    for i, e in enumerate(episodes):
        tokens[i, : e.length] = e.tokens
    idx = np.arange(width)
    lengths = np.asarray([e.length for e in episodes])
    seg = (idx[None] < lengths[:, None]).astype(np.int32)
    logits = nnx.jit(lambda m, t, s: m(t, jnp.broadcast_to(jnp.arange(width), t.shape), s))(
        model, jnp.asarray(tokens), jnp.asarray(seg)
    )
    lp = np.asarray(token_logprobs(logits, jnp.asarray(tokens), cfg.actor.temperature, 0))
    diffs = []
    for i, e in enumerate(episodes):
        where = np.nonzero(e.loss_mask)[0]
        diffs.append(lp[i, where - 1] - e.behavior_logprobs[where])  # log pi - log mu
    d = np.concatenate(diffs)
    return {"mean_kl": float(np.mean(np.exp(d) - 1 - d)), "max_abs_diff": float(np.abs(d).max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--envs", type=int, nargs="+", default=[64, 256, 1024, 4096])
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--window", type=float, default=15.0)
    p.add_argument("--async-max", type=int, default=4096, help="largest E for the async actor")
    p.add_argument("--precision-envs", type=int, default=256)
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = p.parse_args()
    root = f"file://{tempfile.mkdtemp(prefix='bench-vec-')}"
    print(f"JAX {jax.__version__} on {jax.devices()[0].platform}: {jax.device_count()} device(s)")
    rows = []
    for e in args.envs:
        row: dict = {"envs": e}
        if e <= args.async_max:
            a = measure(_config(root, f"a{e}", "async", e), Actor, args.warmup, args.window)
            row.update(async_eps=a["episodes_per_s"], async_steps=a["env_steps_per_s"])
        v = measure(
            _config(root, f"v{e}", "vectorized", e), VectorizedActor, args.warmup, args.window
        )
        limit = decode_limit(_config(root, "lim", "vectorized", e), e)
        row.update(
            vec_eps=v["episodes_per_s"],
            vec_steps=v["env_steps_per_s"],
            vec_first_shard_s=v["first_shard_s"],
            of_limit=(v["row_steps_per_s"] or 0.0) / limit,
            limit_row_steps=limit,
        )
        rows.append(row)
        print(json.dumps({k: round(x, 3) if isinstance(x, float) else x for k, x in row.items()}))
    precision = {}
    for dtype in ("float32", "bfloat16"):
        cfg = _config(root, f"p{dtype}", "vectorized", args.precision_envs, dtype)
        m = measure(cfg, VectorizedActor, args.warmup, args.window)
        precision[dtype] = {"episodes_per_s": m["episodes_per_s"], **mismatch(cfg, m["actor"])}
    _print(rows, precision, args.precision_envs)
    if args.json:
        print(json.dumps({"rows": rows, "precision": precision}))


def _print(rows: list[dict], precision: dict, precision_envs: int) -> None:
    print("\n| E | async episodes/s | async env steps/s | vectorized episodes/s | "
          "vectorized env steps/s | x async | of decode limit | first shard s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        a = r.get("async_eps")
        ratio = f"{r['vec_eps'] / a:.1f}x" if a else "-"
        print(
            f"| {r['envs']} | {a or float('nan'):,.1f} | {r.get('async_steps') or float('nan'):,.1f}"
            f" | {r['vec_eps']:,.1f} | {r['vec_steps']:,.1f} | {ratio} | {r['of_limit']:.2f}"
            f" | {r['vec_first_shard_s']:.1f} |"
        )
    f32 = precision["float32"]
    print(f"\nprecision (vectorized, E={precision_envs}): episodes/s, vs a float32 learner")
    print("| model.dtype | episodes/s | x float32 | mean KL | max abs logprob diff |")
    print("|---|---|---|---|---|")
    for name, m in precision.items():
        print(
            f"| {name} | {m['episodes_per_s']:,.1f} | {m['episodes_per_s'] / f32['episodes_per_s']:.2f}"
            f" | {m['mean_kl']:.2e} | {m['max_abs_diff']:.2e} |"
        )


if __name__ == "__main__":
    main()
