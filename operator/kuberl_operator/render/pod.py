"""Pod templates of the Ray head and worker groups (the Ray container is always the first one,
which is where KubeRay injects `ray start`)."""

from __future__ import annotations

from typing import Any

from kuberl_api import runtime
from kuberl_api.rljob import RLJob
from kuberl_api.spec import NodePool, Storage
from kuberl_operator.render import names, nccl
from kuberl_operator.render.code import code_volume, with_code_path
from kuberl_operator.render.layout import WorkerGroup

GPU_RESOURCE = "nvidia.com/gpu"
HEAD_CONTAINER = "ray-head"
WORKER_CONTAINER = "ray-worker"

# The head runs the driver (training loop, rollout manager, reward functions), the GCS and the
# dashboard, but no model: a few cores and enough memory for batches of token ids and rewards.
# requests == limits (Guaranteed QoS) because losing the head loses the job.
HEAD_CPU = "4"
HEAD_MEMORY = "16Gi"

VOLUME_CONFIG = "config"
VOLUME_MODEL = "model"
VOLUME_DATA = "data"
VOLUME_REWARD_MODEL = "reward-model"
VOLUME_CHECKPOINTS = "checkpoints"

# The kuberl images run as this (non-root) user and group. A PVC's root directory usually belongs
# to root, so pods that write to a claim (checkpoints) get it as fsGroup: the kubelet then makes
# the volume group-writable for it. OnRootMismatch skips the recursive chown when the root
# already matches, which would otherwise take minutes on a claim full of checkpoints.
IMAGE_GID = 1000

# Never restart a Ray container in place: a restarted head comes back with an empty GCS and the
# RayJob can then sit in Running forever (KubeRay #3903 and friends), a restarted worker can't
# rejoin the NCCL groups. With Never a dead container fails its pod, which KubeRay and the
# operator see and act on (the operator restarts the whole job from its checkpoint).
RESTART_POLICY = "Never"


def identity_env(job: RLJob, attempt: int) -> list[dict[str, Any]]:
    """Who am I: the trainer patches this RLJob's status and tags metrics with the attempt.
    The namespace comes from the downward API, so it is the pod's truth, not a copy."""
    return [
        {"name": names.ENV_JOB_NAME, "value": job.name},
        {"name": names.ENV_JOB_NAMESPACE,
         "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": names.ENV_ATTEMPT, "value": str(attempt)},
    ]


def engine_key_env(job: RLJob, attempt: int) -> dict[str, Any]:
    """The engines' API key, from the attempt's Secret: every Ray pod may run engines (colocated
    on train pods) or call them (the head's loop, the train ranks' weight sync)."""
    return {"name": names.ENV_ENGINE_API_KEY, "valueFrom": {"secretKeyRef": {
        "name": names.engine_key_secret(job.name, attempt),
        "key": names.ENGINE_API_KEY_SECRET_KEY}}}


def quantities(cpu: str | None, memory: str | None, extra: dict[str, str]) -> dict[str, Any]:
    """requests == limits: Guaranteed QoS, and Ray sizes itself from the limits KubeRay reads."""
    values: dict[str, str] = {}
    if cpu:
        values["cpu"] = cpu
    if memory:
        values["memory"] = memory
    values.update(extra)
    return {"requests": dict(values), "limits": dict(values)} if values else {}


def pvc_volume(name: str, claim: str, read_only: bool = False) -> dict[str, Any]:
    source: dict[str, Any] = {"claimName": claim}
    if read_only:
        source["readOnly"] = True
    return {"name": name, "persistentVolumeClaim": source}


def storage_mount(name: str, storage: Storage) -> dict[str, Any]:
    mount: dict[str, Any] = {"name": name, "mountPath": storage.mount_path}
    if storage.sub_path:
        mount["subPath"] = storage.sub_path
    if storage.read_only:
        mount["readOnly"] = True
    return mount


