"""Kubernetes manifests of a tunix fleet on GKE, and the Airflow operators that run them.

Pure functions of the run and the environment (`K8sSettings`) build plain dicts shaped as
the Kubernetes API objects (`tests/airflow/test_k8s.py` validates every one against the
`kubernetes` client's OpenAPI models):

- one **actor** = one Pod on the CPU node pool at a time: a parked actor's pod exits and
  is deleted, and its task starts a new one when the autopilot unparks it;
- the **learner** on a single-host TPU slice = one Pod with the GKE TPU selectors
  (`cloud.google.com/gke-tpu-accelerator`, `cloud.google.com/gke-tpu-topology`) and
  `google.com/tpu` chips;
- the learner on a **multi-host** slice (`TUNIX_TPU_HOSTS` > 1) = an Indexed Job with one
  pod per host (all `hosts` pods must run at once: `parallelism = completions = hosts`)
  plus a headless Service, so pod `i` is reachable as `<job>-<i>.<service>`. Each pod gets
  the `jax.distributed` wiring as env: `TUNIX_COORDINATOR_ADDRESS` (pod 0, port 8476),
  `TUNIX_NUM_PROCESSES` and `TUNIX_PROCESS_ID` (the pod's completion index, downward API).
  On GKE the TPU webhook also injects `TPU_WORKER_ID` / `TPU_WORKER_HOSTNAMES`, which
  `jax.distributed.initialize()` reads on TPU by itself. `backoffLimit: 0`: a failed host
  fails the Job, and the Airflow task's retry starts a fresh Job that resumes from the
  learner's checkpoint (a multi-host step cannot continue with a host missing).

Pods run in `TUNIX_K8S_NAMESPACE` as `TUNIX_K8S_SERVICE_ACCOUNT` (GKE workload identity
maps it to a Google service account with access to the run's `gs://` bucket), from
`TUNIX_IMAGE` (infra/docker/Dockerfile). The operators are those of the maintained
`apache-airflow-providers-cncf-kubernetes` (imported only when building them):
`KubernetesPodOperator` for pods, `KubernetesJobOperator` for the learner's Job.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

XCOM_RETURN = "/airflow/xcom/return.json"  # where KubernetesPodOperator's sidecar reads XCom
COORDINATOR_PORT = 8476
#: `KubernetesJobOperator` names a Job `job-<name>`; its pods' hostnames derive from that.
JOB_NAME_PREFIX = "job-"
TPU_TOLERATION = {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}
PASSED_ENV = ("TUNIX_STORE", "JAX_PLATFORMS", "STORAGE_EMULATOR_HOST")


@dataclass(frozen=True)
class K8sSettings:
    """Where and how the pods run; `from_env()` reads the `TUNIX_*` knobs (docs/airflow.md)."""

    image: str = "tunix-tasks:latest"
    namespace: str = "tunix"
    service_account: str | None = None
    cpu_node_pool: str = "cpu-pool"
    actor_cpu: str = "2"
    actor_memory: str = "4Gi"
    tpu_accelerator: str = "tpu-v5-lite-podslice"
    tpu_topology: str = "2x2"
    tpu_chips_per_host: int = 4
    tpu_hosts: int = 1
    env: dict[str, str] = field(default_factory=dict)  # passed to every container

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> K8sSettings:
        e = dict(os.environ if environ is None else environ)
        d = cls()
        return cls(
            image=e.get("TUNIX_IMAGE", d.image),
            namespace=e.get("TUNIX_K8S_NAMESPACE", d.namespace),
            service_account=e.get("TUNIX_K8S_SERVICE_ACCOUNT") or None,
            cpu_node_pool=e.get("TUNIX_CPU_NODE_POOL", d.cpu_node_pool),
            actor_cpu=e.get("TUNIX_ACTOR_CPU", d.actor_cpu),
            actor_memory=e.get("TUNIX_ACTOR_MEMORY", d.actor_memory),
            tpu_accelerator=e.get("TUNIX_TPU_ACCELERATOR", d.tpu_accelerator),
            tpu_topology=e.get("TUNIX_TPU_TOPOLOGY", d.tpu_topology),
            tpu_chips_per_host=_positive(e, "TUNIX_TPU_CHIPS", d.tpu_chips_per_host),
            tpu_hosts=_positive(e, "TUNIX_TPU_HOSTS", d.tpu_hosts),
            env={k: e[k] for k in PASSED_ENV if e.get(k)},
        )


def _positive(environ: dict[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return int(raw)


# --------------------------------------------------------------------------- manifests


def resource_name(run_uri: str, suffix: str, *, max_len: int = 63) -> str:
    """A DNS-1123 label (≤ `max_len` chars) naming this run's `suffix` object."""
    run = run_uri.rstrip("/").rsplit("/", 1)[-1].lower()
    name = re.sub(r"[^a-z0-9-]+", "-", f"tunix-{run}-{suffix}").strip("-")
    return name[:max_len].rstrip("-")


