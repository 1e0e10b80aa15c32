"""`kuberl run`'s preflight for mixture-of-experts settings: what only an MoE model has is
refused for a dense one, naming the field, before Ray starts; an MoE model is held to what
kuberl can train and sync."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.preflight import PreflightError, check_engine_tp, check_moe

DENSE = {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 64,
         "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 96}
MOE = {**DENSE, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 48}


def spec(model: Path, *, backend: str = "fsdp", engine: str = "reference",
         parallelism: dict[str, int] | None = None, lora: bool = False,
         **algorithm: Any) -> RLJobSpec:
    training: dict[str, Any] = {"backend": backend,
                                "gpusPerNode": 8 if backend == "megatron" else 0,
                                "parallelism": parallelism or {"tp": 1}}
    if lora:
        training["lora"] = {"rank": 8}
    return RLJobSpec.model_validate({
        "model": {"path": str(model)},
        "data": {"prompts": "/data/p.jsonl", "rolloutBatchSize": 8},
        "training": training, "rollout": {"engine": engine}, "algorithm": algorithm})


def model_dir(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(("settings", "field"), [
    ({"routingReplay": "training"}, "spec.algorithm.routingReplay"),
    ({"routingReplay": "rollout"}, "spec.algorithm.routingReplay"),
    ({"routerAuxLossCoef": 0.01}, "spec.algorithm.routerAuxLossCoef"),
    ({"backend": "megatron", "parallelism": {"ep": 2}}, "spec.training.parallelism.ep"),
])
def test_moe_settings_are_refused_for_a_dense_model(tmp_path: Path, settings: dict[str, Any],
                                                    field: str) -> None:
    with pytest.raises(PreflightError, match=rf"^{field}: .*dense model"):
        check_moe(spec(model_dir(tmp_path, DENSE), **settings))


def test_a_dense_model_without_them_passes(tmp_path: Path) -> None:
    check_moe(spec(model_dir(tmp_path, DENSE)))


def test_an_moe_model_takes_them(tmp_path: Path) -> None:
    model = model_dir(tmp_path, MOE)
    check_moe(spec(model, routingReplay="rollout", routerAuxLossCoef=0.0))
    check_moe(spec(model, backend="megatron", engine="sglang", parallelism={"ep": 4}))


def test_ep_must_divide_the_experts(tmp_path: Path) -> None:
    # 8 GPUs, ep 8 x etp 1 fits the layout rule; 6 experts do not split over 8 ranks
    model = model_dir(tmp_path, {**MOE, "num_experts": 6})
    with pytest.raises(PreflightError, match=r"parallelism.ep: 8 must divide .* 6 experts"):
        check_moe(spec(model, backend="megatron", engine="sglang",
                       parallelism={"ep": 8}))


def test_lora_and_unsupported_families_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match=r"^spec.training.lora: LoRA on a mixture"):
        check_moe(spec(model_dir(tmp_path, MOE), lora=True))
    mixtral = {**DENSE, "model_type": "mixtral", "num_local_experts": 8,
               "num_experts_per_tok": 2}
    with pytest.raises(PreflightError, match=r"type 'mixtral'; kuberl trains qwen3_moe"):
        check_moe(spec(model_dir(tmp_path, mixtral)))


def test_engine_tp_must_divide_each_experts_mlp(tmp_path: Path) -> None:
    model = model_dir(tmp_path, {**MOE, "moe_intermediate_size": 36})
    job = RLJobSpec.model_validate({
        "model": {"path": str(model)}, "data": {"prompts": "/p.jsonl", "rolloutBatchSize": 8},
        "training": {"backend": "fsdp", "gpusPerNode": 1},
        "placement": "disaggregated",
        "rollout": {"engine": "sglang", "gpus": 8, "gpusPerEngine": 8}})
    with pytest.raises(PreflightError, match="experts' intermediate size 36"):
        check_engine_tp(job)
