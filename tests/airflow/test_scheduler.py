"""A real Airflow, as `make airflow` runs it: scheduler + dag-processor + api-server
(LocalExecutor, SQLite), started by `infra/airflow/local_airflow.py` in a temporary
AIRFLOW_HOME on a free loopback port and stopped at the end, leaving no process.

One training run goes through it as a user's would: in a real browser (Debian's chromium,
driven by Selenium) the test opens `tunix_train`, clicks *Trigger*, checks what the form
shows (descriptions, the optional run name, a free-text environment with suggestions),
fills a small run (tiny model, one actor, two steps) and submits it. Through the REST API
it then checks that the run succeeded, that the actor ran at the same time as the
learner, that weight snapshots were published, that the learner task's asset events (its
watcher of `weights/LATEST`) scheduled `tunix_eval`, which evaluated a snapshot, and that
the run is DONE. REST alone: invalid params are refused at trigger time, and a typo in the
conf and a deleted `tpu` pool fail `prepare` within seconds, saying what to do. On a form
failure, screenshots and the page source are left in the test's tmp dir (`form.png`,
`failure.png`, `failure.html`).

`make test` installs chromium and chromium-driver (the Makefile's `browser` step, as
root); the module is skipped only when they are missing and cannot be installed (not root).
(The Celery deployment's run, with a worker killed mid-run, is `test_celery.py`'s.)
"""

from __future__ import annotations

import ast
import os
import shutil
import time
import urllib.error
from datetime import datetime
from pathlib import Path

import pytest

from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import read_latest

from .conftest import SMALL_RUN_OVERRIDES, running, small_train_conf

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(600)]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER) and os.geteuid() != 0:
    pytest.skip(
        "chromium/chromedriver are not installed and this user cannot install them: as root, "
        "`make browser` (apt-get install chromium chromium-driver)",
        allow_module_level=True,
    )

RUN = "sched-e2e"
#: What the test types into the form (param name -> text).
FORM = {
    "run_name": RUN,
    "num_actors": "1",
    "envs_per_actor": "4",
    "max_steps": "2",
    "deadline_s": "240",
}
OVERRIDES = SMALL_RUN_OVERRIDES
CONF = small_train_conf(RUN)  # the REST triggers' base conf


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    from local_airflow import LocalAirflow

    home = tmp_path_factory.mktemp("airflow_home")
    store = f"file://{tmp_path_factory.mktemp('runs')}"
    af = LocalAirflow(home, parallelism=8, cpu_slots=6, tpu_slots=1, triggerer=False)
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
def test_trigger_with_invalid_params_is_rejected(airflow, param, value):
    code, detail = _post_error(
        airflow,
        "/api/v2/dags/tunix_train/dagRuns",
        {"logical_date": None, "conf": {**CONF, param: value}},
    )
    print(f"{param}={value!r}: HTTP {code} {detail}")
    assert code == 400, detail
    assert param in detail, detail


def _ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _wait_run(af, dag_id: str, run_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        af.check_alive()
        run = af.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")
        if run["state"] in ("success", "failed"):
            return run
        if time.monotonic() > deadline:
            raise TimeoutError(f"{dag_id}/{run_id} still {run['state']} after {timeout:.0f}s")
        time.sleep(3)


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


def _wait(what: str, fn, timeout: float = 30.0, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        try:
            out = fn()
        except Exception:  # element not there yet, stale after a re-render...
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


def test_train_run_from_the_form_end_to_end(airflow, browser, tmp_path):
    from selenium.webdriver.common.by import By

    af, driver = airflow, browser
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
        env = driver.find_element(By.NAME, "element_env")
        assert env.tag_name == "input" and env.get_attribute("list"), "env: free text"

        for name, text in FORM.items():
            _type(driver, name, text)
        overrides = driver.find_element(By.NAME, "element_overrides")
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", overrides)
        overrides.click()
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
    assert conf["num_actors"] == 1 and conf["max_steps"] == 2, conf
    assert conf["overrides"] == OVERRIDES, conf
    run_id = run["dag_run_id"]
    run = _wait_run(af, "tunix_train", run_id, timeout=360)
    tis = af.request("GET", f"/api/v2/dags/tunix_train/dagRuns/{run_id}/taskInstances?limit=100")
    tis = tis["task_instances"]
    states = {(t["task_id"], t["map_index"]): t["state"] for t in tis}
    print(f"run {run['state']} after {time.monotonic() - t0:.0f}s: {states}")
    assert run["state"] == "success", states
    assert ("actor", 0) in states and ("actor", 1) not in states, states
    # the learner's task log: progress lines from the run's metrics, no orbax INFO noise
    logs = "".join(f.read_text() for f in Path(af.home, "logs").rglob("task_id=learner/**/*.log"))
    assert "learner step 2:" in logs and "reward_mean=" in logs, logs[-3000:]

    # actors ran concurrently with the learner
    actors = [t for t in tis if t["task_id"] == "actor"]
    (learner,) = [t for t in tis if t["task_id"] == "learner"]
    assert [(t["map_index"], t["rendered_map_index"]) for t in actors] == [(0, "actor 0")]
    for a in actors:
        assert _ts(a["start_date"]) < _ts(learner["end_date"]), (a, learner)
        assert _ts(learner["start_date"]) < _ts(a["end_date"]), (a, learner)

    # snapshots were published, the run is DONE (so no actor outlives it), report written
    run_uri = f"{af.store}/{RUN}"
    store = open_store(run_uri)
    assert store.exists(RunLayout.LATEST)
    assert store.exists(RunLayout.DONE)
    xcom = af.request(
        "GET",
        f"/api/v2/dags/tunix_train/dagRuns/{run_id}/taskInstances/learner/xcomEntries/return_value",
    )
    learned = xcom["value"]
    if isinstance(learned, str):  # older API versions return XCom values as repr strings
        learned = ast.literal_eval(learned)
    assert learned["steps"] >= 2
    assert learned["asset_events_posted"] and not learned["asset_events_failed"], learned
    # the learner task's watcher announced the final weights/LATEST
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


def _prepare_log(af, run_id: str) -> str:
    return "".join(
        f.read_text()
        for f in Path(af.home, "logs").rglob("task_id=prepare/*.log")
        if run_id in str(f)
    )


def test_prepare_fails_fast_on_a_typo_and_a_missing_pool(airflow):
    """A real scheduler: the conf typo and the missing pool fail `prepare` in seconds
    (instead of a run with defaults / tasks "scheduled" forever), saying what to do."""
    af = airflow
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


def test_stop_leaves_no_process(airflow):
    assert airflow.pids(), "components should be running before stop()"
    assert airflow.stop() == []
