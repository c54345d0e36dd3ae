"""Launchers: where an actor or the learner actually runs.

The DAG tasks call `launch_actor` / `launch_learner`; this module decides how:

- ``TUNIX_LAUNCHER=local`` (default): in the Airflow worker's own Python process, by
  calling `tunix_tasks.frontdoor.entrypoints.run_actor` / `run_learner`. With the LocalExecutor
  that is one OS process per task on the Airflow machine; with the Celery executor the
  `cpu`/`tpu` queues route the tasks to CPU and TPU workers.
- ``TUNIX_LAUNCHER=kubernetes``: the task builds a pod (`actor_pod_spec` /
  `learner_pod_spec`: image, node pool selector, resources, command) and runs it with
  `KubernetesPodOperator` from `apache-airflow-providers-cncf-kubernetes`. The provider is
  imported only then, so it is not a dependency of the default setup. Because the learner
  then runs in a pod, its weight snapshots are announced by `WeightsWatcher`, a thread in
  the Airflow task that polls `learner_progress(run_uri)` and posts one asset event per new
  version.

Environment knobs of the kubernetes launcher (all optional except the image):
`TUNIX_IMAGE`, `TUNIX_K8S_NAMESPACE` (default `tunix`), `TUNIX_K8S_SERVICE_ACCOUNT`
(workload identity for `gs://`), `TUNIX_CPU_NODE_POOL` (default `cpu-pool`),
`TUNIX_TPU_ACCELERATOR` (default `tpu-v5-lite-podslice`), `TUNIX_TPU_TOPOLOGY`
(default `2x2`), `TUNIX_TPU_CHIPS` (default `4`), `TUNIX_ACTOR_CPU` / `TUNIX_ACTOR_MEMORY`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

LOCAL = "local"
KUBERNETES = "kubernetes"
XCOM_RETURN = "/airflow/xcom/return.json"  # where KubernetesPodOperator's sidecar reads XCom


def launcher_kind() -> str:
    kind = os.environ.get("TUNIX_LAUNCHER", LOCAL).strip().lower() or LOCAL
    if kind not in (LOCAL, KUBERNETES):
        raise ValueError(f"TUNIX_LAUNCHER must be {LOCAL!r} or {KUBERNETES!r}, got {kind!r}")
    return kind


def _entrypoints():
    from tunix_common import entrypoints

    return entrypoints()


# --------------------------------------------------------------------------- launch


def launch_actor(run_uri: str, actor_id: int, *, deadline_s: float | None = None) -> dict:
    """Run actor `actor_id` of the run until the run is DONE (or its deadline)."""
    if launcher_kind() == KUBERNETES:
        spec = actor_pod_spec(run_uri, actor_id, deadline_s=deadline_s)
        return run_pod(spec, task_suffix=f"actor-{actor_id}")
    return _entrypoints().run_actor(run_uri, actor_id, deadline_s=deadline_s)


def launch_learner(
    run_uri: str,
    *,
    max_steps: int | None = None,
    deadline_s: float | None = None,
    on_publish: Callable[[int, str], None] | None = None,
) -> dict:
    """Run the learner (resuming from its latest checkpoint) until `max_steps` / deadline."""
    if launcher_kind() == KUBERNETES:
        spec = learner_pod_spec(run_uri, max_steps=max_steps, deadline_s=deadline_s)
        watcher = WeightsWatcher(run_uri, on_publish) if on_publish else None
        if watcher:
            watcher.start()
        try:
            return run_pod(spec, task_suffix="learner")
        finally:
            if watcher:
                watcher.stop()
    return _entrypoints().run_learner(
        run_uri, max_steps=max_steps, deadline_s=deadline_s, on_publish=on_publish
    )


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
    import re

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


class WeightsWatcher:
    """Polls `learner_progress(run_uri)` and calls `on_publish` for every new version.

    Used when the learner runs outside the task's process (a pod), where no in-process
    callback is possible.
    """

    def __init__(self, run_uri: str, on_publish: Callable[[int, str], None], poll_s: float = 15.0):
        self.run_uri = run_uri
        self.on_publish = on_publish
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name="tunix-weights-watcher", daemon=True
        )
        self._seen: int | None = None

    def start(self) -> None:
        self._seen = self._version()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.poll_s + 5)
        self._check()  # the final snapshot

    def _version(self) -> int | None:
        try:
            version = _entrypoints().learner_progress(self.run_uri).get("version")
        except Exception as err:
            log.warning("learner_progress(%s) failed: %s", self.run_uri, err)
            return self._seen
        return None if version is None else int(version)

    def _check(self) -> None:
        version = self._version()
        if version is not None and (self._seen is None or version > self._seen):
            self._seen = version
            path = f"{self.run_uri.rstrip('/')}/weights/v{version:08d}"
            self.on_publish(version, path)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._check()
