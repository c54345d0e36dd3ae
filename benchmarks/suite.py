"""`make bench`: every figure of the README's benchmark table, by the command that made it.

Each entry below is one row of the README's table: a script and the arguments its figures
were measured with (the README quotes the same arguments). The suite prints the machine's
limits once (`_machine.py`: matmul FLOP/s, DRAM and cache bandwidth; each script measures
its own again, a figure is a ratio against its run's), then runs the entries in order,
each in a process of its own, its output both shown and kept in `bench-out/<name>.log`,
and ends with each entry's wall time and exit status. Figures move with the machine's
load: run it on a quiet machine, and compare ratios, not absolute rates.

    python benchmarks/suite.py                     # the speed figures (hours on 2 cores)
    python benchmarks/suite.py --only shards,packing
    python benchmarks/suite.py --group learning    # the learning studies (~6 h on 2 cores)
    python benchmarks/suite.py --list              # the commands, without running them

`accelerator` needs a GPU or TPU: on a CPU-only machine it runs `--smoke`, which checks
that the script works, not its figures.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from _cli import one_of


class Entry(NamedTuple):
    name: str  # its log: <out>/<name>.log
    script: str  # benchmarks/<script>.py, the README row's
    args: str  # "{out}": the suite's --out (the learning studies write their figures there)
    group: str  # "speed": `make bench`; "learning": hours of training runs


def _entry(script: str, args: str = "", group: str = "speed", name: str = "") -> Entry:
    return Entry(name or script, script, args, group)


_TRANSFER = "--transfer env.kwargs.config.max_digits=2"
_STALE = (
    "--seeds 0,1,2 --modes async --set actor.reload_every_versions=4 "
    "--set learner.max_staleness=4 --set actor.flow_control=false"
)
SUITE = (
    _entry("shards", "--shards 40 --repeats 10"),
    _entry("packing"),
    _entry("actor"),
    _entry("sampler", "--batches 64 --replicas 1 2"),
    _entry(
        "sampler",
        "--batches --windows --reuse-episodes 0 --prefill-batches --train-len 2048 "
        "--vocab 32768 --no-rss --repeats 3 --attention-block 0 128",
        name="sampler_train",
    ),
    _entry("models", "--shape cpu --families qwen3 --sample-batches 16"),
    _entry("weights", "--gcs"),
    _entry("export"),
    _entry("publishing"),
    _entry("publishing", "--store gs", name="publishing_gs"),
    _entry("publishing", "--pin", name="publishing_pin"),
    _entry("vectorized"),
    _entry("utilization", "--steps 20"),
    _entry("buffer"),
    _entry("agent_endpoint"),
    _entry("remote_engine"),
    _entry("real_model"),
    _entry("model_memory"),
    _entry("accelerator"),
    _entry("flow_control"),
    _entry("autopilot"),
    # docs/learning.md: each study's table and figure.
    _entry("learning", "--out {out}/learning", "learning"),
    _entry("real_learning", f"--seeds 0,1,2,3,4 {_TRANSFER} --out {{out}}/sync", "learning"),
    _entry(
        "real_learning",
        f"--seeds 0,1,2 --modes async --set actor.flow_control=true {_TRANSFER} "
        "--out {out}/async",
        "learning",
        name="real_learning_async",
    ),
    *(
        _entry(
            "real_learning",
            f"{_STALE} --set learner.correction={c} {_TRANSFER} --out {{out}}/stale_{c}",
            "learning",
            name=f"real_learning_stale_{c}",
        )
        for c in ("none", "token_tis")
    ),
)
GROUPS = ("speed", "learning")


ROOT = Path(__file__).resolve().parents[1]  # the commands run from here


def command(entry: Entry, *, accelerator: bool, out: Path) -> list[str]:
    args = [arg.format(out=out) for arg in shlex.split(entry.args)]
    if entry.script == "accelerator" and not accelerator:
        args.append("--smoke")
    return [sys.executable, f"benchmarks/{entry.script}.py", *args]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--group", choices=GROUPS, default="speed")
    p.add_argument("--only", type=one_of([e.name for e in SUITE]), help="names, comma-separated")
    p.add_argument("--list", action="store_true", help="print the commands and stop")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="one log per entry")
    a = p.parse_args()
    entries = [e for e in SUITE if (e.name in a.only if a.only else e.group == a.group)]
    if a.list:
        for e in entries:
            print("python", shlex.join(command(e, accelerator=True, out=a.out)[1:]))
        return 0
    import jax  # here: listing should not pay for JAX's start

    from _machine import llc_bytes, machine_limits, measure_limits

    llc = llc_bytes()
    limits = machine_limits(measure_limits("float32", repeats=8, llc=llc), llc)
    cache = (
        f", last-level cache {limits['cache_bw'] / 1e9:.1f} GB/s ({limits['llc_bytes'] >> 20} MiB)"
        if "cache_bw" in limits
        else ""
    )
    print(
        f"machine: {os.cpu_count()} CPUs, {jax.devices()[0].device_kind}; measured now: matmul"
        f" {limits['matmul_flops'] / 1e9:.0f} GFLOP/s, DRAM {limits['mem_bw'] / 1e9:.1f} GB/s{cache}",
        flush=True,
    )
    accelerator = jax.default_backend() != "cpu"
    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    for e in entries:
        cmd = command(e, accelerator=accelerator, out=a.out.resolve())  # run from ROOT
        print(f"\n== {e.name}: {shlex.join(cmd[1:])}", flush=True)
        t0 = time.monotonic()
        with open(a.out / f"{e.name}.log", "w") as log:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        results.append((e.name, time.monotonic() - t0, rc))
    print("\n| entry | wall | exit |\n|---|---:|---:|")
    for name, wall, rc in results:
        print(f"| {name} | {wall / 60:.1f} min | {rc} |")
    return max((rc != 0 for _, _, rc in results), default=0)


if __name__ == "__main__":
    raise SystemExit(main())
