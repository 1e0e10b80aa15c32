"""Placement: which Ray resources training workers and engines ask for, and what a local Ray
must advertise so the same requests fit one machine."""

from __future__ import annotations

from typing import Any

import pytest

from kuberl_api import parse
from kuberl_api.runtime import RESOURCE_CRITIC, RESOURCE_ROLLOUT, RESOURCE_TRAIN
from kuberl_operator.render import render_children
from kuberl_trainer.placement import cpu_threads, layout, local_resources, weight_sync_port

CPU_ROLLOUT = {"engine": "reference", "gpus": 0}  # sglang needs GPUs


def job(**spec: Any) -> Any:
    body = {"model": {"path": "/m"}, "data": {"prompts": "/d.jsonl"}} | spec
    return parse({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
                  "metadata": {"name": "p"}, "spec": body})


def test_colocated_gpu_job() -> None:
    lay = layout(job(training={"nodes": 2, "gpusPerNode": 8}, rollout={"gpusPerEngine": 2}).spec)
    assert lay.train_workers == 16 and lay.train_actor.num_gpus == 1
    assert lay.engines == 8 and lay.gpus_per_engine == 2
    assert lay.engine_actor.num_gpus == 0  # shares the trainers' GPUs
    assert lay.engine_actor.resources == {RESOURCE_ROLLOUT: 2}


def test_disaggregated_gpu_job() -> None:
    spec = job(placement="disaggregated", training={"gpusPerNode": 8},
               rollout={"gpus": 8, "gpusPerEngine": 4}).spec
    lay = layout(spec)
    assert lay.engines == 2 and lay.engine_actor.num_gpus == 4
    assert lay.train_actor.resources == {RESOURCE_TRAIN: 1}


def test_an_engine_wider_than_a_node_is_one_actor_per_node() -> None:
    """SGLang's --nnodes: a 16-GPU engine on 8-GPU rollout nodes is two actors of 8 GPUs."""
    spec = job(placement="disaggregated", training={"gpusPerNode": 8},
               rollout={"gpus": 32, "gpusPerEngine": 16}).spec
    lay = layout(spec)
    assert (lay.engines, lay.engine_nodes, lay.gpus_per_engine) == (2, 2, 16)
    assert lay.engine_actor.num_gpus == 8
    assert lay.engine_actor.resources == {RESOURCE_ROLLOUT: 8}
    cpu = job(placement="disaggregated", training={"gpusPerNode": 0, "backend": "fsdp"},
              rollout={"engine": "reference", "gpus": 0, "engines": 2, "gpusPerEngine": 4,
                       "gpusPerNode": 2}).spec
    lay = layout(cpu)
    assert (lay.engines, lay.engine_nodes) == (2, 2) and lay.engine_actor.num_gpus == 0
    assert local_resources(cpu)[RESOURCE_ROLLOUT] == 4  # one unit per part


def test_cpu_job_fits_a_two_core_box() -> None:
    spec = job(placement="disaggregated", training={"gpusPerNode": 0, "backend": "fsdp"},
               rollout={"engine": "reference", "gpus": 0, "engines": 2}).spec
    lay = layout(spec)
    assert not lay.on_gpu and lay.train_workers == 1 and lay.engines == 2
    assert lay.train_actor.num_cpus + 2 * lay.engine_actor.num_cpus <= 2
    assert local_resources(spec) == {RESOURCE_TRAIN: 1, RESOURCE_ROLLOUT: 2}


@pytest.mark.parametrize("spec", [
    {"training": {"nodes": 2, "gpusPerNode": 8}, "rollout": {"gpusPerEngine": 2}},
    {"placement": "disaggregated", "training": {"gpusPerNode": 8},
     "rollout": {"gpus": 16, "gpusPerEngine": 4}},
    {"placement": "disaggregated", "training": {"gpusPerNode": 0, "backend": "fsdp"},
     "rollout": {"engine": "reference", "gpus": 0, "engines": 3}},
    {"placement": "disaggregated", "training": {"gpusPerNode": 8},  # engines over 2 nodes
     "rollout": {"gpus": 32, "gpusPerEngine": 16}},
    {"placement": "disaggregated", "training": {"gpusPerNode": 0, "backend": "fsdp"},
     "rollout": {"engine": "reference", "gpus": 0, "engines": 2, "gpusPerEngine": 4,
                 "gpusPerNode": 2}},
    {"training": {"nodes": 2, "gpusPerNode": 8}, "algorithm": {"advantageEstimator": "ppo"}},
    {"placement": "disaggregated", "training": {"gpusPerNode": 8},
     "rollout": {"gpus": 8, "gpusPerEngine": 4}, "algorithm": {"advantageEstimator": "ppo"},
     "critic": {"placement": "dedicated", "nodes": 2, "gpusPerNode": 4}},
    {"training": {"gpusPerNode": 0, "backend": "fsdp"},
     "rollout": {"engine": "reference", "gpus": 0}, "algorithm": {"advantageEstimator": "ppo"},
     "critic": {"placement": "dedicated", "gpusPerNode": 0}},
])
def test_rendered_pods_hold_every_actor(spec: dict[str, Any]) -> None:
    """The operator's pods advertise at least the units the trainer's actors ask for."""
    rlj = job(**spec)
    lay = layout(rlj.spec)
    rayjob = render_children(rlj)[-1]
    offered = {RESOURCE_TRAIN: 0, RESOURCE_ROLLOUT: 0, RESOURCE_CRITIC: 0}
    per_pod: dict[str, int] = {}
    for group in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        for key, units in group.get("resources", {}).items():
            offered[key] += int(units) * group["replicas"]
            per_pod[key] = max(per_pod.get(key, 0), int(units))
    assert offered[RESOURCE_TRAIN] >= lay.train_workers * lay.train_actor.resources[
        RESOURCE_TRAIN]
    # every part of every engine (one actor per node it spans), each within one pod
    engine_units = lay.engine_actor.resources[RESOURCE_ROLLOUT]
    assert offered[RESOURCE_ROLLOUT] >= lay.engines * lay.engine_nodes * engine_units
    assert per_pod[RESOURCE_ROLLOUT] >= engine_units
    critic = lay.critic_actor.resources[RESOURCE_CRITIC] if lay.critic_actor else 0
    assert offered[RESOURCE_CRITIC] >= lay.critic_workers * critic


