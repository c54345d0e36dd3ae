"""A real Airflow deployment, as `make airflow-cluster` runs it: Redis broker, PostgreSQL
metadata DB, scheduler, dag-processor and api-server with the CeleryExecutor, and three
Celery workers, each in its own directory as if on its own host; the object store is the
only state they share.

The fixtures start Redis and PostgreSQL (`conftest.celery_services`, the Debian servers
`make services` installs) and `infra/airflow/celery_cluster.py`, a `LocalAirflow` (what
`make airflow` runs) with the Celery executor: workers `cpu-a`, `cpu-b` (queue `cpu`) and
`tpu-a` (queue `tpu`).

One `tunix_train` run goes through it as a user's would: in a real browser (Debian's
chromium, driven by Selenium) the test opens `tunix_train`, clicks *Trigger*, checks what
the form shows (descriptions, the optional run name, a free-text environment with
suggestions), fills a small run (2 actors, 12 steps) and submits it. While its actors
run, the cpu worker that holds an actor is SIGKILLed with everything it started, as a
dying host would be. From the REST API's task instances (and their tries): the run
succeeded, the actors ran on cpu workers at the same time as the learner, the learner on
`tpu-a`, and the dead worker's actors were retried on the other cpu worker; the learner's
task log has progress lines; its asset events (its watcher of `weights/LATEST`) scheduled
`tunix_eval`, which evaluated a snapshot. From the store: nothing was lost (the dead
actor's shards are intact and accounted for in the learner's ledger, every accounted
episode comes from a shard, once), the run is DONE. REST alone, on the same Airflow:
invalid params are refused at trigger time, and a typo in the conf and a deleted `tpu`
pool fail `prepare` within seconds, saying what to do. Then it stops everything and checks
that no process is left. On a form failure, screenshots and the page source are left in
the test's tmp dir (`form.png`, `failure.png`, `failure.html`).

`make test` installs chromium and chromium-driver, Redis and PostgreSQL (the Makefile's
`browser` and `services` steps, as root); the module is skipped only when they are missing
and cannot be installed (not root). (It was two modules, a LocalExecutor Airflow with the
form's run and this cluster with its own run; one deployment and one run check the same
paths, `LocalAirflow` included, which `CeleryAirflow` extends.)
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import time
import urllib.error
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq
import pytest

from tunix_tasks.learner.accounting import read_ledger
from tunix_tasks.learner.checkpoint import Checkpointer
from tunix_tasks.learner.position import ShardPosition
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.metrics import read_metrics
from tunix_tasks.storage.store import ObjectStore, open_store
from tunix_tasks.storage.weights import read_latest

from .conftest import SMALL_RUN_OVERRIDES, running, small_train_conf

if TYPE_CHECKING:
    from celery_cluster import CeleryAirflow

# 1200 s: the first test also pays the module's cluster start (initdb, migrate, up to
# 240 s for the servers and 180 s for the DAGs), and the form test waits up to 1020 s.
pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(1200)]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER) and os.geteuid() != 0:
    pytest.skip(
        "chromium/chromedriver are not installed and this user cannot install them: as root, "
        "`make browser` (apt-get install chromium chromium-driver)",
        allow_module_level=True,
    )

RUN = "cluster-e2e"
MAX_STEPS = 30  # long enough that the kill lands while the actors run (12 finished first once)
#: What the test types into the form (param name -> text).
FORM = {
    "run_name": RUN,
    "num_actors": "2",
    "envs_per_actor": "4",
    "max_steps": str(MAX_STEPS),
    "deadline_s": "300",
    "warm_start_steps": "0",  # the form's default is the demo's recipe: 140
    "env_latency_s": "0",
}
OVERRIDES = [*SMALL_RUN_OVERRIDES, "learner.checkpoint_every=4"]
CONF = small_train_conf(RUN)  # the REST triggers' base conf
#: How long a dead worker's task keeps "running" before the scheduler fails it (then
#: retries it on a live worker). Task runners heartbeat every 5 s.
HEARTBEAT_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def cluster(celery_services, tmp_path_factory):
    from celery_cluster import CeleryAirflow

    redis, postgres = celery_services
    store = f"file://{tmp_path_factory.mktemp('runs')}"
    af = CeleryAirflow.on(
        redis,
        postgres,
        tmp_path_factory.mktemp("cluster"),
        parallelism=8,
        cpu_slots=6,
        tpu_slots=1,
        triggerer=False,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    )
    af.env["TUNIX_STORE"] = store  # the form's default store
    af.env["TUNIX_LEARNER_RETRY_DELAY_S"] = "35"
    af.env["TUNIX_AIRFLOW_ASSET_EVENTS"] = "1"  # conftest turns them off for dag.test()
    af.env["TUNIX_CHECK_POOLS"] = "1"  # conftest turns it off for dag.test(); check for real
    af.store = store
    with running(
        af, ["tunix_train", "tunix_eval", "tunix_recurring"], ["tunix_train", "tunix_eval"]
    ):
        yield af


def _post_error(af, path: str, body: dict) -> tuple[int, str]:
    try:
        af.request("POST", path, body)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    return 200, ""


@pytest.mark.parametrize(
    ("param", "value"), [("num_actors", -1), ("env_max_turns", 65), ("max_staleness", "x")]
)
def test_trigger_with_invalid_params_is_rejected(cluster, param, value):
    code, detail = _post_error(
        cluster,
        "/api/v2/dags/tunix_train/dagRuns",
        {"logical_date": None, "conf": {**CONF, param: value}},
    )
    print(f"{param}={value!r}: HTTP {code} {detail}")
    assert code == 400, detail
    assert param in detail, detail


def _task_instances(af: CeleryAirflow, run_id: str) -> list[dict]:
    path = f"/api/v2/dags/tunix_train/dagRuns/{run_id}/taskInstances?limit=100"
    return af.request("GET", path)["task_instances"]


def _tries(af: CeleryAirflow, run_id: str, task_id: str, map_index: int = -1) -> list[dict]:
    path = f"/api/v2/dags/tunix_train/dagRuns/{run_id}/taskInstances/{task_id}/{map_index}/tries"
    return sorted(af.request("GET", path)["task_instances"], key=lambda t: t["try_number"])


def _wait_cluster(what: str, check: Callable[[], Any], timeout: float, af: CeleryAirflow) -> Any:
    """Poll `check` every 2 s until it returns something true; fail if a component died."""
    return _wait(what, check, timeout, every=2, alive=af.check_alive)


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _episode_ids(store: ObjectStore, key: str) -> list[str]:
    """The episode ids of one shard (its `episode_id` column only)."""
    with store.open_input(key) as f:
        return pq.read_table(f, columns=["episode_id"]).column("episode_id").to_pylist()


def _pending_episodes(store: ObjectStore, keys: Iterable[str]) -> set[str]:
    """Episode ids of `keys`' rows the latest checkpoint's position has not acknowledged."""
    checkpointer = Checkpointer(store)
    try:
        meta = checkpointer.read_meta()
    finally:
        checkpointer.close()
    position = ShardPosition()
    if meta is not None:
        stream = meta["stream"]
        position.set_state(stream.get("parent", stream))  # a PrefetchingSource's state
    return {
        episode
        for key in keys
        if not position.is_done(key)
        for row, episode in enumerate(_episode_ids(store, key))
        if row not in position.acked_rows(key)
    }


def _shards(store: ObjectStore, prefix: str) -> list[str]:
    return [i.key for i in store.list(prefix) if i.key.endswith(".parquet")]


@pytest.fixture
def browser(tmp_path: Path):
    assert CHROMIUM and CHROMEDRIVER, (
        "chromium/chromedriver missing: `make browser` installs them (as root)"
    )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    opts.add_argument("--window-size=1400,1000")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(
    what: str,
    fn: Callable[[], Any],
    timeout: float = 30.0,
    every: float = 0.25,
    alive: Callable[[], None] | None = None,
) -> Any:
    """Poll `fn` until it returns something true (an exception counts as not yet: an
    element not there, stale after a re-render...); `alive` raises if a component died."""
    deadline = time.monotonic() + timeout
    while True:
        if alive is not None:
            alive()
        try:
            out = fn()
        except Exception:
            out = None
        if out:
            return out
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def _type(driver, name: str, text: str) -> None:
    """Replace a (React-controlled) field's text the way a user would."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    field = driver.find_element(By.NAME, f"element_{name}")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", field)
    field.click()
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.BACKSPACE)
    field.send_keys(text)
    assert field.get_attribute("value") == text, (name, field.get_attribute("value"))


