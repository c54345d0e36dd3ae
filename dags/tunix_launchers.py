"""Launchers: where an actor or the learner actually runs.

The DAG tasks call `launch_actor` / `launch_learner`; this module decides how:

- ``TUNIX_LAUNCHER=local`` (default): in the Airflow worker's own Python process, by
  calling `tunix_tasks.frontdoor.entrypoints.run_actor` / `run_learner`. With the LocalExecutor
  that is one OS process per task on the Airflow machine; with the Celery executor the
  `cpu`/`tpu` queues route the tasks to CPU and TPU workers.
- ``TUNIX_LAUNCHER=kubernetes``: the task builds a pod (`actor_pod_spec` /
  `learner_pod_spec`: image, node pool selector, resources, command) and runs it with
  `KubernetesPodOperator` from `apache-airflow-providers-cncf-kubernetes`. The provider is
  imported only then, so it is not a dependency of the default setup.

Either way the learner's weight snapshots are announced by the learner task's
`tunix_weights.WeightsWatcher`, which watches the run's `weights/LATEST`.

Environment knobs of the kubernetes launcher (all optional except the image):
`TUNIX_IMAGE`, `TUNIX_K8S_NAMESPACE` (default `tunix`), `TUNIX_K8S_SERVICE_ACCOUNT`
(workload identity for `gs://`), `TUNIX_CPU_NODE_POOL` (default `cpu-pool`),
`TUNIX_TPU_ACCELERATOR` (default `tpu-v5-lite-podslice`), `TUNIX_TPU_TOPOLOGY`
(default `2x2`), `TUNIX_TPU_CHIPS` (default `4`), `TUNIX_ACTOR_CPU` / `TUNIX_ACTOR_MEMORY`.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
from typing import Any

from tunix_params import ensure_library_importable

log = logging.getLogger(__name__)

LOCAL = "local"
KUBERNETES = "kubernetes"
XCOM_RETURN = "/airflow/xcom/return.json"  # where KubernetesPodOperator's sidecar reads XCom


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


def launch_actor(run_uri: str, actor_id: int, *, deadline_s: float | None = None) -> dict:
    """Run actor `actor_id` of the run until the run is DONE (or its deadline)."""
    if launcher_kind() == KUBERNETES:
        spec = actor_pod_spec(run_uri, actor_id, deadline_s=deadline_s)
        return run_pod(spec, task_suffix=f"actor-{actor_id}")
    return entrypoints().run_actor(run_uri, actor_id, deadline_s=deadline_s)


def launch_learner(
    run_uri: str, *, max_steps: int | None = None, deadline_s: float | None = None
) -> dict:
    """Run the learner (resuming from its latest checkpoint) until `max_steps` / deadline."""
    if launcher_kind() == KUBERNETES:
        spec = learner_pod_spec(run_uri, max_steps=max_steps, deadline_s=deadline_s)
        return run_pod(spec, task_suffix="learner")
    return entrypoints().run_learner(run_uri, max_steps=max_steps, deadline_s=deadline_s)


# --------------------------------------------------------------------------- pod specs


def _python_command(function: str, args: list[Any], kwargs: dict[str, Any]) -> list[str]:
    """`python -c` calling `tunix_tasks.frontdoor.entrypoints.<function>` and writing its XCom."""
    code = (
        "import json, os; from tunix_tasks.frontdoor import entrypoints as e; "
        f"a = json.loads({json.dumps(json.dumps({'args': args, 'kwargs': kwargs}))}); "
        f"r = e.{function}(*a['args'], **a['kwargs']); "
        f"os.makedirs(os.path.dirname({XCOM_RETURN!r}), exist_ok=True); "
        f"json.dump(r, open({XCOM_RETURN!r}, 'w'), default=str)"
    )
    return ["python", "-c", code]


def _pod(
    name: str,
    *,
    role: str,
    command: list[str],
    node_selector: dict[str, str],
    resources: dict[str, dict[str, str]],
    tolerations: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    image = os.environ.get("TUNIX_IMAGE", "tunix-tasks:latest")
    env = [
        {"name": k, "value": os.environ[k]}
        for k in ("TUNIX_STORE", "JAX_PLATFORMS", "STORAGE_EMULATOR_HOST")
        if os.environ.get(k)
    ]
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "nodeSelector": node_selector,
        "containers": [
            {
                "name": "base",  # KubernetesPodOperator expects the main container "base"
                "image": image,
                "command": command,
                "env": env,
                "resources": resources,
            }
        ],
    }
    if tolerations:
        spec["tolerations"] = tolerations
    sa = os.environ.get("TUNIX_K8S_SERVICE_ACCOUNT")
    if sa:
        spec["serviceAccountName"] = sa
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": os.environ.get("TUNIX_K8S_NAMESPACE", "tunix"),
            "labels": {"app": "tunix-tasks", "tunix/role": role},
        },
        "spec": spec,
    }


def _pod_name(run_uri: str, suffix: str) -> str:
    run = run_uri.rstrip("/").rsplit("/", 1)[-1].lower()
    name = re.sub(r"[^a-z0-9-]+", "-", f"tunix-{run}-{suffix}").strip("-")
    return name[:63].rstrip("-")


def actor_pod_spec(run_uri: str, actor_id: int, *, deadline_s: float | None = None) -> dict:
    """Pod manifest (dict, V1Pod-shaped) for one actor on the CPU node pool."""
    cpu = os.environ.get("TUNIX_ACTOR_CPU", "2")
    mem = os.environ.get("TUNIX_ACTOR_MEMORY", "4Gi")
    return _pod(
        _pod_name(run_uri, f"actor-{actor_id}"),
        role="actor",
        command=_python_command("run_actor", [run_uri, int(actor_id)], {"deadline_s": deadline_s}),
        node_selector={
            "cloud.google.com/gke-nodepool": os.environ.get("TUNIX_CPU_NODE_POOL", "cpu-pool")
        },
        resources={"requests": {"cpu": cpu, "memory": mem}, "limits": {"memory": mem}},
    )


def learner_pod_spec(
    run_uri: str, *, max_steps: int | None = None, deadline_s: float | None = None
) -> dict:
    """Pod manifest for the learner on a TPU slice node pool (GKE TPU labels)."""
    chips = os.environ.get("TUNIX_TPU_CHIPS", "4")
    return _pod(
        _pod_name(run_uri, "learner"),
        role="learner",
        command=_python_command(
            "run_learner", [run_uri], {"max_steps": max_steps, "deadline_s": deadline_s}
        ),
        node_selector={
            "cloud.google.com/gke-tpu-accelerator": os.environ.get(
                "TUNIX_TPU_ACCELERATOR", "tpu-v5-lite-podslice"
            ),
            "cloud.google.com/gke-tpu-topology": os.environ.get("TUNIX_TPU_TOPOLOGY", "2x2"),
        },
        resources={"requests": {"google.com/tpu": chips}, "limits": {"google.com/tpu": chips}},
        tolerations=[{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
    )


def run_pod(spec: dict, *, task_suffix: str) -> dict:
    """Run `spec` with KubernetesPodOperator inside the current task; return its XCom."""
    try:
        from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
        from kubernetes.client import ApiClient
    except ImportError as err:
        raise RuntimeError(
            "TUNIX_LAUNCHER=kubernetes needs apache-airflow-providers-cncf-kubernetes in the "
            "Airflow worker image (see docs/airflow.md)"
        ) from err
    from airflow.sdk import get_current_context

    context = get_current_context()
    pod = ApiClient()._ApiClient__deserialize(spec, "V1Pod")  # dict -> V1Pod
    op = KubernetesPodOperator(
        task_id=f"{context['task'].task_id}-{task_suffix}",
        full_pod_spec=pod,
        namespace=spec["metadata"]["namespace"],
        do_xcom_push=True,
        get_logs=True,
        on_finish_action="delete_pod",
    )
    return op.execute(context) or {}
