"""How the spec's GPU counts become Ray worker groups: pods, GPUs per pod, Ray custom resources.

Contract with the trainer (kuberl_trainer's placement): a train actor asks for one unit of
`names.RESOURCE_TRAIN` per GPU it uses, an engine for `gpusPerEngine` units of
`names.RESOURCE_ROLLOUT`, a served reward model's engine for `gpusPerReplica` units of
`names.RESOURCE_REWARD`; on CPU every actor asks for one unit. So a pod advertises one unit per
GPU it has (or, on CPU, one per actor it should host), and actors land only on their own group:
the head advertises none of them, so nothing but the driver runs there by accident.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kuberl_api.spec import NodePool, Resources, RLJobSpec
from kuberl_operator.render import names


@dataclass(frozen=True)
class WorkerGroup:
    name: str
    image: str
    replicas: int
    gpus_per_pod: int
    node_pool: NodePool
    resources: Resources
    # Ray custom resources of each pod, in a fixed order (goldens stay stable).
    ray_resources: dict[str, int] = field(default_factory=dict)
    # Trainer rank 0 listens here for the engines joining the weight-update group.
    weight_sync_listener: bool = False
    # Megatron ranks write their checkpoint shards from the train pods.
    mounts_checkpoints: bool = False
    # Engines load each step's LoRA adapter from under checkpoint.path (training.lora.sync:
    # adapter): the checkpoint volume, mounted read-only.
    reads_adapters: bool = False
    # GPU pods of the group each take a node of their own (required anti-affinity): the layout
    # gives them whole nodes, or one pod with all the group's GPUs.
    one_per_node: bool = True


def train_group(spec: RLJobSpec) -> WorkerGroup:
    t = spec.training
    units = t.gpus_per_node or 1
    ray_resources = {names.RESOURCE_TRAIN: units}
    if spec.placement == "colocate":
        # Engines share the training GPUs (memory released/resumed around each phase), so the
        # train pods also carry the rollout resource and there is no rollout group at all.
        per_node = t.gpus_per_node or math.ceil(spec.num_engines / t.nodes)
        ray_resources[names.RESOURCE_ROLLOUT] = per_node
    if spec.has_critic and spec.critic.placement == "shared":
        ray_resources[names.RESOURCE_CRITIC] = units  # a critic beside each train worker
    return WorkerGroup(
        name=names.GROUP_TRAIN, image=t.image, replicas=t.nodes, gpus_per_pod=t.gpus_per_node,
        node_pool=t.node_pool, resources=t.resources, ray_resources=ray_resources,
        weight_sync_listener=spec.placement == "disaggregated", mounts_checkpoints=True,
    )


def rollout_group(spec: RLJobSpec) -> WorkerGroup:
    """Disaggregated engines: whole nodes of `gpusPerNode` GPUs, or one smaller pod when all
    rollout GPUs fit on one node (the model guarantees one of the two, so the division is
    exact); an engine wider than a node takes `engine_nodes` whole pods. On CPU (gpus: 0)
    one pod per engine, or per part of an engine that spans pods."""
    r = spec.rollout
    gpus = spec.rollout_gpus
    if gpus:
        per_pod = min(gpus, r.gpus_per_node)
        replicas, units = math.ceil(gpus / per_pod), per_pod
    else:
        per_pod, replicas, units = 0, spec.num_engines * spec.engine_nodes, 1
    return WorkerGroup(
        name=names.GROUP_ROLLOUT, image=r.image, replicas=replicas, gpus_per_pod=per_pod,
        node_pool=r.node_pool, resources=r.resources,
        ray_resources={names.RESOURCE_ROLLOUT: units}, reads_adapters=spec.adapter_sync,
    )


def critic_group(spec: RLJobSpec) -> WorkerGroup:
    """Dedicated critic pods (PPO's value model): one unit of the critic resource per GPU, or
    one per pod on CPU. Critic rank 0 writes the value model's checkpoint."""
    c = spec.critic
    return WorkerGroup(
        name=names.GROUP_CRITIC, image=c.image, replicas=c.nodes, gpus_per_pod=c.gpus_per_node,
        node_pool=c.node_pool, resources=c.resources,
        ray_resources={names.RESOURCE_CRITIC: c.gpus_per_node or 1}, mounts_checkpoints=True,
    )


def reward_group(spec: RLJobSpec) -> WorkerGroup | None:
    """A served reward model's engines (reward.type model): one pod per replica with its
    `gpusPerReplica` GPUs, advertising as many units of the reward resource (one on CPU), so
    each engine actor takes a pod. The pods are engine-sized, not node-sized (a 1-GPU reward
    model beside others on an 8-GPU node), and hold no state: no checkpoint, no preStop hook."""
    m = spec.reward.model
    if spec.reward.type != "model" or m is None:
        return None
    return WorkerGroup(
        name=names.GROUP_REWARD, image=m.image, replicas=m.replicas,
        gpus_per_pod=m.gpus_per_replica, node_pool=m.node_pool, resources=m.resources,
        ray_resources={names.RESOURCE_REWARD: m.gpus_per_replica or 1}, one_per_node=False,
    )


def worker_groups(spec: RLJobSpec) -> list[WorkerGroup]:
    # mode eval trains nothing: disaggregated, it needs only the engines' pods (colocated
    # engines run on the training pods, which it keeps)
    evaluates_only = spec.mode == "eval" and spec.placement == "disaggregated"
    groups = [] if evaluates_only else [train_group(spec)]
    if spec.placement == "disaggregated":
        groups.append(rollout_group(spec))
    if spec.has_critic and spec.critic.placement == "dedicated":
        groups.append(critic_group(spec))
    # A reward model has pods of its own in every mode and placement: it is never trained
    # (nothing to colocate it with) and grades eval sets as it grades steps.
    reward = reward_group(spec)
    if reward is not None:
        groups.append(reward)
    return groups
