"""The CLI: parses, calls the library, reports errors clearly (no JAX needed for these)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.paths import HF_FIXTURES, REPO
from tunix_tasks.storage.shards import ShardWriter
from tunix_tasks.storage.store import open_store
from tunix_tasks.testing.shard_factory import make_episode


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tunix_tasks.frontdoor.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_inspect_json_and_text(tmp_path):
    store = open_store(str(tmp_path))
    rng = np.random.default_rng(0)
    w = ShardWriter(store, actor_id="a", max_episodes=10)
    for i in range(25):
        w.add(make_episode(rng, length=20 + i, policy_version=i // 10))
    w.close()
    out = _cli("inspect", str(tmp_path / "shards"), "--json")
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert (s["shards"], s["rows"]) == (3, 25)
    assert s["policy_versions"] == {"0": 10, "1": 10, "2": 5}
    assert s["length"]["min"] == 20 and s["length"]["max"] == 44
    text = _cli("inspect", f"file://{tmp_path}/{w.shards_written[0]}")
    assert text.returncode == 0 and "rows: 10" in text.stdout and "length histogram" in text.stdout
    store.write_bytes("shards/a/broken.parquet", b"nope")
    bad = _cli("inspect", str(tmp_path / "shards"))
    assert (
        bad.returncode == 1
        and f"INVALID file://{tmp_path}/shards/a/broken.parquet: corrupt" in bad.stdout
    )


def test_config_errors_exit_2_with_message():
    out = _cli("config", "--set", "actor.num_actors=-1")
    assert out.returncode == 2
    assert "actor.num_actors" in out.stderr and "greater than or equal to 1" in out.stderr


def test_config_names_a_missing_checkpoint_directory(tmp_path):
    """Issue #30.9: `config` returned 0 for a checkpoint directory that does not exist."""
    missing = tmp_path / "no-such-model"
    out = _cli("config", "--set", f"model.checkpoint={missing}")
    assert out.returncode == 2, out.stdout
    assert f"model.checkpoint: file://{missing}: no config.json there" in out.stderr
    assert "does not exist" in out.stderr and "Traceback" not in out.stderr


def test_config_prints_validated_json():
    out = _cli("config", "--config", "configs/demo.yaml", "--set", "learner.max_steps=7")
    assert out.returncode == 0
    assert json.loads(out.stdout)["learner"]["max_steps"] == 7


# -- one CLI module: heavy imports only inside the commands that need them -------------------
_HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax")


