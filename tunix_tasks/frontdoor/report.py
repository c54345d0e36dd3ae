"""The run report: summary numbers (JSON) and plots (one self-contained HTML page), and
what the model wrote: a few episodes of each phase of training as conversations
(`frontdoor/inspect.py: answer_phases`).

Built only from what the run left in its store (metrics chunks, ledger, quarantine,
evaluations, config), so it works for a finished, a running or a crashed run. Metrics
records come through `MetricsTail`, the reader the live display of `tunix-tasks train`
uses, so the report and the display show the same numbers:

    uri = write_report("file:///tmp/runs/demo")   # -> .../report/index.html
    summary = summarize(store)                     # the numbers alone
"""

from __future__ import annotations

import collections
import html
import json
from typing import Any

import numpy as np

from tunix_tasks.config import RunConfig
from tunix_tasks.frontdoor.audit import (
    actor_records,
    compare_runs,
    health,
    learner_steps,
    rounded,
    run_utilization,
    step_records,
    utc,
)
from tunix_tasks.frontdoor.autopilot import PROCESS as AUTOPILOT
from tunix_tasks.frontdoor.inspect import answer_phases, read_episodes, turn_label
from tunix_tasks.frontdoor.plots import report_plots
from tunix_tasks.learner import drop_bias
from tunix_tasks.learner.accounting import read_ledger
from tunix_tasks.policy.preflight import build_chat
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.metrics import MetricsTail
from tunix_tasks.storage.runs import is_done, read_config
from tunix_tasks.storage.store import NotFound, ObjectStore
from tunix_tasks.storage.uri import join_uri
from tunix_tasks.storage.weights import PointerError, read_latest


def step_record_gaps(records: list[dict[str, Any]]) -> tuple[int, int]:
    """(steps redone, steps without metrics). Redone: step records superseded by a later
    attempt's record of the same step (a crash after the metrics of those steps were
    flushed). Without metrics: steps up to the last one with no record at all, e.g. run
    after the last metrics flush of an attempt that then crashed past a checkpoint (such
    steps are not redone, so their metrics are lost)."""
    every = step_records(records)
    unique = {r["step"] for r in every}
    last = max(unique, default=0)
    return len(every) - len(unique), last - len({s for s in unique if 1 <= s <= last})


def sampler_mismatch(steps: list[dict[str, Any]], cfg: RunConfig) -> dict[str, Any] | None:
    """What the actors' numerics cost, from the steps that trained fresh tokens (bucket
    s0: tokens trained by the very weights that sampled them, no learner step in between;
    a version lag of 0 is not enough, the weights move within a version): the mean of
    their `approx_kl_s0` and the largest `max_abs_logprob_diff_s0`."""
    fresh = [r for r in steps if "approx_kl_s0" in r]
    if not fresh:
        return None
    worst = [r["max_abs_logprob_diff_s0"] for r in fresh if "max_abs_logprob_diff_s0" in r]
    return {
        "model_dtype": cfg.model.dtype,
        "learner_compute_dtype": cfg.learner.compute_dtype,
        "steps_with_fresh_tokens": len(fresh),
        "approx_kl_s0_mean": float(np.mean([r["approx_kl_s0"] for r in fresh])),
        "max_abs_logprob_diff_s0_max": max(worst) if worst else None,
        "explained": "Fresh tokens (no learner step between sampling and training) were "
        "scored by the very weights that sampled them, so this gap is numerics alone: 0 "
        "up to float noise (~1e-6) when model.dtype equals learner.compute_dtype; with bfloat16 sampling it is what bf16 costs, each fresh "
        "importance ratio pi/mu being off 1 by up to exp(max diff) - 1 (learner.correction "
        "reweights it).",
    }


