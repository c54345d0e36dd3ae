"""The buffer at fleet scale: W writers, one learner-side reader, a run growing to 100k shards.

For each store (file://, and gs:// on a real fake-gcs-server), each fleet size W and each
run size N (shards already in the run, all consumed by the reader):

  history  N shards spread over W actor folders, named at a realistic cadence (one shard
           per actor every `--interval-s` seconds of simulated time, so a W=10 run of
           100k shards spans 14 h and its time folders). On file:// they are hard links
           of one real shard (writing 100k files through fsync would dominate the run);
           on gs:// they are uploaded (fake-gcs-server with its memory backend:
           `FakeGcs(backend="memory")`). The reader's position is the one a learner that
           consumed them all checkpoints (watermarks trailing by the 10 s grace window).
  write    `--live` new shards (32 episodes of log-normal length, ~2 KB each before
           compression, encoded once in a pool) written round-robin by the W writers
           through `ObjectStore.write_bytes` under `RunLayout.shard_key` keys at the same
           simulated cadence, 8 uploads in flight: shards/s and MB/s.
  ingest   a fresh `EpisodeSource` restored at that position drains them as the learner
           does (`poll()` then `ack_entries` of every block): episodes/s and MB/s (best of two
           drains, the N of one W taking turns), and that rate over the learner's
           training rate (below). Writers and reader run one after
           the other: on 2 cores, concurrent writers would bill their CPU to the reader.
  poll     `--polls` rounds (at most `--poll-budget-s`), the runs of every N of one W
           taking turns (a shared machine's load then weighs on each N alike): one new
           shard lands, then the reader's sweep (`pending_shards`: one listing per actor folder from its
           watermark) is timed: p50 / p99 ms, keys the listings returned, list requests,
           and one listing of an empty prefix ("1 list ms": the store's own cost of a
           request; the emulator scans the whole bucket for every listing, real GCS does
           not, so on gs:// keys/poll and requests/poll are the figures that carry),
           and one listing of the whole `shards/` prefix ("full ms": what every poll cost
           before #11.11, the in-run baseline).

The learner's training rate: the learner alone at the small preset (`model.preset=small`,
the demo's episode shape: 64 tokens, buckets [128], 8 rows), steady episodes/s after its
first step, measured in the same run (`--learner-eps` to give it instead). Shard sizing:
write and read cost per shard for 8 to 512 episodes per shard on both stores.

Goals (issue #16): sweep p50 at the largest N within 2x of the smallest N, per store and
W; ingest >= 10x the learner's episodes/s.

    python benchmarks/buffer.py [--writers 10 100 1000] [--shards 1000 10000 100000]
                                [--gcs-shards 1000 5000] [--live 512] [--stores file gs]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from tunix_tasks.learner.position import ShardPosition
from tunix_tasks.learner.source import EpisodeSource
from tunix_tasks.storage.backends.local_tempfiles import sweep_temp_files
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.shards import episodes_to_table, table_to_parquet_bytes
from tunix_tasks.storage.store import ObjectStore, open_store
from tunix_tasks.testing.gcs_server import FakeGcs
from tunix_tasks.testing.shard_factory import make_episode, realistic_lengths

UPLOADS_IN_FLIGHT = 8


class Counting:
    """Forwards to a store; counts list requests and the keys they return."""

    def __init__(self, store: ObjectStore) -> None:
        self._store, self.lists, self.keys = store, 0, 0

    def list(self, prefix: str = "", **kw) -> list:
        out = self._store.list(prefix, **kw)
        self.lists, self.keys = self.lists + 1, self.keys + len(out)
        return out

    def list_folders(self, prefix: str) -> list[str]:
        self.lists += 1
        return self._store.list_folders(prefix)

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)


def payload_pool(n: int, per_shard: int, seed: int = 0) -> list[bytes]:
    """`n` distinct shards of `per_shard` episodes (~2 KB each before compression)."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(n):
        lengths = realistic_lengths(rng, per_shard, hi=1024)
        eps = [
            make_episode(rng, length=int(L), group_id=f"{s}/{i // 8}")
            for i, L in enumerate(lengths)
        ]
        out.append(table_to_parquet_bytes(episodes_to_table(eps)))
    return out


