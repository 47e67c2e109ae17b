"""The JobSet manifest of `train.launch --emit=jobset` against the JobSet CRD's schema (tests/fixtures/jobset, with
its source), and what each pod of it starts with: its completion index, the coordinator's DNS name and the process
count, as Kubernetes hands them to the container, are what train/runtime/distributed.py reads."""
import json
import re

import pytest

from tests.helpers import ROOT, run_cli
from train.launch import elastic, jobset
from train.runtime import distributed

jsonschema = pytest.importorskip("jsonschema")
SCHEMA = json.loads((ROOT / "tests" / "fixtures" / "jobset" / "jobset-v1alpha2.schema.json").read_text())
ARGS = ["--config=experiments/tiny.py", "--workdir=/shared/run"]


def errors(manifest: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(SCHEMA)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]


@pytest.mark.parametrize("processes, gpus, restarts", [(1, 0, 0), (4, 8, 3), (64, 8, 10)])
def test_manifest_is_a_valid_jobset(processes, gpus, restarts):
    made = json.loads(jobset.manifest(ARGS, processes, "registry.example/spmdtrain:1", gpus, restarts))
    assert errors(made) == []
    job = made["spec"]["replicatedJobs"][0]["template"]["spec"]
    codes = job["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"]
    assert codes == sorted(set(codes)) and 0 not in codes  # the API server's rules for operator In
    assert job["parallelism"] <= job["completions"] == processes


def test_the_schema_rejects_what_the_cluster_would():
    """The checks have teeth: a misspelled field, a rule without its name, a pod without containers."""
    good = json.loads(jobset.manifest(ARGS, 2, "img", 8, 3))
    misspelled = json.loads(json.dumps(good).replace('"completionMode"', '"completionsMode"'))
    unnamed = json.loads(json.dumps(good).replace('"name": "finalStatus", ', ""))
    empty = json.loads(json.dumps(good))
    empty["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"].pop("containers")
    assert any("completionsMode" in e for e in errors(misspelled))
    assert any("'name' is a required property" in e for e in errors(unnamed))
    assert any("'containers' is a required property" in e for e in errors(empty))


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a container's command: $(VAR) from its env, $$ an escaped $, unknown refs kept."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def pod_command(manifest: dict, index: int) -> list[str]:
    """The command pod `index` of the indexed Job runs, its env resolved as the kubelet does (the completion
    index annotation the Job controller sets on the pod, through the fieldRef)."""
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
    env = {}
    for var in pod["spec"]["containers"][0]["env"]:
        path = var["valueFrom"]["fieldRef"]["fieldPath"]
        key = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", path)
        env[var["name"]] = annotations[key.group(1)]
    return [expand(part, env) for part in pod["spec"]["containers"][0]["command"]]


def test_each_pod_joins_as_its_completion_index_through_pod_0s_dns_name():
    processes = 4
    made = json.loads(jobset.manifest(ARGS, processes, "img", 8, 3))
    name, job = made["metadata"]["name"], made["spec"]["replicatedJobs"][0]["name"]
    subdomain = made["spec"].get("network", {}).get("subdomain", name)  # JobSet's headless service: the JobSet's name
    port = made["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["ports"][0]
    for index in range(processes):
        command = pod_command(made, index)
        assert command[:3] == ["python", "-m", "train"] and command[3:5] == ARGS
        given = dict(part[2:].split("=", 1) for part in command[3:] if part.startswith("--"))
        cluster = distributed.detect(given["coordinator_address"], int(given["num_processes"]),
                                     int(given["process_id"]))
        # JobSet names pod P of job J <jobset>-<replicatedJob>-J-P, reachable as <hostname>.<subdomain>
        assert cluster == distributed.Cluster(f"{name}-{job}-0-0.{subdomain}:{port['containerPort']}", processes,
                                              index, "flags")


def test_launch_prints_the_manifest_and_its_final_statuses():
    done = run_cli("--emit=jobset", "--num_processes=3", "--image=img", "--", *ARGS, module="train.launch",
                   timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    made = json.loads(done.stdout)
    assert errors(made) == [] and made["spec"]["replicatedJobs"][0]["template"]["spec"]["completions"] == 3
    rule = made["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["onExitCodes"]["values"] == sorted(s for s in elastic.FINAL if s)
