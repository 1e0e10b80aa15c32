"""Where training workers and engines run: a pure function of the spec, then Ray resources.

The operator gives every train pod `kuberl_train` units (one per GPU, or one on CPU) and every
rollout pod `kuberl_rollout` units (colocated train pods carry both). Actors ask for those units,
so the same code lands actors on the right pods in a cluster and on the right share of one
machine locally (where `local_resources` advertises the same units to a local Ray).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kuberl_api.runtime import RESOURCE_CRITIC, RESOURCE_REWARD, RESOURCE_ROLLOUT, RESOURCE_TRAIN
from kuberl_api.spec import RLJobSpec


@dataclass(frozen=True)
class ActorShape:
    """What one actor asks Ray for."""

    num_cpus: float
    num_gpus: float
    resources: dict[str, float]

    def options(self) -> dict[str, object]:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                "resources": dict(self.resources)}

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle reserving exactly what one such actor asks for."""
        out = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            out["GPU"] = self.num_gpus
        return out


@dataclass(frozen=True)
class Layout:
    placement: str
    train_workers: int
    train_actor: ActorShape
    engines: int
    engine_actor: ActorShape  # one per node an engine spans (its parts)
    gpus_per_engine: int
    # Nodes one engine spans (SGLang's --nnodes): `engine_nodes` actors of `engine_actor`
    # each, node rank 0 serving HTTP; 1 for an engine that fits a node.
    engine_nodes: int = 1
    # PPO's value model: `critic_workers` actors of `critic_actor`; shared ones sit in the same
    # placement-group bundle as the training worker of their rank (see `train_bundle`).
    critic_workers: int = 0
    critic_actor: ActorShape | None = None
    critic_shared: bool = False

    @property
    def on_gpu(self) -> bool:
        return self.train_actor.num_gpus > 0

    def train_bundle(self) -> dict[str, float]:
        """One training rank's bundle: the train actor's, plus its critic's when shared."""
        bundle = self.train_actor.bundle()
        if self.critic_shared and self.critic_actor is not None:
            for key, value in self.critic_actor.bundle().items():
                bundle[key] = bundle.get(key, 0.0) + value
        return bundle


# CPU actors ask for a sliver of CPU so that on a laptop or CI box (2 cores) trainers and
# engines can share the machine; their real limit is the Ray custom resource.
_CPU_SLIVER = 0.1


def layout(spec: RLJobSpec) -> Layout:
    """One training worker per GPU (per node on CPU); `num_engines` engines of
    `gpusPerEngine` GPUs (one CPU engine each when rollout runs on CPU), each one actor per
    node it spans (`spec.engine_nodes`)."""
    t = spec.training
    gpu = t.gpus_per_node > 0
    train = ActorShape(num_cpus=1 if gpu else _CPU_SLIVER, num_gpus=1 if gpu else 0,
                       resources={RESOURCE_TRAIN: 1})
    rollout_gpu = spec.rollout_gpus > 0
    nodes = spec.engine_nodes
    per_engine = spec.rollout.gpus_per_engine if rollout_gpu else 0
    per_part = per_engine // nodes
    # Colocated engines share the trainers' GPUs: they take no GPU from Ray's accounting (the
    # engine process sees the devices through CUDA_VISIBLE_DEVICES set by the launcher) and
    # hand memory back between phases (release/resume_memory_occupation: memory_handoff.py).
    engine_gpus = per_part if (rollout_gpu and spec.placement == "disaggregated") else 0
    engine = ActorShape(num_cpus=1 if rollout_gpu else _CPU_SLIVER, num_gpus=engine_gpus,
                        resources={RESOURCE_ROLLOUT: per_part or 1})
    lay = Layout(placement=spec.placement, train_workers=t.world_size, train_actor=train,
                 engines=spec.num_engines, engine_actor=engine, gpus_per_engine=per_engine,
                 engine_nodes=nodes)
    return _with_critic(spec, lay) if spec.has_critic else lay


def _with_critic(spec: RLJobSpec, lay: Layout) -> Layout:
    """A shared critic splits each training GPU with its training worker (half each, in one
    bundle, so Ray hands both the same device); a dedicated one has GPUs of its own."""
    c = spec.critic
    if c.placement == "shared":
        gpu_share = 0.5 if lay.on_gpu else 0
        train = ActorShape(lay.train_actor.num_cpus, gpu_share, dict(lay.train_actor.resources))
        critic = ActorShape(lay.train_actor.num_cpus, gpu_share, {RESOURCE_CRITIC: 1})
        return dataclasses.replace(lay, train_actor=train, critic_workers=lay.train_workers,
                                   critic_actor=critic, critic_shared=True)
    gpu = c.gpus_per_node > 0
    critic = ActorShape(num_cpus=1 if gpu else _CPU_SLIVER, num_gpus=1 if gpu else 0,
                        resources={RESOURCE_CRITIC: 1})
    return dataclasses.replace(lay, critic_workers=spec.critic_world_size, critic_actor=critic)