def test_shared_critic_halves_each_training_gpu_in_one_bundle() -> None:
    spec = job(training={"nodes": 2, "gpusPerNode": 8},
               algorithm={"advantageEstimator": "ppo"}).spec
    lay = layout(spec)
    assert lay.critic_shared and lay.critic_workers == lay.train_workers == 16
    assert lay.critic_actor is not None
    assert lay.train_actor.num_gpus == lay.critic_actor.num_gpus == 0.5
    # one bundle per rank holds both: Ray hands the pair the same GPU
    assert lay.train_bundle() == {"CPU": 2, "GPU": 1.0, RESOURCE_TRAIN: 1, RESOURCE_CRITIC: 1}


def test_dedicated_critic_has_gpus_of_its_own() -> None:
    spec = job(training={"gpusPerNode": 8}, algorithm={"advantageEstimator": "ppo"},
               critic={"placement": "dedicated", "nodes": 2, "gpusPerNode": 4}).spec
    lay = layout(spec)
    assert not lay.critic_shared and lay.critic_workers == 8
    assert lay.critic_actor is not None and lay.critic_actor.num_gpus == 1
    assert lay.train_actor.num_gpus == 1
    assert lay.train_bundle() == lay.train_actor.bundle()


def test_local_run_advertises_the_critic() -> None:
    spec = job(training={"gpusPerNode": 0, "backend": "fsdp"}, rollout=CPU_ROLLOUT,
               algorithm={"advantageEstimator": "ppo"}).spec
    assert local_resources(spec) == {RESOURCE_TRAIN: 1, RESOURCE_ROLLOUT: 1, RESOURCE_CRITIC: 1}
    plain = job(training={"gpusPerNode": 0, "backend": "fsdp"}, rollout=CPU_ROLLOUT).spec
    assert RESOURCE_CRITIC not in local_resources(plain)


def test_cpu_actors_split_the_cores_among_their_role() -> None:
    # sync loop: engines and trainers take turns, so each role gets every core
    assert cpu_threads(cores=2, actors_sharing=1) == 2
    assert cpu_threads(cores=16, actors_sharing=4) == 4
    assert cpu_threads(cores=2, actors_sharing=2) == 1
    assert cpu_threads(cores=2, actors_sharing=3) == 1  # never zero threads


def test_async_local_actors_split_the_cores_between_both_roles() -> None:
    """Engines generate while trainers train: on one machine they split its cores between
    them (in sync mode each role gets them all in turn); a cluster's pods have their own."""
    from kuberl_trainer.placement import cpu_sharing

    cpu = {"training": {"gpusPerNode": 0, "backend": "fsdp"}, "placement": "disaggregated",
           "rollout": CPU_ROLLOUT | {"engines": 2}}
    sync, async_ = job(**cpu).spec, job(**cpu, mode="async").spec
    assert cpu_sharing(sync, layout(sync), 2, one_machine=True) == 2  # the role's own
    assert cpu_sharing(async_, layout(async_), 2, one_machine=True) == 1 + 2  # trainer + 2
    assert cpu_sharing(async_, layout(async_), 2, one_machine=False) == 1


def test_colocated_engines_take_their_slice_of_each_node() -> None:
    from kuberl_trainer.placement import colocated_engine_devices

    # 8-GPU nodes, 2 GPUs an engine: 4 engines a node, engine 5 is the 2nd on the 2nd node
    assert [colocated_engine_devices(i, 2, 8) for i in range(5)] == [
        [0, 1], [2, 3], [4, 5], [6, 7], [0, 1]]
    assert colocated_engine_devices(5, 2, 8) == [2, 3]
    assert colocated_engine_devices(0, 1, 1) == [0]
    with pytest.raises(ValueError, match="gpusPerEngine 3"):
        colocated_engine_devices(0, 3, 8)


def test_weight_sync_listens_on_the_declared_port_in_a_cluster() -> None:
    """The train pods declare network.weightSyncPort (rendered as a containerPort): in a
    cluster the rendezvous listens there; on one machine on a free port (0)."""
    spec = job(placement="disaggregated", rollout={"gpus": 8},
               network={"weightSyncPort": 31000}).spec
    assert weight_sync_port(spec, one_machine=False) == 31000
    assert weight_sync_port(spec, one_machine=True) == 0
    ports = [p["containerPort"] for group in render_children(job(
        placement="disaggregated", rollout={"gpus": 8}, network={"weightSyncPort": 31000}
    ))[-1]["spec"]["rayClusterSpec"]["workerGroupSpecs"] if group["groupName"] == "train"
        for c in group["template"]["spec"]["containers"] for p in c.get("ports", [])]
    assert ports == [31000]