class Volumes:
    """Volumes and the Ray container's mounts, built together so they can't disagree."""

    def __init__(self, memory: str | None) -> None:
        self.volumes: list[dict[str, Any]] = [nccl.shm_volume(memory)]
        self.mounts: list[dict[str, Any]] = [nccl.shm_mount()]
        self.writes_to_a_claim = False

    def add(self, volume: dict[str, Any], mount: dict[str, Any]) -> None:
        self.volumes.append(volume)
        self.mounts.append(mount)

    def config(self, job: RLJob) -> None:
        self.add({"name": VOLUME_CONFIG, "configMap": {"name": names.configmap(job.name)}},
                 {"name": VOLUME_CONFIG, "mountPath": names.CONFIG_DIR, "readOnly": True})

    def storage(self, name: str, storage: Storage | None) -> None:
        """A PVC at its mountPath, once: two sections naming the same storage (a reward model
        on the policy's PVC) share one volume, as the spec's rules allow only then."""
        if storage is None or any(m["mountPath"] == storage.mount_path for m in self.mounts):
            return
        self.writes_to_a_claim |= not storage.read_only
        self.add(pvc_volume(name, storage.pvc, storage.read_only), storage_mount(name, storage))

    def models(self, job: RLJob) -> None:
        """The PVCs of the models every Ray pod may load: the policy's (engines, ranks, the
        head's tokenizer) and a served reward model's (its engines, the head's tokenizer)."""
        self.storage(VOLUME_MODEL, job.spec.model.storage)
        reward = job.spec.reward.model
        if job.spec.reward.type == "model" and reward is not None:
            self.storage(VOLUME_REWARD_MODEL, reward.storage)

    def code(self, job: RLJob) -> None:
        """spec.code's modules, read-only at CODE_DIR (render/code.py)."""
        found = code_volume(job.spec.code)
        if found is not None:
            self.add(*found)

    def checkpoints(self, job: RLJob) -> None:
        """A PVC when given; otherwise an emptyDir, so the path exists but a restart (a new
        RayJob, new pods) starts from scratch, as CheckpointSpec documents."""
        ckpt = job.spec.checkpoint
        self.writes_to_a_claim |= ckpt.pvc is not None
        volume = (pvc_volume(VOLUME_CHECKPOINTS, ckpt.pvc) if ckpt.pvc
                  else {"name": VOLUME_CHECKPOINTS, "emptyDir": {}})
        self.add(volume, {"name": VOLUME_CHECKPOINTS, "mountPath": ckpt.path})

    def adapters(self, job: RLJob) -> None:
        """The checkpoint PVC, read-only, for engines that load the trainer's LoRA adapters
        from under checkpoint.path (training.lora.sync: adapter; the operator refuses the job
        without a PVC: status/phases.py)."""
        ckpt = job.spec.checkpoint
        if ckpt.pvc is not None:
            self.add(pvc_volume(VOLUME_CHECKPOINTS, ckpt.pvc, read_only=True),
                     {"name": VOLUME_CHECKPOINTS, "mountPath": ckpt.path, "readOnly": True})

    def pod_security(self) -> dict[str, Any]:
        if not self.writes_to_a_claim:
            return {}
        return {"securityContext": {"fsGroup": IMAGE_GID,
                                    "fsGroupChangePolicy": "OnRootMismatch"}}


# KubeRay's own head ports, by its names and default numbers. KubeRay builds the head Service
# from the head container's ports and falls back to these only when the container declares none
# (common/service.go, getServicePorts): declaring just the trainer's metrics port would drop
# them, and a RayJob then never submits ("dashboard port is not found"; the e2e tier caught it).
RAY_HEAD_PORTS = (("gcs-server", 6379), ("dashboard", 8265), ("client", 10001))


def head_ports() -> list[dict[str, Any]]:
    """Ray's ports, then the training loop's /metrics (the chart's PodMonitor scrapes it by
    name). KubeRay adds its `metrics` port (Ray's own) itself."""
    ports = [*RAY_HEAD_PORTS, (runtime.TRAINER_METRICS_PORT_NAME, runtime.TRAINER_METRICS_PORT)]
    return [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports]


