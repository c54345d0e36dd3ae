"""The remote engine's cost: turns/s through `tunix-tasks serve` over loopback HTTP (the
`RemoteEngine` an actor with `actor.remote.url` uses) against the in-process batched
sampler (`BatchingPolicy`, the async actor's own), same model, same concurrency, same
turns; the per-turn overhead in ms at concurrency 1; a weights push (write the Hugging
Face folder, the server loads it) against the snapshot's bytes; and a fleet of `--fleet`
actors on the one server pushing each version at once, each through its own folder (no
snapshot digest: every actor writes and pushes it) against the folder they share (the
runtime's way: the manifest's digest names it, one actor writes it, one push reaches the
server), alternated version by version; the pushes the server was asked for come from its
`GET /health`.

Workload: E callers each play episodes of `--turns` turns of at most `--new-tokens`
tokens: a 32-token prompt, then each turn's sampled ids and a 4-token reply appended (the
same session, as an episode's turns). The server is its own process (`tunix-tasks serve
--port 0`), so client and server do not share an interpreter. Each path at each E runs
unmeasured until every caller has finished two episodes, `--warmup` s have passed and
nothing has compiled for `--quiet` s, then
turns are counted over `--window` s (both processes share one persistent compile cache, so
a program one path compiled the other loads); the sampler's compile count (the server's from `GET
/health`) must not move inside a window: one that met a compile, or held fewer turns than
callers, is measured again over twice the time (at most five times, then the run fails).

    python benchmarks/remote_engine.py [--preset small] [--envs 1 16 64] [--window 10]
    python benchmarks/remote_engine.py --smoke      # every code path, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import numpy as np
from flax import nnx

from tunix_tasks.actor.asynchronous.batching import BatchingPolicy
from tunix_tasks.actor.remote.engine import RemoteEngine
from tunix_tasks.config import RunConfig, config_from_dict
from tunix_tasks.frontdoor.compile_cache import ENV, enable_compile_cache
from tunix_tasks.policy.build import build_actor_sampler, build_policy, lora_spec, policy_spec
from tunix_tasks.policy.params import flat_params
from tunix_tasks.policy.spec import LoraSpec

PROMPT, REPLY = 32, 4
Turn = Callable[[list[int], str], Awaitable[list[int]]]


def _config(args) -> RunConfig:
    envs = max(args.envs)
    return config_from_dict(
        {
            "model": {"preset": args.preset},
            "actor": {
                "envs_per_actor": envs,
                "kv_cache_slots": envs,
                "max_new_tokens": args.new_tokens,
                "max_episode_tokens": PROMPT + args.turns * (args.new_tokens + REPLY),
                "batch_wait_s": args.batch_wait,
            },
        }
    )


def _overrides(cfg: RunConfig) -> list[str]:
    a = cfg.actor
    return [
        f"model.preset={cfg.model.preset}",
        f"model.lora_rank={cfg.model.lora_rank}",
        f"actor.envs_per_actor={a.envs_per_actor}",
        f"actor.kv_cache_slots={a.kv_cache_slots}",
        f"actor.max_new_tokens={a.max_new_tokens}",
        f"actor.max_episode_tokens={a.max_episode_tokens}",
        f"actor.batch_wait_s={a.batch_wait_s}",
    ]


async def _rate(turn: Turn, compiles: Callable[[], Awaitable[int]], envs: int, args, vocab: int):
    """(turns/s over the window, per-turn latencies in it); fails if anything compiled."""
    rng = np.random.default_rng(0)
    done_episodes = [0] * envs
    stamps: list[tuple[float, float]] = []  # (end, latency)
    stop = asyncio.Event()

    async def caller(i: int) -> None:
        n = 0
        while not stop.is_set():
            context = [int(t) for t in rng.integers(5, vocab, PROMPT)]
            session = f"c{i}-e{n}"
            for _ in range(args.turns):
                t0 = time.perf_counter()
                tokens = await turn(context, session)
                stamps.append((time.perf_counter(), time.perf_counter() - t0))
                context += tokens + [int(t) for t in rng.integers(5, vocab, REPLY)]
            done_episodes[i] += 1
            n += 1

    tasks = [asyncio.create_task(caller(i)) for i in range(envs)]
    t_warm = time.perf_counter() + args.warmup
    count, changed = await compiles(), time.perf_counter()
    while (
        min(done_episodes) < 2
        or time.perf_counter() < t_warm
        or time.perf_counter() - changed < args.quiet
    ):
        await asyncio.sleep(0.1)
        if (n := await compiles()) != count:
            count, changed = n, time.perf_counter()
    # A window that met a compile (a program the warm-up missed; one still compiling when
    # the window opened finishes no turn in it) is measured again, twice as long each time
    # (a loaded host may finish fewer than `envs` turns in a short one).
    for attempt in range(5):
        before, start = await compiles(), time.perf_counter()
        await asyncio.sleep(args.window * 2**attempt)
        end, after = time.perf_counter(), await compiles()
        inside = [lat for t, lat in stamps if start <= t <= end]
        if after == before and len(inside) >= envs:
            break
        print(f"  (E={envs}: {after - before} compiles, {len(inside)} turns in the window: again)")
    stop.set()
    await asyncio.gather(*tasks)
    if after != before or len(inside) < envs:
        raise SystemExit(f"every timed window met a compile or too few turns (E={envs})")
    return len(inside) / (end - start), inside


def _start_server(cfg: RunConfig, cache: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tunix_tasks.frontdoor.cli", "serve", "--port", "0"]
    for o in _overrides(cfg):
        cmd += ["--set", o]
    env = os.environ | {ENV: cache}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if " on http" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.rsplit(" ", 1)[1].strip()


async def measure(args, cache: str) -> None:
    cfg = _config(args)
    vocab = policy_spec(cfg.model)[1].vocab_size
    os.environ[ENV] = cache
    enable_compile_cache()
    server, url = _start_server(cfg, cache)
    try:
        _, sampler = build_actor_sampler(cfg)
        policy = BatchingPolicy(
            sampler, max_new_tokens=args.new_tokens, gather_s=cfg.actor.batch_wait_s
        )
        engine = _engine(args, cfg, url, connections=max(args.envs))
        flat = flat_params(build_policy(cfg.model, seed=1)[1])
        await asyncio.to_thread(engine.update_params, flat, version=0)  # as an actor does

        async def local_turn(context: list[int], session: str) -> list[int]:
            tokens, _, _ = await policy(context, session=session)
            return tokens

        async def remote_turn(context: list[int], session: str) -> list[int]:
            tokens, _, _ = await engine(context, session=session)
            return tokens

        async def local_compiles() -> int:
            return sampler.compile_count

        async with httpx.AsyncClient(base_url=url, timeout=60) as http:

            async def server_compiles() -> int:
                return int((await http.get("/health")).json()["compile_count"])

            print(
                f"{cfg.model.preset} preset, {args.turns} turns of <= {args.new_tokens} tokens, "
                f"batch_wait_s {args.batch_wait}"
            )
            print(f"{'E':>5} {'in-process t/s':>15} {'remote t/s':>11} {'ratio':>6}")
            latencies = {}
            async with policy, engine:
                for envs in args.envs:
                    local, lat_l = await _rate(local_turn, local_compiles, envs, args, vocab)
                    far, lat_r = await _rate(remote_turn, server_compiles, envs, args, vocab)
                    latencies[envs] = (lat_l, lat_r)
                    print(f"{envs:>5} {local:>15.1f} {far:>11.1f} {far / local:>6.2f}")
            if 1 in latencies:
                lat_l, lat_r = latencies[1]
                extra = statistics.median(lat_r) - statistics.median(lat_l)
                print(
                    f"per-turn overhead at E=1: {extra * 1e3:.2f} ms "
                    f"(median {statistics.median(lat_r) * 1e3:.1f} vs "
                    f"{statistics.median(lat_l) * 1e3:.1f} ms in-process)"
                )

        size = sum(v.nbytes for v in flat.values())
        times = []
        for v in range(1, args.pushes + 1):
            t0 = time.perf_counter()
            await asyncio.to_thread(engine.update_params, flat, version=v)
            times.append(time.perf_counter() - t0)
        push = statistics.median(times)
        print(
            f"weights push (write the folder, the server loads it): {push * 1e3:.0f} ms for "
            f"{size / 1e6:.1f} MB, {size / push / 1e6:.0f} MB/s (median of {args.pushes})"
        )
        await asyncio.to_thread(_fleet_pushes, args, cfg, url, flat, args.pushes + 1)
    finally:
        server.terminate()
        server.wait(30)
    if args.lora_rank:  # from a thread: the engine's push runs its own event loop
        await asyncio.to_thread(_adapter_pushes, args, cfg, cache, full_s=push, full_bytes=size)


def _adapter_pushes(args, cfg: RunConfig, cache: str, *, full_s: float, full_bytes: int) -> None:
    """A LoRA run's push (a PEFT folder, loaded by name) on a server of the same preset
    with `--lora-rank` adapters on every projection, against the full push above."""
    model = cfg.model.model_copy(update={"lora_rank": args.lora_rank})
    cfg = cfg.model_copy(update={"model": model})
    server, url = _start_server(cfg, cache)
    try:
        engine = _engine(args, cfg, url, connections=1, lora=lora_spec(cfg.model))
        _, lora_model = build_policy(cfg.model, seed=1)
        adapters = flat_params(lora_model, nnx.LoRAParam)
        times = []
        for v in range(1, args.pushes + 1):
            t0 = time.perf_counter()
            engine.update_params(adapters, version=v, only=nnx.LoRAParam)
            times.append(time.perf_counter() - t0)
    finally:
        server.terminate()
        server.wait(30)
    push, size = statistics.median(times), sum(v.nbytes for v in adapters.values())
    print(
        f"adapter push (rank {args.lora_rank}, every projection; write the PEFT folder, the "
        f"server loads it by name): {push * 1e3:.0f} ms for {size / 1e6:.2f} MB (median of "
        f"{args.pushes}): {push / full_s:.2f}x the full push's time, "
        f"{size / full_bytes:.3f}x its bytes"
    )


def _engine(
    args,
    cfg: RunConfig,
    url: str,
    *,
    connections: int,
    actor_id: str = "actor-0",
    lora: LoraSpec | None = None,
    **remote,
) -> RemoteEngine:
    """An actor's engine on the server at `url` (`remote`: more `actor.remote` fields)."""
    chat, spec = policy_spec(cfg.model)
    return RemoteEngine(
        cfg.actor.remote.model_copy(update={"url": url, **remote}),
        chat=chat,
        spec=spec,
        max_new_tokens=args.new_tokens,
        temperature=1.0,
        top_k=0,
        seed=0,
        connections=connections,
        run_folder="bench",
        actor_id=actor_id,
        lora=lora,
    )


