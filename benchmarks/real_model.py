"""A real checkpoint (SmolLM2-135M-Instruct by default) on this machine: what a 30-layer
model costs the sampler and the learner.

Measured in one run (figures are medians of `--repeats` samples after a warm-up):

  0. limits    matmul FLOP/s and DRAM read bandwidth (benchmarks/_machine.py), at the start
               and at the end, the best sample of each.
  1. compiles  per program kind (sampler prefill, sampler decode segment, train step) and
               layer mode (`loop`: the layers unrolled; `scan`: one `lax.scan`), how many
               programs were compiled and the seconds JAX spent on them (trace + lowering
               + XLA compile, from `jax.monitoring`'s events).
  2. TTFT      time to first token of one fresh request (`--prompt` tokens, no session:
               `Sampler.admit()`, whose prefill draws the first token): cold (the first
               request: its prefill program compiles) and warm.
  3. decode    steady decode tokens/s at each `--batches` over a `--window` cache window
               (`_sampler_cases.DecodeCase`: `step()` calls with every row decoding), against
               the DRAM roofline: the weights (float32, as the sampler holds them) + the K/V
               window read once per step (`policy/costs.py`, `_rooflines.Roofline.decode`).
               "vs loop": the scanned sampler against the unrolled one, same run.
  4. train     `Trainer.step` on fully packed `--train-shapes` (ROWSxT) batches, full
               fine-tuning and LoRA (`--lora-rank`), against the FLOP roofline (costs.py's
               train FLOPs, 3 x the forward, at the measured matmul rate; LoRA computes no
               weight gradient of the base, so it could beat that line). The scanned step
               (`learner.scan_layers`) is measured at the first shape, its timed steps
               interleaved with the unrolled one's.
  5. memory    the process's peak RSS (every model, optimizer and program of the run).

"compiles during timing" must be 0: every timed window runs warm programs only.

    python benchmarks/real_model.py                       # fetches smollm2 into the cache
    python benchmarks/real_model.py --checkpoint DIR --batches 1 16 --no-train
    python benchmarks/real_model.py --json                # + raw numbers

The progress log (stderr) carries elapsed seconds; the tables go to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax.numpy as jnp

from tunix_tasks.policy import costs
from tunix_tasks.policy.hf_checkpoint import HFCheckpoint
from tunix_tasks.policy.packaged_models import fetch_model

from _machine import machine_limits, measure_limits, peak
from _real_model_cases import CompileClock, sampler_rows, train_rows

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="checkpoint dir (default: fetch smollm2-135m-instruct)")
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--window", type=int, default=256, help="decode cache window (a bucket)")
    p.add_argument("--segments", type=int, default=2, help="timed segments per decode sample")
    p.add_argument("--segment-steps", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64, help="TTFT prompt tokens")
    p.add_argument(
        "--modes", nargs="+", choices=["loop", "scan"], default=["loop", "scan"], help="layers"
    )
    p.add_argument("--train-shapes", nargs="*", default=["4x512", "2x1024"], help="ROWSxT")
    p.add_argument("--lora-rank", type=int, default=8, help="the LoRA cases' rank (0: none)")
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--json", action="store_true", help="also print the raw numbers as JSON")
    return p.parse_args(argv)


def _limits(args, samples: dict[str, list[float]] | None) -> dict[str, list[float]]:
    new = measure_limits(args.compute_dtype, max(args.repeats, 4), llc=0)
    return new if samples is None else {k: samples[k] + new[k] for k in samples}


def print_tables(res: dict[str, Any], args) -> None:
    lim, spec = res["limits"], res["spec"]
    print(
        f"\n{res['checkpoint']}: {spec['n_layers']} layers, d_model {spec['d_model']}, heads "
        f"{spec['n_heads']}/{spec['n_kv_heads']}, vocab {spec['vocab_size']}, "
        f"{res['params'] / 1e6:.1f}M params; compute {args.compute_dtype}"
    )
    print(
        f"Machine (best sample): DRAM read {lim['mem_bw'] / 1e9:.1f} GB/s, matmul "
        f"{lim['matmul_flops'] / 1e9:.0f} GFLOP/s"
    )
    print("\nCompiles (programs, seconds of trace + lowering + XLA compile)")
    for kind in sorted(res["compile_s"]):
        n, s = res["compiles"].get(kind, 0), res["compile_s"][kind]
        print(f"  {kind:<34}{n:>4}{s:>9.1f} s{s / max(n, 1):>8.1f} s each")
    print("\nTime to first token, one fresh request of", args.prompt, "tokens")
    for r in res["sampler"]:
        print(f"  {r['mode']:<6} cold {r['ttft_cold_s']:6.2f} s   warm {r['ttft_warm_s']:6.3f} s")
    base = {r["batch"]: r["tokens_per_s"] for r in res["sampler"][0]["decode"]}
    print(f"\nSteady decode, window {args.window}")
    head = (
        f"{'mode':<6}{'batch':>6}{'tok/s':>9}{'ms/step':>9}{'MB/step':>9}{'DRAM lim':>10}"
        f"{'of DRAM':>9}{'vs ' + res['sampler'][0]['mode']:>9}{'first s':>9}"
    )
    print(head + "\n" + "-" * len(head))
    for s in res["sampler"]:
        for r in s["decode"]:
            print(
                f"{s['mode']:<6}{r['batch']:>6}{r['tokens_per_s']:>9.1f}{r['ms_per_step']:>9.1f}"
                f"{r['bytes_per_step'] / 1e6:>9.0f}{r['limit_dram']:>10.1f}{r['of_dram']:>9.2f}"
                f"{r['tokens_per_s'] / base[r['batch']]:>8.2f}x{r['warm_s']:>9.1f}"
            )
    if res.get("train"):
        print("\nTrain step (fully packed; FLOP roofline = costs.train_flops / matmul rate)")
        head = (
            f"{'case':<34}{'first s':>9}{'compile s':>10}{'step s':>8}{'tok/s':>8}"
            f"{'FLOP lim':>10}{'of lim':>8}{'vs loop':>9}"
        )
        print(head + "\n" + "-" * len(head))
        loop = {(r["lora"], r["rows"], r["length"]): r for r in res["train"] if not r["scan"]}
        for r in res["train"]:
            base = loop.get((r["lora"], r["rows"], r["length"]), r)
            print(
                f"{r['kind']:<34}{r['first_step_s']:>9.1f}{r['compile_s']:>10.1f}"
                f"{r['step_s']:>8.1f}{r['tokens_per_s']:>8.0f}{r['limit']:>10.0f}"
                f"{r['of_limit']:>8.2f}{r['tokens_per_s'] / base['tokens_per_s']:>8.2f}x"
            )
    print(
        f"\nPeak RSS {res['peak_rss'] / 1e9:.2f} GB; compiles during timing: {res['timed_compiles']}"
    )


def main() -> None:
    args = parse()
    ckpt = args.checkpoint or str(fetch_model("smollm2-135m-instruct"))
    clock = CompileClock()
    log("limits")
    samples = _limits(args, None)
    res: dict[str, Any] = {"checkpoint": ckpt, "args": vars(args)}
    hf = HFCheckpoint(ckpt)
    spec = hf.spec(max_seq_len=args.window)
    res["spec"], res["params"] = vars(spec), costs.total_params(spec)
    model = hf.load_model(spec, compute_dtype=jnp.dtype(args.compute_dtype))
    lim = machine_limits(samples, 0)
    res["sampler"] = []
    for mode in args.modes:
        log(f"sampler, layers {mode}")
        res["sampler"].append(sampler_rows(model, args, lim, clock, scan_layers=mode == "scan"))
    del model
    res["train"] = []
    shapes = [tuple(map(int, s.split("x"))) for s in ([] if args.no_train else args.train_shapes)]
    for lora in sorted({0, args.lora_rank}):
        for i, (rows, length) in enumerate(shapes):
            scans = [m == "scan" for m in args.modes if i == 0 or m == "loop"]
            log(
                f"train {rows}x{length} lora {lora}: {'loop and scan' if len(scans) > 1 else 'loop'}"
            )
            res["train"] += train_rows(
                ckpt, rows, length, lora=lora, scans=scans, args=args, lim=lim, clock=clock
            )
    log("limits again")
    samples = _limits(args, samples)
    res["limits"] = lim = machine_limits(samples, 0)
    for s in res["sampler"]:  # the decode figures against the run's final limits
        for r in s["decode"]:
            r["limit_dram"] = r["batch"] * lim["mem_bw"] / r["bytes_per_step"]
            r["of_dram"] = r["tokens_per_s"] / r["limit_dram"]
    for r in res["train"]:
        r["limit"] = r["rows"] * r["length"] * lim["matmul_flops"] / r["flops"]
        r["of_limit"] = r["tokens_per_s"] / r["limit"]
    res["compiles"], res["compile_s"] = dict(clock.compiles), dict(clock.seconds)
    res["timed_compiles"] = sum(x["compiles_during_timing"] for x in res["sampler"] + res["train"])
    res["peak_rss"] = peak()
    print_tables(res, args)
    if args.json:
        print(json.dumps(res, indent=1, default=str))
    assert res["timed_compiles"] == 0, "a program compiled inside a timed window"
    log("done")


if __name__ == "__main__":
    main()
