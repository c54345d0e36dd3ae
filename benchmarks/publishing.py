"""Learner step time with weight publishing on vs off, at `publish_every: 1` (issue #29, 5).

One `Trainer` (preset `--preset`, one bucket `--bucket`, `--rows` rows; random episodes)
trains `--steps` steps per window in each mode, the modes interleaved `--repeats` times
so load on a shared machine hits them alike:

  off        the train step alone (dispatch + collect)
  coalesce   the step, then what `Learner._publish` does after it: queue the params'
             copies to host memory (`Trainer.snapshot_params`) and hand them to
             `SnapshotPublisher.publish`, which returns at once; the wait for the copies,
             check, encode, sha256, upload to a file:// store and pruning run in its
             thread, and a version still waiting when a newer one comes is superseded
             (coalesced)
  in order   as before issue #29: the same, but `publish` first waits for the previous
             version's upload (`wait` then `publish`), so every version is published and
             a slow upload stalls the next step

Per mode: median and interquartile range of the step time (the step plus the publish
call, what the learner's loop waits on), the ratio against "off" (goal <= 1.05 for
coalesce), the longest stall of a thread that wakes every millisecond (how long the
publisher kept the learner's Python thread from running: holding the GIL, or a core;
"off" shows the step's own), and for the publishing modes the versions published /
coalesced and the median background publish time. `--store gs` publishes to a real
fake-gcs-server (objects in its memory) on this host instead of a local folder. The
train step is compiled before any window and the script asserts no compile lands inside
one. On a CPU the publisher's thread competes with XLA's for the same cores, which an
accelerator's learner does not: read the ratio as an upper bound there. `--pin` splits
the cores as an accelerator does: the train step (XLA's threads and the loop's) on the
first core, the publisher's thread and the store's server on the rest; what is left
between the modes is what the publisher costs the learner besides cores (the GIL, the
copy to host, DRAM bandwidth).

    python benchmarks/publishing.py [--preset base] [--bucket 128] [--rows 2]
        [--steps 6] [--repeats 3] [--store file|gs] [--pin]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks._machine import iqr, med
from tunix_tasks.config import config_from_dict
from tunix_tasks.learner.multihost import make_trainer
from tunix_tasks.learner.packing import PackedBatch, pack
from tunix_tasks.learner.publishing import SnapshotPublisher
from tunix_tasks.learner.train_step import Trainer
from tunix_tasks.storage.lease import Lease
from tunix_tasks.storage.retention import SnapshotRetention
from tunix_tasks.storage.store import open_store
from tunix_tasks.testing.gcs_server import FakeGcs
from tunix_tasks.testing.shard_factory import make_episode
from tunix_tasks.testing.ticker import Ticker

MODES = ("off", "coalesce", "in order")
WIDTHS = (9, 6, 6, 9, 10, 10, 11)  # of the columns after the mode's


def _batch(trainer: Trainer, bucket: int, rows: int) -> PackedBatch:
    rng = np.random.default_rng(0)
    vocab = trainer.model.vocab_size
    episodes = [make_episode(rng, length=bucket, vocab_size=vocab) for _ in range(rows)]
    return pack(episodes, buckets=(bucket,), batch_rows=rows).batches[0]


@contextlib.contextmanager
def _store_root(kind: str) -> Iterator[str]:
    """A fresh run root: a temporary folder, or a bucket of a fake-gcs-server."""
    if kind == "gs":
        with FakeGcs(backend="memory") as gcs:
            yield gcs.new_bucket_uri()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            yield tmp


def _window(
    trainer: Trainer,
    batch: PackedBatch,
    pub: SnapshotPublisher,
    mode: str,
    steps: int,
    first_version: int,
) -> list[float]:
    """Step times (s) of `steps` steps in `mode`, publishing from `first_version` on."""
    times = []
    for version in range(first_version, first_version + steps):
        t0 = time.perf_counter()
        trainer.step(batch)
        if mode != "off":
            flat = trainer.snapshot_params()
            if mode == "in order":
                pub.wait()
            pub.publish(flat, version=version, step=version)
        times.append(time.perf_counter() - t0)
    return times


def _split_cores() -> tuple[set[int], set[int]]:
    """(the train step's core, the host work's cores) for `--pin`: the first core this
    process may run on, and the rest."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"--pin needs 2 cores or more; this process may use {cores}")
    return {cores[0]}, set(cores[1:])


