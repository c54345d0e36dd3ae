"""`tunix-tasks export`'s cost: a run's full snapshot written as a Hugging Face folder
(`export_snapshot`: the checksum-verified snapshot, then `model.safetensors` a tensor at
a time into its place) against the naive way (the same snapshot, `params_to_hf` of all of
it, `safetensors.numpy.save_file`), each in a fresh subprocess (clean RSS), alternated.

Setup: a random-weight checkpoint of `--family` at `--shape` (benchmarks/models.py's),
a run of it (`model.checkpoint`), its params published as v0, float32.

Figures, medians of `--repeats`, each run in a fresh process, alternated:
- "export": `export_snapshot` end to end;
- "write": only the writing of `model.safetensors` from the loaded snapshot, the export's
  way and the naive way: what the writing itself costs and holds;
- wall time, and throughput = bytes written / time, against a plain write of as many
  bytes to the same disk in the same run (page cache: the practical limit of writing
  them at all: the best of the plain writes, one after each run); each run and each
  plain write starts after `os.sync()`, so none pays for the write-back of the one
  before;
- peak RSS over the RSS before (for "write": with the snapshot loaded) / the snapshot's
  bytes. Ideal for the writing: the largest tensor, ~0.
    python benchmarks/export.py [--shape cpu] [--family qwen3] [--repeats 3]
    python benchmarks/export.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from safetensors.numpy import save_file

from tunix_tasks.config import config_from_dict
from tunix_tasks.frontdoor.export import _no_progress, _write_weights, export_snapshot
from tunix_tasks.policy.hf_checkpoint import HFCheckpoint, params_to_hf
from tunix_tasks.policy.spec import spec_from_hf_config
from tunix_tasks.storage.runs import read_config, write_config
from tunix_tasks.storage.weights import WeightsPublisher, load_snapshot

from _machine import peak, reset_peak, rss, trim
from _models_checkpoint import SHAPES, hf_config, write_checkpoint

MB = 1 << 20
F32 = np.dtype(np.float32)


def child(mode: str, run_uri: str, dest: str) -> dict:
    """Runs in a fresh process, on v0. "export": `export_snapshot` end to end (wall time,
    peak RSS over the RSS before). "ours" / "naive": the snapshot loaded first, then only
    `model.safetensors` written, the export's way or the naive way (wall time, peak RSS
    over the RSS with the snapshot loaded: what the writing itself holds)."""
    cfg, store = read_config(run_uri)
    spec = HFCheckpoint(cfg.model.checkpoint).spec(max_seq_len=cfg.model.max_seq_len)
    Path(dest).mkdir()
    flat = None
    if mode != "export":
        flat, _ = load_snapshot(store, 0)
    trim()
    base = rss()
    reset_peak()
    t0 = time.perf_counter()
    if mode == "export":
        Path(dest).rmdir()
        export_snapshot(run_uri, dest, version=0)
    elif mode == "ours":
        _write_weights(
            Path(dest) / "model.safetensors", spec, iter(flat.items()), F32, _no_progress
        )
    else:
        save_file(params_to_hf(flat, spec), f"{dest}/model.safetensors", metadata={"format": "pt"})
    wall = time.perf_counter() - t0
    written = (Path(dest) / "model.safetensors").stat().st_size
    return {"s": wall, "peak_over_base": peak() - base, "bytes": written}


def run_child(mode: str, run_uri: str, dest: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, run_uri, str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} export failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plain_write(path: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` (already in memory) to `path`: the disk's practical limit."""
    data = memoryview(np.ones(nbytes, np.uint8))
    t0 = time.perf_counter()
    with path.open("wb") as f:
        for start in range(0, nbytes, 8 * MB):  # one 700 MB write() took 3 s here, 8 MB ones 0.2 s
            f.write(data[start : start + 8 * MB])
    wall = time.perf_counter() - t0
    path.unlink()
    return wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="cpu", choices=sorted(SHAPES))
    p.add_argument("--family", default="qwen3", choices=("qwen3", "llama3"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="the toy shape, one repeat")
    p.add_argument("--child", nargs=3, metavar=("MODE", "RUN", "DEST"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    if args.smoke:
        args.shape, args.repeats = "toy", 1
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        root = Path(tmp)
        config = hf_config(args.family, args.shape, "float32")
        spec = spec_from_hf_config(config, max_seq_len=4096)
        write_checkpoint(root / "ckpt", config, spec, "float32", shard_mb=2000, seed=1)
        cfg = config_from_dict(
            {
                "store": f"file://{root}/runs",
                "run_name": "export",
                "model": {"checkpoint": str(root / "ckpt")},
            }
        )
        store = write_config(cfg)
        ckpt = HFCheckpoint(str(root / "ckpt"))
        flat = {name: np.asarray(w) for name, w in ckpt.tensors(spec)}
        manifest = WeightsPublisher(store).publish(flat, version=0, step=0, model={})
        del flat
        snapshot = manifest.num_bytes
        print(
            f"{args.family} at shape {args.shape}: snapshot {snapshot / MB:.0f} MB (float32), "
            f"medians of {args.repeats}, each export in a fresh process"
        )
        runs: dict[str, list[dict]] = {"export": [], "naive": [], "ours": []}
        limits = []
        for i in range(args.repeats):
            for mode in runs:  # alternated; each from a disk with nothing left to write back
                os.sync()
                runs[mode].append(run_child(mode, cfg.run_uri, root / f"out-{mode}-{i}"))
                os.sync()
                limits.append(plain_write(root / "plain.bin", runs[mode][-1]["bytes"]))
        limit_s = min(limits)  # the disk's practical limit: its best showing
        print(f"{'':>22} {'s':>7} {'MB/s':>7} {'of plain write':>15} {'peak RSS / snapshot':>20}")
        what = {
            "export": "export (end to end)",
            "naive": "write: naive",
            "ours": "write: the export's",
        }
        for mode, results in runs.items():
            wall = statistics.median(r["s"] for r in results)
            rate = results[0]["bytes"] / wall
            ratio = statistics.median(r["peak_over_base"] for r in results) / snapshot
            print(
                f"{what[mode]:>22} {wall:>7.2f} {rate / MB:>7.0f} {limit_s / wall:>15.2f} "
                f"{ratio:>20.2f}"
            )
        written = runs["ours"][0]["bytes"]
        print(
            f"plain write of as many bytes (8 MB write() calls, after os.sync()): best "
            f"{limit_s:.2f} s ({written / limit_s / MB:.0f} MB/s), worst {max(limits):.2f} s: "
            "the first write after another process's writes stalls on this disk"
        )
        print(
            "export: peak over the RSS before it (the snapshot read: its file mapped while its "
            "verified copy fills, then the writing); write: over the RSS with the snapshot loaded"
        )


if __name__ == "__main__":
    main()