def _imports_after(*argv: str) -> tuple[int, list[str]]:
    code = (
        "import json, sys\n"
        "from tunix_tasks.frontdoor.cli import main\n"
        f"rc = main({list(argv)!r})\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {_HEAVY!r})\n"
        "print(json.dumps({'rc': rc, 'heavy': heavy}), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    result = json.loads(out.stderr.strip().splitlines()[-1])
    return result["rc"], result["heavy"]


def test_inspect_config_and_prepare_never_import_jax(tmp_path):
    store = open_store(str(tmp_path))
    w = ShardWriter(store, actor_id="a", max_episodes=10)
    w.add(make_episode(np.random.default_rng(0), length=20, policy_version=0))
    w.close()
    assert _imports_after("inspect", str(tmp_path / "shards"), "--json") == (0, [])
    assert _imports_after("config", "--config", "configs/demo.yaml") == (0, [])
    rc, heavy = _imports_after("prepare", "--set", f"store={tmp_path}/runs", "--set", "run_name=p1")
    assert (rc, heavy) == (0, [])
    assert json.loads((tmp_path / "runs/p1/config.json").read_text())["run_name"] == "p1"
    # Issue #30.9: a checkpoint's fail-fast check (tokenizer, template, headers) needs no JAX.
    checkpoint = f"model.checkpoint={HF_FIXTURES / 'tiny-qwen3'}"
    rc, heavy = _imports_after(
        "prepare", "--set", f"store={tmp_path}/runs", "--set", "run_name=p2", "--set", checkpoint
    )
    assert (rc, heavy) == (0, [])


def test_every_command_parses_and_train_flags_are_overrides():
    from tunix_tasks.frontdoor.cli import build_parser, train_overrides

    parser = build_parser()
    for argv in (
        ["inspect", "x"],
        ["config"],
        ["train"],
        ["prepare"],
        ["actor", "--run", "r", "--actor-id", "3", "--deadline", "5"],
        ["learner", "--run", "r", "--max-steps", "7", "--deadline", "5"],
        ["report", "r"],
        ["eval", "r", "--version", "2", "--episodes", "8"],
    ):
        assert callable(parser.parse_args(argv).func), argv
    args = parser.parse_args(
        ["train", "--store", "gs://b/p", "--run-name", "n", "--mode", "sync", "--set", "seed=1"]
    )
    # --mode sync only sets mode=sync: RunConfig itself derives what sync implies.
    assert train_overrides(args) == ["store=gs://b/p", "run_name=n", "mode=sync"]
    assert train_overrides(parser.parse_args(["train", "--mode", "async"])) == ["mode=async"]
    assert train_overrides(parser.parse_args(["train"])) == []
    # `agents` is `train` with the agent actor kind running the given program
    args = parser.parse_args(["agents", "--program", "my_pkg.agent:run", "--mode", "sync"])
    assert args.func is parser.parse_args(["train"]).func
    assert train_overrides(args) == [
        "mode=sync",
        "actor.kind=agent",
        "actor.agent.program=my_pkg.agent:run",
    ]


def test_train_calls_the_launcher_with_the_config(monkeypatch, tmp_path, capsys):
    from tunix_tasks.frontdoor import cli, launcher

    seen = {}

    def fake_train_local(cfg, *, quiet):
        seen["cfg"], seen["quiet"] = cfg, quiet
        return {"run_uri": cfg.run_uri, "learner_exit_code": 0, "interrupted": None}

    monkeypatch.setattr(launcher, "train_local", fake_train_local)
    argv = ["train", "--store", str(tmp_path), "--run-name", "t", "--mode", "sync", "--quiet"]
    assert cli.main([*argv, "--json", "--set", "learner.max_steps=3"]) == 0
    cfg = seen["cfg"]
    assert (cfg.mode, cfg.run_name, cfg.learner.max_steps, seen["quiet"]) == ("sync", "t", 3, True)
    out = capsys.readouterr().out
    assert "mode=sync" in out and json.loads(out[out.index("\n{") + 1 :])["run_uri"] == cfg.run_uri
    assert "next steps" not in out  # --json prints the JSON alone
    # Without --json: labelled lines for a person, no JSON.
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "{" not in out and re.search(rf"\nrun +{re.escape(cfg.run_uri)} \(None\): finished", out)
    # ... and then the next steps, whose commands paste and whose files exist.
    steps = out[out.index("\nnext steps:\n") :]
    assert f"tunix-tasks report {cfg.run_uri}\n" in steps  # no report in this fake summary
    assert f"tunix-tasks inspect {cfg.run_uri}/shards --conversations 3 --order best" in steps
    paths = re.findall(r"(?:docs|examples)/[\w/.-]+\.(?:md|yaml)", steps)
    assert len(paths) == 5 and all((REPO / p).is_file() for p in paths), paths
    # Exit codes: a failed learner -> 1, an interrupted run -> 130.
    monkeypatch.setattr(
        launcher, "train_local", lambda cfg, quiet: {"learner_exit_code": 3, "interrupted": None}
    )
    assert cli.main(argv) == 1
    monkeypatch.setattr(
        launcher,
        "train_local",
        lambda cfg, quiet: {"learner_exit_code": 0, "interrupted": "SIGINT"},
    )
    assert cli.main(argv) == 130


def test_learner_has_no_progress_flag():
    out = _cli("learner", "--run", "r", "--progress")
    assert out.returncode == 2 and "unrecognized arguments: --progress" in out.stderr


# -- the live display: rendered from metrics records, no run needed ---------------------------
def _step_record(step: int, t: float, **kw) -> dict:
    record = {
        "time": t,
        "process": "learner",
        "step": step,
        "version": step // 2,
        "loss": 0.1,
        "reward_mean": 0.5,
        "duty_cycle": 0.87,
        "buffer": 12,
        "backlog_shards": 3,
        "staleness": {"0": 6, "2": 2},
        "dropped": {"stale": 4, "env_error": 1},
    }
    return {**record, **kw}


def test_live_display_renders_from_metrics_records(tmp_path):
    import io
    import time

    from rich.console import Console

    from tunix_tasks.frontdoor.launcher import LiveStatus
    from tunix_tasks.storage.metrics import MetricsTail, MetricsWriter

    status = LiveStatus(20, warm_start_steps=40, actors_total=2)
    status.actors_alive = 2
    assert "starting" in status.line() and "actors 2/2" in status.line()

    # The records the learner writes, read back the way train_local reads them.
    store = open_store(str(tmp_path))
    writer = MetricsWriter(store, "learner", flush_interval_s=0)
    tail = MetricsTail(store, "learner")
    writer.log(warm_start_step=10, nll=2.0)
    status.update(tail.poll())
    assert "warm start 10/40" in status.line()
    now = time.time()
    for step, reward in ((1, 0.0), (2, 1.0)):
        rec = _step_record(step, now, reward_mean=reward)
        writer.log(**{k: v for k, v in rec.items() if k not in ("time", "process")})
    status.update(tail.poll(), now=time.time() + 0.5)
    line = status.line(now=time.time() + 0.5)
    for part in (
        "step 2/20",
        "version v1",
        "reward 0.100",  # EMA: 0.9 * 0.0 + 0.1 * 1.0
        "duty 0.87",
        "buffer 12 eps",
        "backlog 3 shards",
        "staleness 0.5 (max 2)",
        "dropped 5",
        "actors 2/2",
    ):
        assert part in line, (part, line)
    assert status.record["step"] == 2
    lag = status.lag_summary()
    assert lag["records"] == 3 and 0.5 <= lag["max"] < 30 and lag["mean"] < lag["max"]

    buf = io.StringIO()
    Console(file=buf, width=200, color_system=None).print(status.render())
    table = buf.getvalue()
    for part in ("learner", "10%", "step", "2/20", "reward", "0.100", "staleness", "0.5 (max 2)"):
        assert part in table, (part, table)
    # Records that arrive out of step order never move the display backwards.
    status.update([_step_record(1, now)])
    assert status.record["step"] == 2


def test_display_kinds(capsys):
    import io

    from rich.console import Console

    from tunix_tasks.frontdoor.launcher import LiveStatus, _Display

    status = LiveStatus(10, actors_total=1)
    status.update([_step_record(4, 0.0)])
    with _Display(status, quiet=True) as d:  # --quiet: nothing
        d.refresh(force=True)
        d.message("hello")
    assert capsys.readouterr().out == ""
    plain = Console(file=io.StringIO())  # not a terminal: plain lines, throttled
    with _Display(status, quiet=False, console=plain) as d:
        assert d.kind == "plain"
        d.refresh()
        d.refresh()  # within PLAIN_EVERY_S: not printed again
        d.refresh(force=True)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all("step 4/10" in line for line in out)
    buf = io.StringIO()
    term = Console(file=buf, force_terminal=True, width=160, color_system=None)
    with _Display(status, quiet=False, console=term) as d:
        assert d.kind == "live"
        d.refresh()
        d.message("SIGINT: stopping")
    text = buf.getvalue()
    assert "4/10" in text and "SIGINT: stopping" in text


# -- errors: one line `tunix-tasks: ...` on stderr and a documented exit code ----------------
def _cli_env(
    *args: str, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "tunix_tasks.frontdoor.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _assert_one_line_error(out: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert out.returncode == code, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("tunix-tasks: "), out.stderr[-3000:]
    for needle in needles:
        assert needle in last, (needle, last)
    return last


def test_exit_codes_are_documented():
    from tunix_tasks.frontdoor import cli

    for code in (0, 1, 2, 3, 4, 5, 130):
        assert f"\n    {code} " in cli.__doc__, code
    assert (cli.EXIT_USAGE, cli.EXIT_FENCED, cli.EXIT_LEASE_HELD, cli.EXIT_STORAGE) == (2, 3, 4, 5)


def test_config_file_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  max_steps: [3\nmode: async\n")
    _assert_one_line_error(_cli("config", "--config", str(bad)), 2, str(bad), "YAML", "line")
    missing = tmp_path / "missing.yaml"
    _assert_one_line_error(
        _cli("config", "--config", str(missing)), 2, str(missing), "does not exist"
    )
    _assert_one_line_error(
        _cli("train", "--config", str(tmp_path)), 2, str(tmp_path), "is a directory"
    )


def test_hostile_config_files_are_one_line_in_bounded_time(tmp_path):
    """Issue #30.10: a billion-laughs file hung `config` (>90 s); a recursive alias and
    10,000-deep nesting gave tracebacks. Each is one line naming the file and the bound
    (every bound: tests/unit/test_config.py)."""
    import time

    from tests.unit.test_config import _laughs

    files = {
        "laughs.yaml": (_laughs(), "100,000 values"),
        "deep.yaml": ("seed: " + "[" * 10_000 + "]" * 10_000 + "\n", "deeper than 64 levels"),
    }
    for name, (text, bound) in files.items():
        (tmp_path / name).write_text(text)
        start = time.monotonic()
        out = _cli_env("config", "--config", str(tmp_path / name), timeout=20)
        # an unbounded parse took over 90 s; this allows a loaded host's start-up
        assert time.monotonic() - start < 15.0, name
        _assert_one_line_error(out, 2, str(tmp_path / name), bound)


def test_unsupported_scheme_is_one_line():
    for argv in (("inspect", "s3://bucket/shards"), ("report", "s3://bucket/run")):
        _assert_one_line_error(_cli(*argv), 2, "unsupported store scheme 's3'", "valid: file, gs")


def test_corrupt_run_config_is_one_line(tmp_path):
    store = open_store(str(tmp_path / "run"))
    store.write_bytes("config.json", b'{"run_name": "run", "learner": ')
    for argv in (("report", store.uri), ("learner", "--run", store.uri)):
        _assert_one_line_error(
            _cli(*argv), 2, f"{store.uri}/config.json", "corrupt", "not valid JSON"
        )


def test_unreachable_gcs_logs_its_retries_then_one_line():
    from tunix_tasks.testing.gcs_server import hold_port

    with hold_port() as closed:  # nothing listens, and nothing beside this test will
        env = {
            "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{closed.getsockname()[1]}",
            "TUNIX_STORE_RETRY_DEADLINE_S": "3",
        }
        out = _cli_env("inspect", "gs://bucket/run/shards", env=env, timeout=60)
    last = _assert_one_line_error(out, 5, "gs://bucket/run/shards", "unreachable", "3 s")
    retries = [line for line in out.stderr.splitlines() if "retrying" in line]
    assert retries and all("gs://bucket/run" in line for line in retries), out.stderr
    assert "ConnectionError" in retries[0] and last == out.stderr.strip().splitlines()[-1]


def test_unreachable_gcs_ends_train_within_the_connect_deadline(tmp_path):
    """`train` against a dead endpoint (closed port) and a silent one (accepts, never
    answers: each request would wait 60 s): one line, exit 5, after
    TUNIX_STORE_CONNECT_DEADLINE_S, not the 120 s per-call retry deadline."""
    import socket
    import time

    from tunix_tasks.testing.gcs_server import hold_port

    with (
        socket.create_server(("127.0.0.1", 0), backlog=16) as silent,  # never accepts
        hold_port() as closed,
    ):
        for port in (closed.getsockname()[1], silent.getsockname()[1]):
            env = {
                "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
                "TUNIX_STORE_CONNECT_DEADLINE_S": "2",
                "TUNIX_STORE_RETRY_DEADLINE_S": "",  # the default, 120 s
            }
            t0 = time.monotonic()
            out = _cli_env("train", "--store", "gs://bucket/runs", "--run-name", "r", env=env)
            wall = time.monotonic() - t0
            _assert_one_line_error(
                out, 5, "gs://bucket/runs/r: unreachable", "within 2 s", "CONNECT_DEADLINE"
            )
            assert wall < 30, wall  # 2 s and the start-up of a loaded machine


def test_gcs_without_credentials_is_one_line(tmp_path):
    """No credentials, no emulator (and no metadata server to ask): one line, exit 5."""
    import os

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GOOGLE_", "CLOUDSDK_", "GCE_")) and k != "STORAGE_EMULATOR_HOST"
    }
    env.update(HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), NO_GCE_CHECK="True")
    for argv in (
        ("train", "--store", "gs://bucket/runs", "--run-name", "nocreds"),
        ("inspect", "gs://bucket/runs/nocreds/shards"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "tunix_tasks.frontdoor.cli", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=tmp_path,
        )
        last = _assert_one_line_error(
            out, 5, "gs://bucket/runs/nocreds", "no usable Google Cloud credentials"
        )
        assert "gcloud auth application-default login" in last and "STORAGE_EMULATOR_HOST" in last
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr  # nothing else either


def test_second_learner_is_refused_in_one_line(tmp_path):
    import os
    import socket
    import time

    from tunix_tasks.frontdoor.entrypoints import prepare_run
    from tunix_tasks.storage.layout import RunLayout

    uri = prepare_run({"store": str(tmp_path)}, run_name="held")
    holder = {  # this (live) test process holds the lease
        "owner": "first-learner",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "expires_at": time.time() + 600,
    }
    open_store(uri).write_if_generation(RunLayout.LEASE, json.dumps(holder).encode(), 0)
    out = _cli("learner", "--run", uri)
    _assert_one_line_error(out, 4, "'first-learner'", "refusing to start a second learner")


@pytest.mark.parametrize("command", ["actor", "learner"])
def test_a_process_started_for_a_run_created_again_since_exits_3_without_joining(tmp_path, command):
    """What `train` restarts and a retried DAG task meet: `--run-id` names the run they
    were started for; the run at the URI now is another one. Exit 3 (fenced, not
    restarted), one logged line, and nothing of the other run touched."""
    import shutil

    from tunix_tasks.frontdoor.entrypoints import prepare_run, prepared_run_id

    uri = prepare_run({"store": str(tmp_path)}, run_name="again")
    first = prepared_run_id(uri)
    shutil.rmtree(tmp_path / "again")
    uri = prepare_run({"store": str(tmp_path)}, run_name="again")
    before = sorted(p.name for p in (tmp_path / "again").iterdir())
    extra = ["--actor-id", "0"] if command == "actor" else []
    out = _cli(command, "--run", uri, f"--run-id={first}", *extra)
    assert out.returncode == 3, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert f"created again (run_id {prepared_run_id(uri)})" in last and first in last, last
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == before
    shutil.rmtree(tmp_path / "again")  # deleted, not created again: the same exit
    out = _cli(command, "--run", uri, f"--run-id={first}", *extra)
    assert out.returncode == 3 and "holds no run: deleted" in out.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "again").exists()
    out = _cli(command, "--run", uri, "--run-id= " + first, *extra)  # not an id: usage
    assert out.returncode == 2 and "is not a run id: 32 hex digits" in out.stderr


def test_permission_denied_is_one_line(tmp_path):
    import os

    if os.geteuid() == 0:  # root ignores file modes; sysfs refuses new folders to root too
        store = "/sys/tunix_tasks_test_runs"
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        store = str(tmp_path / "ro")
    out = _cli("prepare", "--set", f"store={store}", "--set", "run_name=p")
    _assert_one_line_error(out, 5, "permission denied", store)


def test_inspect_of_a_missing_path_fails(tmp_path):
    for uri in (str(tmp_path / "nope"), f"file://{tmp_path}/nope/x.parquet"):
        _assert_one_line_error(_cli("inspect", uri), 2, "nope", "does not exist")
    (tmp_path / "empty").mkdir()  # an existing empty folder: zero shards, not an error
    ok = _cli("inspect", str(tmp_path / "empty"))
    assert ok.returncode == 0 and "shards: 0" in ok.stdout


def test_unknown_env_fails_config_and_prepare(tmp_path):
    for argv in (
        ("config", "--set", "env.name=no_such_env"),
        ("prepare", "--set", f"store={tmp_path}", "--set", "env.name=no_such_env"),
    ):
        out = _cli(*argv)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert "env.name" in out.stderr
        assert all(f" {n}," in out.stderr for n in ("calculator", "guess_number", "python_exec"))
    assert not (tmp_path / "demo").exists()


# -- resuming a run: `train` / `prepare` again with the same store and run name ---------------
def _demo(store, *extra: str) -> list[str]:
    """The demo's config in `store`, without its warm start (no demonstrations to play)."""
    return [
        "--config",
        "configs/demo.yaml",
        "--set",
        f"store={store}",
        "--set",
        "warm_start_steps=0",
        *extra,
    ]


def test_a_resume_that_changes_what_is_trained_is_refused_in_one_line(tmp_path):
    """Issue #31.1: a new kind of run on an existing run's name is refused (exit 2), one
    line naming each field old -> new and `--run-name`; config.json is left as it was."""
    from tunix_tasks.frontdoor.cli import main

    assert main(["prepare", *_demo(tmp_path)]) == 0
    config = tmp_path / "demo" / "config.json"
    before = config.read_bytes()
    for argv in (
        ("train", "--mode", "sync", *_demo(tmp_path)),
        ("prepare", *_demo(tmp_path, "--set", "seed=3")),
        (
            "train",
            *_demo(tmp_path, "--set", "actor.kind=vectorized", "--set", "env.latency_s=0"),
        ),
    ):
        out = _cli(*argv)
        line = _assert_one_line_error(out, 2, f"run file://{tmp_path}/demo exists", "--run-name")
        assert out.stdout == "" and out.stderr.strip() == line, (out.stdout, out.stderr)
        assert config.read_bytes() == before
    assert "exists with another configuration: env.latency_s 0.2 -> 0.0, actor.kind " in line


def test_a_finished_run_is_left_alone_until_max_steps_is_raised(monkeypatch, tmp_path, capsys):
    """Issue #31.1: `train` of a finished run (DONE, max_steps reached) says so and exits
    0 without launching or rewriting anything; with max_steps raised (or the fleet
    changed: a resume may) it trains on."""
    from tunix_tasks.frontdoor import cli, launcher
    from tunix_tasks.storage.metrics import MetricsWriter
    from tunix_tasks.storage.runs import mark_done

    argv = ["train", *_demo(tmp_path, "--set", "learner.max_steps=3")]
    assert cli.main(["prepare", *argv[1:]]) == 0
    store = open_store(str(tmp_path / "demo"))
    metrics = MetricsWriter(store, "learner", flush_interval_s=0)
    for step in (1, 2, 3):
        metrics.log(step=step, loss=0.1, reward_mean=0.5)
    metrics.close()
    launched, train_local = [], launcher.train_local
    fake = {"run_uri": "x", "learner_exit_code": 0, "interrupted": None}
    monkeypatch.setattr(launcher, "train_local", lambda cfg, quiet: launched.append(cfg) or fake)
    assert cli.main([*argv, "--json"]) == 0 and len(launched) == 1  # not DONE: resumes
    mark_done(store, "learner max_steps at step 3")
    store.write_bytes("report/index.html", b"<html>the report</html>")
    files = {k: store.read_bytes(k) for k in ("config.json", "report/index.html", "control/DONE")}
    capsys.readouterr()
    assert cli.main([*argv, "--set", "actor.num_actors=5"]) == 0
    message = f"run file://{tmp_path}/demo is finished (step 3 of 3); raise learner.max_steps"
    out = capsys.readouterr().out
    assert out.startswith(message) and out.count("\n") == 1, out
    assert cli.main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["finished"].startswith(message)
    assert len(launched) == 1
    assert {k: store.read_bytes(k) for k in files} == files
    # The library call is guarded the same way.
    summary = train_local(cli._config(cli.build_parser().parse_args(argv)), quiet=True)
    assert summary["finished"].startswith(message) and summary["learner_exit_code"] == 0
    assert {k: store.read_bytes(k) for k in files} == files
    assert cli.main([*argv, "--set", "learner.max_steps=4"]) == 0
    assert launched[-1].learner.max_steps == 4 and len(launched) == 2


def test_train_writes_process_logs_with_the_run(monkeypatch, tmp_path):
    """Issue #30.12: `train` wrote its process logs to `./runs/_logs` of the working
    directory, wherever the run lived. A local run's are in `<run>/logs/`; a gs:// run's
    in `~/.cache/tunix-tasks/logs/<run_name>/`, under `$XDG_CACHE_HOME` where set."""
    import pytest

    from tunix_tasks.config import load_config
    from tunix_tasks.frontdoor import launcher

    class Launched(Exception):
        """Raised where the launcher would start its display: the log folder exists."""

    def launched(*args, **kwargs):
        raise Launched

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setattr(launcher, "LiveStatus", launched)
    cfg = load_config(None, [f"store={tmp_path / 'store'}", "run_name=r", "warm_start_steps=0"])
    with pytest.raises(Launched):
        launcher.train_local(cfg, quiet=True)
    assert (tmp_path / "store/r/logs").is_dir()
    assert list((tmp_path / "elsewhere").iterdir()) == []
    from tunix_tasks.frontdoor.supervision import process_log_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert process_log_dir(None, "r") == tmp_path / "home/.cache/tunix-tasks/logs/r"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert process_log_dir(None, "r") == tmp_path / "xdg/tunix-tasks/logs/r"


def test_no_jax_backend_noise_on_a_cpu_run():
    """The CLI's INFO logging does not carry JAX's "Unable to initialize backend 'tpu'"
    (every CPU-only process printed it); `-v` keeps it."""
    code = (
        "import sys, jax\n"
        "from tunix_tasks.frontdoor.cli import main\n"
        "main(sys.argv[1:])\n"
        "jax.devices()\n"
    )
    argv = [sys.executable, "-c", code]
    # As a user's shell runs it: JAX looks for a TPU (tests/conftest.py pins the CPU).
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    kw = {"capture_output": True, "text": True, "timeout": 120, "env": env}
    quiet = subprocess.run([*argv, "config"], **kw)
    verbose = subprocess.run([*argv, "-v", "config"], **kw)
    assert quiet.returncode == verbose.returncode == 0, quiet.stderr + verbose.stderr
    assert "Unable to initialize backend" not in quiet.stderr
    assert "Unable to initialize backend 'tpu'" in verbose.stderr
