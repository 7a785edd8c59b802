"""make submit-k8s (trainer/launchers/k8s.py) without a cluster, and the pods' side of it
(trainer/launchers/torchrun.py: apply_rendezvous, operator_exit): the rendered TrainJob, JobSet and
PodGroup against the vendored CRD schemas (tests/schemas/) and golden files (tests/golden/*.yaml), the
rendezvous each operator's variables give the launcher in every pod, and bad input refused in one line
before anything is written. The ConfigMap of a config of the user's own is core v1, whose schema is not
vendored: its shape is checked here plainly (config_map_problems). The image's two containers on a
Docker engine: tests/system/test_k8s_containers.py."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.helpers.run import ROOT, TINY
from trainer.launchers import k8s, torchrun
from trainer.resilience import outcomes, signals
from trainer.rundir import layout

GOLDEN = ROOT / "tests" / "golden"
SCHEMAS = ROOT / "tests" / "schemas"
SCHEMA_OF = {
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainjob-v1alpha1.json",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset-v1alpha2.json",
    ("scheduling.volcano.sh/v1beta1", "PodGroup"): "podgroup-v1beta1.json",
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): "clustertrainingruntime-v1alpha1.json",
}
IMAGE = "registry.example.com/ml/fsdp-trainer:1.4.0"


def closed(schema):
    """The schema with every object that lists its properties closed to others (tests/schemas/README.md):
    a misspelt field is an error, as kubectl's strict validation makes it."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    open_ = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_:
        out["additionalProperties"] = False
    return out


@functools.cache
def validator(file: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(closed(json.loads((SCHEMAS / file).read_text())))


def problems(doc: dict) -> list[str]:
    """What the vendored CRD schema of doc's kind says is wrong with it: 'path: message' each (a
    ConfigMap: config_map_problems)."""
    if (doc.get("apiVersion"), doc.get("kind")) == ("v1", "ConfigMap"):
        return config_map_problems(doc)
    found = validator(SCHEMA_OF[doc["apiVersion"], doc["kind"]]).iter_errors(doc)
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in found)


DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
CONFIG_MAP_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def config_map_problems(doc: dict) -> list[str]:
    """What the API server's validation of a core v1 ConfigMap (k8s.io/kubernetes pkg/apis/core/validation,
    ValidateConfigMap) would refuse in the fields make submit-k8s renders: the name a DNS-1123
    subdomain, keys of letters, digits, '-', '_' and '.' (not '.' or '..'), text values, at most 1 MiB
    of data; and no field that is not a ConfigMap's."""
    found = [
        f"{key}: not a field of a ConfigMap" for key in doc if key not in ("apiVersion", "kind", "metadata", "data")
    ]
    meta = doc.get("metadata", {})
    found += [f"metadata.{key}: not rendered here" for key in meta if key not in ("name", "namespace", "labels")]
    name = meta.get("name", "")
    if not (DNS_SUBDOMAIN.fullmatch(name) and len(name) <= 253):
        found.append(f"metadata.name: {name!r} is not a DNS-1123 subdomain")
    data = doc.get("data")
    if not isinstance(data, dict) or not data:
        return [*found, "data: expected a mapping of file names to their text"]
    for key, value in data.items():
        if not (isinstance(key, str) and CONFIG_MAP_KEY.fullmatch(key) and key not in (".", "..")):
            found.append(f"data: {key!r} is not a valid ConfigMap key")
        if not isinstance(value, str):
            found.append(f"data.{key}: {type(value).__name__} is not text")
    if sum(len(k.encode()) + len(str(v).encode()) for k, v in data.items()) > 1 << 20:
        found.append("data: more than 1 MiB")
    return sorted(found)


def _job(**changes) -> k8s.Job:
    job = k8s.Job(
        kind=k8s.KIND_TRAINJOB,
        name="llama-8b",
        namespace="ml",
        nodes=4,
        gpus_per_node=8,
        image=IMAGE,
        pvc="shared-runs",
        run_dir="/runs/llama-8b",
        config="/app/configs/llama-8b.yaml",
        overrides=["train.steps=10000"],
        queue="team-a",
        gang="kueue",
        runtime="torch-distributed",
        grace_seconds=380,
        max_restarts=5,
    )
    for key, value in changes.items():
        setattr(job, key, value)
    return job


CPU = {"nodes": 2, "gpus_per_node": 0, "namespace": None, "name": "mnist", "run_dir": "/runs/mnist/a"}
# A config of the user's own: a ConfigMap, the file as it is (comments and all).
MINE = {
    "config": f"{k8s.CONFIG_MOUNT}/{k8s.CONFIG_KEY}",
    "config_text": "# my model\nmodel:\n  dim: 64   # wider\ntrain:\n  steps: 20\n",
}

# A run dir in a bucket: no claim, the credentials from a Secret.
S3 = {"pvc": None, "run_dir": "s3://ml-runs/team-a/llama-8b", "s3_secret": "s3-credentials"}


