"""One prepared run for a machine with an NVIDIA GPU: what the sampler, the learner and
the vectorized actor reach there, against the device's limits. Under 8 minutes.

  0. install  `pip install -U "jax[cuda12]"` into this interpreter's environment (skipped
              with `--no-install` or `--smoke`), then the script re-executes itself.
  1. limits   the device's dense bf16 matmul FLOP/s and HBM bandwidth from a table of
              known accelerators (H200: 989 TFLOP/s, 4.8 TB/s; `_accelerator_cases.
              KNOWN_DEVICES`), else measured (`_machine.measure_limits`).
  2. decode   `Sampler` steady decode tokens/s at `--batches` (default 1, 64, 256) over a
              `--window` cache window, random weights of the SmolLM2-135M and Qwen3-0.6B
              shapes (`tunix_tasks/testing/published.py`) in the compute dtype, against the
              memory roofline (weights + K/V window read once per step: `policy/costs.py`).
  3. train    `Trainer.step` on fully packed `--train-shapes` (default 4 x 2,048 and
              1 x 8,192 tokens), full fine-tuning with per-layer remat: tokens/s and MFU
              (costs.train_flops per second / the peak matmul rate).
  4. actors   `benchmarks/vectorized.py --envs 4096` (the vectorized actor's episodes/s
              against the asynchronous actor's, same run), its table as printed.
  5. publish  `benchmarks/publishing.py --preset base --rows 8 --bucket 512`: the train
              step with weight publishing off / coalesced / in order at `publish_every:
              1` (issue #29, 5: coalesced <= 1.05x off), its table as printed.

`--smoke` runs every code path on a CPU at toy sizes (2 layers, d_model 64, vocab 512;
batches 1 and 4; 64-token rows; 8 environments) in about two minutes: the figures mean
nothing there.

    python benchmarks/accelerator.py                 # on the GPU machine, from the repo root
    python benchmarks/accelerator.py --smoke         # anywhere: the code paths
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FULL_PUBLISHING = "--preset base --rows 8 --bucket 512"  # stage 5's size on a device
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="toy sizes on any device (CPU)")
    p.add_argument("--no-install", action="store_true", help="use the installed jax")
    p.add_argument("--models", nargs="+", default=["smollm2", "Qwen3-0.6B"])
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--window", type=int, default=None, help="decode cache window (a bucket)")
    p.add_argument("--train-shapes", nargs="*", default=None, help="ROWSxT")
    p.add_argument("--envs", type=int, default=None, help="actor environments")
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="also print the raw numbers as JSON")
    args = p.parse_args(argv)
    full = {
        "batches": [1, 64, 256],
        "window": 512,
        "train_shapes": ["4x2048", "1x8192"],
        "envs": 4096,
        "compute_dtype": "bfloat16",
    }
    smoke = {
        "batches": [1, 4],
        "window": 64,
        "train_shapes": ["2x64"],
        "envs": 8,
        "compute_dtype": "float32",
    }
    for key, value in (smoke if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.segment_steps, args.segments = 16, 2
    return args


def install() -> None:
    """jax with its CUDA 12 plugin from PyPI, into this environment; then run again."""
    log('pip install -U "jax[cuda12]"')
    pip = [sys.executable, "-m", "pip", "install", "-q", "-U", "jax[cuda12]"]
    subprocess.run(pip, check=True)
    os.execv(sys.executable, [sys.executable, __file__, *sys.argv[1:], "--no-install"])


def _script(name: str, *argv: str) -> str:
    """benchmarks/`name` run in a process of its own: its table, or why it failed."""
    cmd = [sys.executable, str(HERE / name), *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        return f"{name} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}"
    return proc.stdout


def actors(args) -> str:
    """benchmarks/vectorized.py at `--envs` environments: its table."""
    short = (
        ["--warmup", "1", "--window", "3"] if args.smoke else ["--warmup", "2", "--window", "20"]
    )
    envs = ["--envs", str(args.envs), "--precision-envs", str(min(args.envs, 256))]
    return _script("vectorized.py", *envs, *short)


def publishing(args) -> str:
    """benchmarks/publishing.py (issue #29, 5): the train step with publishing off /
    coalesced / in order, where the step runs on the device and the publisher on the
    host's cores (goal: coalesced <= 1.05x off)."""
    size = "--preset tiny --rows 8 --steps 2 --repeats 1" if args.smoke else FULL_PUBLISHING
    return _script("publishing.py", *size.split())


def main() -> None:
    args = parse()
    if not (args.smoke or args.no_install):
        install()
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    import jax

    from _accelerator_cases import decode_rows, device_limits, model_spec, train_row

    dev = jax.devices()[0]
    log(f"JAX {jax.__version__} on {dev.platform} ({dev.device_kind})")
    lim = device_limits(args)
    res = {"device": dev.device_kind, "limits": lim, "decode": {}, "train": {}}
    shapes = [tuple(map(int, s.split("x"))) for s in args.train_shapes]
    for name in args.models:
        log(f"{name}: decode at batches {args.batches}")
        spec = model_spec(name, args.window, args.smoke)
        res["decode"][name] = decode_rows(spec, args, lim)
        res["train"][name] = []
        for rows, length in shapes:
            log(f"{name}: train step {rows}x{length}")
            res["train"][name].append(train_row(spec, rows, length, args, lim))
    log(f"actors at E={args.envs}")
    res["actors"] = actors(args)
    log("publishing beside the train step")
    res["publishing"] = publishing(args)
    print(
        f"\n{res['device']}: matmul {lim['matmul_flops'] / 1e12:.1f} TFLOP/s, memory "
        f"{lim['mem_bw'] / 1e12:.2f} TB/s ({lim['source']}); compute {args.compute_dtype}"
    )
    print("\n| model | batch | decode tok/s | ms/step | roofline tok/s | of roofline |")
    print("|---|---|---|---|---|---|")
    for name, rows in res["decode"].items():
        for r in rows:
            print(
                f"| {name} | {r['batch']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.2f} "
                f"| {r['limit_dram']:,.0f} | {r['of_roofline']:.2f} |"
            )
    print("\n| model | rows x T | train tok/s | MFU | first step s |")
    print("|---|---|---|---|---|")
    for name, rows in res["train"].items():
        for r in rows:
            print(
                f"| {name} | {r['rows']}x{r['length']} | {r['tokens_per_s']:,.0f} "
                f"| {r['mfu']:.2f} | {r['first_step_s']:.1f} |"
            )
    print(f"\nActors (benchmarks/vectorized.py --envs {args.envs}):\n{res['actors']}")
    print(f"\nPublishing (benchmarks/publishing.py):\n{res['publishing']}")
    if args.json:
        print(json.dumps(res, indent=1, default=str))
    log("done")


if __name__ == "__main__":
    main()
