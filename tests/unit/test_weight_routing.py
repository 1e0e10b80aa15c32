"""Colocated updates: each engine TP rank's entry comes from the trainer rank on its GPU."""

from __future__ import annotations

import pytest

from kuberl_trainer.placement import colocated_engine_devices
from kuberl_trainer.weight_sync.routing import colocated_sources, engine_gpus
from kuberl_wire.protocol import rank_offsets


def test_two_engines_of_tp2_on_a_four_gpu_node_read_from_their_own_gpus() -> None:
    # Ray gave the trainer ranks the node's GPUs out of order: routing follows the GPU,
    # not the rank number.
    trainers = [("10.0.0.1", 2), ("10.0.0.1", 0), ("10.0.0.1", 3), ("10.0.0.1", 1)]
    devices = [colocated_engine_devices(i, 2, 4) for i in range(2)]
    engines = engine_gpus(["http://10.0.0.1:30000", "http://10.0.0.1:30001"], devices)
    assert devices == [[0, 1], [2, 3]]
    assert colocated_sources(trainers, engines) == [[1, 3], [0, 2]]


def test_engines_on_two_nodes_take_ranks_of_their_node() -> None:
    trainers = [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    engines = engine_gpus(["http://a:1", "http://b:1"], [[0, 1], [0, 1]])
    assert colocated_sources(trainers, engines) == [[0, 1], [2, 3]]


def test_an_engine_on_a_gpu_without_a_trainer_rank_is_named() -> None:
    with pytest.raises(ValueError, match=r"engine 1 runs on b GPU 1, where no training rank"):
        colocated_sources([("a", 0), ("a", 1), ("b", 0)],
                          engine_gpus(["http://a:1", "http://b:1"], [[0, 1], [0, 1]]))


def test_group_ranks_count_every_tp_process() -> None:
    # trainer rank 0, engine 0's ranks 1-2, engine 1's ranks 3-4 (SGLang: offset + tp_rank)
    assert rank_offsets([2, 2]) == (5, [1, 3])
    assert rank_offsets([1, 4, 2]) == (8, [1, 2, 6])
    assert rank_offsets([1]) == (2, [1])
    with pytest.raises(ValueError):
        rank_offsets([0])