def head_template(job: RLJob, attempt: int) -> dict[str, Any]:
    """The head runs the training loop: it reads the config, the prompts (data PVC) and the
    tokenizers (the model PVCs), writes checkpoint metadata, and patches the RLJob status with
    its ServiceAccount. It has no GPUs, so no NCCL wiring."""
    vols = Volumes(HEAD_MEMORY)
    vols.config(job)
    vols.models(job)
    vols.storage(VOLUME_DATA, job.spec.data.storage)
    vols.checkpoints(job)
    vols.code(job)
    env = [*identity_env(job, attempt), engine_key_env(job, attempt)]
    if job.spec.environment.image is not None:  # the loop's environment service
        env.append({"name": runtime.ENV_ENVIRONMENT_URL,
                    "value": names.environment_url(job.name)})
    auth = job.spec.reward.auth
    if auth is not None:  # the reward service's credential: the loop grades on the head
        env.append({"name": runtime.ENV_REWARD_AUTH, "valueFrom": {"secretKeyRef": {
            "name": auth.secret, "key": auth.key}}})
    container = {
        "name": HEAD_CONTAINER,
        "image": job.spec.training.image,
        "env": with_code_path(env, job.spec.code),
        "resources": quantities(HEAD_CPU, HEAD_MEMORY, {}),
        "volumeMounts": vols.mounts,
        "ports": head_ports(),
        "lifecycle": graceful_stop_hook(job, "head"),
    }
    return {
        "metadata": {"labels": names.pod_labels(job.name, names.GROUP_HEAD, attempt)},
        "spec": {
            "serviceAccountName": names.service_account(job.name),
            "restartPolicy": RESTART_POLICY,
            **scheduling_fields(job, holds_state=True),
            **vols.pod_security(),
            "containers": [container],
            "volumes": vols.volumes,
        },
    }


def graceful_stop_hook(job: RLJob, role: str) -> dict[str, Any]:
    """The preStop hook that lets the driver save a checkpoint before Ray is stopped (see
    runtime.GRACEFUL_STOP): it may use the grace period less Ray's own margin."""
    within = (job.spec.scheduling.termination_grace_period_seconds
              - runtime.GRACEFUL_STOP_MARGIN_SECONDS)
    command = [*runtime.GRACEFUL_STOP, role, "--within", str(within)]
    return {"preStop": {"exec": {"command": command}}}


def scheduling_fields(job: RLJob, holds_state: bool) -> dict[str, Any]:
    """Pod priority (Kueue and kube-scheduler order and preempt by it) and, for the pods the
    checkpoint needs (head, train, critic), the grace period it is written in."""
    sched = job.spec.scheduling
    out: dict[str, Any] = {}
    if sched.priority_class_name:
        out["priorityClassName"] = sched.priority_class_name
    if holds_state:
        out["terminationGracePeriodSeconds"] = sched.termination_grace_period_seconds
    return out


def anti_affinity(job: RLJob, group: WorkerGroup) -> dict[str, Any]:
    """One pod per node (required, not preferred: two GPU pods of a group on one node would
    split its GPUs and NICs, and the layout arithmetic assumes whole nodes). On the host network
    the term spans all worker pods of the job, since two Ray pods on one host would fight over
    Ray's fixed ports (a reward model's pods too, which otherwise may share a node)."""
    match = {names.LABEL_JOB: job.name}
    if job.spec.network.host_network:
        match[names.LABEL_COMPONENT] = names.COMPONENT_WORKER
    else:
        match[names.LABEL_GROUP] = group.name
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": match}, "topologyKey": "kubernetes.io/hostname"},
    ]}}


