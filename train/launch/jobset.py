"""`python -m train.launch --emit=jobset`: a Kubernetes JobSet manifest (jobset.x-k8s.io) running the training
arguments as one indexed Job of N pods, one process each, joined through the first pod's stable DNS name. The
cluster restarts it under the launcher's rules: any failure restarts the whole set (up to --max_restarts) and
the run resumes from its checkpoint, except the statuses a restart cannot help (train/launch/elastic.FINAL),
which end it through the Job's pod failure policy."""
from __future__ import annotations

import json

from train.launch import elastic

NAME, JOB, PORT = "spmdtrain", "workers", 8476


def _command(train_args: list[str], processes: int) -> list[str]:
    coordinator = f"{NAME}-{JOB}-0-0.{NAME}:{PORT}"  # pod 0 of job 0, under the JobSet's headless service
    return ["python", "-m", "train", *train_args, f"--coordinator_address={coordinator}",
            f"--num_processes={processes}", "--process_id=$(JOB_COMPLETION_INDEX)"]


def _pod(train_args: list[str], processes: int, image: str, gpus: int) -> dict:
    index = {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    return {"spec": {"restartPolicy": "Never", "containers": [{
        "name": "train", "image": image, "command": _command(train_args, processes),
        "env": [{"name": "JOB_COMPLETION_INDEX", "valueFrom": index}],
        "ports": [{"containerPort": PORT}],
        "resources": {"limits": {"nvidia.com/gpu": gpus}}}]}}


def manifest(train_args: list[str], processes: int, image: str, gpus: int, max_restarts: int) -> str:
    """The JobSet as YAML (JSON is YAML: printed with json, so no YAML library is needed)."""
    job = {"parallelism": processes, "completions": processes, "completionMode": "Indexed", "backoffLimit": 0,
           "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
               "containerName": "train", "operator": "In", "values": [s for s in elastic.FINAL if s]}}]},
           "template": _pod(train_args, processes, image, gpus)}
    jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": NAME},
              "spec": {"failurePolicy": {"maxRestarts": max_restarts, "rules": [
                  # The CRD requires a rule's name: given here, the manifest is valid without the defaulting webhook.
                  {"name": "finalStatus", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]},
                  "replicatedJobs": [{"name": JOB, "replicas": 1, "template": {"spec": job}}]}}
    return json.dumps(jobset, indent=2) + "\n"