def entrypoint_command(function: str, args: list[Any], kwargs: dict[str, Any]) -> list[str]:
    """`python -c` calling `tunix_tasks.frontdoor.entrypoints.<function>` and writing its XCom."""
    code = (
        "import json, os; from tunix_tasks.frontdoor import entrypoints as e; "
        f"a = json.loads({json.dumps(json.dumps({'args': args, 'kwargs': kwargs}))}); "
        f"r = e.{function}(*a['args'], **a['kwargs']); "
        f"os.makedirs(os.path.dirname({XCOM_RETURN!r}), exist_ok=True); "
        f"json.dump(r, open({XCOM_RETURN!r}, 'w'), default=str)"
    )
    return ["python", "-c", code]


def _labels(run_uri: str, role: str) -> dict[str, str]:
    return {"app": "tunix-tasks", "tunix/role": role, "tunix/run": resource_name(run_uri, "")}


def _pod_spec(
    s: K8sSettings,
    command: list[str],
    *,
    node_selector: dict[str, str],
    resources: dict[str, dict[str, str]],
    extra_env: list[dict[str, Any]] = (),  # type: ignore[assignment]
    tpu: bool = False,
) -> dict[str, Any]:
    env = [{"name": k, "value": v} for k, v in sorted(s.env.items())] + list(extra_env)
    container = {
        "name": "base",  # KubernetesPodOperator expects the main container "base"
        "image": s.image,
        "command": command,
        "env": env,
        "resources": resources,
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "nodeSelector": node_selector,
        "containers": [container],
    }
    if tpu:
        spec["tolerations"] = [dict(TPU_TOLERATION)]
    if s.service_account:
        spec["serviceAccountName"] = s.service_account
    return spec


def _tpu_pod_spec(s: K8sSettings, command: list[str], extra_env=()) -> dict[str, Any]:
    chips = str(s.tpu_chips_per_host)
    return _pod_spec(
        s,
        command,
        node_selector={
            "cloud.google.com/gke-tpu-accelerator": s.tpu_accelerator,
            "cloud.google.com/gke-tpu-topology": s.tpu_topology,
        },
        resources={"requests": {"google.com/tpu": chips}, "limits": {"google.com/tpu": chips}},
        extra_env=extra_env,
        tpu=True,
    )