def stale_drop_bias(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Episodes dropped as stale against those trained, from the last step record's
    cumulative `drop_bias` (`learner/drop_bias.py`): each side's count, mean, sd and
    p50/p90 of length, turns and reward, the ratios of the means, and the live
    display's hint. None without it: no stale drop (or a run from before it was
    recorded)."""
    bias = steps[-1].get("drop_bias") if steps else None
    if not bias:
        return None
    trained, stale = bias["trained"], bias["stale"]
    return {
        "hint": drop_bias.hint(trained, stale),
        **drop_bias.compare(trained, stale),
        "by_side": [{"side": side, **drop_bias.describe(bias[side])} for side in drop_bias.SIDES],
    }


def autopilot_decisions(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The autopilot's decisions (`actor.autopilot`, frontdoor/autopilot.py): how many,
    the fleet's range, and each change with its time (seconds since the run's first
    record) and reason. None when it did not run."""
    decisions = [r for r in records if r.get("process") == AUTOPILOT]
    if not decisions:
        return None
    start = min(r["time"] for r in records)
    return {
        "decisions": len(decisions),
        "actors_range": [
            min(r["actors"] for r in decisions),
            max(r["actors"] for r in decisions),
        ],
        "last": decisions[-1]["reason"],
        "changes": [
            {
                "at_s": round(r["time"] - start, 1),
                "action": r["autopilot"],
                "actors": f"{r['actors_before']} -> {r['actors']}",
                "reason": r["reason"],
            }
            for r in decisions
            if r["autopilot"] != "hold"
        ],
    }


def read_records(store: ObjectStore) -> list[dict[str, Any]]:
    """Every metrics record of the run (all processes), sorted by time."""
    return MetricsTail(store).poll()


def latest_version(store: ObjectStore) -> int | None:
    """The version `weights/LATEST` points at: the last published snapshot. The last step
    record's version can be one less: the learner logs a step before publishing after it,
    and publishes once more at the end of the run."""
    try:
        got = read_latest(store)
    except (PointerError, NotFound):
        return None
    return got[0] if got else None


