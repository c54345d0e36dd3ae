"""The end of `tunix-tasks train`: its summary dict as a few lines a person reads.

`train_local` returns a JSON-able summary (what scripts use: `tunix-tasks train --json`);
`format_train_summary` turns it into the lines the terminal shows by default:

    print(format_train_summary(train_local(cfg)))
    print(format_next_steps(summary))    # after a finished run: where to go from here
"""

from __future__ import annotations

from typing import Any

from tunix_tasks.frontdoor.audit import explain_duty

__all__ = ["format_next_steps", "format_train_summary"]


def _num(value: Any, fmt: str = ".3g") -> str:
    return "-" if value is None else format(value, fmt)


def _counts(counts: dict[str, Any] | None) -> str:
    """`{"0": 86, "1": 3}` -> `0: 86, 1: 3`."""
    return ", ".join(f"{k}: {v}" for k, v in (counts or {}).items()) or "none"


def _outcome(s: dict[str, Any]) -> str:
    if s.get("failed"):
        return f"FAILED: {s['failed']}"
    if s.get("interrupted"):
        return f"interrupted ({s['interrupted']}); the same command resumes it"
    code = s.get("learner_exit_code")
    return "finished" if code == 0 else f"learner exited with code {code}"


def _actors(s: dict[str, Any]) -> str:
    codes = s.get("actor_exit_codes") or []
    text = f"{len(codes)} processes, exit codes {codes}"
    restarts = s.get("actor_restarts") or {}
    if restarts:
        text += "; restarted " + ", ".join(f"{n} x{k}" for n, k in sorted(restarts.items()))
    return text


def _autopilot(pilot: dict[str, Any]) -> str:
    """`2 changes (1 -> 2, 2 -> 3), 3 actors at the end; last: ...`."""
    changes = pilot["changes"]
    done = f"{len(changes)} changes ({', '.join(changes)})" if changes else "no change"
    return f"{done}, {pilot['actors']} actors at the end; last: {pilot['last']}"


def _utilization(s: dict[str, Any]) -> str:
    """The report's steady duty cycle (start-up excluded) when the run's records were
    read at the end, else the last step's (compilation included)."""
    steady = s.get("duty_cycle_steady")
    if steady is None:
        return explain_duty((s.get("last_step") or {}).get("duty_cycle"), None)
    return explain_duty(steady, None) + " (after its first step, as in the report)"


def format_train_summary(s: dict[str, Any]) -> str:
    """The summary of a `train_local` run, one labelled line per topic."""
    step = s.get("last_step") or {}
    lag = (s.get("display") or {}).get("lag_s") or {}
    version = s.get("version", step.get("version", "-"))
    rows = {
        "run": f"{s.get('run_uri')} ({s.get('mode')}): {_outcome(s)} "
        f"(wall time {_num(s.get('wall_s'), '.0f')} s)",
        "learner": f"step {step.get('step', '-')}, weights version {version}, "
        f"{_num(step.get('step_s'))} s/step, {step.get('compile_count', '-')} compiles",
        "reward": f"{_num(step.get('reward_mean'))} (mean of the last step's episodes)",
        "data": f"last step's episodes by staleness {_counts(step.get('staleness'))}; "
        f"over the run: dropped {_counts(step.get('dropped'))}, quarantined shards "
        f"{step.get('quarantined', 0)}",
        "utilization": _utilization(s),  # the why: the audit line
        # Staleness 0: sampler-vs-learner numerics alone (bf16 sampling's cost; the report
        # has them over the run). "-": the last step had no fresh tokens.
        "mismatch": f"fresh tokens: k3 KL {_num(step.get('approx_kl_s0'))}, max |logprob "
        f"diff| {_num(step.get('max_abs_logprob_diff_s0'))} (last step)",
        "audit": (s.get("latency_audit") or {}).get("advice") or "-",
        "actors": _actors(s),
        **({"autopilot": _autopilot(s["autopilot"])} if s.get("autopilot") else {}),
        "display": f"lag mean {_num(lag.get('mean'))} s, max {_num(lag.get('max'))} s",
        "report": s.get("report") or s.get("report_error") or "not written",
        "logs": str(s.get("logs") or "-"),
    }
    width = max(map(len, rows))
    return "\n".join(f"{label:<{width}}  {text}" for label, text in rows.items())


def format_next_steps(s: dict[str, Any], prog: str = "tunix-tasks") -> str:
    """What to do after a finished run: its report, what the model wrote, your own task,
    scaling out (commands to copy, docs in the repository to read). `prog`: how the
    user called `tunix-tasks`, so the commands can be pasted as they are."""
    run = s.get("run_uri")
    report = s.get("report")
    rows = {
        "report": f"{report} (open it in a browser)" if report else f"{prog} report {run}",
        "answers": f"{prog} inspect {run}/shards --conversations 3 --order best",
        "your task": "prompts and answers from a JSONL/Parquet file, no code: "
        f"{prog} train --config examples/dataset_task/config.yaml "
        "(docs/environments.md, 'Your own task from a dataset')",
        "scale out": "actors and envs per actor (docs/scaling.md), a gs:// store and Airflow "
        "(docs/airflow.md), a real model (docs/models.md)",
    }
    width = max(map(len, rows))
    return "next steps:\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows.items())
