"""The Kubernetes launcher's manifests, validated against the `kubernetes` client's
OpenAPI models, and the cncf.kubernetes operators built from them (a dry run: the exact
Pod / Job objects the operators would submit, built with their own code, no cluster).

Validation is a round trip: manifest dict -> `V1Pod` / `V1Job` / ... model -> dict. The
models reject missing required fields and wrong types, and drop keys they do not know,
so a misspelt field or a value of the wrong type makes the round trip differ.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from tests.paths import REPO

pytest.importorskip("airflow.providers.cncf.kubernetes", reason="cncf-kubernetes provider")
from kubernetes.client import ApiClient

pytestmark = pytest.mark.airflow

RUN = "gs://bucket/runs/My_Run.v2"
GROUPS = {"v1": "V1", "batch/v1": "V1", "rbac.authorization.k8s.io/v1": "V1"}


def roundtrip(manifest: dict) -> dict:
    api = ApiClient()
    model = api._ApiClient__deserialize(manifest, GROUPS[manifest["apiVersion"]] + manifest["kind"])
    return api.sanitize_for_serialization(model)


def assert_valid(manifest: dict) -> None:
    assert roundtrip(manifest) == manifest


def entry_kwargs(code: str) -> dict:
    """The keyword arguments a pod's `python -c` passes to its entry point."""
    import ast
    import json

    loads = next(
        n
        for n in ast.walk(ast.parse(code))
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "loads"
    )
    return json.loads(loads.args[0].value)["kwargs"]


@pytest.fixture
def settings():
    import tunix_k8s

    env = {
        "TUNIX_IMAGE": "us-docker.pkg.dev/p/tunix/tunix-tasks:1",
        "TUNIX_K8S_SERVICE_ACCOUNT": "tunix-runner",
        "TUNIX_CPU_NODE_POOL": "actors",
        "TUNIX_TPU_ACCELERATOR": "tpu-v5p-slice",
        "TUNIX_TPU_TOPOLOGY": "2x2x2",
        "TUNIX_TPU_HOSTS": "2",
        "TUNIX_STORE": "gs://bucket/runs",
    }
    return tunix_k8s.K8sSettings.from_env(env)


@pytest.fixture
def context(tmp_path, monkeypatch):
    """What the operators read from a task's context, and a kubeconfig that is never
    contacted (building the objects only asks whether it runs in a cluster)."""
    (tmp_path / "kubeconfig").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    from kubernetes.config import kube_config

    # Read once at import: the KUBECONFIG env var would come too late.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "kubeconfig"))
    ti = SimpleNamespace(dag_id="tunix_train", task_id="learner", map_index=-1, try_number=1)
    return {"ti": ti, "dag": SimpleNamespace(), "run_id": "manual__1"}


def test_every_manifest_validates(settings):
    import dataclasses

    import tunix_k8s

    actor = tunix_k8s.actor_pod(RUN, 7, deadline_s=60.0, s=settings)
    single = tunix_k8s.learner_manifests(
        RUN, max_steps=10, s=dataclasses.replace(settings, tpu_hosts=1)
    )
    service, job = tunix_k8s.learner_manifests(RUN, max_steps=10, s=settings)
    rbac = list(yaml.safe_load_all((REPO / "infra/gke/rbac.yaml").read_text()))
    for manifest in [actor, *single, service, job, *rbac]:
        assert_valid(manifest)
    assert [m["kind"] for m in single] == ["Pod"]
    assert actor["spec"]["nodeSelector"] == {"cloud.google.com/gke-nodepool": "actors"}
    assert actor["spec"]["serviceAccountName"] == "tunix-runner"  # workload identity
    assert {"name": "TUNIX_STORE", "value": "gs://bucket/runs"} in actor["spec"]["containers"][0]["env"]  # fmt: skip
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "2x2x2",
    }
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert job["spec"]["completionMode"] == "Indexed" and pod["subdomain"] == service["metadata"]["name"]  # fmt: skip
    assert service["spec"] == {"clusterIP": "None", "selector": {"job-name": job["metadata"]["name"]}}  # fmt: skip
    for name in (actor["metadata"]["name"], job["metadata"]["name"] + "-9"):  # pod hostnames
        assert len(name) <= 63 and name.replace("-", "").isalnum() and name == name.lower()
    # The commands are Python that compiles and calls the library's entry points.
    for m, fn in ((actor, "run_actor"), (single[0], "run_learner"), (job, "run_learner")):
        spec = m["spec"]["template"]["spec"] if m["kind"] == "Job" else m["spec"]
        cmd = spec["containers"][0]["command"]
        assert cmd[:2] == ["python", "-c"] and f"e.{fn}(" in cmd[2]
        compile(cmd[2], "<pod>", "exec")


