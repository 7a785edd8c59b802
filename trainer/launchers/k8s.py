"""Training as a Kubernetes job, from the image: a Kubeflow Trainer v2 TrainJob, or a plain JobSet.

    python -m trainer.launchers.k8s --nodes 4 --image REGISTRY/fsdp-trainer:TAG --pvc runs
                                    [--gpus-per-node 8] [--kind trainjob|jobset] [--name N] [--namespace NS]
                                    [--config F] [--run-dir /runs/N | s3://BUCKET/PREFIX] [--s3-secret S]
                                    [--s3-endpoint URL] [--queue Q] [--gang kueue|volcano]
                                    [--runtime torch-distributed] [--grace-seconds S] [--max-restarts R]
                                    [--gpu-mem-gb G] [--out FILE] [--apply] [k=v ...]

`make submit-k8s` calls it (fsdp-submit-k8s where the package is installed). Like `make submit`, it
decides nothing of its own about training: every pod runs `python3 -m trainer.launch` under the
image's entrypoint (tini), which takes its node rank, the node count and the first pod's address from
what the operator set on the pod (trainer/launchers/torchrun.py, apply_rendezvous): Kubeflow Trainer's
PET_* variables for a TrainJob, the Job's completion index and the JobSet's names for a JobSet. What
is checked here, before anything is written, is what can be known without the cluster: the config for
the job's ranks (the one preflight, Target.k8s), the names Kubernetes will take, and the time one
checkpoint save needs, from which the pods' terminationGracePeriodSeconds is computed so that a SIGTERM
(a drained node, a preempted or evicted pod) leaves time to save.

What the rendered job does:

* kind trainjob: a TrainJob (trainer.kubeflow.org/v1alpha1) on a ClusterTrainingRuntime (--runtime,
  torch-distributed by default: Kubeflow Trainer v2.3's); the run dir's volume, /dev/shm and the grace
  period go in as runtimePatches. Restarts of the whole set are the runtime's JobSet failurePolicy.
* kind jobset: a JobSet (jobset.x-k8s.io/v1alpha2) of one Indexed Job of --nodes pods, for clusters
  without the trainer operator; failurePolicy.maxRestarts recreates every pod after a failure, and
  they resume from the newest checkpoint; the exit codes that would fail again (bad input, a lost
  lease: trainer/resilience/outcomes.py) fail the JobSet instead (podFailurePolicy FailJob).
* the run dir on a ReadWriteMany PersistentVolumeClaim (--pvc) mounted at /runs in every pod, or in a
  bucket (--run-dir s3://BUCKET/PREFIX, trainer/rundir/objects.py; no claim needed): then each pod's
  staging copy (TRAINER_S3_STAGING) is on an emptyDir, and its AWS credentials come from a Secret's keys
  (--s3-secret) or, without one, from its service account (IRSA, pod identity);
* the config: a file of the image's configs/ by its path there, or any other file (the user's own) as a
  ConfigMap, the manifest's first document, mounted read-only at /etc/fsdp-trainer in every pod: the
  pods run the very bytes the preflight checked here;
* gang scheduling where asked: Kueue's queue label, or Volcano's queue (and, for a JobSet, a PodGroup
  of --nodes pods).

The manifest goes to --out (written through trainer/rundir/files.py) or standard output; --apply hands
the very bytes to `kubectl apply -f -`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from trainer import cli
from trainer.launchers import torchrun
from trainer.resilience import outcomes, signals
from trainer.rundir import files, objects

REPO_DIR = Path(__file__).resolve().parents[2]  # trainer/launchers/k8s.py: the checkout holding configs/
# The image (Dockerfile): its entrypoint, and where it holds the checkout's configs/.
ENTRYPOINT = ["/usr/bin/tini", "--"]
IMAGE_CONFIGS = "/app/configs"
# A config of the user's own (not in the image): a ConfigMap NAME-config of one key, mounted read-only here.
CONFIG_MOUNT = "/etc/fsdp-trainer"
CONFIG_KEY = "config.yaml"
CONFIG_VOLUME = "config"
CONTAINER = "node"  # the training container's name, and its replicated job's: Kubeflow Trainer's "node"
MOUNT = "/runs"  # where the PersistentVolumeClaim holding the run dirs is mounted in every pod
VOLUME = "runs"
SHM_VOLUME = "dshm"  # /dev/shm in memory: NCCL and the data loaders need more than a container's 64 MB
# An s3:// run dir's staging copies (trainer/rundir/objects.py) on an emptyDir, the pod's own disk: the
# container's root filesystem may be read-only. The trainer's root is a folder it makes inside, because it
# must be its user's own (0700), which the emptyDir (root's, 0777) is not.
STAGING_VOLUME = "s3-staging"
STAGING_MOUNT = "/s3-staging"
STAGING_ROOT = f"{STAGING_MOUNT}/trainer"
# The Secret's keys each pod takes (S3_SECRET=): the first two required, the others where the Secret has them.
SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
SECRET_OPTIONAL_KEYS = ("AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION")
KIND_TRAINJOB, KIND_JOBSET, KIND_RUNTIME = "trainjob", "jobset", "runtime"
RUNTIME_NAME = "fsdp-trainer"  # the ClusterTrainingRuntime KIND=runtime renders, unless JOB_NAME= says otherwise
TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
PODGROUP_API = "scheduling.volcano.sh/v1beta1"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
VOLCANO_QUEUE_ANNOTATION = "scheduling.volcano.sh/queue-name"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
GPU_RESOURCE = "nvidia.com/gpu"
PATCH_MANAGER = "fsdp-trainer"  # the runtimePatches entry this launcher owns
# Seconds of the grace period beyond one save and the launcher's exit margin: the ranks first finish
# the step they are in (the loop acts on a stop at a step boundary), and a save on a busy shared volume
# can take longer than the estimate.
STEP_MARGIN_S = 60
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
ENDPOINT_URL = re.compile(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[!-~]*)?")
IMAGE_REF = re.compile(
    r"[a-z0-9][a-z0-9._-]*(:[0-9]+)?(/[a-z0-9][a-z0-9._-]*)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?"
)


class K8sError(Exception):
    """Bad input, said in one line to the user before anything is written or applied."""


@dataclasses.dataclass
class Job:
    """What the manifest asks of the cluster, checked."""

    kind: str  # KIND_TRAINJOB or KIND_JOBSET
    name: str  # the TrainJob's or JobSet's name: a DNS-1123 label short enough for its pods' host names
    namespace: str | None  # None: kubectl's current namespace
    nodes: int  # pods, one per node
    gpus_per_node: int  # nvidia.com/gpu of each pod; 0: one CPU process per pod
    image: str
    pvc: str | None  # the ReadWriteMany PersistentVolumeClaim holding the run dirs, mounted at MOUNT; None: none
    run_dir: str  # in the pods, under MOUNT, or s3://BUCKET/PREFIX
    config: str  # the config's path in the pods: in the image (IMAGE_CONFIGS/...) or the ConfigMap's
    overrides: list[str]
    queue: str | None  # the Kueue LocalQueue or Volcano queue; None: no gang scheduling asked
    gang: str  # "kueue" or "volcano" (with a queue)
    runtime: str  # the ClusterTrainingRuntime of a TrainJob
    grace_seconds: int  # terminationGracePeriodSeconds, and the launcher's --grace-seconds
    max_restarts: int  # the JobSet's failurePolicy.maxRestarts
    config_text: str | None = None  # a config the image does not hold: the ConfigMap's file; None: the image's
    notes: list[str] = dataclasses.field(default_factory=list)  # said before the manifest: why each value
    s3_secret: str | None = None  # an s3:// run dir's Secret of AWS_* keys; None: the service account's credentials
    s3_endpoint: str | None = None  # AWS_ENDPOINT_URL in the pods (MinIO, Ceph); None: the Secret's, or AWS's

    @property
    def remote(self) -> bool:
        """The run dir is in a bucket (s3://)."""
        return objects.is_remote(self.run_dir)

    @property
    def nproc_per_node(self) -> int:
        return self.gpus_per_node or 1


# ---- the checks ---------------------------------------------------------------------------------


def _number(name: str, text: str, minimum: int) -> int:
    if not re.fullmatch(r"\d+", text or "") or int(text) < minimum:
        raise K8sError(f"{name}={text!r}: expected a whole number >= {minimum}")
    return int(text)


def _label(name: str, text: str, longest: int = 63) -> str:
    if not DNS_LABEL.fullmatch(text) or len(text) > longest:
        raise K8sError(
            f"{name}={text!r}: not a DNS-1123 label of at most {longest} characters (lower-case letters, digits "
            f"and '-', starting and ending with a letter or digit), as Kubernetes names it"
        )
    return text


def longest_name(nodes: int) -> int:
    """The longest job name whose pods' host names (NAME-node-0-INDEX, under the JobSet's headless
    service) stay DNS-1123 labels of 63 characters."""
    return 63 - len(f"-{CONTAINER}-0-{nodes - 1}")


def default_name(config: Path, nodes: int) -> str:
    """train-<the config's name>, as a DNS-1123 label that fits."""
    stem = re.sub(r"[^a-z0-9]+", "-", config.stem.lower()).strip("-") or "run"
    return f"train-{stem}"[: longest_name(nodes)].rstrip("-")


def image_config(config: Path) -> str | None:
    """The config's path in the image, which holds the checkout's configs/ (Dockerfile; an installed
    trainer ships the same files as trainer/configs/: config.SHIPPED_CONFIGS); None for any other file."""
    from trainer.config import SHIPPED_CONFIGS

    for folder in SHIPPED_CONFIGS:
        if config.resolve().is_relative_to(folder.resolve()):
            return f"{IMAGE_CONFIGS}/{config.resolve().relative_to(folder.resolve()).as_posix()}"
    return None


def read_config(config: Path) -> str:
    """The text of a config file of the user's own, for its ConfigMap (K8sError: unreadable). Bytes that
    are not UTF-8 are kept as they are (surrogateescape): the preflight says what is wrong with them.
    At most CONFIG_FILE_BYTES, which is also a ConfigMap's limit (1 MiB)."""
    from trainer.config import CONFIG_FILE_BYTES

    try:
        return files.read_named(config, CONFIG_FILE_BYTES).decode("utf-8", "surrogateescape")
    except files.UnsafeFile as e:
        raise K8sError(f"CONFIG={config}: {e.why}; give a YAML file") from None
    except OSError as e:
        raise K8sError(f"CONFIG={config}: cannot read it ({e.strerror or e}); check its permissions") from None


def pod_run_dir(given: list[str], name: str) -> str:
    """The run dir in the pods: RUN_DIR or ARGS run_dir= (which must agree), else MOUNT/<name>; a folder
    under MOUNT, or s3://BUCKET/PREFIX checked as `make run` checks one (objects.split)."""
    named = {p.rstrip("/") if objects.is_remote(p) else str(Path(p)) for p in given}
    if len(named) > 1:
        raise K8sError(f"RUN_DIR and ARGS run_dir= name different run directories ({', '.join(sorted(named))})")
    run_dir = named.pop() if named else f"{MOUNT}/{name}"
    if re.search(r"[\x00-\x1f\x7f]", run_dir):
        raise K8sError(f"RUN_DIR={run_dir!r}: a control character; choose a folder name without one")
    if objects.is_remote(run_dir):
        try:
            objects.split(run_dir, "RUN_DIR")
        except objects.StoreError as e:
            raise K8sError(str(e)) from None
        return run_dir
    parts = Path(run_dir).parts
    if not run_dir.startswith(f"{MOUNT}/") or ".." in parts or Path(run_dir) == Path(MOUNT):
        raise K8sError(
            f"RUN_DIR={run_dir}: the run dir must be a folder under {MOUNT}/, where every pod mounts the "
            f"PersistentVolumeClaim (PVC=), e.g. {MOUNT}/{name}, or in a bucket, s3://BUCKET/PREFIX"
        )
    return run_dir


def s3_access(run_dir: str, secret: str, endpoint: str) -> tuple[str | None, str | None]:
    """(the Secret, the endpoint) the pods of an s3:// run dir take their credentials and object store
    from, checked (K8sError); both None for a run dir on the claim, which takes neither."""
    if not objects.is_remote(run_dir):
        for name, given in (("S3_SECRET", secret), ("AWS_ENDPOINT_URL", endpoint)):
            if given:
                raise K8sError(
                    f"{name}={given}: the run dir {run_dir} is no s3:// run dir; give RUN_DIR=s3://BUCKET/PREFIX "
                    f"or leave {name} out"
                )
        return None, None
    if secret and not (DNS_SUBDOMAIN.fullmatch(secret) and len(secret) <= 253):
        raise K8sError(
            f"S3_SECRET={secret!r}: not a DNS-1123 subdomain of at most 253 characters (lower-case letters, digits, "
            f"'-' and '.'), as Kubernetes names a Secret"
        )
    if endpoint and not ENDPOINT_URL.fullmatch(endpoint):
        raise K8sError(
            f"AWS_ENDPOINT_URL={endpoint!r}: not an http:// or https:// URL; give the object store's, e.g. "
            f"https://minio.example.com:9000"
        )
    return secret or None, endpoint or None


def parse_job(args: argparse.Namespace) -> tuple[Job, Path]:
    """(the job, the config file on this machine): every input checked; K8sError for the first problem."""
    nodes = _number("NODES", args.nodes, 1)
    gpus = _number("GPUS_PER_NODE", args.gpus_per_node, 0)
    kind = args.kind
    if kind not in (KIND_TRAINJOB, KIND_JOBSET):
        raise K8sError(
            f"KIND={kind!r}: give {KIND_TRAINJOB} (Kubeflow Trainer v2), {KIND_JOBSET} (a plain JobSet) or "
            f"{KIND_RUNTIME} (a ClusterTrainingRuntime for the TrainJobs)"
        )
    if not args.image:
        raise K8sError("IMAGE is empty: give the image every pod runs, as the cluster pulls it (REGISTRY/NAME:TAG)")
    if not IMAGE_REF.fullmatch(args.image):
        raise K8sError(f"IMAGE={args.image!r}: not an image reference (REGISTRY/NAME:TAG or NAME@sha256:DIGEST)")
    pvc = _label("PVC", args.pvc) if args.pvc else None
    namespace = _label("NAMESPACE", args.namespace) if args.namespace else None
    from trainer.config import find_config

    config = Path(find_config(args.config))
    if not config.is_file():
        raise K8sError(f"CONFIG={args.config}: no such file")
    in_image = image_config(config)
    text = None if in_image else read_config(config)
    name = _label("JOB_NAME", args.name, longest_name(nodes)) if args.name else default_name(config, nodes)
    overrides, run_dirs = [], [args.run_dir] if args.run_dir else []
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise K8sError(f"ARGS: {item!r} is not key=value")
        if key == "run_dir":
            run_dirs += [value] if value else []
        else:
            overrides.append(item)
    run_dir = pod_run_dir(run_dirs, name)
    if pvc is None and not objects.is_remote(run_dir):
        raise K8sError(
            "PVC is empty: give the ReadWriteMany PersistentVolumeClaim that holds the run dirs (every pod "
            f"mounts it at {MOUNT}), or a run dir in a bucket, RUN_DIR=s3://BUCKET/PREFIX"
        )
    secret, endpoint = s3_access(run_dir, args.s3_secret, args.s3_endpoint)
    gang = args.gang
    if gang not in ("kueue", "volcano"):
        raise K8sError(f"GANG={gang!r}: give kueue or volcano")
    queue = _label("QUEUE", args.queue) if args.queue else None
    runtime = _label("RUNTIME", args.runtime)
    max_restarts = _number("MAX_RESTARTS", args.max_restarts, 0)
    grace = _number("GRACE", args.grace_seconds, signals.EXIT_MARGIN_S + 1) if args.grace_seconds else 0
    job = Job(
        kind, name, namespace, nodes, gpus, args.image, pvc, run_dir, in_image or f"{CONFIG_MOUNT}/{CONFIG_KEY}",
        overrides, queue, gang, runtime, grace, max_restarts, text, s3_secret=secret, s3_endpoint=endpoint,
    )  # fmt: skip
    return job, config


def grace_for(save_s: float) -> int:
    """terminationGracePeriodSeconds for a save of `save_s` seconds: the step in progress, the save,
    and the launcher's exit margin; never below the trainer's default grace (compose's, Slurm's WARN)."""
    return max(signals.DEFAULT_GRACE_S, math.ceil(save_s) + STEP_MARGIN_S + signals.EXIT_MARGIN_S)


def check(job: Job, config: Path, gpu_mem_gb: str = "") -> None:
    """The one preflight for the job's ranks (Target.k8s), the GPU memory where GPU_MEM_GB says it,
    and the grace period from the save time the planner estimates; K8sError (one line) for a problem.
    Fills job.grace_seconds where it was not given, and job.notes."""
    from trainer.config import ConfigError
    from trainer.preflight import memory
    from trainer.preflight.interval import save_seconds
    from trainer.preflight.startup import Target, preflight

    try:
        ready = preflight(
            Target.k8s(job.nodes, job.nproc_per_node), str(config), [f"run_dir={job.run_dir}", *job.overrides]
        )
        cfg = ready.cfg
        job.notes += [*ready.notes, *(f"warning: {w}" for w in ready.warnings)]
        if gpu_mem_gb and job.gpus_per_node:
            try:
                have = int(float(gpu_mem_gb) * 1e9)
            except ValueError:
                have = 0
            if have <= 0:
                raise K8sError(f"GPU_MEM_GB={gpu_mem_gb!r}: give the memory of one GPU in GB, e.g. 80")
            world = job.nodes * job.nproc_per_node
            need = memory.preflight(
                cfg, world, job.gpus_per_node, have, f"GPU_MEM_GB={gpu_mem_gb}", job.nodes, "NODES={}"
            )
            job.notes.append(f"GPU memory: about {memory.gb(need.total)} per GPU of {memory.gb(have)}")
    except ConfigError as e:
        raise K8sError(str(e)) from None
    estimate, how = save_seconds(cfg, job.nodes, job.run_dir)
    if job.grace_seconds:
        budget = signals.shutdown_budget(job.grace_seconds)
        if budget < estimate:
            raise K8sError(
                f"GRACE={job.grace_seconds} leaves the ranks {budget} s to save after a SIGTERM, but one save takes "
                f"about {estimate:.0f} s ({how}); use GRACE={grace_for(estimate)} or more, or leave it empty"
            )
        why = "GRACE"
    else:
        job.grace_seconds, why = (
            grace_for(estimate),
            (
                f"one save + {STEP_MARGIN_S} s for the step in progress + {signals.EXIT_MARGIN_S} s for the launcher's "
                f"exit, at least {signals.DEFAULT_GRACE_S} s"
            ),
        )
    job.notes.append(
        f"terminationGracePeriodSeconds: {job.grace_seconds} ({why}); one save: about {estimate:.1f} s ({how})"
    )
    if job.config_text is not None:  # the pods get what was checked, or nothing
        if read_config(config) != job.config_text:
            raise K8sError(f"CONFIG={config}: the file changed while it was checked; run make submit-k8s again")
        job.notes.append(
            f"config: {config} as ConfigMap {config_map_name(job)}, {job.config} in the pods (mounted read-only)"
        )


# ---- the manifests ------------------------------------------------------------------------------


def pod_args(job: Job) -> list[str]:
    """What each pod runs under the image's entrypoint. A TrainJob's pods get their node count and
    ranks per node from the runtime (PET_*); a JobSet's from here, their rank from the Job."""
    shape = [] if job.kind == KIND_TRAINJOB else [f"--nnodes={job.nodes}", f"--nproc-per-node={job.nproc_per_node}"]
    return [
        "python3", "-m", "trainer.launch", *shape, f"--grace-seconds={job.grace_seconds}",
        "--config", job.config, f"run_dir={job.run_dir}", *job.overrides,
    ]  # fmt: skip


def fail_job_codes() -> list[int]:
    """The exit codes that would fail again if the set restarted (bad input, a lost lease)."""
    return sorted({o.code for o in outcomes.OUTCOMES if o.code and o.requeue == outcomes.NOT_REQUEUED})


def _metadata(job: Job, labels: dict | None = None, annotations: dict | None = None) -> dict:
    meta: dict = {"name": job.name}
    if job.namespace:
        meta["namespace"] = job.namespace
    meta["labels"] = {"app.kubernetes.io/name": "fsdp-trainer", **(labels or {})}
    if annotations:
        meta["annotations"] = annotations
    return meta


def _volumes(job: Job) -> tuple[list[dict], list[dict]]:
    """(the pod's volumes, the container's mounts): the run dirs' claim (where there is one), /dev/shm,
    the ConfigMap of a config of the user's own, and an s3:// run dir's staging emptyDir."""
    volumes = [{"name": VOLUME, "persistentVolumeClaim": {"claimName": job.pvc}}] if job.pvc else []
    mounts = [{"name": VOLUME, "mountPath": MOUNT}] if job.pvc else []
    volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
    mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    if job.config_text is not None:
        volumes.append({"name": CONFIG_VOLUME, "configMap": {"name": config_map_name(job)}})
        mounts.append({"name": CONFIG_VOLUME, "mountPath": CONFIG_MOUNT, "readOnly": True})
    if job.remote:
        volumes.append({"name": STAGING_VOLUME, "emptyDir": {}})
        mounts.append({"name": STAGING_VOLUME, "mountPath": STAGING_MOUNT})
    return volumes, mounts


def s3_env(job: Job) -> list[dict]:
    """The variables of an s3:// run dir's pods: the staging root, the Secret's keys (a TrainJob's pod
    patch cannot take envFrom, so each key by name, the same for a JobSet), AWS_ENDPOINT_URL as given.
    Nothing for a run dir on the claim."""
    if not job.remote:
        return []
    env = [{"name": objects.STAGING_ENV, "value": STAGING_ROOT}]
    if job.s3_endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": job.s3_endpoint})
    if job.s3_secret:
        optional = [k for k in SECRET_OPTIONAL_KEYS if not (job.s3_endpoint and k == "AWS_ENDPOINT_URL")]
        env += [
            {"name": key, "valueFrom": {"secretKeyRef": {"name": job.s3_secret, "key": key}}} for key in SECRET_KEYS
        ]
        env += [
            {"name": key, "valueFrom": {"secretKeyRef": {"name": job.s3_secret, "key": key, "optional": True}}}
            for key in optional
        ]
    return env


def config_map_name(job: Job) -> str:
    return f"{job.name}-config"


def render_config_map(job: Job) -> list[dict]:
    """The ConfigMap (core v1) of a config of the user's own, one key (CONFIG_KEY); none for the image's."""
    if job.config_text is None:
        return []
    meta = _metadata(job)
    meta["name"] = config_map_name(job)
    return [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {CONFIG_KEY: job.config_text}}]


