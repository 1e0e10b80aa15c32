"""Placement: which Ray resources training workers and engines ask for, and what a local Ray
must advertise so the same requests fit one machine."""

from __future__ import annotations

from typing import Any

import pytest

from kuberl_api import parse
from kuberl_api.runtime import RESOURCE_ROLLOUT, RESOURCE_TRAIN
from kuberl_operator.render import render_children
from kuberl_trainer.placement import cpu_threads, layout, local_resources


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


def test_cpu_job_fits_a_two_core_box() -> None:
    spec = job(placement="disaggregated", training={"gpusPerNode": 0, "backend": "fsdp"},
               rollout={"gpus": 0, "engines": 2}).spec
    lay = layout(spec)
    assert not lay.on_gpu and lay.train_workers == 1 and lay.engines == 2
    assert lay.train_actor.num_cpus + 2 * lay.engine_actor.num_cpus <= 2
    assert local_resources(spec) == {RESOURCE_TRAIN: 1, RESOURCE_ROLLOUT: 2}


@pytest.mark.parametrize("spec", [
    {"training": {"nodes": 2, "gpusPerNode": 8}, "rollout": {"gpusPerEngine": 2}},
    {"placement": "disaggregated", "training": {"gpusPerNode": 8},
     "rollout": {"gpus": 16, "gpusPerEngine": 4}},
    {"placement": "disaggregated", "training": {"gpusPerNode": 0, "backend": "fsdp"},
     "rollout": {"gpus": 0, "engines": 3}},
])
def test_rendered_pods_hold_every_actor(spec: dict[str, Any]) -> None:
    """The operator's pods advertise at least the units the trainer's actors ask for."""
    rlj = job(**spec)
    lay = layout(rlj.spec)
    rayjob = render_children(rlj)[-1]
    offered = {RESOURCE_TRAIN: 0, RESOURCE_ROLLOUT: 0}
    for group in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        for key, units in group.get("resources", {}).items():
            offered[key] += int(units) * group["replicas"]
    assert offered[RESOURCE_TRAIN] >= lay.train_workers * lay.train_actor.resources[
        RESOURCE_TRAIN]
    assert offered[RESOURCE_ROLLOUT] >= lay.engines * lay.engine_actor.resources[
        RESOURCE_ROLLOUT]


def test_cpu_actors_split_the_cores_among_their_role() -> None:
    # sync loop: engines and trainers take turns, so each role gets every core
    assert cpu_threads(cores=2, actors_sharing=1) == 2
    assert cpu_threads(cores=16, actors_sharing=4) == 4
    assert cpu_threads(cores=2, actors_sharing=2) == 1
    assert cpu_threads(cores=2, actors_sharing=3) == 1  # never zero threads
