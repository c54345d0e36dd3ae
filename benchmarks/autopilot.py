"""The autopilot against a changing world (issue #32): env latency jumps mid-run.

The demo config (calculator, flow control on; `--preset small`: a learner slow enough
that the fleet, not the learner, decides its duty cycle on 2 cores) runs three times, each for
three phases of `--phase-s` seconds: env latency `--fast` (0.2 s), then `--slow` x the
same from the second phase (`env.latency_schedule`), then `--fast` again:
  static small  `--small` actors for the whole run
  static large  `--large` actors
  autopilot     starts with `--small`, `actor.autopilot` within [1, `--large`]
Per phase, from each run's metrics records (the phase's first `--settle-s` left out: the
time any fleet needs to answer a change): the learner's duty cycle (device time of its
steps over the window), and the autopilot's fleet at the phase's end. Over the run: stale
drops over episodes generated, the autopilot's changes and the most in any minute.
Goals (#32 item 4): in each phase the autopilot's duty within 0.1 of the best static
fleet's, stale drops <= 2% of generated, a bounded number of decisions per minute.

    python benchmarks/autopilot.py [--phase-s 210] [--settle-s 90] [--small 2] [--large 6]
    python benchmarks/autopilot.py --smoke     # short phases: the code paths
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tunix_tasks.config import load_config
from tunix_tasks.frontdoor.audit import busy_s, learner_steps
from tunix_tasks.frontdoor.autopilot import PROCESS
from tunix_tasks.frontdoor.launcher import train_local
from tunix_tasks.frontdoor.report import read_records, summarize
from tunix_tasks.storage.runs import prepared_at
from tunix_tasks.storage.store import open_store

PHASES = ("fast", "slow", "fast again")


def run(root: str, name: str, actors: int, args: argparse.Namespace, pilot: bool) -> dict:
    p = args.phase_s
    overrides = [
        f"store={root}",
        f"run_name={name}",
        "warm_start_steps=0",
        f"model.preset={args.preset}",
        f"env.latency_s={args.fast}",
        f"env.latency_schedule=[[{p}, {args.fast * args.slow}], [{2 * p}, {args.fast}]]",
        f"actor.num_actors={actors}",
        f"actor.envs_per_actor={args.envs}",
        "actor.flow_control=true",
        f"learner.min_episodes_per_step={args.batch}",
        f"learner.batch_rows={args.batch}",
        "learner.max_steps=100000",
        "learner.checkpoint_every=100000",
        f"deadline_s={3 * p}",
    ]
    if not pilot:  # a static fleet: the same actors throughout
        overrides.append("actor.autopilot.enabled=false")
    else:
        overrides += [
            "actor.autopilot.enabled=true",
            "actor.autopilot.min_actors=1",
            f"actor.autopilot.max_actors={args.large}",
            f"actor.autopilot.interval_s={args.interval_s}",
            f"actor.autopilot.cooldown_s={args.cooldown_s}",
        ]
    out = train_local(load_config("configs/demo.yaml", overrides), quiet=True, report=False)
    store = open_store(out["run_uri"])
    records = read_records(store)
    return measure(records, summarize(store, records), prepared_at(store) or 0.0, args)


def measure(
    records: list[dict[str, Any]], s: dict[str, Any], t0: float, args: argparse.Namespace
) -> dict[str, Any]:
    """Per phase: duty cycle after the settling time, and the autopilot's fleet."""
    steps = learner_steps(records)
    decisions = [r for r in records if r.get("process") == PROCESS]
    changes = [r for r in decisions if r["autopilot"] != "hold"]
    out: dict[str, Any] = {}
    for k, phase in enumerate(PHASES):
        start, end = t0 + k * args.phase_s + args.settle_s, t0 + (k + 1) * args.phase_s
        busy = sum(busy_s(r) for r in steps if start <= r["time"] < end)
        out[f"duty, {phase}"] = busy / max(end - start, 1e-9)
        fleet = [r["actors"] for r in decisions if r["time"] < end]
        out[f"actors at end, {phase}"] = fleet[-1] if fleet else None
    generated = max(1, s["episodes_generated"])
    out["stale / generated"] = s["dropped_total"].get("stale", 0) / generated
    out["episodes generated"] = s["episodes_generated"]
    out["trained episodes"] = s["trained_episodes_ledger"]
    out["autopilot changes"] = len(changes)
    times = sorted(r["time"] for r in changes)
    out["most changes in a minute"] = max(
        (sum(1 for u in times if t <= u < t + 60) for t in times), default=0
    )
    out["reasons"] = [f"{r['time'] - t0:.0f}s {r['reason']}" for r in changes]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phase-s", type=float, default=210.0)
    p.add_argument("--settle-s", type=float, default=90.0)
    p.add_argument("--fast", type=float, default=0.2, help="env latency, s")
    p.add_argument("--slow", type=float, default=10.0, help="latency x in the second phase")
    p.add_argument("--small", type=int, default=2, help="a small static fleet; the first")
    p.add_argument("--large", type=int, default=6, help="a large static fleet; the ceiling")
    p.add_argument("--preset", default="small", help="model.preset: the learner's step cost")
    p.add_argument("--envs", type=int, default=16, help="actor.envs_per_actor")
    p.add_argument("--batch", type=int, default=32, help="learner.min_episodes_per_step")
    p.add_argument("--interval-s", type=float, default=5.0)
    p.add_argument("--cooldown-s", type=float, default=30.0)
    p.add_argument("--smoke", action="store_true", help="short phases: the code paths")
    p.add_argument("--keep", help="keep the runs under this folder instead of a temp dir")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    if args.smoke:
        args.phase_s, args.settle_s, args.large = 25.0, 5.0, 2
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        results = {
            f"static {args.small}": run(root, "small", args.small, args, pilot=False),
            f"static {args.large}": run(root, "large", args.large, args, pilot=False),
            "autopilot": run(root, "pilot", args.small, args, pilot=True),
        }
    print(
        f"\nenv latency {args.fast} s -> x{args.slow:g} -> {args.fast} s, phases of "
        f"{args.phase_s:.0f} s (first {args.settle_s:.0f} s of each left out)"
    )
    print(f"{'':<28}" + "".join(f"{name:>14}" for name in results))
    rows = [r for r in results["autopilot"] if r != "reasons"]
    for row in rows:
        cells = (results[name].get(row) for name in results)
        print(f"{row:<28}" + "".join(f"{_fmt(v):>14}" for v in cells))
    pilot = results["autopilot"]
    for phase in PHASES:
        best = max(results[n][f"duty, {phase}"] for n in results if n != "autopilot")
        gap = best - pilot[f"duty, {phase}"]
        print(f"duty gap to the best static fleet, {phase}: {gap:.3f} (goal <= 0.1)")
    print(f"stale / generated, autopilot: {pilot['stale / generated']:.3f} (goal <= 0.02)")
    print("autopilot changes:\n  " + "\n  ".join(pilot["reasons"] or ["none"]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
