"""Latency audit: is the learner or the actor fleet the bottleneck, and by how much?

A pure function of the metrics records (no store, no clock). One computation serves the
live display of `tunix-tasks train` (one line, over its recent records), its end-of-run
summary and the run report (both `run_utilization` over every record of the run, so they
agree):

    audit = run_utilization(records, cfg)["latency_audit"]   # or latency_audit(steps, ...)
    audit["bottleneck"], audit["advice"]   # "actors", "actor-bound: add ~3 envs per actor ..."

- learner capacity: episodes/s (and real tokens/s) it could train if it never waited for
  data = episodes per step / median train-step time (steps that compiled excluded);
- actor supply: episodes over time, per actor from its first record after its first
  episode (start-up excluded: loading, compiling the sampler) to its last, summed over
  actors; with env step latency p50/p99 and the policy (sampler) latency p50. Not the
  median of the per-record `episodes_per_s`: most 5 s windows of a short run are
  compilation or a window without a committed group, so that median is 0;
- the ratio supply / capacity says which side waits. Below 1 the learner idles for data
  (its duty cycle is at most about that ratio): the fleet that keeps it busy is suggested
  both ways, more environments per actor (hides env latency while the sampler keeps up)
  or more actors. Above 1 the surplus becomes backlog, staleness and dropped episodes;
- the backlog the learner's latest steps report: a whole batch (or more) buffered means
  the learner does not wait for the actors whatever the rates say (they are noisy under
  load), so the audit never advises more actors then.

In sync mode the learner waits for each batch by design, so a low duty cycle there is the
cost of synchrony, not a fleet that is too small.
"""

from __future__ import annotations

import collections
import datetime
import glob
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tunix_tasks.frontdoor.supervision import process_log_dir

BALANCED = 0.1  # supply within ±10% of capacity: neither side is the bottleneck
STOPPED_EARLY_S = 30.0  # a process whose last record is this much older than the run's
BACKLOG_STEPS = 5  # the learner's latest steps whose buffer the audit weighs


def _median(values: Iterable[float | None]) -> float | None:
    vals = [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]
    return float(np.median(vals)) if vals else None