def _row_text(driver, name: str) -> str:
    """The text of a param's form row (label, field, description)."""
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.NAME, f"element_{name}")
    row = field.find_element(
        By.XPATH, "./ancestor::*[.//label or .//*[contains(@class, 'label')]][1]"
    )
    return row.text


def test_train_run_from_the_form_survives_a_dead_cpu_worker(cluster, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    af, driver = cluster, browser
    t0 = time.monotonic()
    try:
        driver.get(f"{af.url}/dags/tunix_train")
        _wait(
            "the Trigger button",
            lambda: driver.find_element(By.CSS_SELECTOR, "button[aria-label='Trigger Dag']"),
        ).click()
        _wait("the form", lambda: driver.find_element(By.NAME, "element_max_steps"))

        # what the form shows: descriptions from RunConfig, optional run name, free-text env
        page = driver.find_element(By.TAG_NAME, "body").text
        assert "turns before an episode is truncated" in page  # Max turns' description
        assert "random seed of the run" in page  # Seed's description
        run_name_row = _row_text(driver, "run_name")
        assert "Run name" in run_name_row and "*" not in run_name_row, run_name_row
        assert "*" not in _row_text(driver, "overrides")  # optional too
        assert "*" in _row_text(driver, "max_steps")  # (a required field has the badge)
        assert "*" not in _row_text(driver, "env_latency_s")  # optional: empty = none
        env = driver.find_element(By.NAME, "element_env")
        assert env.tag_name == "input" and env.get_attribute("list"), "env: free text"

        for name, text in FORM.items():
            _type(driver, name, text)
        overrides = driver.find_element(By.NAME, "element_overrides")
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", overrides)
        overrides.click()
        overrides.send_keys(Keys.CONTROL, "a")  # the demo recipe's overrides: replaced
        overrides.send_keys(Keys.BACKSPACE)
        text = "\n".join(OVERRIDES)
        for char in text:  # one key at a time: the array field re-renders on each change
            overrides.send_keys(char)
            time.sleep(0.01)
        assert overrides.get_attribute("value") == text, overrides.get_attribute("value")
        driver.save_screenshot(str(tmp_path / "form.png"))

        submit = [
            b for b in driver.find_elements(By.TAG_NAME, "button") if b.text.strip() == "Trigger"
        ][-1]
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", submit)
        _wait("an enabled submit button", submit.is_enabled)
        submit.click()

        def our_run():
            runs = af.request("GET", "/api/v2/dags/tunix_train/dagRuns?limit=20")["dag_runs"]
            return next((r for r in runs if (r.get("conf") or {}).get("run_name") == RUN), None)

        run = _wait("the DAG run the form created", our_run, timeout=30, every=1)
    except BaseException:
        driver.save_screenshot(str(tmp_path / "failure.png"))
        (tmp_path / "failure.html").write_text(driver.page_source)
        print(f"screenshot of the form: {tmp_path / 'failure.png'}")
        raise
    print(f"triggered from the form after {time.monotonic() - t0:.0f}s: {run['dag_run_id']}")

    conf = run["conf"]
    assert conf["num_actors"] == 2 and conf["max_steps"] == MAX_STEPS, conf
    assert conf["overrides"] == OVERRIDES, conf
    run_id = run["dag_run_id"]
    run_uri = f"{af.store}/{RUN}"
    store = open_store(run_uri)

    # Both actors running, the learner training: pick the cpu worker holding an actor.
    def running_actors() -> list[dict] | None:
        actors = [t for t in _task_instances(af, run_id) if t["task_id"] == "actor"]
        ok = len(actors) == 2 and all(t["state"] == "running" and t["hostname"] for t in actors)
        return actors if ok else None

    actors = _wait_cluster("both actors running", running_actors, 240, af)
    hosts = {t["map_index"]: t["hostname"] for t in actors}
    assert set(hosts.values()) <= {"cpu-a", "cpu-b"}, hosts
    victim = max(set(hosts.values()), key=list(hosts.values()).count)
    survivor = ({"cpu-a", "cpu-b"} - {victim}).pop()
    doomed = sorted(i for i, h in hosts.items() if h == victim)
    folders = [f"{RunLayout.SHARDS}actor-{i:04d}/" for i in doomed]

    def written() -> bool:
        if not store.exists(RunLayout.CONFIG):
            return False
        steps = [r for r in read_metrics(store, "learner") if "loss" in r]
        return bool(steps) and all(_shards(store, f) for f in folders)

    _wait_cluster("the victim's actors wrote shards and the learner trained", written, 240, af)
    before = {k for f in folders for k in _shards(store, f)}
    t_kill, t_kill_wall = time.monotonic(), time.time()
    killed = af.kill_worker(victim)
    print(
        f"{t_kill - t0:.0f}s: killed {victim} ({len(killed)} processes) running actors "
        f"{doomed} after {len(before)} of their shards; placement {hosts}"
    )

    def finished() -> dict | None:
        run = af.request("GET", f"/api/v2/dags/tunix_train/dagRuns/{run_id}")
        return run if run["state"] in ("success", "failed") else None

    run = _wait_cluster("the DAG run finished", finished, 360, af)
    tis = _task_instances(af, run_id)
    summary = {
        f"{t['task_id']}[{t['map_index']}]": (t["state"], t["hostname"], t["try_number"])
        for t in tis
    }
    print(f"run {run['state']} {time.monotonic() - t0:.0f}s after the trigger: {summary}")
    assert run["state"] == "success", json.dumps(summary)
    assert all(t["state"] == "success" for t in tis), summary

    # Placement: actors (and the cpu-queue control tasks) on cpu workers, learner on tpu-a.
    for t in tis:
        want = {"tpu-a"} if t["task_id"] == "learner" else {"cpu-a", "cpu-b"}
        assert t["hostname"] in want, (t["task_id"], t["map_index"], t["hostname"])
    (learner,) = [t for t in tis if t["task_id"] == "learner"]
    assert learner["try_number"] == 1, "the learner's worker was not touched"
    actors = sorted((t for t in tis if t["task_id"] == "actor"), key=lambda t: t["map_index"])
    assert [a["rendered_map_index"] for a in actors] == ["actor 0", "actor 1"], actors
    # the learner's task log: progress lines from the run's metrics, no orbax INFO noise
    logs = "".join(f.read_text() for f in Path(af.home).rglob("task_id=learner/**/*.log"))
    assert f"learner step {MAX_STEPS}:" in logs and "reward_mean=" in logs, logs[-3000:]
    # The dead worker's actors: attempt 1 failed there (no heartbeat), the retry ran on
    # the survivor and succeeded; the other actor was not disturbed.
    retried_after = []
    for i in (0, 1):
        tries = _tries(af, run_id, "actor", i)
        seen = [(t["try_number"], t["hostname"], t["state"]) for t in tries]
        # Each actor's first try ran at the same time as the learner (a retry may start
        # after the learner finished on the other actor's episodes, then find the run DONE).
        first = tries[0]
        assert _ts(first["start_date"]) < _ts(learner["end_date"]), (first, learner)
        assert _ts(learner["start_date"]) < _ts(first["end_date"]), (first, learner)
        if i in doomed:
            assert seen[0][1:] == (victim, "failed"), seen
            assert seen[-1][1:] == (survivor, "success") and seen[-1][0] >= 2, seen
            failed_s = _ts(tries[0]["end_date"]) - t_kill_wall
            restarted_s = _ts(tries[-1]["start_date"]) - t_kill_wall
            retried_after.append(
                f"actor {i}: {seen}; attempt 1 failed {failed_s:.0f}s after the kill, "
                f"attempt {seen[-1][0]} started after {restarted_s:.0f}s"
            )
        else:
            assert seen == [(1, survivor, "success")], seen
    print("retries:", retried_after)

    # Nothing lost. Every episode the learner accounted for (trained or dropped) comes
    # from a shard in the store, and is accounted once ...
    ledger = read_ledger(store)
    accounted = [i for e in ledger for i in e["trained"]]
    accounted += [i for e in ledger for ids in e["dropped"].values() for i in ids]
    assert len(accounted) == len(set(accounted)) > 0
    shards = _shards(store, RunLayout.SHARDS)
    quarantined = _shards(store, RunLayout.QUARANTINE)
    written_ids = {i for k in shards + quarantined for i in _episode_ids(store, k)}
    assert set(accounted) <= written_ids, set(accounted) - written_ids
    # ... no shard was torn by the kill ...
    originals = [k[len(RunLayout.QUARANTINE) :] for k in quarantined]
    reasons = [
        json.loads(store.read_bytes(RunLayout.quarantine_reason(k)))["reason"] for k in originals
    ]
    assert "corrupt" not in reasons, reasons
    # ... and every episode of the shards the dead worker's actors wrote is accounted, or
    # still unacknowledged in the final checkpoint's position (a resume reads it again):
    # the learner may stop at max_steps with a few rows buffered that no batch packed.
    assert before <= set(shards), before - set(shards)
    pending = _pending_episodes(store, before)
    unaccounted = {
        k: n for k in before if (n := set(_episode_ids(store, k)) - set(accounted) - pending)
    }
    assert not unaccounted, unaccounted
    after = {k for f in folders for k in _shards(store, f)} - before
    steps = max(r["step"] for r in read_metrics(store, "learner") if "loss" in r)
    assert steps == MAX_STEPS
    assert store.exists(RunLayout.LATEST) and store.exists(RunLayout.DONE)
    print(
        f"{len(shards)} shards ({len(before)} by the dead attempt, {len(after)} by the "
        f"retries), {len(quarantined)} quarantined {reasons}, {len(set(accounted))} episodes "
        f"accounted; run took {time.monotonic() - t0:.0f}s, {time.monotonic() - t_kill:.0f}s "
        "after the kill"
    )

    # the learner task's watcher announced every new weights/LATEST, the last one included
    xcom = af.request(
        "GET",
        f"/api/v2/dags/tunix_train/dagRuns/{run_id}/taskInstances/learner/xcomEntries/return_value",
    )
    learned = xcom["value"]
    if isinstance(learned, str):  # older API versions return XCom values as repr strings
        learned = ast.literal_eval(learned)
    assert learned["steps"] >= MAX_STEPS
    assert learned["asset_events_posted"] and not learned["asset_events_failed"], learned
    assert max(learned["asset_events_posted"]) == read_latest(store)[0]

    # the learner's asset events (posted through REST) carry the run and version ...
    events = af.request("GET", "/api/v2/assets/events?limit=100")["asset_events"]
    ours = [e["extra"] for e in events if e["extra"].get("run_uri") == run_uri]
    assert sorted(e["version"] for e in ours) == sorted(learned["asset_events_posted"])
    assert all(e["path"].startswith(run_uri) for e in ours)

    # ... and scheduled tunix_eval, which evaluated a snapshot
    deadline = time.monotonic() + 180
    while True:
        evals = af.request("GET", "/api/v2/dags/tunix_eval/dagRuns?limit=50")["dag_runs"]
        if any(r["state"] == "success" for r in evals) and not any(
            r["state"] in ("queued", "running") for r in evals
        ):
            break
        assert not any(r["state"] == "failed" for r in evals), evals
        assert time.monotonic() < deadline, f"tunix_eval did not succeed: {evals}"
        time.sleep(3)
    assert all(r["run_type"] == "asset_triggered" for r in evals)
    assert [o for o in store.list(RunLayout.EVAL)], "evaluate_snapshot wrote no eval/v*.json"
    print(f"end to end (train + eval) in {time.monotonic() - t0:.0f}s")


def _prepare_log(af: CeleryAirflow, run_id: str) -> str:
    return "".join(
        f.read_text() for f in Path(af.home).rglob("task_id=prepare/*.log") if run_id in str(f)
    )


def test_prepare_fails_fast_on_a_typo_and_a_missing_pool(cluster):
    """A real scheduler: the conf typo and the missing pool fail `prepare` in seconds
    (instead of a run with defaults / tasks "scheduled" forever), saying what to do."""
    af = cluster
    t0 = time.monotonic()
    failures = {}
    for case, conf in (
        ("typo", {"run_name": "typo", "max_step": 2}),
        ("pool", {"run_name": "nopool", "max_steps": 2}),
    ):
        if case == "pool":
            af.request("DELETE", "/api/v2/pools/tpu")
        run = af.request(
            "POST", "/api/v2/dags/tunix_train/dagRuns", {"logical_date": None, "conf": conf}
        )
        deadline = time.monotonic() + 90
        while run["state"] not in ("success", "failed"):
            assert time.monotonic() < deadline, f"{case}: run still {run['state']}"
            time.sleep(2)
            run = af.request("GET", f"/api/v2/dags/tunix_train/dagRuns/{run['dag_run_id']}")
        assert run["state"] == "failed", (case, run)
        failures[case] = _prepare_log(af, run["dag_run_id"])
    print(f"both runs failed in prepare after {time.monotonic() - t0:.0f}s")
    assert "did you mean 'max_steps'?" in failures["typo"], failures["typo"][-2000:]
    assert "airflow pools set tpu" in failures["pool"], failures["pool"][-2000:]


def test_stop_leaves_no_process(cluster, celery_services):
    redis, postgres = celery_services
    assert cluster.pids(), "the cluster should be running before stop()"
    t0 = time.monotonic()
    assert cluster.stop() == []
    assert postgres.stop() == [] and redis.stop() == []
    print(f"stopped cluster, PostgreSQL and Redis in {time.monotonic() - t0:.0f}s")