def _gpus(job: Job) -> dict:
    return {GPU_RESOURCE: job.gpus_per_node} if job.gpus_per_node else {}


def render_trainjob(job: Job) -> list[dict]:
    """A TrainJob on the ClusterTrainingRuntime job.runtime; the pods' volumes and grace period as a
    runtimePatches entry of this launcher's own."""
    volumes, mounts = _volumes(job)
    labels = {KUEUE_QUEUE_LABEL: job.queue} if job.queue and job.gang == "kueue" else {}
    annotations = {VOLCANO_QUEUE_ANNOTATION: job.queue} if job.queue and job.gang == "volcano" else {}
    trainer: dict = {
        "image": job.image,
        "numNodes": job.nodes,
        "numProcPerNode": job.nproc_per_node,
        "command": ENTRYPOINT,
        "args": pod_args(job),
    }
    if job.remote:
        trainer["env"] = s3_env(job)
    if job.gpus_per_node:
        trainer["resourcesPerNode"] = {"limits": _gpus(job), "requests": _gpus(job)}
    pod = {
        "terminationGracePeriodSeconds": job.grace_seconds,
        "volumes": volumes,
        "containers": [{"name": CONTAINER, "volumeMounts": mounts}],
    }
    patch = {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {"replicatedJobs": [{"name": CONTAINER, "template": {"spec": {"template": {"spec": pod}}}}]}
            }
        },
    }
    spec = {
        "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime", "name": job.runtime},
        "trainer": trainer,
        "runtimePatches": [patch],
    }
    return [
        *render_config_map(job),
        {"apiVersion": TRAINJOB_API, "kind": "TrainJob", "metadata": _metadata(job, labels, annotations), "spec": spec},
    ]