def reward_actor(spec: RLJobSpec) -> ActorShape | None:
    """One served reward model engine (reward.model): its GPUs Ray's (never colocated), one
    unit of the reward pods' resource per GPU, or one on CPU. None: no reward model."""
    m = spec.reward.model
    if m is None:
        return None
    gpus = m.gpus_per_replica
    return ActorShape(num_cpus=1 if gpus else _CPU_SLIVER, num_gpus=gpus,
                      resources={RESOURCE_REWARD: gpus or 1})


def reward_sharing(spec: RLJobSpec, lay: Layout, one_machine: bool) -> int:
    """The CPU actors a reward model engine splits a machine's cores with (see cpu_sharing):
    in mode sync it grades while the policy's engines and trainers wait, so only its own
    replicas; in mode async everything runs at once."""
    m = spec.reward.model
    if not one_machine or m is None:
        return 1
    own = m.replicas
    if spec.mode == "async":
        return own + lay.train_workers + lay.engines * lay.engine_nodes
    return own


def cpu_threads(cores: int, actors_sharing: int) -> int:
    """Torch intra-op threads for one CPU actor (training worker or engine).

    The loop is synchronous: engines generate, then trainers train, never both at once, so
    each role may use every core of its machine, split among that role's actors there. Ray
    would otherwise pin a 0.1-CPU actor (and the engine process it starts) to one thread,
    which made the local loop about 1.5x slower on a 2-core box.
    """
    return max(1, cores // max(1, actors_sharing))


def cpu_sharing(spec: RLJobSpec, lay: Layout, own: int, one_machine: bool) -> int:
    """The CPU actors that split a machine's cores with one of a role's `own` actors (see
    cpu_threads). In mode sync the roles take turns, so a role's actors split the cores
    among themselves; in mode async engines generate while trainers train, so they split
    them between both roles (each role taking every core made both 3-5x slower on a 2-core
    box: bench/RESULTS.md). In a cluster every actor has its pod's cores: 1."""
    if not one_machine:
        return 1
    if spec.mode == "async":
        return lay.train_workers + lay.engines * lay.engine_nodes
    return own


def local_resources(spec: RLJobSpec) -> dict[str, float]:
    """Custom resources a local Ray advertises so the cluster's actor requests fit one
    machine: exactly the units the job's actors ask for."""
    lay = layout(spec)
    train_units = lay.train_workers * lay.train_actor.resources[RESOURCE_TRAIN]
    rollout_units = (lay.engines * lay.engine_nodes
                     * lay.engine_actor.resources[RESOURCE_ROLLOUT])
    out = {RESOURCE_TRAIN: train_units, RESOURCE_ROLLOUT: rollout_units}
    if lay.critic_actor is not None:
        out[RESOURCE_CRITIC] = lay.critic_workers * lay.critic_actor.resources[RESOURCE_CRITIC]
    reward = reward_actor(spec)
    if reward is not None and spec.reward.model is not None:
        out[RESOURCE_REWARD] = spec.reward.model.replicas * reward.resources[RESOURCE_REWARD]
    return out


def colocated_engine_devices(index: int, gpus_per_engine: int, gpus_per_node: int) -> list[int]:
    """The GPUs (node-local indices) colocated engine ``index`` runs on.

    A colocated engine's Ray actor takes no GPU from Ray's accounting (the trainers hold
    them), so Ray hides every GPU from it (``CUDA_VISIBLE_DEVICES=""``); its engine process is
    given its slice explicitly instead. Engines are placed node by node in index order (PACK),
    ``gpus_per_node / gpus_per_engine`` to a node, so engine ``index`` takes slice
    ``index mod engines_per_node`` of its node's GPUs.
    """
    if gpus_per_engine < 1 or gpus_per_node % gpus_per_engine:
        raise ValueError(f"gpusPerEngine {gpus_per_engine} must divide the node's "
                         f"{gpus_per_node} GPUs")
    local = index % (gpus_per_node // gpus_per_engine)
    return list(range(local * gpus_per_engine, (local + 1) * gpus_per_engine))


def weight_sync_port(spec: RLJobSpec, one_machine: bool) -> int:
    """The port the trainer-to-engines group's rendezvous listens on: in a cluster the one the
    train pods declare (network.weightSyncPort: what NetworkPolicies and host networking are
    written against); on one machine 0, a free port, so that runs side by side never collide."""
    return 0 if one_machine else spec.network.weight_sync_port