def test_a_misspelt_field_fails_validation(settings):
    import tunix_k8s

    pod = tunix_k8s.actor_pod(RUN, 0, s=settings)
    pod["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(AssertionError):
        assert_valid(pod)
    job = tunix_k8s.learner_manifests(RUN, s=settings)[1]
    job["spec"]["parallelism"] = "2"  # a string where the API wants an integer
    with pytest.raises((AssertionError, ValueError, TypeError)):
        assert_valid(job)


def test_settings_reject_a_bad_host_count():
    import tunix_k8s

    with pytest.raises(ValueError, match="TUNIX_TPU_HOSTS must be a positive integer"):
        tunix_k8s.K8sSettings.from_env({"TUNIX_TPU_HOSTS": "two"})


def test_operators_build_what_the_manifests_say(settings, context):
    """Dry run: the operators' own request builders produce the manifests' objects."""
    import dataclasses

    import tunix_k8s
    from airflow.providers.cncf.kubernetes.operators.job import KubernetesJobOperator
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    actor = tunix_k8s.actor_pod(RUN, 3, run_id="ab" * 16, s=settings)
    op = tunix_k8s.build_operator(actor, "actor-3")
    assert isinstance(op, KubernetesPodOperator) and op.namespace == "tunix"
    built = ApiClient().sanitize_for_serialization(op.build_pod_request_obj(context))
    assert roundtrip(built) == built
    base = next(c for c in built["spec"]["containers"] if c["name"] == "base")
    assert base["image"] == actor["spec"]["containers"][0]["image"]
    assert base["command"] == actor["spec"]["containers"][0]["command"]
    assert entry_kwargs(base["command"][2]) == {
        "deadline_s": None,
        "leave_when_parked": True,
        "run_id": "ab" * 16,  # a pod of a deleted run's DAG run never joins the next
    }
    # Each shift is a new pod: the operator names it afresh, so a parked actor's next pod
    # does not collide with the last one while that one is still being deleted.
    again = op.build_pod_request_obj(context).metadata.name
    assert again != built["metadata"]["name"] and again.startswith(actor["metadata"]["name"])
    assert built["spec"]["nodeSelector"] == actor["spec"]["nodeSelector"]
    assert built["spec"]["serviceAccountName"] == "tunix-runner"

    single = tunix_k8s.learner_manifests(RUN, s=dataclasses.replace(settings, tpu_hosts=1))[0]
    assert isinstance(tunix_k8s.build_operator(single, "learner"), KubernetesPodOperator)

    service, job = tunix_k8s.learner_manifests(RUN, max_steps=5, s=settings)
    op = tunix_k8s.build_operator(job, "learner")
    assert isinstance(op, KubernetesJobOperator) and op.do_xcom_push
    built = ApiClient().sanitize_for_serialization(op.build_job_request_obj(context))
    assert roundtrip(built) == built
    # The names the Service and the coordinator address rely on are the Job's real name.
    assert built["metadata"]["name"] == job["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": built["metadata"]["name"]}
    for key in ("completionMode", "completions", "parallelism", "backoffLimit"):
        assert built["spec"][key] == job["spec"][key], key
    pod = built["spec"]["template"]["spec"]
    env = {e["name"]: e for e in next(c for c in pod["containers"] if c["name"] == "base")["env"]}
    host = f"{built['metadata']['name']}-0.{service['metadata']['name']}"
    assert env["TUNIX_COORDINATOR_ADDRESS"]["value"] == f"{host}:{tunix_k8s.COORDINATOR_PORT}"
    assert env["TUNIX_NUM_PROCESSES"]["value"] == "2"
    assert "job-completion-index" in env["TUNIX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert pod["subdomain"] == service["metadata"]["name"]
    assert pod["tolerations"] == [tunix_k8s.TPU_TOLERATION]
