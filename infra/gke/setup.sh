#!/usr/bin/env bash
# One-time GKE setup for tunix-tasks: cluster, CPU pool (actors), TPU pool (learner),
# the run bucket and workload identity. Idempotent-ish: re-running skips what exists.
# Usage: PROJECT=my-proj REGION=us-central2 ZONE=us-central2-b BUCKET=my-tunix-runs ./setup.sh
set -euo pipefail
: "${PROJECT:?}" "${REGION:?}" "${ZONE:?}" "${BUCKET:?}"
CLUSTER=${CLUSTER:-tunix}
CPU_POOL=${CPU_POOL:-cpu-pool}
TPU_POOL=${TPU_POOL:-tpu-pool}
TPU_TYPE=${TPU_TYPE:-ct5lp-hightpu-4t}      # v5e, 4 chips per host
TPU_TOPOLOGY=${TPU_TOPOLOGY:-2x2}
NAMESPACE=${NAMESPACE:-tunix}
GSA="tunix-runner@${PROJECT}.iam.gserviceaccount.com"

gcloud container clusters describe "$CLUSTER" --zone "$ZONE" --project "$PROJECT" >/dev/null 2>&1 ||
  gcloud container clusters create "$CLUSTER" --zone "$ZONE" --project "$PROJECT" \
    --workload-pool="${PROJECT}.svc.id.goog" --release-channel=regular --num-nodes=1

# Actors: cheap CPUs, autoscaled with the fleet size; spot is fine (shards are atomic,
# an actor killed mid-shard loses only its unflushed episodes, never a partial shard).
gcloud container node-pools describe "$CPU_POOL" --cluster "$CLUSTER" --zone "$ZONE" --project "$PROJECT" >/dev/null 2>&1 ||
  gcloud container node-pools create "$CPU_POOL" --cluster "$CLUSTER" --zone "$ZONE" --project "$PROJECT" \
    --machine-type=c3-standard-22 --spot --enable-autoscaling --min-nodes=0 --max-nodes=32 \
    --workload-metadata=GKE_METADATA

# Learner: one TPU slice. The learner resumes from its checkpoint if the node is preempted.
gcloud container node-pools describe "$TPU_POOL" --cluster "$CLUSTER" --zone "$ZONE" --project "$PROJECT" >/dev/null 2>&1 ||
  gcloud container node-pools create "$TPU_POOL" --cluster "$CLUSTER" --zone "$ZONE" --project "$PROJECT" \
    --machine-type="$TPU_TYPE" --tpu-topology="$TPU_TOPOLOGY" --num-nodes=1 \
    --workload-metadata=GKE_METADATA

# The run bucket: shards are the replay buffer; delete old ones automatically.
gcloud storage buckets describe "gs://$BUCKET" >/dev/null 2>&1 ||
  gcloud storage buckets create "gs://$BUCKET" --project "$PROJECT" --location "$REGION" \
    --uniform-bucket-level-access
cat > /tmp/tunix-lifecycle.json <<JSON
{"rule": [{"action": {"type": "Delete"}, "condition": {"age": 30, "matchesPrefix": ["runs/"], "matchesSuffix": [".parquet"]}}]}
JSON
gcloud storage buckets update "gs://$BUCKET" --lifecycle-file=/tmp/tunix-lifecycle.json

# Workload identity: pods run as KSA tunix/tunix-runner -> GSA with bucket access only.
gcloud iam service-accounts describe "$GSA" --project "$PROJECT" >/dev/null 2>&1 ||
  gcloud iam service-accounts create tunix-runner --project "$PROJECT"
gcloud storage buckets add-iam-policy-binding "gs://$BUCKET" \
  --member="serviceAccount:$GSA" --role=roles/storage.objectAdmin
gcloud iam service-accounts add-iam-policy-binding "$GSA" --project "$PROJECT" \
  --role=roles/iam.workloadIdentityUser \
  --member="serviceAccount:${PROJECT}.svc.id.goog[${NAMESPACE}/tunix-runner]"
kubectl apply -f "$(dirname "$0")/rbac.yaml"
kubectl annotate serviceaccount tunix-runner -n "$NAMESPACE" --overwrite \
  "iam.gke.io/gcp-service-account=$GSA"
echo "done: set TUNIX_LAUNCHER=kubernetes TUNIX_K8S_NAMESPACE=$NAMESPACE TUNIX_K8S_SERVICE_ACCOUNT=tunix-runner"
echo "      TUNIX_CPU_NODE_POOL=$CPU_POOL TUNIX_TPU_TOPOLOGY=$TPU_TOPOLOGY in the Airflow workers' environment"