def _fleet_pushes(args, cfg: RunConfig, url: str, flat: dict, first: int) -> None:
    """`--fleet` actors push each new version at once: through their own folders, then
    through the shared one, alternated; wall time until all hold it, folders written,
    pushes that reached the server."""

    def pushes() -> int:
        return int(httpx.get(f"{url}/health", timeout=60).json()["weights"]["pushes"])

    with tempfile.TemporaryDirectory(prefix="remote-bench-w-") as shared:
        fleet = [
            _engine(args, cfg, url, connections=1, actor_id=f"actor-{i}", weights_dir=shared)
            for i in range(args.fleet)
        ]
        walls: dict[str, list[float]] = {"own folders": [], "shared": []}
        writes, served = dict.fromkeys(walls, 0), dict.fromkeys(walls, 0)
        version = first
        for _ in range(args.pushes):
            for how in walls:
                digest = f"{version:064x}" if how == "shared" else ""
                before, asked = sum(e.folders_written for e in fleet), pushes()
                start = threading.Barrier(len(fleet))

                def push(engine: RemoteEngine, v=version, d=digest, start=start) -> None:
                    start.wait()  # all at once, as actors polling the same LATEST
                    engine.update_params(flat, version=v, digest=d)

                t0 = time.perf_counter()
                with ThreadPoolExecutor(len(fleet)) as pool:
                    list(pool.map(push, fleet))
                walls[how].append(time.perf_counter() - t0)
                writes[how] += sum(e.folders_written for e in fleet) - before
                served[how] += pushes() - asked
                version += 1
    own, shared_s = (statistics.median(walls[h]) for h in walls)
    print(
        f"a fleet of {args.fleet} on one server, a version pushed by all at once (median of "
        f"{args.pushes}): own folders {own * 1e3:.0f} ms, "
        f"{writes['own folders'] / args.pushes:.0f} folders written, "
        f"{served['own folders'] / args.pushes:.0f} pushes reached the server; shared "
        f"{shared_s * 1e3:.0f} ms, {writes['shared'] / args.pushes:.0f} written, "
        f"{served['shared'] / args.pushes:.0f} pushed; shared / own {shared_s / own:.2f}x the time"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="small", choices=("tiny", "small", "base"))
    p.add_argument("--envs", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--window", type=float, default=10.0)
    p.add_argument("--quiet", type=float, default=10.0, help="s without a compile before a window")
    p.add_argument("--pushes", type=int, default=3)
    p.add_argument("--fleet", type=int, default=4, help="actors pushing to one server at once")
    p.add_argument(
        "--lora-rank", type=int, default=8, help="a LoRA run's adapter push too (0: not)"
    )
    p.add_argument(
        "--batch-wait",
        type=float,
        default=0.02,
        help="actor.batch_wait_s of both samplers (the config's default 0.02)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny preset, E=1 and 4, short windows")
    args = p.parse_args()
    if args.smoke:
        args.preset, args.envs, args.warmup, args.window, args.pushes = "tiny", [1, 4], 0.5, 1.0, 1
        args.quiet = 5.0
    with tempfile.TemporaryDirectory(prefix="remote-bench-xla-") as cache:
        asyncio.run(measure(args, cache))


if __name__ == "__main__":
    main()