def actor(a: int) -> str:
    return f"actor-{a:04d}"


class Run:
    """One store, one fleet size: the history grows from one N to the next."""

    def __init__(self, uri: str, writers: int, interval_s: float, max_shards: int) -> None:
        self.uri, self.writers, self.interval_s = uri, writers, interval_s
        self.store = open_store(uri)
        self.keys: list[str] = []
        self.slots = [0] * writers  # shards each actor has written so far
        self.template = b""  # the shard the history links to and the polls write
        self.source: EpisodeSource  # the reader, once it has ingested the live shards
        self.counting: Counting  # its store
        # Simulated creation times, one slot per shard of an actor, ending before now.
        self.t0 = time.time() - (2 * max_shards // writers + 1000) * interval_s

    def key(self, a: int) -> str:
        """The next shard key of actor `a`, at its realistic cadence."""
        slot, self.slots[a] = self.slots[a], self.slots[a] + 1
        return RunLayout.shard_key(actor(a), self.t0 + slot * self.interval_s + a * 1e-3)

    def grow(self, shards: int) -> float:
        """History so that the run holds `shards` shards; returns seconds taken."""
        t = time.perf_counter()
        rounds = max(0, -(-(shards - len(self.keys)) // self.writers))  # ceil
        new = [self.key(a) for _ in range(rounds) for a in range(self.writers)]
        if self.uri.startswith("file://"):
            root = Path(self.uri.removeprefix("file://"))
            for i, key in enumerate(new, start=len(self.keys)):
                first = root / f"template-{i // 60_000}.parquet"  # ext4: 65,000 links a file
                if not first.exists():
                    root.mkdir(parents=True, exist_ok=True)
                    first.write_bytes(self.template)
                (root / key).parent.mkdir(parents=True, exist_ok=True)
                os.link(first, root / key)
        else:
            with ThreadPoolExecutor(UPLOADS_IN_FLIGHT) as pool:  # the client pools 10
                list(pool.map(lambda k: self.store.write_bytes(k, self.template), new))
        self.keys += new
        return time.perf_counter() - t

    def consumed_state(self) -> dict:
        """The position of a learner that read and acknowledged every shard so far."""
        pos = ShardPosition()
        for key in self.keys:
            pos.opened(key, 1)
            pos.ack(key, [0])
        pos.compact(self.keys)
        return {**pos.get_state(), "seen": {}}

    def write_live(self, pool: list[bytes], live: int) -> tuple[float, int]:
        """`live` shards, round-robin over the writers: (seconds, bytes)."""
        jobs = [(self.key(j % self.writers), pool[j % len(pool)]) for j in range(live)]

        def put(job: tuple[str, bytes]) -> str:
            self.store.write_bytes(*job)
            return job[0]

        t = time.perf_counter()
        with ThreadPoolExecutor(UPLOADS_IN_FLIGHT) as ex:
            self.keys += list(ex.map(put, jobs))
        return time.perf_counter() - t, sum(len(p) for _, p in jobs)

    def ingest(self, state: dict, live: int) -> tuple[float, int, EpisodeSource, Counting]:
        """Drain the live shards as the learner does: (seconds, episodes, source, store)."""
        counting = Counting(self.store)
        source = EpisodeSource(counting, vocab_size=103)
        source.set_state(state)
        t, episodes, shards = time.perf_counter(), 0, 0
        while shards < live:
            blocks = source.poll()
            if not blocks:
                raise RuntimeError(f"reader starved after {shards} of {live} shards")
            shards += len(blocks)
            for block in blocks:
                episodes += len(block)
                source.ack_entries(block, np.arange(len(block)))
        return time.perf_counter() - t, episodes, source, counting

    def poll_once(self, rng: np.random.Generator) -> tuple[float, int, int]:
        """One new shard, then the reader's timed sweep: (seconds, keys listed, requests)."""
        source, store = self.source, self.counting
        key = self.key(int(rng.integers(self.writers)))
        self.store.write_bytes(key, self.template)
        self.keys.append(key)
        k0, l0 = store.keys, store.lists
        t = time.perf_counter()
        pending = source.pending_shards()
        took = time.perf_counter() - t
        assert key in pending, "the new shard was not found"
        for block in source.poll():
            source.ack_entries(block, np.arange(len(block)))
        return took, store.keys - k0, store.lists - l0

    def store_costs(self) -> dict:
        empty = []  # the store's own cost of one request, whatever it returns
        for _ in range(5):
            t = time.perf_counter()
            self.store.list("nothing/")
            empty.append(time.perf_counter() - t)
        t = time.perf_counter()
        self.store.list(RunLayout.SHARDS)
        costs = {"empty list ms": float(np.median(empty) * 1e3)}
        costs["full list ms"] = (time.perf_counter() - t) * 1e3  # a poll before #11.11
        if self.uri.startswith("file://"):
            t = time.perf_counter()
            sweep_temp_files(Path(self.uri.removeprefix("file://")), 3600.0)
            costs["tmp sweep ms"] = (time.perf_counter() - t) * 1e3
        return costs


def learner_episodes_per_s(root: str, steps: int) -> float:
    """Steady episodes/s of the learner alone at the small preset (utilization.py's setup)."""
    from benchmarks.utilization import overrides_for
    from tunix_tasks.config import load_config
    from tunix_tasks.frontdoor.audit import learner_steps
    from tunix_tasks.frontdoor.entrypoints import prepare_run, run_learner
    from tunix_tasks.frontdoor.report import read_records
    from tunix_tasks.storage.shards import ShardWriter

    ov = overrides_for(root, steps, 0.0, 1, 1, 1_000_000)
    cfg = load_config("configs/demo.yaml", [*ov, "run_name=learner", "warm_start_steps=0"])
    uri = prepare_run(cfg)
    store, rng = open_store(uri), np.random.default_rng(0)
    writer = ShardWriter(store, actor_id="actor-0000", max_episodes=cfg.actor.episodes_per_shard)
    for i in range(int(2 * steps * cfg.learner.min_episodes_per_step) + 64):
        writer.add(make_episode(rng, length=64, group_id=f"g{i // cfg.actor.group_size}"))
    writer.close()
    run_learner(uri, max_steps=steps, handle_signals=False)
    done = learner_steps(read_records(open_store(uri)))
    span = done[-1]["time"] - done[0]["time"]
    return sum(r["episodes"] for r in done[1:]) / span


def shard_sizes(uri: str, sizes: list[int], shards: int) -> list[dict]:
    """Per-shard write and read (+ validate + decode) cost against episodes per shard."""
    from tunix_tasks.storage.validation import read_shard

    store, out = open_store(uri), []
    for per in sizes:
        pool = payload_pool(max(4, shards * 32 // per), per, seed=per)
        keys = [f"sizes/{per}/{i:06d}.parquet" for i in range(len(pool))]
        t = time.perf_counter()
        for key, data in zip(keys, pool, strict=True):
            store.write_bytes(key, data)
        w = (time.perf_counter() - t) / len(pool)
        t = time.perf_counter()
        for key in keys:
            read_shard(store, key, vocab_size=103).column("tokens").combine_chunks()
        r = (time.perf_counter() - t) / len(pool)
        kb = np.mean([len(p) for p in pool]) / 1e3
        out.append(
            {
                "episodes/shard": per,
                "KB": kb,
                "write ms": w * 1e3,
                "read ms": r * 1e3,
                "read episodes/s": per / r,
                "read MB/s": kb / 1e3 / r,
            }
        )
    return out


def bench_store(uri_for, name: str, args, pool: list[bytes], grow_to: list[int]) -> list[dict]:
    """Per W: one run per size N, built and ingested in turn; then their polls interleaved,
    so that the load of a shared machine weighs on every N alike."""
    rows = []
    small = payload_pool(1, 1)[0]
    for w in args.writers:
        runs, stats, states = [], [], []
        for n in [n for n in grow_to if n >= w]:
            run = Run(uri_for(), w, args.interval_s, n)
            run.template = small  # history and poll shards: one short episode (a real shard)
            grow_s = run.grow(n - args.live)
            states.append(run.consumed_state())
            write_s, nbytes = run.write_live(pool, args.live)
            runs.append(run)
            stats.append(
                {
                    "store": name,
                    "writers": w,
                    "shards": len(run.keys),
                    "history s": grow_s,
                    "write shards/s": args.live / write_s,
                    "write MB/s": nbytes / 1e6 / write_s,
                    "ingest eps/s": 0.0,
                    "bytes": nbytes,
                }
            )
        for _ in range(2):  # best of two drains per N, interleaved: the machine is shared
            for run, row, state in zip(runs, stats, states, strict=True):
                if hasattr(run, "source"):
                    run.source.close()
                ingest_s, episodes, run.source, run.counting = run.ingest(state, args.live)
                if episodes / ingest_s > row["ingest eps/s"]:
                    row["ingest eps/s"] = episodes / ingest_s
                    row["ingest MB/s"] = row["bytes"] / 1e6 / ingest_s
        polls: list[list[tuple[float, int, int]]] = [[] for _ in runs]
        rng, end = np.random.default_rng(1), time.monotonic() + args.poll_budget_s
        for i in range(args.polls):
            if i >= 3 and time.monotonic() > end:
                break
            for run, out in zip(runs, polls, strict=True):
                out.append(run.poll_once(rng))
        for run, row, out in zip(runs, stats, polls, strict=True):
            ms = np.asarray([p[0] for p in out]) * 1e3
            row |= {
                "poll p50 ms": float(np.percentile(ms, 50)),
                "poll p99 ms": float(np.percentile(ms, 99)),
                "keys/poll": float(np.mean([p[1] for p in out])),
                "requests/poll": float(np.mean([p[2] for p in out])),
                "polls": len(out),
            }
            row |= run.store_costs()
            run.source.close()
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--writers", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--shards", type=int, nargs="+", default=[1000, 10_000, 100_000])
    p.add_argument("--gcs-shards", type=int, nargs="+", default=[1000, 5000])
    p.add_argument("--stores", nargs="+", default=["file", "gs"])
    p.add_argument("--live", type=int, default=512, help="new shards written and ingested")
    p.add_argument("--per-shard", type=int, default=32)
    p.add_argument("--interval-s", type=float, default=5.0, help="simulated shard cadence")
    p.add_argument("--polls", type=int, default=30)
    p.add_argument("--poll-budget-s", type=float, default=10.0, help="per W, all N together")
    p.add_argument("--learner-eps", type=float, help="skip measuring the learner")
    p.add_argument("--learner-steps", type=int, default=12)
    p.add_argument("--size-shards", type=int, default=24, help="0: skip shard sizing")
    args = p.parse_args()
    t_start = time.monotonic()
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    machine = f"{cpu}, {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}"
    with tempfile.TemporaryDirectory(prefix="buffer-") as tmp:
        learner = args.learner_eps or learner_episodes_per_s(tmp, args.learner_steps)
        pool = payload_pool(max(args.live, 64), args.per_shard)
        rows, sizes = [], {}
        counter = iter(range(1_000_000))
        if "file" in args.stores:
            uri = lambda: f"file://{tmp}/file-{next(counter)}"  # noqa: E731
            rows += bench_store(uri, "file", args, pool, args.shards)
            if args.size_shards:
                sizes["file"] = shard_sizes(uri(), [8, 32, 128, 512], args.size_shards)
        if "gs" in args.stores:
            with FakeGcs(backend="memory") as gcs:
                rows += bench_store(gcs.new_bucket_uri, "gs", args, pool, args.gcs_shards)
                if args.size_shards:
                    sizes["gs"] = shard_sizes(
                        gcs.new_bucket_uri(), [8, 32, 128, 512], args.size_shards
                    )
    report(rows, sizes, learner, machine, args, time.monotonic() - t_start)


def report(rows, sizes, learner: float, machine: str, args, wall_s: float) -> None:
    mean_kb = np.mean([len(p) for p in payload_pool(8, args.per_shard)]) / args.per_shard / 1e3
    print(f"\nmachine: {machine}; learner alone (small preset): {learner:.1f} episodes/s")
    print(
        f"live shards: {args.live} x {args.per_shard} episodes (~{mean_kb:.2f} KB/episode compressed)"
    )
    head = (
        "store",
        "W",
        "shards",
        "write sh/s",
        "ingest ep/s",
        "MB/s",
        "x learner",
        "poll p50 ms",
        "p99 ms",
        "keys/poll",
        "req/poll",
        "1 list ms",
        "full ms",
    )
    print("".join(f"{h:>12}" for h in head))
    for r in rows:
        cells = (
            r["store"],
            r["writers"],
            r["shards"],
            f"{r['write shards/s']:.0f}",
            f"{r['ingest eps/s']:.0f}",
            f"{r['ingest MB/s']:.1f}",
            f"{r['ingest eps/s'] / learner:.0f}x",
            f"{r['poll p50 ms']:.1f}",
            f"{r['poll p99 ms']:.1f}",
            f"{r['keys/poll']:.0f}",
            f"{r['requests/poll']:.0f}",
            f"{r['empty list ms']:.2f}",
            f"{r['full list ms']:.0f}",
        )
        print("".join(f"{c:>12}" for c in cells))
    print("\npoll cost as the run grows (p50 at the largest N / at the smallest; goal <= 2x):")
    for store in dict.fromkeys(r["store"] for r in rows):
        for w in dict.fromkeys(r["writers"] for r in rows if r["store"] == store):
            rs = [r for r in rows if r["store"] == store and r["writers"] == w]
            if len(rs) > 1:
                ratio = rs[-1]["poll p50 ms"] / rs[0]["poll p50 ms"]
                ingest = rs[-1]["ingest eps/s"] / rs[0]["ingest eps/s"]
                full = rs[-1]["full list ms"] / rs[0]["full list ms"]
                print(
                    f"  {store:<5} W={w:<5} {rs[0]['shards']:>7} -> {rs[-1]['shards']:>7} shards: poll {ratio:.2f}x (whole-prefix listing {full:.1f}x), keys/poll {rs[0]['keys/poll']:.0f} -> {rs[-1]['keys/poll']:.0f}, ingest {ingest:.2f}x"
                )
    worst = min(r["ingest eps/s"] for r in rows) / learner if rows else float("nan")
    print(f"lowest ingest / learner: {worst:.0f}x (goal >= 10x)")
    tmp = [(r["shards"], r["tmp sweep ms"]) for r in rows if "tmp sweep ms" in r]
    if tmp:
        print(
            f"local temp-file collection (a whole-run walk, every 10 min): {tmp[-1][1]:.0f} ms at {tmp[-1][0]} shards"
        )
    if sizes:
        print("\nshard size: per-shard write, and read + validate + decode, one thread")
        print(
            "".join(
                f"{h:>12}"
                for h in (
                    "store",
                    "episodes",
                    "KB",
                    "write ms",
                    "read ms",
                    "read ep/s",
                    "read MB/s",
                )
            )
        )
    for store, table in sizes.items():
        for s in table:
            cells = (
                store,
                s["episodes/shard"],
                f"{s['KB']:.0f}",
                f"{s['write ms']:.1f}",
                f"{s['read ms']:.1f}",
                f"{s['read episodes/s']:.0f}",
                f"{s['read MB/s']:.1f}",
            )
            print("".join(f"{c:>12}" for c in cells))
    print(f"\nwall {wall_s:.0f} s")
    print(json.dumps({"machine": machine, "learner_eps": learner, "rows": rows, "sizes": sizes}))


if __name__ == "__main__":
    main()
