"""`tunix-tasks` command line: parse arguments, then call the library.

    tunix-tasks inspect URI [--json]
    tunix-tasks config [--config run.yaml] [--set k=v ...]    # print the validated config
    tunix-tasks train  [--config run.yaml] [--set k=v ...] [--store URI] [--mode async|sync]
    tunix-tasks actor  --run URI --actor-id N
    tunix-tasks learner --run URI
    tunix-tasks report RUN_URI
    tunix-tasks eval RUN_URI [--version N]

Heavy modules (JAX) are imported inside the commands that need them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence

from tunix_tasks.config import ConfigError, load_config

_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def _command(
    name: str,
) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    def wrap(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        _COMMANDS[name] = fn
        return fn

    return wrap


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML or JSON run configuration (defaults if omitted)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set actor.num_actors=4 (repeatable)",
    )


def _config(args: argparse.Namespace, extra: Sequence[str] = ()):
    return load_config(args.config, [*args.overrides, *extra])


@_command("inspect")
def _inspect(args: argparse.Namespace) -> int:
    from tunix_tasks.frontdoor.inspect import format_summary, inspect_uri

    summary = inspect_uri(args.uri)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 1 if summary["invalid"] else 0


@_command("config")
def _print_config(args: argparse.Namespace) -> int:
    cfg = _config(args)
    print(cfg.to_json())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tunix-tasks", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="summarize a shard or every shard under a prefix")
    p.add_argument("uri", help="file path, file://..., or gs://... (a .parquet or a prefix)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("config", help="validate and print a run configuration")
    _add_config_args(p)

    _extend_parser(sub)
    return parser


def _extend_parser(sub: argparse._SubParsersAction) -> None:
    """Commands of the actor/learner/run halves register here (see commands below)."""
    from tunix_tasks.frontdoor import cli_run

    cli_run.add_commands(sub, _add_config_args, _COMMANDS, _config)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return _COMMANDS[args.command](args)
    except ConfigError as err:
        print(f"tunix-tasks: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