@pytest.mark.parametrize(
    "name, job",
    [
        ("trainjob-8x4-kueue.yaml", _job()),
        ("trainjob-cpu-2-volcano.yaml", _job(**CPU, queue="research", gang="volcano")),
        ("jobset-8x4-kueue.yaml", _job(kind=k8s.KIND_JOBSET)),
        ("jobset-8x4-volcano.yaml", _job(kind=k8s.KIND_JOBSET, queue="research", gang="volcano")),
        ("jobset-cpu-2.yaml", _job(kind=k8s.KIND_JOBSET, **CPU, queue=None)),
        ("trainjob-cpu-2-configmap.yaml", _job(**CPU, **MINE, queue=None)),
        ("jobset-8x4-configmap-volcano.yaml", _job(kind=k8s.KIND_JOBSET, **MINE, queue="research", gang="volcano")),
        ("trainjob-cpu-2-s3.yaml", _job(**{**CPU, **S3}, queue=None)),
        ("jobset-8x4-s3.yaml", _job(kind=k8s.KIND_JOBSET, **S3, s3_endpoint="https://minio.example.com:9000")),
    ],
)
def test_rendered_manifest_matches_golden_and_its_crd_schema(name, job):
    text = k8s.render(job)
    if os.environ.get("UPDATE_GOLDEN"):
        (GOLDEN / name).write_text(text)
    assert text == (GOLDEN / name).read_text(), f"rendered manifest differs from tests/golden/{name}"
    docs = list(yaml.safe_load_all(text))
    assert [problems(doc) for doc in docs] == [[] for _ in docs]
    kinds = ["JobSet", "PodGroup"] if job.kind == k8s.KIND_JOBSET and job.gang == "volcano" else [docs[-1]["kind"]]
    assert [d["kind"] for d in docs] == (["ConfigMap"] if job.config_text else []) + kinds
    if job.config_text:  # the pods mount the ConfigMap the manifest holds, which is the file as it was
        assert docs[0]["data"] == {k8s.CONFIG_KEY: job.config_text}
        assert _mounted_config(docs[1]) == (docs[0]["metadata"]["name"], k8s.CONFIG_MOUNT)
    if job.run_dir.startswith("s3://"):  # no claim; the staging copies on the pod's own disk, credentials
        env, mounts, volumes = _pod_parts(docs[-1])
        assert [m["mountPath"] for m in mounts] == ["/dev/shm", "/s3-staging"]
        assert volumes[-1] == {"name": "s3-staging", "emptyDir": {}}
        assert env["TRAINER_S3_STAGING"] == {"value": "/s3-staging/trainer"}
        assert env["AWS_ACCESS_KEY_ID"] == {
            "valueFrom": {"secretKeyRef": {"name": job.s3_secret, "key": "AWS_ACCESS_KEY_ID"}}
        }
        assert env["AWS_REGION"]["valueFrom"]["secretKeyRef"]["optional"] is True
        assert env.get("AWS_ENDPOINT_URL") == (
            {"value": job.s3_endpoint}
            if job.s3_endpoint
            else {"valueFrom": {"secretKeyRef": {"name": job.s3_secret, "key": "AWS_ENDPOINT_URL", "optional": True}}}
        )