def summarize(store: ObjectStore, records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    cfg, _ = read_config(store.uri)
    if records is None:
        records = read_records(store)
    steps = learner_steps(records)  # one per step: redone steps count once
    steps_redone, steps_without_metrics = step_record_gaps(records)
    actors = actor_records(records)
    final_actor: dict[str, dict[str, Any]] = {}
    for r in actors:
        final_actor[r["process"]] = r
    ledger = read_ledger(store)
    trained = sum(len(e.get("trained", [])) for e in ledger)
    dropped: collections.Counter[str] = collections.Counter()
    for e in ledger:
        for reason, ids in e.get("dropped", {}).items():
            dropped[reason] += len(ids)
    staleness: collections.Counter[int] = collections.Counter()
    for r in steps:
        for k, v in (r.get("staleness") or {}).items():
            staleness[int(k)] += v
    quarantined = [
        i.key for i in store.list(RunLayout.QUARANTINE) if i.key.endswith(".reason.json")
    ]
    evals = [
        json.loads(store.read_bytes(i.key))
        for i in store.list(RunLayout.EVAL)
        if i.key.endswith(".json")
    ]
    rewards = [r["reward_mean"] for r in steps]
    k = max(1, len(rewards) // 10)
    wall = steps[-1]["time"] - steps[0]["time"] + steps[0]["step_s"] if steps else 0.0
    trained_tokens = sum(r["real_tokens"] for r in steps)
    actor_eps = sum(int(r.get("episodes", 0)) for r in final_actor.values())
    done = is_done(store)
    utilization = run_utilization(records, cfg)
    last_step_version = steps[-1]["version"] if steps else None
    version = latest_version(store)
    times = [r["time"] for r in records]
    return rounded(
        {
            "run_uri": store.uri,
            "mode": cfg.mode,
            "env": cfg.env.name,
            "env_latency_s": cfg.env.latency_s,
            "started_utc": utc(min(times, default=None)),
            "ended_utc": utc(max(times, default=None)),
            "done": {**done, "time": utc(done.get("time"))} if done else None,
            "steps": steps[-1]["step"] if steps else 0,
            "steps_redone": steps_redone,
            "steps_without_metrics": steps_without_metrics,
            "version": version if version is not None else last_step_version,
            "version_last_step_record": last_step_version,
            "trained_episodes_ledger": trained,
            "dropped_ledger": dict(dropped),
            "dropped_total": steps[-1]["dropped"] if steps else {},
            "episodes_generated": actor_eps,
            "quarantined_shards": len(quarantined),
            "reward_first": float(np.mean(rewards[:k])) if rewards else None,
            "reward_last": float(np.mean(rewards[-k:])) if rewards else None,
            "duty_cycle": steps[-1]["duty_cycle"] if steps else None,
            **utilization,  # duty_cycle_steady, duty_cycle_explained, latency_audit
            "learner_wall_s": wall,
            "trained_tokens": trained_tokens,
            "trained_tokens_per_s": trained_tokens / wall if wall else None,
            "compile_count": steps[-1]["compile_count"] if steps else 0,
            "staleness_histogram": {str(s): n for s, n in sorted(staleness.items())},
            "stale_drop_bias": stale_drop_bias(steps),
            "autopilot": autopilot_decisions(records),
            "sampler_mismatch": sampler_mismatch(steps, cfg),
            "evaluations": sorted(
                (
                    {
                        "version": e["version"],
                        "reward_mean": e["reward_mean"],
                        "success_rate": e.get("success_rate"),
                    }
                    for e in evals
                ),
                key=lambda e: e["version"],
            ),
            "actors": {
                name: {
                    "episodes": r.get("episodes"),
                    "env_step_p50_s": r.get("env_step_p50_s"),
                    "env_step_p99_s": r.get("env_step_p99_s"),
                    "weights_version": r.get("weights_version"),
                }
                for name, r in sorted(final_actor.items())
            },
            "health": health(store.local_path(), records, done, cfg.run_name),
        }
    )


def _cell(v: Any) -> str:
    """A value as HTML for a table cell: text as it is, `-` for none, a flat dict as
    `key: value` pairs, a list of dicts as a table of its own; never a JSON dump."""
    if v is None or v == [] or v == {}:
        return "-"
    if isinstance(v, dict):
        return html.escape(", ".join(f"{k}: {'-' if x is None else x}" for k, x in v.items()))
    if isinstance(v, list | tuple):
        if v and all(isinstance(x, dict) for x in v):
            return _table(list(v))
        return html.escape(", ".join(map(str, v)))
    return html.escape(str(v))


def _table(rows: list[dict[str, Any]] | dict[str, Any]) -> str:
    """An HTML table: of a dict (key, value rows) or of a list of dicts (one per row)."""
    if isinstance(rows, dict):
        body = "".join(f"<tr><th>{_cell(k)}</th><td>{_cell(v)}</td></tr>" for k, v in rows.items())
        return f"<table>{body}</table>"
    keys = list(dict.fromkeys(k for r in rows for k in r))  # a row may lack some
    head = "".join(f"<th>{_cell(k)}</th>" for k in keys)
    body = "".join(
        "<tr>" + "".join(f"<td>{_cell(r.get(k))}</td>" for k in keys) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


SECTIONS = (
    *("actors", "latency_audit", "health", "baseline", "duty_cycle_explained"),
    "sampler_mismatch",
    "stale_drop_bias",
    "autopilot",
    "answers_by_phase",
)
# Shards the report reads and episodes it decodes at most, spread over the run's time:
# enough for each phase's figures, bounded for a long run (8 MiB shards of long episodes).
REPORT_SHARDS = 48
REPORT_EPISODES = 3000


def answers_over_training(store: ObjectStore, cfg: RunConfig) -> tuple[list[dict[str, Any]], str]:
    """(the phases of `answer_phases` over up to `REPORT_EPISODES` episodes of up to
    `REPORT_SHARDS` of the run's shards, a sentence saying where they come from or why
    there are none)."""
    try:
        chat = build_chat(cfg.model)
        episodes = read_episodes(store.uri + "/shards", max_shards=REPORT_SHARDS)
        episodes = episodes[:: -(-len(episodes) // REPORT_EPISODES) or 1]
        phases = answer_phases(episodes, chat)
    except NotFound:  # no shards/ folder (yet)
        phases = []
    except ValueError as err:  # PolicyError: names the checkpoint and the file
        return [], f"The run's tokenizer cannot be loaded: {err}"
    if not phases:
        return [], (
            "No episodes in the run's shards: none written yet, or deleted once trained "
            "(learner.delete_consumed_shards)."
        )
    return phases, (
        f"Up to {REPORT_EPISODES} episodes of up to {REPORT_SHARDS} shards spread over "
        "the run, cut by weights "
        "version into phases; each phase's best, worst and most recent episode, decoded "
        "with the run's tokenizer (model turns are what the policy sampled). More: "
        f"tunix-tasks inspect {store.uri}/shards --conversations 5 --order best|worst|recent"
    )


def _figures(phases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each phase's numbers, without its sample episodes (what summary.json holds)."""
    return rounded([{k: v for k, v in p.items() if k != "samples"} for p in phases])


def _conversations_html(phases: list[dict[str, Any]], note: str) -> str:
    out = f"<p>{html.escape(note)}</p>" + (_table(_figures(phases)) if phases else "")
    for p in phases:
        out += f"<h3>{p['phase']} (versions {p['versions'][0]}-{p['versions'][1]})</h3>"
        for order, sample in p["samples"].items():
            ep = sample["episode"]
            talk = "".join(
                f'<span class="{t.role}{" call" if t.tool_call else ""}">[{turn_label(t)}]</span>\n'
                f"{html.escape(t.text)}\n"
                for t in sample["turns"]
            )
            out += (
                f"<details><summary>{order}: reward {ep.reward:.3f}, version "
                f"{ep.policy_version}, {ep.status}, {ep.num_turns} turns</summary>"
                f'<pre class="talk">{talk}</pre></details>'
            )
    return out


def _drop_bias_html(summary: dict[str, Any]) -> str:
    """The "Stale drops vs trained episodes" section: the hint and each side's figures."""
    bias = summary.get("stale_drop_bias")
    if not (summary.get("dropped_total") or {}).get("stale"):
        return "<p>No episode was dropped as stale.</p>"
    if not bias:
        return "<p>No step record holds the drop bias (a run from before it was recorded).</p>"
    said = bias["hint"] or "No significant difference from the trained episodes"
    return f"<p>{html.escape(said)}.</p>{_table(bias['by_side'])}"


def _autopilot_html(summary: dict[str, Any]) -> str:
    """The "Autopilot" section: its decisions and every change with its reason."""
    pilot = summary.get("autopilot")
    if not pilot:
        return "<p>The autopilot was off (actor.autopilot.enabled): the fleet kept its size.</p>"
    low, high = pilot["actors_range"]
    said = (
        f"{pilot['decisions']} decisions, {len(pilot['changes'])} changes; the fleet ran "
        f"{low}-{high} actors. Last: {pilot['last']}"
    )
    return f"<p>{html.escape(said)}.</p>" + (_table(pilot["changes"]) if pilot["changes"] else "")


def render_html(
    summary: dict[str, Any], plots: list[tuple[str, str]], conversations: str = ""
) -> str:
    """The page; `conversations`: the "What the model wrote" section's HTML."""
    summary = rounded(summary)
    rows = _table({k: v for k, v in summary.items() if k not in SECTIONS})
    audit = summary.get("latency_audit") or {}
    utilization = f"<p>{html.escape(str(summary.get('duty_cycle_explained', '')))}</p>"
    utilization += f"<p>{html.escape(str(audit.get('advice', '')))}</p>" + _table(audit)
    baseline = summary.get("baseline")
    if baseline:
        utilization += f"<h3>Against the baseline {html.escape(baseline['run_uri'])}</h3>"
        utilization += _table(baseline["comparison"])
    h = summary.get("health") or {}
    state = "finished" if h.get("finished") else "did not finish (crashed, stopped or running)"
    why = f"<p>The run {state}; DONE: {html.escape(str(h.get('done_reason')))}."
    if h.get("stopped_early"):
        why += f" Metrics stopped early: {html.escape(', '.join(h['stopped_early']))}."
    why += "</p>" + "".join(
        f"<h4>last log lines of {html.escape(n)}</h4><pre>{html.escape(chr(10).join(ls))}</pre>"
        for n, ls in (h.get("log_tails") or {}).items()
    )
    procs = [{"process": n, **p} for n, p in (h.get("processes") or {}).items()]
    mismatch = dict(summary.get("sampler_mismatch") or {})
    numerics = "<p>No step trained fresh tokens (on the very weights that sampled them).</p>"
    if mismatch:
        numerics = f"<p>{html.escape(mismatch.pop('explained'))}</p>{_table(mismatch)}"
    # The title is in each image: no caption repeats it.
    imgs = "".join(
        f'<figure><img alt="{html.escape(t)}" src="data:image/png;base64,{b}"></figure>'
        for t, b in plots
    )
    actors = [{"actor": name, **a} for name, a in (summary.get("actors") or {}).items()]
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>tunix-tasks report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1400px}} table{{border-collapse:collapse}}
th,td{{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:13px}} figure{{display:inline-block;margin:8px}}
pre.talk{{white-space:pre-wrap;background:#f6f6f6;padding:6px}} .model{{color:#1a55b0}} .call{{color:#b05a00}} .env{{color:#2a7a2a}} .prompt,.end{{color:#777}}</style>
</head><body><h1>tunix-tasks run report</h1><p>{html.escape(summary["run_uri"])}</p>
<h2>Summary</h2>{rows}<h2>Utilization</h2>{utilization}<h2>Processes</h2>{why}{_table(procs)}
<h2>Sampler vs learner numerics</h2>{numerics}
<h2>Stale drops vs trained episodes</h2>{_drop_bias_html(summary)}
<h2>Autopilot</h2>{_autopilot_html(summary)}
<p>Times: seconds since the run's first metrics record ({summary.get("started_utc")} UTC).</p>
<h2>Plots</h2>{imgs}
<h2>What the model wrote</h2>{conversations}
<h2>Actors</h2>{_table(actors) if actors else "<p>No actor wrote metrics.</p>"}</body></html>"""


def baseline_uri(run_uri: str) -> str | None:
    """The sync baseline of a run, by convention its sibling `<run>-sync`, if it exists."""
    uri = run_uri.rstrip("/") + "-sync"
    try:
        read_config(uri)
    except Exception:  # no such run, or unreadable: no baseline
        return None
    return uri


def write_report(run_uri: str, baseline: str | None = None) -> str:
    """Write report/index.html and report/summary.json under the run; returns the HTML URI.
    `baseline`: a run of the same config to compare with (default: `<run>-sync` if any)."""
    cfg, store = read_config(run_uri)
    records = read_records(store)
    summary = summarize(store, records)
    phases, note = answers_over_training(store, cfg)
    summary["answers_by_phase"] = _figures(phases)
    baseline = baseline or (
        None if run_uri.rstrip("/").endswith("-sync") else baseline_uri(run_uri)
    )
    if baseline:
        _, base_store = read_config(baseline)
        other = summarize(base_store)
        summary["baseline"] = {
            "run_uri": base_store.uri,
            "comparison": compare_runs(summary, other),
        }
    plots = report_plots(records, learner_steps(records), summary)
    store.write_bytes(
        RunLayout.SUMMARY, json.dumps(rounded(summary), indent=2, default=str).encode()
    )
    page = render_html(summary, plots, _conversations_html(phases, note))
    store.write_bytes(RunLayout.REPORT, page.encode())
    return join_uri(store.uri, RunLayout.REPORT)
