"""Weight publishing and reloading: full snapshots, deltas and adapters (issue #10).

For each size (random float32 "layer" matrices: per layer wq/wk/wv/wo d x d, up d x 4d,
down 4d x d) and store (file://; gs:// on fake-gcs-server with --gcs), one run each of:
  full           v0 published with `WeightsPublisher`, reloaded by a fresh `WeightsClient`
  delta, held    v1 = v0 after one AdamW step at `--lr` (every weight moves by exactly lr,
                 the size of Adam's first step, m/sqrt(v) = sign(g); a later step moves
                 each by about lr or less), published as a delta against v0; reloaded
                 by a client that holds v0 (it loaded it): reads delta.bin only
  delta, fresh   the same v1, reloaded by a fresh client: reads v0's params and the delta
  adapter        rank-`--rank` LoRA factors (A: d_in x r, B: r x d_out) of every matrix,
                 `kind="adapter"`, reloaded by a fresh client
Columns: MB written; publish s (the synchronous `WeightsPublisher.publish` call, i.e. what
the learner's background thread spends); MB read and reload s (`WeightsClient.poll` with an
apply that keeps the dict: read, sha256, rebuild, zero-copy decode; best of --repeats);
and ratios against "full" in the same run: written bytes (x smaller), reload (x faster).
"peak/blob" (full rows): traced peak memory of a reload over the params blob, against the
old path (`read_bytes` + `safetensors.numpy.load`, which copies every tensor).
Goals (#10): adapter reload >= 50x faster than full at the larger size; delta >= 3x
smaller than full after one update at lr 1e-5.

    python benchmarks/weights.py [--sizes 1 100] [--repeats 3] [--rank 8] [--lr 1e-5] [--gcs]
    python benchmarks/weights.py --sizes 300          # ~300M params (~1.2 GB per blob)
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from safetensors.numpy import load as st_load

from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.store import ObjectStore, open_store
from tunix_tasks.storage.weights import PARAMS_FILE, WeightsClient, WeightsPublisher
from tunix_tasks.testing.gcs_server import FakeGcs

MB = 1e6


def shapes(params_m: float) -> dict[str, tuple[int, int]]:
    """Layer matrices totalling about `params_m` million params (12 d^2 per layer)."""
    layers = 4 if params_m < 10 else 8
    d = max(16, round(math.sqrt(params_m * 1e6 / (12 * layers)) / 16) * 16)
    out = {}
    for i in range(layers):
        for name in ("wq", "wk", "wv", "wo"):
            out[f"blocks/{i}/attn/{name}"] = (d, d)
        out[f"blocks/{i}/mlp/up"] = (d, 4 * d)
        out[f"blocks/{i}/mlp/down"] = (4 * d, d)
    return out


def random_params(spec: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s, dtype=np.float32) * np.float32(0.02) for k, s in spec.items()}


def optimizer_step(flat: dict[str, np.ndarray], lr: float) -> dict[str, np.ndarray]:
    """The weights after an update the size of a real one: Adam's first step moves every
    weight by exactly `lr` (m / sqrt(v) = sign(g)), in a random direction here."""
    rng = np.random.default_rng(1)
    step = np.float32(lr)
    return {
        k: v - step * np.sign(rng.standard_normal(v.shape, dtype=np.float32))
        for k, v in flat.items()
    }


def adapters(spec: dict[str, tuple[int, int]], rank: int) -> dict[str, np.ndarray]:
    lora = {}
    for k, (d_in, d_out) in spec.items():
        lora[f"{k}/lora_a"], lora[f"{k}/lora_b"] = (d_in, rank), (rank, d_out)
    return random_params(lora, seed=2)


def written(store: ObjectStore, version: int) -> int:
    return sum(i.size for i in store.list(RunLayout.snapshot(version) + "/"))


def publish(pub: WeightsPublisher, flat: dict[str, np.ndarray], **kw: object) -> float:
    """Seconds of one synchronous publish (the learner's background thread's share)."""
    t0 = time.perf_counter()
    pub.publish(flat, step=0, model={}, **kw)
    return time.perf_counter() - t0


def reload(client: WeightsClient) -> tuple[float, int]:
    """(seconds, bytes read) of one poll that loads a new version."""
    kept: list[dict[str, np.ndarray]] = []
    t0 = time.perf_counter()
    client.poll(lambda flat, manifest: kept.append(flat))
    dt = time.perf_counter() - t0
    assert kept, "nothing loaded"
    return dt, client.last_reload_bytes


def traced_peak(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def run(
    uri: str, params_m: float, repeats: int, rank: int, lr: float
) -> dict[str, dict[str, float]]:
    store = open_store(f"{uri}/deltas")
    spec = shapes(params_m)
    v0 = random_params(spec, seed=0)
    pub = WeightsPublisher(store, full_every=1000)
    rows: dict[str, dict[str, float]] = {}

    def row(name: str, version: int, publish_s: float, loads: list[tuple[float, int]]) -> None:
        best = min(loads)
        rows[name] = {"MB written": written(store, version) / MB, "publish s": publish_s}
        rows[name] |= {"MB read": best[1] / MB, "reload s": best[0]}

    publish_s = publish(pub, v0, version=0)
    row("full", 0, publish_s, [reload(WeightsClient(store)) for _ in range(repeats)])
    blob_bytes = len(store.read_bytes(f"{RunLayout.snapshot(0)}/{PARAMS_FILE}"))
    ours = traced_peak(lambda: WeightsClient(store).poll())
    old = traced_peak(lambda: st_load(store.read_bytes(f"{RunLayout.snapshot(0)}/{PARAMS_FILE}")))
    rows["full"]["peak/blob"] = ours / blob_bytes
    holders = [WeightsClient(store) for _ in range(repeats)]
    for client in holders:
        client.poll()  # holds v0 from here on
    v1 = optimizer_step(v0, lr)
    del v0
    publish_s = publish(pub, v1, version=1)
    row("delta, held", 1, publish_s, [reload(c) for c in holders])
    del holders
    row("delta, fresh", 1, publish_s, [reload(WeightsClient(store)) for _ in range(repeats)])

    store = open_store(f"{uri}/adapters")
    lora = adapters(spec, rank)
    base = {"fingerprint": "0" * 64, "uri": "bench://base"}
    publish_s = publish(WeightsPublisher(store), lora, version=0, kind="adapter", base=base)
    row("adapter", 0, publish_s, [reload(WeightsClient(store)) for _ in range(repeats)])
    full = rows["full"]
    for r in rows.values():
        r["x smaller"] = full["MB written"] / r["MB written"]
        r["x faster"] = full["reload s"] / r["reload s"]
    rows["old reload (read + st.load)"] = {"peak/blob": old / blob_bytes}
    rows["full"]["params M"] = sum(math.prod(s) for s in spec.values()) / 1e6
    rows["adapter"]["params M"] = sum(v.size for v in lora.values()) / 1e6
    return rows


COLS = [
    "params M",
    "MB written",
    "publish s",
    "MB read",
    "reload s",
    "x smaller",
    "x faster",
    "peak/blob",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 100], help="M params")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-5, help="the delta's optimizer step")
    parser.add_argument("--gcs", action="store_true", help="also on gs:// (fake-gcs-server)")
    args = parser.parse_args()
    results: dict[tuple[str, float], dict[str, dict[str, float]]] = {}
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            results["file://", size] = run(f"file://{tmp}", size, args.repeats, args.rank, args.lr)
        if args.gcs:
            with FakeGcs() as gcs:
                results["gs://", size] = run(
                    gcs.new_bucket_uri(), size, args.repeats, args.rank, args.lr
                )
    print(f"{'store':<7}{'size':>6}  {'':<28}" + "".join(f"{c:>11}" for c in COLS))
    for (where, size), rows in results.items():
        for name, r in rows.items():
            cells = "".join(f"{r[c]:>11.3f}" if c in r else f"{'':>11}" for c in COLS)
            print(f"{where:<7}{size:>5g}M  {name:<28}{cells}")
    for (where, size), rows in results.items():
        delta, adapter = rows["delta, held"]["x smaller"], rows["adapter"]["x faster"]
        print(
            f"{where} {size:g}M: delta {delta:.2f}x smaller than full after a step at lr "
            f"{args.lr:g} (goal >= 3); adapter "
            f"reload {adapter:.1f}x faster than full (goal >= 50 at the larger size)"
        )


if __name__ == "__main__":
    main()