def _pod(name: str, run_uri: str, role: str, spec: dict[str, Any], s: K8sSettings) -> dict:
    meta = {"name": name, "namespace": s.namespace, "labels": _labels(run_uri, role)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def actor_pod(
    run_uri: str,
    actor_id: int,
    *,
    deadline_s: float | None = None,
    run_id: str | None = None,
    s: K8sSettings,
) -> dict[str, Any]:
    """One actor's shift: a Pod on the CPU node pool. It leaves once the autopilot parks
    it (`leave_when_parked`); its task starts a new pod when it is unparked
    (`entrypoints.run_actor_shifts`). `run_id`: the run's id when the DAG run prepared it."""
    kwargs = {"deadline_s": deadline_s, "leave_when_parked": True, "run_id": run_id}
    command = entrypoint_command("run_actor", [run_uri, int(actor_id)], kwargs)
    spec = _pod_spec(
        s,
        command,
        node_selector={"cloud.google.com/gke-nodepool": s.cpu_node_pool},
        resources={
            "requests": {"cpu": s.actor_cpu, "memory": s.actor_memory},
            "limits": {"memory": s.actor_memory},
        },
    )
    return _pod(resource_name(run_uri, f"actor-{actor_id}"), run_uri, "actor", spec, s)


def learner_manifests(
    run_uri: str,
    *,
    max_steps: int | None = None,
    deadline_s: float | None = None,
    run_id: str | None = None,
    s: K8sSettings,
) -> list[dict[str, Any]]:
    """The learner: `[Pod]` on one TPU host, `[Service, Job]` on a multi-host slice."""
    kwargs = {"max_steps": max_steps, "deadline_s": deadline_s, "run_id": run_id}
    command = entrypoint_command("run_learner", [run_uri], kwargs)
    if s.tpu_hosts == 1:
        name = resource_name(run_uri, "learner")
        return [_pod(name, run_uri, "learner", _tpu_pod_spec(s, command), s)]
    # Room for the prefix and the pods' `-<index>` within a 63-char hostname.
    name = resource_name(run_uri, "learner", max_len=63 - len(JOB_NAME_PREFIX) - 6)
    job_name = JOB_NAME_PREFIX + name
    labels = _labels(run_uri, "learner")
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": s.namespace, "labels": labels},
        # Headless: DNS records per pod (`<job>-<i>.<service>`), no load balancing.
        "spec": {"clusterIP": "None", "selector": {"job-name": job_name}},
    }
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    coordinator = f"{job_name}-0.{name}:{COORDINATOR_PORT}"
    env = [
        {"name": "TUNIX_COORDINATOR_ADDRESS", "value": coordinator},
        {"name": "TUNIX_NUM_PROCESSES", "value": str(s.tpu_hosts)},
        {"name": "TUNIX_PROCESS_ID", "valueFrom": {"fieldRef": {"fieldPath": index}}},
    ]
    pod_spec = {**_tpu_pod_spec(s, command, env), "subdomain": name}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name, "namespace": s.namespace, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": s.tpu_hosts,
            "parallelism": s.tpu_hosts,
            "backoffLimit": 0,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
    return [service, job]


# --------------------------------------------------------------------------- operators


def _api_client():
    try:
        from kubernetes.client import ApiClient
    except ImportError as err:
        raise RuntimeError(
            "TUNIX_LAUNCHER=kubernetes needs apache-airflow-providers-cncf-kubernetes in the "
            "Airflow worker image (see docs/airflow.md)"
        ) from err
    return ApiClient()


def to_model(manifest: dict[str, Any]) -> Any:
    """The `kubernetes.client` model of a manifest (`V1Pod`, `V1Job`, `V1Service`)."""
    kind = f"V1{manifest['kind']}"
    return _api_client()._ApiClient__deserialize(manifest, kind)


def build_operator(manifest: dict[str, Any], task_id: str) -> Any:
    """The operator that runs a Pod or Job manifest and returns the entrypoint's XCom."""
    from airflow.providers.cncf.kubernetes.operators.job import KubernetesJobOperator
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    common = {
        "task_id": task_id,
        "namespace": manifest["metadata"]["namespace"],
        "do_xcom_push": True,
        "get_logs": True,
    }
    if manifest["kind"] == "Pod":
        pod = to_model(manifest)
        return KubernetesPodOperator(full_pod_spec=pod, on_finish_action="delete_pod", **common)
    if manifest["kind"] == "Job":
        spec = manifest["spec"]
        return KubernetesJobOperator(
            full_job_spec=to_model(manifest),
            # Set again here: the operator overrides the spec's with its own arguments.
            name=manifest["metadata"]["name"].removeprefix(JOB_NAME_PREFIX),
            random_name_suffix=False,  # the Service and the coordinator address use the name
            parallelism=spec["parallelism"],
            completions=spec["completions"],
            completion_mode=spec["completionMode"],
            backoff_limit=spec["backoffLimit"],
            wait_until_job_complete=True,
            **common,
        )
    raise ValueError(f"no operator runs a {manifest['kind']}")


def ensure_service(manifest: dict[str, Any]) -> None:
    """Create the learner's headless Service unless it exists (a retried task reuses it)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    from kubernetes.client.exceptions import ApiException

    api = KubernetesHook().core_v1_client
    try:
        api.create_namespaced_service(manifest["metadata"]["namespace"], to_model(manifest))
    except ApiException as err:
        if err.status != 409:  # 409: already exists
            raise
