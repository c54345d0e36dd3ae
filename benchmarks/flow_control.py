"""Flow control (`actor.flow_control`): stale drops and learner duty cycle, with and without.

Runs the vectorized demo (`configs/demo.yaml` with `actor.kind=vectorized`,
`env.latency_s=0`, as in the README) twice in one process's machine, for the same number
of learner steps: once with `actor.flow_control=off` (actors never wait: they generate
far more than the learner trains, and the backlog goes stale) and once with `on` (actors
pause new episodes while the backlog would be staler than `learner.max_staleness` when the
learner reaches it). Prints side by side: episodes generated, the share of them dropped as
stale (goal with flow control: <= 0.02), the share never read by the end, learner duty
cycle (steady; goal: no lower than without), the actors' time paused, and tokens trained
per second.

    python benchmarks/flow_control.py [--steps 200] [--warm-start 20]
    python benchmarks/flow_control.py --actor async    # the demo's own actor, env latency 0.2 s
    python benchmarks/flow_control.py --smoke     # a few steps: the code paths

The default is the vectorized actor, where flow control matters (it makes several times
what the learner trains); `--actor async` is the demo as `make demo` runs it (actor-bound:
flow control should rarely pause it and must cost nothing).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tunix_tasks.config import load_config
from tunix_tasks.frontdoor.launcher import train_local
from tunix_tasks.frontdoor.report import read_records, summarize
from tunix_tasks.storage.store import open_store


def run(root: str, flow: str, steps: int, warm_start: int, actor: str) -> dict:
    kind = ["actor.kind=vectorized", "env.latency_s=0"] if actor == "vectorized" else []
    cfg = load_config(
        "configs/demo.yaml",
        [
            f"store={root}",
            f"run_name=flow-{flow}",
            *kind,
            f"actor.flow_control={flow}",
            f"learner.max_steps={steps}",
            f"learner.checkpoint_every={steps}",
            f"warm_start_steps={warm_start}",
        ],
    )
    out = train_local(cfg, quiet=True, report=False)
    store = open_store(out["run_uri"])
    s = summarize(store)
    final = {}  # each actor's last record
    for r in read_records(store):
        if r.get("process", "").startswith("actor/"):
            final[r["process"]] = r
    generated = max(1, s["episodes_generated"])
    consumed = s["trained_episodes_ledger"] + sum(s["dropped_total"].values())
    return {
        "episodes generated": s["episodes_generated"],
        "stale / generated": s["dropped_total"].get("stale", 0) / generated,
        "unread / generated": max(0, s["episodes_generated"] - consumed) / generated,
        "trained episodes": s["trained_episodes_ledger"],
        "duty cycle": s["duty_cycle_steady"],
        "learner wall s": s["learner_wall_s"],
        "tokens/s": s["trained_tokens_per_s"],
        "actor paused s": sum(r.get("flow_paused_s", 0.0) for r in final.values()),
        "actor pauses": sum(r.get("flow_pauses", 0) for r in final.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--actor", choices=("vectorized", "async"), default="vectorized")
    p.add_argument("--warm-start", type=int, default=20, help="warm_start_steps (demo: 140)")
    p.add_argument("--smoke", action="store_true", help="a few steps: the code paths")
    p.add_argument("--keep", help="keep the runs under this folder instead of a temp dir")
    args = p.parse_args()
    steps, warm = (6, 2) if args.smoke else (args.steps, args.warm_start)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        results = {flow: run(root, flow, steps, warm, args.actor) for flow in ("off", "on")}
    print(f"\n{args.actor} actor on the demo, {steps} learner steps (warm start {warm})")
    print(f"{'':<22}" + "".join(f"{'flow ' + m:>12}" for m in results))
    for row in results["off"]:
        values = (results[m][row] for m in results)
        print(
            f"{row:<22}" + "".join(f"{v if v is not None else float('nan'):>12.3f}" for v in values)
        )
    on, off = results["on"], results["off"]
    print(f"{'stale share, on':<22}{on['stale / generated']:>12.3f}   (goal <= 0.02)")
    ratio = (on["duty cycle"] or 0) / (off["duty cycle"] or float("nan"))
    print(f"{'duty on / off':<22}{ratio:>12.3f}   (goal >= 1)")


if __name__ == "__main__":
    main()