def placement(job: RLJob, group: WorkerGroup) -> dict[str, Any]:
    """Pod-spec fields that put a group on its node pool."""
    pool: NodePool = group.node_pool
    out: dict[str, Any] = {}
    if pool.node_selector:
        out["nodeSelector"] = dict(sorted(pool.node_selector.items()))
    if pool.tolerations:
        out["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True)
                              for t in pool.tolerations]
    # CPU pods (tests, tiny jobs) have no GPUs or NICs to keep to themselves and may share a
    # node, so small clusters can run them; GPU pods each own a node, but for engine-sized
    # ones (a reward model's) off the host network.
    if group.gpus_per_pod and (group.one_per_node or job.spec.network.host_network):
        out["affinity"] = anti_affinity(job, group)
    return out


def worker_container(job: RLJob, group: WorkerGroup, attempt: int,
                     mounts: list[dict[str, Any]]) -> dict[str, Any]:
    network = job.spec.network
    gpu = group.gpus_per_pod > 0
    env = [*identity_env(job, attempt), engine_key_env(job, attempt)]
    if gpu:
        owned = {e["name"] for e in env}
        env += [e for e in nccl.nccl_env(network) if e["name"] not in owned]
    extra = {GPU_RESOURCE: str(group.gpus_per_pod), **nccl.device_resources(network)} if gpu else {}
    container: dict[str, Any] = {
        "name": WORKER_CONTAINER,
        "image": group.image,
        "env": with_code_path(env, job.spec.code),
        "resources": quantities(group.resources.cpu, group.resources.memory, extra),
        "volumeMounts": mounts,
    }
    if gpu and group.weight_sync_listener:
        container["ports"] = [nccl.weight_sync_port(network)]
    if group.mounts_checkpoints:
        container["lifecycle"] = graceful_stop_hook(job, "worker")
    security = nccl.security_context(network) if gpu else None
    if security:
        container["securityContext"] = security
    return container


def worker_template(job: RLJob, group: WorkerGroup, attempt: int) -> dict[str, Any]:
    vols = Volumes(group.resources.memory)
    vols.models(job)
    if group.mounts_checkpoints:
        vols.checkpoints(job)
    elif group.reads_adapters:
        vols.adapters(job)
    vols.code(job)
    spec: dict[str, Any] = {
        # Workers never call the Kubernetes API; don't hand them a token.
        "automountServiceAccountToken": False,
        "restartPolicy": RESTART_POLICY,
    }
    if group.gpus_per_pod:
        spec.update(nccl.host_network_fields(job.spec.network))
    spec.update(placement(job, group))
    spec.update(scheduling_fields(job, holds_state=group.mounts_checkpoints))
    spec.update(vols.pod_security())
    spec["containers"] = [worker_container(job, group, attempt, vols.mounts)]
    spec["volumes"] = vols.volumes
    return {
        "metadata": {"labels": names.pod_labels(job.name, group.name, attempt)},
        "spec": spec,
    }


# KubeRay's default submitter container (common/job.go, GetDefaultSubmitterContainer): its name,
# requests and limits. Stated because a template replaces the default whole.
SUBMITTER_CONTAINER = "ray-job-submitter"
SUBMITTER_RESOURCES = {"limits": {"cpu": "1", "memory": "1Gi"},
                       "requests": {"cpu": "500m", "memory": "200Mi"}}


def submitter_template(job: RLJob) -> dict[str, Any]:
    """The pod of KubeRay's submitter Job (`ray job submit` to the head's dashboard): KubeRay's
    default (the head's image; KubeRay fills in the command and its env), plus the job's labels,
    which the default lacks, so that the job's NetworkPolicy admits it to the head."""
    return {
        "metadata": {"labels": names.submitter_labels(job.name)},
        "spec": {
            # `ray job submit` speaks to the dashboard, never to the Kubernetes API.
            "automountServiceAccountToken": False,
            "restartPolicy": "Never",
            "containers": [{"name": SUBMITTER_CONTAINER, "image": job.spec.training.image,
                            "resources": SUBMITTER_RESOURCES}],
        },
    }