def _threads_per_core() -> dict[str, int]:
    """How many of this process's threads may run on each set of cores."""
    found: collections.Counter[str] = collections.Counter()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that just ended
            found[",".join(map(str, sorted(os.sched_getaffinity(int(task.name)))))] += 1
    return dict(sorted(found.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="base", choices=["tiny", "small", "base"])
    ap.add_argument("--bucket", type=int, default=128)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="steps per window")
    ap.add_argument("--repeats", type=int, default=3, help="windows per mode, interleaved")
    ap.add_argument("--store", default="file", choices=["file", "gs"])
    ap.add_argument(
        "--pin",
        action="store_true",
        help="the train step (XLA's threads, the loop) on the first core, the publisher "
        "and the store's server on the others: an accelerator's split, on a CPU",
    )
    args = ap.parse_args()

    step_cores, host_cores = _split_cores() if args.pin else (None, None)
    if host_cores:  # what starts now (the server, the publisher's thread) inherits them
        os.sched_setaffinity(0, host_cores)
    with _store_root(args.store) as root:
        store = open_store(root)
        lease = Lease(store, ttl_s=600)
        lease.acquire()
        retention = SnapshotRetention(store, keep_last=2, keep_every=0)
        pub = SnapshotPublisher(store, lease, model={}, retention=retention)
        if step_cores:  # before XLA starts its threads: they inherit the step's core
            os.sched_setaffinity(0, step_cores)
        cfg = config_from_dict(
            {
                "model": {"preset": args.preset},
                "learner": {"buckets": [args.bucket], "batch_rows": args.rows},
            }
        )
        trainer = make_trainer(cfg)
        n_params = sum(v.size for v in trainer.flat_params().values())
        batch = _batch(trainer, args.bucket, args.rows)
        trainer.step(batch)  # compiles
        compiles = trainer.compile_count
        threads = _threads_per_core()
        version = 0
        times: dict[str, list[float]] = {m: [] for m in MODES}
        published: dict[str, list[int]] = {m: [0, 0] for m in MODES}  # [asked, coalesced]
        background: dict[str, list[float]] = {m: [] for m in MODES}
        stalls: dict[str, list[float]] = {m: [] for m in MODES}
        try:
            for _ in range(args.repeats):
                for mode in MODES:
                    coalesced = pub.coalesced
                    with Ticker() as stall:
                        times[mode] += _window(trainer, batch, pub, mode, args.steps, version)
                        pub.wait()  # the next window starts with the publisher idle
                    stalls[mode].append(stall.longest)
                    if mode != "off":
                        version += args.steps
                        published[mode][0] += args.steps
                        published[mode][1] += pub.coalesced - coalesced
                        background[mode].append(pub.last_publish_s)
        finally:
            pub.close()
            lease.release()
    assert trainer.compile_count == compiles, "a compile landed inside a timed window"

    mb = n_params * 4 / 1e6
    print(
        f"preset {args.preset}: {n_params / 1e6:.1f} M params ({mb:.0f} MB a snapshot), "
        f"batch {args.rows} x {args.bucket}, {args.repeats} x {args.steps} steps per mode, "
        f"store {args.store}"
    )
    if args.pin:
        print(f"pinned: the step on core {min(step_cores)}; threads per core set {threads}")
    off = med(times["off"])
    header = (
        *("mode", "step ms", "iqr", "x off", "stall ms"),
        *("published", "coalesced", "publish ms"),
    )
    print(
        f"{header[0]:<10} " + " ".join(f"{h:>{w}}" for h, w in zip(header[1:], WIDTHS, strict=True))
    )
    for mode in MODES:
        asked, coalesced = published[mode]
        bg = f"{med(background[mode]) * 1e3:11.0f}" if background[mode] else f"{'-':>11}"
        print(
            f"{mode:<10} {med(times[mode]) * 1e3:9.1f} {iqr(times[mode]):6.2f} "
            f"{med(times[mode]) / off:6.3f} {max(stalls[mode]) * 1e3:9.0f} "
            f"{asked - coalesced:10d} {coalesced:10d} {bg}"
        )


if __name__ == "__main__":
    main()
