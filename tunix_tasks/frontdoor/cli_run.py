"""CLI commands that run processes of a training run (actor, learner, train, report, eval).

Kept apart from `cli.py` so `tunix-tasks inspect` never imports JAX. Each command parses
its arguments and calls one function of `tunix_tasks.frontdoor.entrypoints` or `launcher`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

SYNC_OVERRIDES = ("mode=sync", "learner.max_staleness=0", "learner.publish_every=1")


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def _train(args: argparse.Namespace, load: Callable[..., Any]) -> int:
    from tunix_tasks.frontdoor.launcher import train_local

    extra = []
    if args.store:
        extra.append(f"store={args.store}")
    if args.run_name:
        extra.append(f"run_name={args.run_name}")
    if args.mode == "sync":
        extra.extend(SYNC_OVERRIDES)
    elif args.mode == "async":
        extra.append("mode=async")
    cfg = load(args, extra)
    print(
        f"run {cfg.run_uri}  mode={cfg.mode}  env={cfg.env.name}  model={cfg.model.preset}  "
        f"actors={cfg.actor.num_actors}x{cfg.actor.envs_per_actor} envs  steps={cfg.learner.max_steps}"
    )
    summary = train_local(cfg, quiet=args.quiet)
    _print_json(summary)
    if summary.get("interrupted"):
        print(f"interrupted; run the same command again to resume {cfg.run_uri}", file=sys.stderr)
        return 130
    return 0 if summary["learner_exit_code"] == 0 else 1


def _actor(args: argparse.Namespace) -> int:
    from tunix_tasks.frontdoor.entrypoints import run_actor

    _print_json(run_actor(args.run, args.actor_id, deadline_s=args.deadline))
    return 0


def _learner(args: argparse.Namespace) -> int:
    from tunix_tasks.frontdoor.entrypoints import run_learner
    from tunix_tasks.frontdoor.launcher import PROGRESS_PREFIX

    def progress(record: dict[str, Any]) -> None:
        print(PROGRESS_PREFIX + json.dumps(record, default=str), flush=True)

    summary = run_learner(
        args.run,
        max_steps=args.max_steps,
        deadline_s=args.deadline,
        progress=progress if args.progress else None,
    )
    print(json.dumps(summary, default=str), file=sys.stderr)
    return 0


def _report(args: argparse.Namespace) -> int:
    from tunix_tasks.frontdoor.report import write_report

    print(write_report(args.run_uri))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from tunix_tasks.frontdoor.evaluate import evaluate_snapshot, held_out_seeds

    _print_json(evaluate_snapshot(args.run_uri, args.version, seeds=held_out_seeds(args.episodes)))
    return 0


def _prepare(args: argparse.Namespace, load: Callable[..., Any]) -> int:
    from tunix_tasks.frontdoor.entrypoints import prepare_run

    print(prepare_run(load(args, [])))
    return 0


def add_commands(
    sub: argparse._SubParsersAction,
    add_config_args: Callable[[argparse.ArgumentParser], None],
    commands: dict[str, Callable[[argparse.Namespace], int]],
    load: Callable[..., Any],
) -> None:
    p = sub.add_parser("train", help="run a learner and N actors locally (the main job)")
    add_config_args(p)
    p.add_argument("--store", help="root URI of runs: a folder, file:///abs, or gs://bucket/prefix")
    p.add_argument("--run-name", help="run name (the run lives at <store>/<run-name>)")
    p.add_argument(
        "--mode", choices=["async", "sync"], help="sync: the classic synchronous baseline"
    )
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    commands["train"] = lambda a: _train(a, load)

    p = sub.add_parser("prepare", help="validate a config and write <run>/config.json")
    add_config_args(p)
    commands["prepare"] = lambda a: _prepare(a, load)

    p = sub.add_parser("actor", help="run one actor of a prepared run")
    p.add_argument("--run", required=True, help="run URI (holds config.json)")
    p.add_argument("--actor-id", type=int, required=True)
    p.add_argument("--deadline", type=float, default=None, help="stop after this many seconds")
    commands["actor"] = _actor

    p = sub.add_parser("learner", help="run the learner of a prepared run (resumes)")
    p.add_argument("--run", required=True, help="run URI (holds config.json)")
    p.add_argument("--max-steps", type=int, default=None, help="total steps (overrides config)")
    p.add_argument("--deadline", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--progress", action="store_true", help="print one JSON progress line per step")
    commands["learner"] = _learner

    p = sub.add_parser("report", help="write the HTML report of a run (also a crashed one)")
    p.add_argument("run_uri")
    commands["report"] = _report

    p = sub.add_parser("eval", help="evaluate a weight snapshot on held-out seeds")
    p.add_argument("run_uri")
    p.add_argument("--version", type=int, default=None, help="default: the latest")
    p.add_argument("--episodes", type=int, default=64)
    commands["eval"] = _eval