def learner_capacity(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Episodes/s and tokens/s the learner could train if never waiting, from its step
    records (`step_s`, `episodes`, `real_tokens`). The first step and any step that
    compiled a new bucket are left out: they are start-up, not the steady rate."""
    steady, prev_compiles = [], None
    for i, r in enumerate(steps):
        compiles = r.get("compile_count")
        compiled = prev_compiles is not None and compiles is not None and compiles > prev_compiles
        if i > 0 and not compiled and r.get("step_s"):
            steady.append(r)
        prev_compiles = compiles
    if not steady:  # one or two steps only: better a start-up figure than none
        steady = [r for r in steps if r.get("step_s")]
    step_s = _median(r["step_s"] for r in steady)
    if not step_s:
        return {"step_s": None, "episodes_per_step": None, "eps_per_s": None, "tokens_per_s": None}
    eps = float(np.mean([r.get("episodes", 0) for r in steady]))
    tokens = float(np.mean([r.get("real_tokens", 0) for r in steady]))
    return {
        "step_s": step_s,
        "episodes_per_step": eps,
        "eps_per_s": eps / step_s,
        "tokens_per_s": tokens / step_s,
    }


def _lives(records: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """One actor's records (in time order) split where its episode count starts again:
    a restarted actor (same id, new process) counts from 0."""
    lives: list[list[dict[str, Any]]] = []
    last = None
    for r in records:
        n = r.get("episodes")
        if not isinstance(n, int | float):
            continue
        if last is None or n < last:
            lives.append([])
        lives[-1].append(r)
        last = n
    return lives


def actor_rate(records: Sequence[dict[str, Any]]) -> float | None:
    """Episodes/s of one actor: the episodes counted between its first record after its
    first episode and its last record, over that time, summed over its lives. None
    until two such records exist."""
    episodes, span = 0.0, 0.0
    for life in _lives(sorted(records, key=lambda r: r.get("time", 0.0))):
        producing = [r for r in life if r["episodes"] > 0]
        if len(producing) >= 2:
            episodes += producing[-1]["episodes"] - producing[0]["episodes"]
            span += producing[-1]["time"] - producing[0]["time"]
    return episodes / span if span > 0 else None


def paused_share(records: Sequence[dict[str, Any]]) -> float | None:
    """The share of one actor's time flow control paused it: the growth of its
    `flow_paused_s` over its last life's records, over their span. None without flow
    control or two such records."""
    lives = _lives(sorted(records, key=lambda r: r.get("time", 0.0)))
    timed = [r for r in (lives[-1] if lives else []) if "flow_paused_s" in r]
    if len(timed) < 2 or timed[-1]["time"] <= timed[0]["time"]:
        return None
    paused = timed[-1]["flow_paused_s"] - timed[0]["flow_paused_s"]
    return min(1.0, max(0.0, paused / (timed[-1]["time"] - timed[0]["time"])))


LATENCIES = ("env_step_p50_s", "env_step_p99_s", "policy_latency_p50_s")


def actor_supply(actor_records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Episodes/s the actors produce (the sum of `actor_rate` over actors), the mean
    share of their time flow control paused them (`paused_share`), and their latencies:
    per actor the median of its records' p50/p99 from its first episode on (its latest
    record's before that), then the median over actors. Not the latest
    record alone: an actor's final record, after it stopped, says little."""
    by_actor: dict[str, list[dict[str, Any]]] = {}
    for r in actor_records:
        by_actor.setdefault(str(r.get("process", r.get("actor_id", "?"))), []).append(r)
    rates, latencies, paused = [], [], []
    for rs in by_actor.values():
        rate = actor_rate(rs)
        if rate is not None:
            rates.append(rate)
        if (share := paused_share(rs)) is not None:
            paused.append(share)
        producing = [r for r in rs if (r.get("episodes") or 0) > 0 and not r.get("final")]
        steady = producing or [max(rs, key=lambda r: r.get("time", 0.0))]
        latencies.append({k: _median(r.get(k) for r in steady) for k in LATENCIES})
    return {
        "actors_reporting": len(by_actor),
        "eps_per_s": float(sum(rates)) if rates else None,
        "per_actor_eps_per_s": float(np.mean(rates)) if rates else None,
        "paused_share": float(np.mean(paused)) if paused else None,
        **{k: _median(a[k] for a in latencies) for k in LATENCIES},
    }


def learner_backlog(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the learner's last `BACKLOG_STEPS` step records saw waiting: the median of
    their `buffer` (episodes buffered after the step) and `backlog_shards` (shards not
    read yet), and the largest staleness they trained."""
    recent = steps[-BACKLOG_STEPS:]
    stale = [int(k) for r in recent for k, v in (r.get("staleness") or {}).items() if v]
    buffered = _median(r.get("buffer") for r in recent)
    shards = _median(r.get("backlog_shards") for r in recent)
    return {
        "buffered_episodes": None if buffered is None else round(buffered),
        "unread_shards": None if shards is None else round(shards),
        "staleness_max": max(stale, default=None),
    }


def step_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every learner step record, redone steps included, in time order."""
    steps = [r for r in records if r.get("process") == "learner" and "step" in r and "loss" in r]
    return sorted(steps, key=lambda r: r["time"])


def learner_steps(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per learner step, in step order. A learner that crashes resumes from
    its last checkpoint and redoes the steps after it; a redone step keeps the record of
    the attempt that survived (the latest), so nothing counts twice."""
    last: dict[int, dict[str, Any]] = {}
    for r in step_records(records):
        last[r["step"]] = r
    return [last[step] for step in sorted(last)]


def actor_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The actors' metrics records."""
    return [r for r in records if str(r.get("process", "")).startswith("actor/")]


def _backlog_text(out: dict[str, Any]) -> str:
    """`797 episodes buffered (~12 steps), 3 shards unread, staleness at its bound 4`."""
    text = (
        f"{out['buffered_episodes']} episodes buffered (~{out['backlog_steps']:.0f} steps), "
        f"{out['unread_shards'] or 0} shards unread"
    )
    at_bound = (out["staleness_max"] or 0) >= out["max_staleness"]
    return text + (f", staleness at its bound {out['max_staleness']}" if at_bound else "")


class AuditWindow:
    """The recent records a live latency audit reads: the learner's last `STEPS` step
    records and each actor's last `PER_ACTOR` (about two minutes at one per 5 s).

        window.add(records)                                   # as metrics arrive
        window.audit(cfg, running={"actor-0000"}, actors=1)   # those actors only
    """

    STEPS = 200
    PER_ACTOR = 24

    def __init__(self) -> None:
        self.steps: collections.deque[dict[str, Any]] = collections.deque(maxlen=self.STEPS)
        self.actors: dict[str, collections.deque[dict[str, Any]]] = {}  # process -> records

    def add(self, records: Iterable[dict[str, Any]]) -> None:
        for r in records:
            process = str(r.get("process", ""))
            if process.startswith("actor/"):
                window = self.actors.setdefault(process, collections.deque(maxlen=self.PER_ACTOR))
                window.append(r)
            elif "step" in r and "loss" in r:
                self.steps.append(r)

    def latest_actor_records(self) -> list[dict[str, Any]]:
        return [rs[-1] for rs in self.actors.values() if rs]

    def audit(
        self, cfg: Any, *, running: set[str] | None = None, actors: int | None = None
    ) -> dict[str, Any]:
        """`latency_audit` of the window: of the `running` actors' records only when
        given (actor ids, `actor-0003`), for a fleet of `actors` (default: the config's)."""
        if actors is not None and actors != cfg.actor.num_actors:  # a resized fleet
            cfg = cfg.model_copy(
                update={"actor": cfg.actor.model_copy(update={"num_actors": actors})}
            )
        records = [
            r
            for name, rs in self.actors.items()
            if running is None or name.removeprefix("actor/") in running
            for r in rs
        ]
        return latency_audit(sorted(self.steps, key=lambda r: r["step"]), records, cfg)


def latency_audit(
    learner_records: Sequence[dict[str, Any]], actor_records: Sequence[dict[str, Any]], cfg: Any
) -> dict[str, Any]:
    """Learner capacity vs actor supply, the bottleneck, and the fleet that would keep the
    learner busy. `learner_records`: the learner's step records (one per step, in order);
    `actor_records`: the actors' metrics records; `cfg`: the run's `RunConfig`."""
    steps = [r for r in learner_records if "step" in r and "loss" in r]
    cap, sup = learner_capacity(steps), actor_supply(actor_records)
    actors, envs = cfg.actor.num_actors, cfg.actor.envs_per_actor
    out: dict[str, Any] = {
        "mode": cfg.mode,
        "learner_step_s": cap["step_s"],
        "episodes_per_step": cap["episodes_per_step"],
        "learner_capacity_eps_per_s": cap["eps_per_s"],
        "learner_capacity_tokens_per_s": cap["tokens_per_s"],
        "actors": actors,
        "envs_per_actor": envs,
        "actor_supply_eps_per_s": sup["eps_per_s"],
        "per_actor_eps_per_s": sup["per_actor_eps_per_s"],
        "actor_paused_share": sup["paused_share"],
        "env_step_p50_s": sup["env_step_p50_s"],
        "env_step_p99_s": sup["env_step_p99_s"],
        "policy_latency_p50_s": sup["policy_latency_p50_s"],
        **learner_backlog(steps),
        "backlog_steps": None,
        "max_staleness": cfg.learner.max_staleness,
        "supply_over_capacity": None,
        "bottleneck": "unknown",
        "suggest_envs_per_actor": None,
        "suggest_num_actors": None,
        "policy_bound": None,
        "advice": "not enough metrics yet (learner steps, and actor records after their "
        "first episodes)",
    }
    capacity, supply = cap["eps_per_s"], sup["eps_per_s"]
    if not capacity or not supply:
        return out
    ratio = supply / capacity
    out["supply_over_capacity"] = ratio
    if out["buffered_episodes"] is not None and cap["episodes_per_step"]:
        out["backlog_steps"] = out["buffered_episodes"] / cap["episodes_per_step"]
    # A whole batch waiting: the learner does not wait for the actors, whatever the rates.
    backlog = cfg.mode != "sync" and (out["backlog_steps"] or 0.0) >= 1
    fleet = max(ratio, 1.0) if backlog else ratio  # never more actors over a backlog
    out["suggest_envs_per_actor"] = max(1, math.ceil(envs / fleet))
    out["suggest_num_actors"] = max(1, math.ceil(actors / fleet))
    rates = f"actors supply {supply:.3g} eps/s, learner trains up to {capacity:.3g} eps/s"
    if cfg.mode == "sync":
        out["bottleneck"] = "sync"
        out["advice"] = (
            f"sync: the learner waits for every batch by design ({rates}); "
            "async mode overlaps generation with training"
        )
    elif backlog or ratio > 1 + BALANCED:
        out["bottleneck"] = "learner"
        out["advice"] = f"learner-bound ({rates}"
        out["advice"] += f"; {_backlog_text(out)}): " if backlog else "): "
        out["advice"] += (
            f"the surplus becomes backlog and staleness; ~{out['suggest_num_actors']} actors "
            "would do"
            if ratio > 1 + BALANCED
            else "the learner does not wait for the actors; more actors would only add staleness"
        )
    elif ratio < 1 - BALANCED:
        out["bottleneck"] = "actors"
        out["policy_bound"] = (sup["env_step_p50_s"] or 0.0) < (sup["policy_latency_p50_s"] or 0.0)
        add_envs = out["suggest_envs_per_actor"] - envs
        add_actors = out["suggest_num_actors"] - actors
        out["advice"] = f"actor-bound ({rates}): " + (
            f"policy latency dominates: add ~{add_actors} actors"
            if out["policy_bound"]
            else f"add ~{add_envs} envs per actor or {add_actors} actors"
        )
    else:
        out["bottleneck"] = "balanced"
        out["advice"] = f"balanced ({rates})"
    return out


def busy_s(step: dict[str, Any]) -> float:
    """The device's time in a learner step: `device_s` (launch to result, the host's
    packing of the next batch excluded); records older than it have only `step_s`."""
    return step["device_s"] if "device_s" in step else step["step_s"]


def steady_duty_cycle(steps: Sequence[dict[str, Any]]) -> float | None:
    """Device time in train steps over wall time, from the end of the first step
    (compilation and start-up excluded) to the last step."""
    if len(steps) < 3:
        return None
    span = steps[-1]["time"] - steps[0]["time"]
    busy = sum(busy_s(r) for r in steps[1:])
    return busy / span if span > 0 else None


def run_utilization(records: Sequence[dict[str, Any]], cfg: Any) -> dict[str, Any]:
    """The utilization figures of a whole run's metrics records (every process, any
    order; a redone step's surviving record counts once): `duty_cycle_steady`,
    `duty_cycle_explained` and `latency_audit`, what the report and `train`'s summary
    show."""
    steps = learner_steps(records)
    audit = latency_audit(steps, actor_records(records), cfg)
    duty = steady_duty_cycle(steps)
    return {
        "duty_cycle_steady": duty,
        "duty_cycle_explained": explain_duty(duty, audit),
        "latency_audit": audit,
    }


def audit_line(audit: dict[str, Any]) -> str:
    """One short line for the live display."""
    b, ratio = audit.get("bottleneck"), audit.get("supply_over_capacity")
    if b in (None, "unknown") or ratio is None:
        return "audit: waiting for learner steps and actors' first episodes"
    rates = (
        f"supply {audit['actor_supply_eps_per_s']:.3g} / capacity "
        f"{audit['learner_capacity_eps_per_s']:.3g} eps/s"
    )
    if b == "actors":
        add_envs = audit["suggest_envs_per_actor"] - audit["envs_per_actor"]
        add_actors = audit["suggest_num_actors"] - audit["actors"]
        if audit.get("policy_bound"):
            return f"actor-bound (policy latency), {rates}: add ~{add_actors} actors"
        return f"actor-bound, {rates}: add ~{add_envs} envs/actor or {add_actors} actors"
    if b == "learner":
        if (audit.get("backlog_steps") or 0.0) >= 1:
            return (
                f"learner-bound, {rates}, {audit['buffered_episodes']} eps buffered: no more actors"
            )
        return f"learner-bound, {rates}: ~{audit['suggest_num_actors']} actors would do"
    return f"{b}, {rates}"


def display_line(duty: float | None, audit: dict[str, Any] | None) -> str:
    """The live display's audit line: what the duty cycle is, and who is the bottleneck."""
    if audit is None:
        return ""
    head = f"duty = train time / wall time ({duty:.2f}); " if duty is not None else ""
    return head + audit_line(audit)


def explain_duty(duty: float | None, audit: dict[str, Any] | None) -> str:
    """What a duty cycle means, with the audit's reason when the learner waited."""
    if duty is None:
        return "duty cycle: not measured yet"
    text = f"duty cycle {duty:.2f}: the learner trained {duty:.0%} of its wall time"
    if duty < 0.9:
        text += f" and waited for data {1 - duty:.0%}"
        if audit and audit.get("bottleneck") not in (None, "unknown"):
            text += f"; {audit['advice']}"
    return text


def utc(t: float | None) -> str | None:
    """Seconds since the epoch as ISO 8601 UTC (to the second)."""
    if t is None:
        return None
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds")


def rounded(value: Any, digits: int = 4) -> Any:
    """`value` with every float rounded to `digits` significant digits (dicts and lists
    too): what the summary and the report show."""
    if isinstance(value, bool) or not isinstance(value, float | dict | list | tuple):
        return value
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, max(0, digits - 1 - math.floor(math.log10(abs(value)))))


COMPARED = (
    ("duty_cycle_steady", "learner duty cycle (steady)"),
    ("learner_wall_s", "learner wall time (s)"),
    ("trained_tokens_per_s", "real tokens trained / s"),
    ("reward_first", "reward, first 10% of steps"),
    ("reward_last", "reward, last 10% of steps"),
    ("steps", "learner steps"),
)


def compare_runs(summary: dict[str, Any], baseline: dict[str, Any]) -> list[dict[str, Any]]:
    """Side-by-side rows of two run summaries (e.g. async vs its sync baseline): the
    metric, both values and run / baseline."""
    rows = []
    for key, label in COMPARED:
        a, b = summary.get(key), baseline.get(key)
        ratio = a / b if isinstance(a, int | float) and isinstance(b, int | float) and b else None
        rows.append({"metric": label, "run": a, "baseline": b, "run_over_baseline": ratio})
    return rows


def _log_dirs(run_dir: Path | None, run_name: str) -> list[str]:
    """Where the local launcher may have written this run's process logs: where it
    writes them (`process_log_dir`), then where it wrote them before (`_logs/<run>` beside
    the run, or under the working directory)."""
    legacy = [os.path.join(os.getcwd(), "runs", "_logs", run_name)]
    if run_dir is not None:
        legacy.insert(0, os.path.join(run_dir.parent, "_logs", run_name))
    return [str(process_log_dir(run_dir, run_name)), *legacy]


def _last_lines(path: str, n: int = 3) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    return [ln.strip()[:300] for ln in lines if ln.strip()][-n:]


def health(
    run_dir: Path | None, records: list[dict[str, Any]], done: dict[str, Any] | None, run_name: str
) -> dict[str, Any]:
    """Which processes stopped and why: per process its first/last record (seconds since
    the run's first record) and whether it logged a final record (actors do when they stop
    cleanly); processes whose records stopped early; the learner's DONE reason; and the
    last lines of the local logs of the processes that look dead, found beside `run_dir`
    (the store's `local_path()`; None for a remote store)."""
    t0 = min((r["time"] for r in records), default=0.0)
    t_end = max((r["time"] for r in records), default=0.0)
    procs: dict[str, dict[str, Any]] = {}
    for r in records:
        p = procs.setdefault(str(r.get("process", "?")), {"first_s": r["time"] - t0, "records": 0})
        p["last_s"], p["records"] = r["time"] - t0, p["records"] + 1
        if "final" in r:
            p["final"] = bool(r["final"])
    reason = str((done or {}).get("reason", ""))  # learner's, launcher's or an Airflow DAG's
    finished = any(
        w in reason for w in ("learner max_steps", "learner deadline", "learner success")
    )
    # A finished run: what stopped well before the learner's end (actors flush after it).
    end = procs["learner"]["last_s"] if finished and "learner" in procs else t_end - t0
    early = [n for n, p in procs.items() if end - p["last_s"] > STOPPED_EARLY_S]
    unclean = [n for n, p in procs.items() if n.startswith("actor/") and p.get("final") is False]
    suspects = sorted(set(early + ([] if finished else [*unclean, "learner"])))
    logs: dict[str, list[str]] = {}
    for d in _log_dirs(run_dir, run_name):
        for path in sorted(glob.glob(os.path.join(d, "*.log"))):
            name = os.path.basename(path)[: -len(".log")]
            key = "learner" if name == "learner" else f"actor/{name}"
            if key in suspects and key not in logs:
                logs[key] = _last_lines(path)
    return {
        "done_reason": reason or None,
        "finished": finished,
        "processes": procs,
        "stopped_early": sorted(early),
        "actors_without_final_record": sorted(unclean),
        "log_tails": logs,
    }
