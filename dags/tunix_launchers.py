"""Launchers: where an actor or the learner actually runs.

The DAG tasks call `launch_actor` / `launch_learner`; this module decides how:

- ``TUNIX_LAUNCHER=local`` (default): in the Airflow worker's own Python process, by
  calling `tunix_tasks.frontdoor.entrypoints.run_actor` / `run_learner`. With the LocalExecutor
  that is one OS process per task on the Airflow machine; with the Celery executor the
  `cpu`/`tpu` queues route the tasks to CPU and TPU workers.
- ``TUNIX_LAUNCHER=kubernetes``: the task builds the manifests of `tunix_k8s` (an
  actor Pod on the CPU node pool; the learner as a Pod on one TPU host, or an Indexed Job
  + headless Service across the hosts of a multi-host slice) and runs them with the
  operators of `apache-airflow-providers-cncf-kubernetes`, imported only then. An actor
  parked by the autopilot gives its pod back; its task starts a new one when unparked.

Either way the learner's weight snapshots are announced by the learner task's
`tunix_weights.WeightsWatcher`, which watches the run's `weights/LATEST`, and a task
acts on the run as its DAG run's setup task prepared it (`prepared_incarnation`): one
fenced off that run (deleted or created again since, or another learner's) fails without
a retry (`failing_when_fenced`).

Environment knobs of the kubernetes launcher (all optional except the image):
`TUNIX_IMAGE`, `TUNIX_K8S_NAMESPACE` (default `tunix`), `TUNIX_K8S_SERVICE_ACCOUNT`
(workload identity for `gs://`), `TUNIX_CPU_NODE_POOL` (default `cpu-pool`),
`TUNIX_TPU_ACCELERATOR` (default `tpu-v5-lite-podslice`), `TUNIX_TPU_TOPOLOGY`
(default `2x2`), `TUNIX_TPU_CHIPS` (chips per host, default `4`), `TUNIX_TPU_HOSTS`
(hosts of the slice, default `1`), `TUNIX_ACTOR_CPU` / `TUNIX_ACTOR_MEMORY`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Iterator

import tunix_k8s
from tunix_params import ensure_library_importable

log = logging.getLogger(__name__)

LOCAL = "local"
KUBERNETES = "kubernetes"


def launcher_kind() -> str:
    kind = os.environ.get("TUNIX_LAUNCHER", LOCAL).strip().lower() or LOCAL
    if kind not in (LOCAL, KUBERNETES):
        raise ValueError(f"TUNIX_LAUNCHER must be {LOCAL!r} or {KUBERNETES!r}, got {kind!r}")
    return kind


def entrypoints():
    """`tunix_tasks.frontdoor.entrypoints`, imported at task run time (never at parse time)."""
    ensure_library_importable()
    return importlib.import_module("tunix_tasks.frontdoor.entrypoints")


# --------------------------------------------------------------------------- launch


@contextlib.contextmanager
def failing_when_fenced() -> Iterator[None]:
    """A process fenced off its run (`entrypoints.Fenced`: another learner has the run, or
    the run was deleted or created again) fails its task without a retry: a retry would
    be fenced again, or join another run."""
    from airflow.sdk.exceptions import AirflowFailException

    try:
        yield
    except entrypoints().Fenced as err:
        raise AirflowFailException(str(err)) from None


def prepared_incarnation(setup_task: str | None) -> str | None:
    """The run's id as `setup_task` prepared it (its `run_incarnation` XCom); None when
    there is none (a setup task that ran the DAG code of before run ids, in a DAG run
    across an upgrade: its tasks then act on the run as it is, as that code did)."""
    from airflow.sdk import get_current_context

    if setup_task is None:
        return None
    ti = get_current_context()["ti"]
    return ti.xcom_pull(task_ids=setup_task, key="run_incarnation", default=None)


def launch_actor(
    run_uri: str, actor_id: int, *, deadline_s: float | None = None, run_id: str | None = None
) -> dict:
    """Run actor `actor_id` of the run until the run is DONE (or its deadline). On
    Kubernetes in shifts: a pod while the autopilot's fleet holds the actor, none while
    it is parked (`entrypoints.run_actor_shifts`); the local launcher parks it in place.
    `run_id`: the run's id when the DAG run prepared it (`entrypoints.run_actor`)."""
    if launcher_kind() == KUBERNETES:
        settings = tunix_k8s.K8sSettings.from_env()

        def shift(seconds_left: float | None) -> dict:
            pod = tunix_k8s.actor_pod(
                run_uri, actor_id, deadline_s=seconds_left, run_id=run_id, s=settings
            )
            return run_manifests([pod], task_suffix=f"actor-{actor_id}")

        return entrypoints().run_actor_shifts(
            run_uri, actor_id, shift, deadline_s=deadline_s, run_id=run_id
        )
    return entrypoints().run_actor(run_uri, actor_id, deadline_s=deadline_s, run_id=run_id)


def launch_learner(
    run_uri: str,
    *,
    max_steps: int | None = None,
    deadline_s: float | None = None,
    actors: int | None = None,
    run_id: str | None = None,
) -> dict:
    """Run the learner (resuming from its latest checkpoint) until `max_steps` / deadline.
    With `actor.autopilot` on, the fleet's autopilot runs beside it in this process
    (`entrypoints.fleet_autopilot`), parking those of the `actors` mapped actors it does
    not need."""
    with entrypoints().fleet_autopilot(run_uri, launched=actors, run_id=run_id):
        if launcher_kind() == KUBERNETES:
            settings = tunix_k8s.K8sSettings.from_env()
            manifests = tunix_k8s.learner_manifests(
                run_uri, max_steps=max_steps, deadline_s=deadline_s, run_id=run_id, s=settings
            )
            return run_manifests(manifests, task_suffix="learner")
        return entrypoints().run_learner(
            run_uri, max_steps=max_steps, deadline_s=deadline_s, run_id=run_id
        )


# --------------------------------------------------------------------------- kubernetes


def run_manifests(manifests: list[dict], *, task_suffix: str) -> dict:
    """Run a Pod (or a learner's Service + Job) from inside the current task; its XCom."""
    from airflow.sdk import get_current_context

    context = get_current_context()
    runnable = manifests[-1]
    for manifest in manifests[:-1]:  # the multi-host learner's headless Service
        tunix_k8s.ensure_service(manifest)
    op = tunix_k8s.build_operator(runnable, f"{context['task'].task_id}-{task_suffix}")
    result = op.execute(context)
    if isinstance(result, list):  # a Job's pods: process 0 speaks for the learner
        result = result[0] if result else {}
    return result or {}