def _pod_failure_policy() -> dict:
    """The Job's: a pod that exits with a code of fail_job_codes() fails its Job at once (FailJob)."""
    on_codes = {"containerName": CONTAINER, "operator": "In", "values": fail_job_codes()}
    return {"rules": [{"action": "FailJob", "onExitCodes": on_codes}]}


def _failure_policy(max_restarts: int) -> dict:
    """The JobSet's: a Job failed by _pod_failure_policy fails the set; any other failure recreates every
    pod (RestartJobSet, the default), at most `max_restarts` times."""
    rule = {"name": "notRestartable", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}
    return {"maxRestarts": max_restarts, "rules": [rule]}


def render_jobset(job: Job) -> list[dict]:
    """A JobSet of one Indexed Job of job.nodes pods (the Job's completion index is the node rank), its
    headless service naming pod 0; a failed pod fails its Job (backoffLimit 0), and the JobSet recreates
    them all, up to job.max_restarts times, but fails at once on an exit code of fail_job_codes()."""
    volumes, mounts = _volumes(job)
    env = [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['jobset.sigs.k8s.io/{label}']"}}}
        for name, label in (("JOBSET_NAME", "jobset-name"), ("REPLICATED_JOB_NAME", "replicatedjob-name"))
    ] + s3_env(job)
    container: dict = {
        "name": CONTAINER,
        "image": job.image,
        "command": ENTRYPOINT,
        "args": pod_args(job),
        "env": env,
        "ports": [{"name": "rendezvous", "containerPort": torchrun.JOBSET_RDZV_PORT}],
        "volumeMounts": mounts,
    }
    if job.gpus_per_node:
        container["resources"] = {"limits": _gpus(job), "requests": _gpus(job)}
    pod_spec: dict = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": job.grace_seconds,
        "containers": [container],
        "volumes": volumes,
    }
    pod_meta: dict = {}
    volcano = job.queue and job.gang == "volcano"
    if volcano:
        pod_spec["schedulerName"] = "volcano"
        pod_meta = {"annotations": {VOLCANO_GROUP_ANNOTATION: job.name}}
    pod = {"metadata": pod_meta, "spec": pod_spec} if pod_meta else {"spec": pod_spec}
    job_spec = {
        "completionMode": "Indexed",
        "completions": job.nodes,
        "parallelism": job.nodes,
        "backoffLimit": 0,
        "podFailurePolicy": _pod_failure_policy(),
        "template": pod,
    }
    spec = {
        "failurePolicy": _failure_policy(job.max_restarts),
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "replicatedJobs": [{"name": CONTAINER, "replicas": 1, "template": {"spec": job_spec}}],
    }
    labels = {KUEUE_QUEUE_LABEL: job.queue} if job.queue and job.gang == "kueue" else {}
    docs = [
        *render_config_map(job),
        {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": _metadata(job, labels), "spec": spec},
    ]
    if volcano:  # the gang: Volcano starts the pods once all of them fit
        group: dict = {"minMember": job.nodes, "queue": job.queue}
        if job.gpus_per_node:
            group["minResources"] = {GPU_RESOURCE: job.nodes * job.gpus_per_node}
        docs.append({"apiVersion": PODGROUP_API, "kind": "PodGroup", "metadata": _metadata(job), "spec": group})
    return docs


def render(job: Job) -> str:
    """The manifest: its documents as YAML, after a comment saying how it was made and why each value."""
    docs = render_trainjob(job) if job.kind == KIND_TRAINJOB else render_jobset(job)
    if job.remote:
        credentials = f"Secret {job.s3_secret}'s keys" if job.s3_secret else "the pods' service account"
        where = f"in object storage, credentials from {credentials}"
    else:
        where = f"on PersistentVolumeClaim {job.pvc} (ReadWriteMany)"
    head = [
        f"# {job.kind} {job.name}: {job.nodes} node(s) x {job.nproc_per_node} rank(s), rendered by make submit-k8s",
        f"# (trainer/launchers/k8s.py). Run dir: {job.run_dir} {where}.",
    ]
    body = "---\n".join(
        yaml.dump(d, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000) for d in docs
    )
    return "\n".join(head) + "\n" + body


class _Dumper(yaml.SafeDumper):
    """yaml.safe_dump's, with a text of several lines (a ConfigMap's file) as a literal block, which reads
    as the file itself (YAML quotes it instead where a block could not hold it exactly)."""


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


# ---- command line -------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = cli.parser("submit-k8s", "Render, and apply, a Kubernetes TrainJob or JobSet that trains from the image.")
    p.add_argument("--nodes", default="1", help="pods, one per node")
    p.add_argument("--gpus-per-node", default="8", help="nvidia.com/gpu of each pod; 0: one CPU process per pod")
    p.add_argument(
        "--kind",
        default=KIND_TRAINJOB,
        help=f"{KIND_TRAINJOB} (Kubeflow Trainer v2), {KIND_JOBSET}, or {KIND_RUNTIME}: a ClusterTrainingRuntime "
        f"for the TrainJobs (--name, --image, --max-restarts only)",
    )
    p.add_argument("--image", default="", help="the image every pod runs (make image; pushed where the cluster pulls)")
    p.add_argument("--pvc", default="", help=f"ReadWriteMany PersistentVolumeClaim of the run dirs, mounted at {MOUNT}")
    p.add_argument("--name", default="", help="the job's name (DNS-1123 label); empty: train-<config>")
    p.add_argument("--namespace", default="", help="empty: kubectl's current namespace")
    p.add_argument(
        "--config",
        default="configs/default.yaml",
        help="a config of configs/ (in the image), or your own (a ConfigMap)",
    )
    p.add_argument(
        "--run-dir",
        default="",
        help=f"run dir in the pods, under {MOUNT}/, or s3://BUCKET/PREFIX; empty: {MOUNT}/<name>",
    )
    p.add_argument(
        "--s3-secret",
        default="",
        help="an s3:// run dir's Secret of AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL, "
        "AWS_REGION...); empty: the pods' service account's credentials",
    )
    p.add_argument("--s3-endpoint", default="", help="AWS_ENDPOINT_URL in the pods of an s3:// run dir (MinIO, Ceph)")
    p.add_argument("--queue", default="", help="Kueue LocalQueue or Volcano queue: gang scheduling; empty: none")
    p.add_argument("--gang", default="kueue", help="kueue or volcano: which scheduler --queue names a queue of")
    p.add_argument("--runtime", default="torch-distributed", help="the TrainJob's ClusterTrainingRuntime")
    p.add_argument("--grace-seconds", default="", help="terminationGracePeriodSeconds; empty: from the save time")
    p.add_argument("--max-restarts", default="5", help="restarts of the whole JobSet after a failure")
    p.add_argument("--gpu-mem-gb", default="", help="memory of one GPU in GB: checks the memory estimate")
    p.add_argument("--out", default="", help="write the manifest to this file; empty: standard output")
    p.add_argument("--apply", action="store_true", help="kubectl apply -f the manifest")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, key=value")
    return p


NO_KUBECTL = "APPLY=1 but kubectl is not on PATH: install it, or leave APPLY out and apply OUT= by hand"


def parse_runtime(args: argparse.Namespace) -> tuple[str, str, int]:
    """(name, image, maxRestarts) of KIND=runtime's ClusterTrainingRuntime, checked (K8sError)."""
    if args.namespace:
        raise K8sError(f"NAMESPACE={args.namespace}: a ClusterTrainingRuntime belongs to no namespace; leave it out")
    if not args.image or not IMAGE_REF.fullmatch(args.image):
        raise K8sError(f"IMAGE={args.image!r}: not an image reference (REGISTRY/NAME:TAG or NAME@sha256:DIGEST)")
    name = _label("JOB_NAME", args.name) if args.name else RUNTIME_NAME
    return name, args.image, _number("MAX_RESTARTS", args.max_restarts, 0)


def render_runtime(name: str, image: str, max_restarts: int) -> str:
    """A ClusterTrainingRuntime for this trainer's TrainJobs (RUNTIME=name), applied once by the cluster's
    admins: Kubeflow Trainer's torch runtime (PET_*) with the failure policy render_jobset gives a JobSet,
    which a TrainJob cannot set itself. Its image and command are the defaults each TrainJob replaces."""
    pod = {
        "restartPolicy": "Never",
        "containers": [
            {"name": CONTAINER, "image": image, "command": ENTRYPOINT, "args": ["python3", "-m", "trainer.launch"]}
        ],
    }
    job_spec = {"backoffLimit": 0, "podFailurePolicy": _pod_failure_policy(), "template": {"spec": pod}}
    replicated = {
        "name": CONTAINER,
        "template": {
            "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
            "spec": job_spec,
        },
    }
    doc = {
        "apiVersion": TRAINJOB_API,
        "kind": "ClusterTrainingRuntime",
        "metadata": {
            "name": name,
            "labels": {"trainer.kubeflow.org/framework": "torch", "app.kubernetes.io/name": "fsdp-trainer"},
        },
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {"spec": {"failurePolicy": _failure_policy(max_restarts), "replicatedJobs": [replicated]}},
        },
    }
    head = (
        f"# ClusterTrainingRuntime {name}: whole-set restarts (at most {max_restarts}) that resume from the newest\n"
        f"# checkpoint, for TrainJobs of make submit-k8s RUNTIME={name}; rendered by trainer/launchers/k8s.py.\n"
    )
    return head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=1000)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    notes = []
    try:
        kubectl = shutil.which("kubectl") if args.apply else None
        if args.apply and kubectl is None:
            raise K8sError(NO_KUBECTL)
        if args.out and not Path(args.out).parent.is_dir():
            raise K8sError(f"OUT={args.out}: no folder {Path(args.out).parent} to write it in")
        if args.kind == KIND_RUNTIME:
            text = render_runtime(*parse_runtime(args))
        else:
            job, config = parse_job(args)
            check(job, config, args.gpu_mem_gb)
            text, notes = render(job), job.notes
            if job.kind == KIND_TRAINJOB:
                notes.append(
                    f"restarts of the whole set are ClusterTrainingRuntime {job.runtime}'s (its JobSet failurePolicy); "
                    f"KIND=runtime renders one that restarts it and resumes (RUNTIME={RUNTIME_NAME})"
                )
    except K8sError as e:
        print(f"submit-k8s: error: {e}", file=sys.stderr)
        return outcomes.BAD_INPUT.code
    for line in notes:
        print(f"submit-k8s: {line}", file=sys.stderr)
    if args.out:
        try:
            files.write_text(Path(args.out), text)
        except OSError as e:  # a folder there, no permission: nothing was written (files.write_bytes)
            print(f"submit-k8s: error: OUT={args.out}: {e.strerror or e}", file=sys.stderr)
            return outcomes.BAD_INPUT.code
        print(f"submit-k8s: wrote {args.out}", file=sys.stderr)
    elif not args.apply:
        print(text, end="")
    if args.apply:
        out = subprocess.run([kubectl, "apply", "-f", "-"], input=text, capture_output=True, text=True)
        if out.returncode != 0:
            said = (out.stderr.strip().splitlines() or ["no message"])[-1]
            print(f"submit-k8s: error: kubectl apply failed: {said}", file=sys.stderr)
            return outcomes.FAILED.code
        print(out.stdout, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