def _pod_parts(doc: dict) -> tuple[dict, list[dict], list[dict]]:
    """(the training container's variables by name, its mounts, the pod's volumes) of a TrainJob (its own
    env, its runtime patch's mounts and volumes) or a JobSet."""
    if doc["kind"] == "TrainJob":
        (patch,) = doc["spec"]["runtimePatches"]
        (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        env = doc["spec"]["trainer"].get("env", [])
    else:
        (rjob,) = doc["spec"]["replicatedJobs"]
        env = rjob["template"]["spec"]["template"]["spec"]["containers"][0].get("env", [])
    pod = rjob["template"]["spec"]["template"]["spec"]
    named = {e["name"]: {k: v for k, v in e.items() if k != "name"} for e in env}
    assert len(named) == len(env), "a variable set twice"
    return named, pod["containers"][0]["volumeMounts"], pod["volumes"]


def _mounted_config(doc: dict) -> tuple[str, str]:
    """(the ConfigMap, where the container mounts it, read-only) of a TrainJob's runtime patch or a JobSet."""
    if doc["kind"] == "TrainJob":
        (patch,) = doc["spec"]["runtimePatches"]
        (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    else:
        (rjob,) = doc["spec"]["replicatedJobs"]
    pod = rjob["template"]["spec"]["template"]["spec"]
    ((volume,),) = [[v for v in pod["volumes"] if "configMap" in v]]
    ((mount,),) = [[m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]]
    assert mount["readOnly"] is True
    return volume["configMap"]["name"], mount["mountPath"]


def test_the_runtime_for_trainjobs_restarts_them_as_the_jobset_does_and_matches_golden_and_its_schema():
    """KIND=runtime: the ClusterTrainingRuntime whose JobSet template carries the failure policy a TrainJob
    cannot set; its policies are the JobSet's own (render_jobset), its names those Kubeflow's torch plugin
    looks for (the replicated job and container "node", the trainer ancestor label)."""
    text = k8s.render_runtime("fsdp-trainer", IMAGE, 5)
    if os.environ.get("UPDATE_GOLDEN"):
        (GOLDEN / "clustertrainingruntime.yaml").write_text(text)
    assert text == (GOLDEN / "clustertrainingruntime.yaml").read_text()
    (runtime,) = yaml.safe_load_all(text)
    assert problems(runtime) == []
    (jobset,) = yaml.safe_load_all(k8s.render(_job(kind=k8s.KIND_JOBSET)))
    assert runtime["spec"]["template"]["spec"]["failurePolicy"] == jobset["spec"]["failurePolicy"]
    (rjob,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    policy = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]
    assert (rjob["name"], rjob["template"]["spec"]["podFailurePolicy"]) == ("node", policy)
    assert rjob["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 1, "torch": {}}


def test_make_submit_k8s_kind_runtime_takes_a_name_an_image_and_max_restarts_only(tmp_path, capsys):
    out = tmp_path / "runtime.yaml"
    argv = ["--kind", "runtime", "--image", IMAGE, "--max-restarts", "5", "--out", str(out)]
    assert k8s.main(argv) == 0
    assert out.read_text() == (GOLDEN / "clustertrainingruntime.yaml").read_text()
    out.unlink()
    assert k8s.main([*argv, "--namespace", "ml"]) == outcomes.BAD_INPUT.code
    assert capsys.readouterr().err.endswith(
        "submit-k8s: error: NAMESPACE=ml: a ClusterTrainingRuntime belongs to no namespace; leave it out\n"
    )
    assert not out.exists()


def test_the_schema_check_finds_a_misspelt_field_a_wrong_type_and_a_value_out_of_its_enum():
    """The check above can fail, where the API server would refuse the manifest."""
    (jobset,) = yaml.safe_load_all(k8s.render(_job(kind=k8s.KIND_JOBSET)))
    bad = copy.deepcopy(jobset)
    pod = bad["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["terminationGracePeriodSecond"] = pod.pop("terminationGracePeriodSeconds")
    bad["spec"]["failurePolicy"]["maxRestarts"] = "5"
    bad["spec"]["failurePolicy"]["restartStrategy"] = "Restart"
    assert problems(bad) == [
        "spec.failurePolicy.maxRestarts: '5' is not of type 'integer'",
        "spec.failurePolicy.restartStrategy: 'Restart' is not one of ['Recreate', 'BlockingRecreate', "
        "'InPlaceRestart']",
        "spec.replicatedJobs.0.template.spec.template.spec: Additional properties are not allowed "
        "('terminationGracePeriodSecond' was unexpected)",
    ]
    (trainjob,) = yaml.safe_load_all(k8s.render(_job()))
    del trainjob["spec"]["runtimeRef"]
    assert problems(trainjob) == ["spec: 'runtimeRef' is a required property"]
    config_map, _ = yaml.safe_load_all(k8s.render(_job(**MINE)))
    config_map["metadata"]["name"] = "Llama_8B-config"
    config_map["data"] = {"my config.yaml": "model: {}\n", "..": 7}
    config_map["binaryDate"] = {}
    assert problems(config_map) == [
        "binaryDate: not a field of a ConfigMap",
        "data...: int is not text",
        "data: '..' is not a valid ConfigMap key",
        "data: 'my config.yaml' is not a valid ConfigMap key",
        "metadata.name: 'Llama_8B-config' is not a DNS-1123 subdomain",
    ]
    config_map["metadata"]["name"] = "llama-8b-config.team-a"
    config_map["data"] = {"config.yaml": "x" * (1 << 20)}
    assert problems(config_map) == ["binaryDate: not a field of a ConfigMap", "data: more than 1 MiB"]


def test_the_jobset_fails_at_once_on_the_codes_a_restart_cannot_help_and_restarts_the_set_on_the_rest():
    (jobset,) = yaml.safe_load_all(k8s.render(_job(kind=k8s.KIND_JOBSET)))
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    (rule,) = job["podFailurePolicy"]["rules"]
    codes = rule["onExitCodes"]["values"]
    assert rule["action"] == "FailJob" and codes == [outcomes.BAD_INPUT.code, outcomes.LEASE_LOST.code]
    assert all(outcomes.by_code(code).requeue == outcomes.NOT_REQUEUED for code in codes)
    stopped = outcomes.signal_code(signal.SIGTERM)  # what operator_exit gives a clean stop before the end
    assert stopped not in codes and outcomes.by_code(stopped).requeue == outcomes.REQUEUED
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    assert jobset["spec"]["failurePolicy"] == {
        "maxRestarts": 5,
        "rules": [{"name": "notRestartable", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}],
    }


def test_the_image_entrypoint_and_configs_are_the_dockerfiles():
    """The pods run the image's own entrypoint (tini, PID 1: it forwards SIGTERM to the launcher) and
    find the config where the Dockerfile copies configs/."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    (entrypoint,) = re.findall(r"^ENTRYPOINT (\[.*\])$", dockerfile, re.M)
    assert json.loads(entrypoint) == k8s.ENTRYPOINT
    assert f"cp -r /src/configs {k8s.IMAGE_CONFIGS}" in dockerfile
    assert "pip install $PIP_OPTS '/src[s3]'" in dockerfile  # s3fs: a run dir in a bucket (RUN_DIR=s3://...)


def test_the_grace_period_follows_the_last_measured_save_and_a_grace_too_short_for_it_is_refused(tmp_path):
    """A run dir whose last blocking save took 250 s (status.json's save_s): 250 + 60 + 20 s; GRACE=200
    leaves the ranks 180 s, less than that save."""
    layout.write_status(tmp_path, state="stopped", step=40, save_s=250.0)
    config = ROOT / "configs" / "default.yaml"
    job = _job(nodes=2, gpus_per_node=0, run_dir=str(tmp_path), overrides=TINY, grace_seconds=0)
    k8s.check(job, config)
    assert job.grace_seconds == 250 + k8s.STEP_MARGIN_S + signals.EXIT_MARGIN_S
    assert job.notes[-1].endswith(f"one save: about 250.0 s (measured by the last save in {tmp_path})")
    with pytest.raises(k8s.K8sError) as e:
        k8s.check(_job(nodes=2, gpus_per_node=0, run_dir=str(tmp_path), overrides=TINY, grace_seconds=200), config)
    assert str(e.value) == (
        f"GRACE=200 leaves the ranks 180 s to save after a SIGTERM, but one save takes about 250 s (measured by the "
        f"last save in {tmp_path}); use GRACE=330 or more, or leave it empty"
    )


def test_grace_period_covers_a_save_the_step_in_progress_and_the_launchers_exit():
    assert k8s.grace_for(0.0) == signals.DEFAULT_GRACE_S
    assert k8s.grace_for(300.2) == 301 + k8s.STEP_MARGIN_S + signals.EXIT_MARGIN_S
    assert signals.shutdown_budget(k8s.grace_for(300.2)) == 301 + k8s.STEP_MARGIN_S  # what the ranks get


# ---- the pods' side: each operator's variables as the launcher reads them -----------------------


def _pod_env(doc: dict, index: int) -> tuple[dict, list[str]]:
    """(environment, command line after the entrypoint) of pod `index` of the rendered job, as the
    operators make it: Kubeflow Trainer's torch plugin (kubeflow/trainer v2.3.0,
    pkg/runtime/framework/plugins/torch/torch.go) sets PET_* from the TrainJob; for a JobSet, the
    Job controller sets JOB_COMPLETION_INDEX and the downward API reads the labels the JobSet
    controller puts on every pod (jobset.sigs.k8s.io/jobset-name, .../replicatedjob-name). The job's own
    plain variables (an s3:// run dir's) are in it too; those from a Secret are not (the kubelet's)."""
    name = doc["metadata"]["name"]
    if doc["kind"] == "TrainJob":
        trainer = doc["spec"]["trainer"]
        env = {
            "PET_NNODES": str(trainer["numNodes"]),
            "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
            "PET_NODE_RANK": str(index),
            "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
            "PET_MASTER_PORT": "29500",
        }
        env |= {var["name"]: var["value"] for var in trainer.get("env", []) if "value" in var}
        return env, trainer["args"]
    (rjob,) = doc["spec"]["replicatedJobs"]
    (container,) = rjob["template"]["spec"]["template"]["spec"]["containers"]
    labels = {"jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"]}
    env = {"JOB_COMPLETION_INDEX": str(index)}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            (key,) = re.fullmatch(r"metadata\.labels\['(.+)'\]", path).groups()
            env[var["name"]] = labels[key]
    return env, container["args"]


def _pod_hostname(doc: dict, index: int) -> str:
    """Pod `index`'s name in DNS: host name <jobset>-<replicated job>-<job index>-<pod index> under the
    JobSet's headless service (its subdomain: the JobSet's name); a TrainJob's JobSet is named after it."""
    name = doc["metadata"]["name"]
    return f"{name}-node-0-{index}.{name}"


@pytest.mark.parametrize("kind", [k8s.KIND_TRAINJOB, k8s.KIND_JOBSET])
def test_every_pod_finds_the_first_pod_and_its_own_rank_from_what_the_operator_set(kind):
    (doc,) = yaml.safe_load_all(k8s.render(_job(kind=kind, queue=None)))
    for index in range(4):
        env, args = _pod_env(doc, index)
        assert args[:3] == ["python3", "-m", "trainer.launch"]
        a = torchrun._parser().parse_intermixed_args(args[3:])
        rdzv = torchrun.apply_rendezvous(a, env)
        assert (a.nnodes, a.node_rank, a.nproc_per_node) == (4, index, "8")
        assert a.rdzv_endpoint == f"{_pod_hostname(doc, 0)}:{torchrun.JOBSET_RDZV_PORT}"
        assert a.rdzv_id == _pod_hostname(doc, 0)  # the same on every pod
        assert (a.config, a.overrides, a.grace_seconds) == (
            "/app/configs/llama-8b.yaml",
            ["run_dir=/runs/llama-8b", "train.steps=10000"],
            380,
        )
        assert rdzv.source.startswith("Kubeflow Trainer" if kind == k8s.KIND_TRAINJOB else "JobSet")
        command = torchrun.torchrun_args(a, 8, 360)
        host = "true" if index == 0 else "false"  # pod 0 hosts the store: its name may not resolve yet
        assert f"--rdzv-conf=is_host={host},read_timeout={torchrun.OPERATOR_STORE_TIMEOUT_S}" in command
        assert "--rdzv-backend=c10d" in command and "--standalone" not in command
    if kind == k8s.KIND_JOBSET:
        (rjob,) = doc["spec"]["replicatedJobs"]
        (container,) = rjob["template"]["spec"]["template"]["spec"]["containers"]
        assert container["ports"] == [{"name": "rendezvous", "containerPort": torchrun.JOBSET_RDZV_PORT}]
        assert doc["spec"]["network"]["enableDNSHostnames"] is True


def test_one_pod_trains_standalone_and_no_operator_leaves_the_command_line_as_it_was():
    (doc,) = yaml.safe_load_all(k8s.render(_job(nodes=1)))
    env, args = _pod_env(doc, 0)
    a = torchrun._parser().parse_intermixed_args(args[3:])
    assert torchrun.apply_rendezvous(a, env) is not None
    assert (a.nnodes, a.node_rank, a.rdzv_endpoint) == (1, 0, "")
    assert "--standalone" in torchrun.torchrun_args(a, 8, 360)
    # Slurm's batch script gives the rendezvous itself: the operator's variables are not read.
    given = ["--nnodes=2", "--node-rank=1", "--rdzv-endpoint=n1:5000", "--rdzv-id=7", "--config", "c.yaml"]
    a = torchrun._parser().parse_intermixed_args(given)
    assert torchrun.apply_rendezvous(a, {**env, "PET_NNODES": "4"}) is None
    assert (a.nnodes, a.node_rank, a.rdzv_endpoint, a.rdzv_id, a.nproc_per_node) == (2, 1, "n1:5000", "7", "auto")
    a = torchrun._parser().parse_intermixed_args(["--config", "c.yaml"])
    assert torchrun.apply_rendezvous(a, {}) is None
    assert (a.nnodes, a.node_rank, a.rdzv_endpoint, a.nproc_per_node) == (1, 0, "", "auto")


KUBEFLOW = {
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "auto",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "t-node-0-0.t",
    "PET_MASTER_PORT": "29500",
}


@pytest.mark.parametrize(
    "env, argv, line",
    [
        (
            {**KUBEFLOW, "PET_NODE_RANK": "one"},
            [],
            "PET_NODE_RANK='one': expected a whole number >= 0 (set by the job's operator)",
        ),
        ({**KUBEFLOW, "PET_NODE_RANK": "2"}, [], "Kubeflow Trainer (PET_*): node rank 2 is not below its 2 node(s)"),
        (
            {k: v for k, v in KUBEFLOW.items() if k != "PET_MASTER_ADDR"},
            [],
            "PET_MASTER_ADDR not set while PET_NNODES, PET_NODE_RANK, PET_MASTER_PORT are: not a Kubeflow Trainer "
            "torch runtime's pod; set all of them, or none",
        ),
        (KUBEFLOW, ["--nnodes=3"], "--nnodes=3 but Kubeflow Trainer (PET_*) says 2 node(s); give one of them"),
        (
            {"JOB_COMPLETION_INDEX": "0", "JOBSET_NAME": "j", "REPLICATED_JOB_NAME": "node"},
            [],
            "JOB_COMPLETION_INDEX and JOBSET_NAME are set (a JobSet's pod) but --nnodes is not: give the number of "
            "pods of the replicated job (its Job's completions)",
        ),
        (
            {"JOB_COMPLETION_INDEX": "0", "JOBSET_NAME": "j"},
            ["--nnodes=2"],
            "REPLICATED_JOB_NAME not set: a JobSet's pod needs JOB_COMPLETION_INDEX, JOBSET_NAME, REPLICATED_JOB_NAME",
        ),
    ],
)
def test_operator_variables_that_are_no_rendezvous_are_one_line(env, argv, line):
    a = torchrun._parser().parse_intermixed_args([*argv, "--config", "c.yaml"])
    with pytest.raises(torchrun.OperatorEnvError) as e:
        torchrun.apply_rendezvous(a, env)
    assert str(e.value) == line


def test_the_launcher_refuses_a_pods_bad_variables_with_exit_2_before_anything(monkeypatch, capsys, handlers, tmp_path):
    for name, value in {**KUBEFLOW, "PET_NODE_RANK": "-1"}.items():
        monkeypatch.setenv(name, value)
    run_dir = tmp_path / "run"
    assert torchrun.main(["--config", "configs/default.yaml", f"run_dir={run_dir}"]) == outcomes.BAD_INPUT.code
    err = capsys.readouterr().err
    assert err.endswith("PET_NODE_RANK='-1': expected a whole number >= 0 (set by the job's operator)\n")
    assert err.count("\n") == 1 and not run_dir.exists()


def test_a_pod_that_stopped_cleanly_before_the_end_exits_as_sigtermd_so_the_set_restarts(tmp_path, capsys):
    rdzv = torchrun.Rendezvous("JobSet (JOB_COMPLETION_INDEX)", 2, 1, "j-node-0-0.j:29500", "j-node-0-0.j", None)
    run_dir = str(tmp_path)
    layout.write_status(run_dir, state="stopped", step=40)
    assert torchrun.operator_exit(rdzv, 0, run_dir) == outcomes.signal_code(signal.SIGTERM)
    assert capsys.readouterr().err == (
        "launch: stopped before the end of training under JobSet (JOB_COMPLETION_INDEX): exit code 143, so that "
        "the whole set is restarted (the JobSet's failurePolicy) and resumes from the start (no checkpoint yet)\n"
    )
    assert torchrun.operator_exit(rdzv, 0, run_dir, finished=True) == 0  # found finished at its start
    assert torchrun.operator_exit(rdzv, outcomes.BAD_INPUT.code, run_dir) == outcomes.BAD_INPUT.code
    layout.write_status(run_dir, state="finished", step=100)
    assert torchrun.operator_exit(rdzv, 0, run_dir) == 0
    assert capsys.readouterr().err == ""


# ---- make submit-k8s: checked, rendered, written, applied ----------------------------------------


def _argv(tmp_path: Path, *more: str, **options: str) -> list[str]:
    """make submit-k8s's command line for a 2-pod CPU job of TINY, written to tmp_path/job.yaml;
    `options`: --name_like_this=value replaced or added, `more`: further arguments."""
    given = {"nodes": "2", "gpus_per_node": "0", "image": IMAGE, "pvc": "runs", "name": "tiny"}
    given |= {"out": str(tmp_path / "job.yaml"), **options}
    return [*(w for key, value in given.items() for w in ("--" + key.replace("_", "-"), value)), *more, *TINY]


@pytest.mark.parametrize("kind", [k8s.KIND_TRAINJOB, k8s.KIND_JOBSET])
def test_submit_renders_what_the_preflight_checked_and_writes_it(tmp_path, capsys, kind):
    assert k8s.main(_argv(tmp_path, kind=kind)) == 0
    docs = list(yaml.safe_load_all((tmp_path / "job.yaml").read_text()))
    assert [problems(doc) for doc in docs] == [[]]
    _, args = _pod_env(docs[0], 1)
    assert args[args.index("--config") :] == ["--config", "/app/configs/default.yaml", "run_dir=/runs/tiny", *TINY]
    err = capsys.readouterr().err
    assert "submit-k8s: terminationGracePeriodSeconds: 120 (one save + 60 s for the step in progress" in err
    assert f"submit-k8s: wrote {tmp_path / 'job.yaml'}" in err


@pytest.mark.parametrize(
    "options, line",
    [
        ({"nodes": "0"}, "NODES='0': expected a whole number >= 1"),
        ({"image": ""}, "IMAGE is empty: give the image every pod runs, as the cluster pulls it (REGISTRY/NAME:TAG)"),
        ({"image": "Registry/Trainer"}, "IMAGE='Registry/Trainer': not an image reference (REGISTRY/NAME:TAG or "),
        ({"pvc": "shared_runs"}, "PVC='shared_runs': not a DNS-1123 label of at most 63 characters"),
        ({"pvc": ""}, "PVC is empty: give the ReadWriteMany PersistentVolumeClaim that holds the run dirs"),
        ({"name": "a" * 56}, f"JOB_NAME='{'a' * 56}': not a DNS-1123 label of at most 54 characters"),
        ({"kind": "pytorchjob"}, "KIND='pytorchjob': give trainjob (Kubeflow Trainer v2), jobset (a plain JobSet) or "),
        ({"run_dir": "/data/x"}, "RUN_DIR=/data/x: the run dir must be a folder under /runs/, where every pod"),
        ({"run_dir": "/runs/../etc"}, "RUN_DIR=/runs/../etc: the run dir must be a folder under /runs/"),
        ({"run_dir": "s3://ab/x"}, "RUN_DIR: s3://ab/x does not name a bucket (s3://BUCKET/PREFIX, a bucket of 3 "),
        ({"run_dir": "s3://bucket"}, "RUN_DIR: s3://bucket needs a prefix of plain names under the bucket "),
        ({"run_dir": "/runs/x", "s3_secret": "creds"}, "S3_SECRET=creds: the run dir /runs/x is no s3:// run dir; "),
        ({"run_dir": "/runs/x", "s3_endpoint": "http://minio:9000"}, "AWS_ENDPOINT_URL=http://minio:9000: the run "),
        (
            {"run_dir": "s3://bucket/runs/x", "s3_secret": "S3_creds"},
            "S3_SECRET='S3_creds': not a DNS-1123 subdomain of at most 253 characters (lower-case letters, digits,",
        ),
        (
            {"run_dir": "s3://bucket/runs/x", "s3_endpoint": "minio:9000"},
            "AWS_ENDPOINT_URL='minio:9000': not an http:// or https:// URL; give the object store's, e.g. ",
        ),
        ({"grace_seconds": "10"}, "GRACE='10': expected a whole number >= 21"),
        ({"queue": "Team A"}, "QUEUE='Team A': not a DNS-1123 label"),
        ({"gang": "slurm"}, "GANG='slurm': give kueue or volcano"),
        ({"out": "/no/such/folder/job.yaml"}, "OUT=/no/such/folder/job.yaml: no folder /no/such/folder to write it in"),
        (
            {"gpus_per_node": "1", "gpu_mem_gb": "eighty"},
            "GPU_MEM_GB='eighty': give the memory of one GPU in GB, e.g. 80",
        ),
        ({"gpus_per_node": "1", "gpu_mem_gb": "0.001"}, "memory: one GPU needs about "),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, capsys, options, line):
    assert k8s.main(_argv(tmp_path, **options)) == outcomes.BAD_INPUT.code
    err = capsys.readouterr().err
    assert err.startswith(f"submit-k8s: error: {line}") and err.count("\n") == 1, err
    assert not (tmp_path / "job.yaml").exists()


def test_a_config_the_preflight_refuses_is_its_one_line_and_nothing_is_written(tmp_path, capsys):
    assert k8s.main([*_argv(tmp_path), "train.global_batch_size=7"]) == outcomes.BAD_INPUT.code
    err = capsys.readouterr().err
    assert err.startswith("submit-k8s: error: override 'train.global_batch_size=7': ") and err.count("\n") == 1, err
    assert not (tmp_path / "job.yaml").exists()


def test_an_s3_run_dir_needs_no_claim_and_its_pods_get_a_staging_folder_and_the_secrets_credentials(
    tmp_path, capsys, monkeypatch
):
    """RUN_DIR=s3://... without PVC: the pods mount no run volume; TRAINER_S3_STAGING on an emptyDir, the
    Secret's AWS variables and AWS_ENDPOINT_URL as given. The plan asks the bucket for the last save's time
    and, where nothing answers (here: an endpoint on a closed port), estimates it. (Once: each kind's
    layout is the golden files'; a refused connection costs s3fs's retries, a second or more.)"""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries of a refused connection: seconds
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    url, secret, endpoint = "s3://ml-runs/team-a/tiny", "s3-credentials", "http://minio.storage:9000"
    argv = _argv(tmp_path, kind=k8s.KIND_JOBSET, pvc="", run_dir=url, s3_secret=secret, s3_endpoint=endpoint)
    assert k8s.main(argv) == 0, capsys.readouterr().err
    (doc,) = yaml.safe_load_all((tmp_path / "job.yaml").read_text())
    assert problems(doc) == []
    env, mounts, volumes = _pod_parts(doc)
    assert [v["name"] for v in volumes] == ["dshm", "s3-staging"] and "runs" not in [m["name"] for m in mounts]
    assert env["TRAINER_S3_STAGING"] == {"value": "/s3-staging/trainer"}
    assert env["AWS_ENDPOINT_URL"] == {"value": endpoint}
    assert env["AWS_SECRET_ACCESS_KEY"] == {
        "valueFrom": {"secretKeyRef": {"name": secret, "key": "AWS_SECRET_ACCESS_KEY"}}
    }
    _, args = _pod_env(doc, 1)
    assert args[args.index("--config") :] == ["--config", "/app/configs/default.yaml", f"run_dir={url}", *TINY]
    err = capsys.readouterr().err
    assert "submit-k8s: terminationGracePeriodSeconds: 120 (one save + 60 s for the step in progress" in err
    assert "one save: about 0.0 s (estimated: " in err


@pytest.mark.parametrize("kind", [k8s.KIND_TRAINJOB, k8s.KIND_JOBSET])
def test_an_s3_run_dir_without_a_secret_sets_no_aws_variable_the_service_account_gives_them(kind):
    """No S3_SECRET: the credentials are the pods' service account's (IRSA, pod identity)."""
    (doc,) = yaml.safe_load_all(k8s.render(_job(kind=kind, **{**S3, "s3_secret": None})))
    assert problems(doc) == []
    env, _, _ = _pod_parts(doc)
    assert [name for name in env if name.startswith("AWS_")] == []
    assert env["TRAINER_S3_STAGING"] == {"value": "/s3-staging/trainer"}
    assert "credentials from the pods' service account" in k8s.render(_job(kind=kind, **{**S3, "s3_secret": None}))


MY_CONFIG = "# mine: a small model\nmodel:\n  seq_len: 32\ntrain:\n  global_batch_size: 12\n  steps: 6\n"


@pytest.mark.parametrize("kind", [k8s.KIND_TRAINJOB, k8s.KIND_JOBSET])
def test_a_config_of_your_own_goes_to_the_pods_as_a_configmap_of_the_file_the_preflight_checked(tmp_path, capsys, kind):
    mine = tmp_path / "mine.yaml"
    mine.write_text(MY_CONFIG)
    assert k8s.main(_argv(tmp_path, "train.steps=8", config=str(mine), kind=kind)) == 0
    config_map, job = yaml.safe_load_all((tmp_path / "job.yaml").read_text())
    assert problems(config_map) == [] and problems(job) == []
    assert config_map["metadata"]["name"] == "tiny-config" and config_map["data"] == {"config.yaml": MY_CONFIG}
    assert _mounted_config(job) == ("tiny-config", "/etc/fsdp-trainer")
    _, args = _pod_env(job, 1)
    assert args[args.index("--config") :][:3] == ["--config", "/etc/fsdp-trainer/config.yaml", "run_dir=/runs/tiny"]
    err = capsys.readouterr().err.splitlines()
    assert (
        f"submit-k8s: config: {mine} as ConfigMap tiny-config, /etc/fsdp-trainer/config.yaml in the pods (mounted "
        "read-only)"
    ) in err
    assert err[-1] == f"submit-k8s: wrote {tmp_path / 'job.yaml'}"


@pytest.mark.parametrize(
    "text",
    [
        "model:\n  dim: 64\n",
        "model:   \n\tdim: 64",  # trailing blanks, a tab, no final line break: quoted, not a block
        "model:\r\n  dim: 64\r\n# größer, 更大\r\n",
        "\n\nmodel: {dim: 64}\n\n\n",
    ],
)
def test_the_configmap_holds_the_file_exactly_as_written(text):
    config_map, _ = yaml.safe_load_all(k8s.render(_job(**{**MINE, "config_text": text})))
    assert config_map["data"] == {k8s.CONFIG_KEY: text}


def test_a_config_of_your_own_changed_after_it_was_read_is_refused(tmp_path):
    """What parse_job read for the ConfigMap is no longer the file the preflight checks: refused, one line."""
    mine = tmp_path / "mine.yaml"
    mine.write_text(MY_CONFIG)
    job = _job(**CPU, **MINE, overrides=TINY)
    job.config_text = MY_CONFIG.replace("6", "7")
    with pytest.raises(k8s.K8sError) as e:
        k8s.check(job, mine)
    assert str(e.value) == f"CONFIG={mine}: the file changed while it was checked; run make submit-k8s again"


@pytest.mark.parametrize(
    "text, line",
    [
        ("model:\n  sise: 7\n", "{mine}: unknown key 'model.sise'"),
        (b"model:\n  dim: 6\xff4\n", "{mine}:2: not UTF-8 text (byte 0xff at offset 15); save the file as UTF-8"),
    ],
)
def test_a_config_of_your_own_the_preflight_refuses_is_its_one_line_and_nothing_is_written(
    tmp_path, capsys, text, line
):
    mine = tmp_path / "mine.yaml"
    mine.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert k8s.main(_argv(tmp_path, config=str(mine))) == outcomes.BAD_INPUT.code
    err = capsys.readouterr().err
    assert err.startswith(f"submit-k8s: error: {line.format(mine=mine)}") and err.count("\n") == 1, err
    assert not (tmp_path / "job.yaml").exists()


def _kubectl(folder: Path, code: int = 0) -> str:
    """A kubectl on PATH that records its arguments and standard input (this machine has no cluster)."""
    folder.mkdir()
    script = folder / "kubectl"
    said = 'echo "error: connection refused" >&2' if code else 'echo "jobset.jobset.x-k8s.io/tiny created"'
    script.write_text(f'#!/bin/sh\necho "$@" > "{folder}/args"\ncat > "{folder}/stdin"\n{said}\nexit {code}\n')
    script.chmod(0o755)
    return f"{folder}:{os.environ['PATH']}"


def test_apply_hands_kubectl_the_bytes_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", _kubectl(tmp_path / "bin"))
    assert k8s.main(_argv(tmp_path, "--apply", kind="jobset")) == 0
    assert (tmp_path / "bin" / "args").read_text() == "apply -f -\n"
    assert (tmp_path / "bin" / "stdin").read_text() == (tmp_path / "job.yaml").read_text()
    assert capsys.readouterr().out == "jobset.jobset.x-k8s.io/tiny created\n"


def test_apply_without_kubectl_or_a_cluster_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert k8s.main(_argv(tmp_path, "--apply")) == outcomes.BAD_INPUT.code
    assert capsys.readouterr().err == (
        "submit-k8s: error: APPLY=1 but kubectl is not on PATH: install it, or leave APPLY out and apply OUT= by hand\n"
    )
    assert not (tmp_path / "job.yaml").exists()
    monkeypatch.setenv("PATH", _kubectl(tmp_path / "bin", code=1))
    assert k8s.main(_argv(tmp_path, "--apply")) == outcomes.FAILED.code
    assert capsys.readouterr().err.endswith("submit-k8s: error: kubectl apply failed: error: connection refused\n")


def test_make_submit_k8s_refuses_bad_input_as_typed(tmp_path):
    out = subprocess.run(
        ["make", "-s", "submit-k8s", "NODES=0", "PVC=runs", f"OUT={tmp_path / 'job.yaml'}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    # make's own line: "make[1]: ***" where this runs under make (make test-fast), "make: ***" alone
    assert (out.returncode, out.stdout) == (2, "") and re.search(
        r"^make(\[\d+\])?: \*\*\* \[Makefile", out.stderr, re.M
    )
    assert out.stderr.splitlines()[0] == "submit-k8s: error: NODES='0': expected a whole number >= 1"
    assert not (tmp_path / "job.yaml").exists()


def test_make_submit_k8s_takes_aws_endpoint_url_from_its_command_line_not_from_the_environment(tmp_path):
    """AWS_ENDPOINT_URL= on make's command line reaches the pods (here: refused for a run dir on the claim);
    the one in this shell's environment (for make run's own bucket) is not handed on."""
    given = ["make", "-s", "submit-k8s", "PVC=runs", "RUN_DIR=/runs/x", "GRACE=10", f"OUT={tmp_path / 'job.yaml'}"]
    env = {**os.environ, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    said = [
        subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env).stderr.splitlines()[0]
        for argv in (given, [*given, "AWS_ENDPOINT_URL=http://minio:9000", "S3_SECRET="])
    ]
    assert said == [
        "submit-k8s: error: GRACE='10': expected a whole number >= 21",
        "submit-k8s: error: AWS_ENDPOINT_URL=http://minio:9000: the run dir /runs/x is no s3:// run dir; give "
        "RUN_DIR=s3://BUCKET/PREFIX or leave AWS_ENDPOINT_URL out",
    ]
    assert not (tmp_path / "job.yaml").exists()
