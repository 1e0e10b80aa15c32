"""`kuberl run`'s preflight for the megatron backend and the router: what they need is checked
before Ray starts, each refusal naming the field and what is allowed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.preflight import PreflightError, check_backend, check_engine_tp, check_router

QWEN2 = {"model_type": "qwen2", "num_hidden_layers": 6, "hidden_size": 64,
         "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 96,
         "vocab_size": 300}


def spec(model: Path, backend: str = "megatron", **parallelism: int) -> RLJobSpec:
    return RLJobSpec.model_validate({
        "model": {"path": str(model)},
        "data": {"prompts": "/data/p.jsonl", "rolloutBatchSize": 8},
        "training": {"backend": backend, "gpusPerNode": 8 if backend == "megatron" else 0,
                     "parallelism": parallelism or {"tp": 1}},
        "rollout": {"engine": "sglang" if backend == "megatron" else "reference"},
    })


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    return tmp_path


@pytest.fixture
def megatron_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return object() if name.split(".")[0] == "megatron" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_fsdp_needs_nothing_more(model: Path) -> None:
    check_backend(spec(model, backend="fsdp"))


def test_megatron_without_megatron_core_says_how_to_get_it(model: Path) -> None:
    if importlib.util.find_spec("megatron") is not None:
        pytest.skip("megatron-core is installed here")
    with pytest.raises(PreflightError, match=r"megatron-core.*kuberl\[megatron\]"):
        check_backend(spec(model))


@pytest.mark.usefixtures("megatron_installed")
def test_megatron_accepts_a_supported_model_and_layout(model: Path) -> None:
    check_backend(spec(model, tp=2, pp=2))


@pytest.mark.usefixtures("megatron_installed")
@pytest.mark.parametrize(("edit", "parallelism", "words"), [
    ({"model_type": "gpt2"}, {"tp": 1}, "spec.model.path: model_type 'gpt2' is not supported"),
    ({}, {"tp": 4}, r"spec.model.path: tp 4 must divide num_key_value_heads \(2\)"),
    ({}, {"pp": 4}, r"spec.training.parallelism.pp: 4 must divide the model's 6 layers"),
])
def test_megatron_refuses_what_it_cannot_shard(model: Path, edit: dict[str, Any],
                                               parallelism: dict[str, int], words: str) -> None:
    (model / "config.json").write_text(json.dumps({**QWEN2, **edit}))
    with pytest.raises(PreflightError, match=words):
        check_backend(spec(model, **parallelism))


def engine_spec(model: Path, tp: int) -> RLJobSpec:
    return RLJobSpec.model_validate({
        "model": {"path": str(model)},
        "data": {"prompts": "/data/p.jsonl", "rolloutBatchSize": 8},
        "training": {"backend": "fsdp", "gpusPerNode": 8},
        "rollout": {"engine": "sglang", "gpusPerEngine": tp},
        "placement": "colocate",
    })


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_engine_tp_that_divides_the_heads_is_accepted(model: Path, tp: int) -> None:
    # 8 heads, 2 KV heads: TP 4 and 8 replicate each KV head (SGLang's rule), 96 / 8 = 12
    check_engine_tp(engine_spec(model, tp))


def test_engine_tp_that_splits_a_head_is_refused_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {**QWEN2, "num_attention_heads": 12, "num_key_value_heads": 3, "intermediate_size": 100}))
    with pytest.raises(PreflightError, match=(
            r"spec.rollout.gpusPerEngine: tensor parallel size 8 must divide the model's 12 "
            r"attention heads, its 3 key/value heads .*, its MLP intermediate size 100")):
        check_engine_tp(engine_spec(tmp_path, 8))


def test_the_router_needs_sglang_router_installed(model: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    routed = spec(model, backend="fsdp")
    routed.rollout.router = "sglang"
    check_router(routed)  # (installed here: the trainer extra has it)
    check_router(spec(model, backend="fsdp"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sglang_router" else real(name, *a))
    check_router(spec(model, backend="fsdp"))  # router none: nothing needed
    with pytest.raises(PreflightError, match=r"^spec\.rollout\.router: .*kuberl\[trainer\]"):
        check_router(routed)


QWEN3_MOE = {**QWEN2, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "norm_topk_prob": True}


@pytest.mark.usefixtures("megatron_installed")
def test_megatron_expert_layouts(tmp_path: Path, model: Path) -> None:
    """An MoE model trains with tp 1 and experts spread over ep (dividing its 8 experts);
    ep on a dense model is refused, naming parallelism."""
    moe_dir = tmp_path / "moe"
    moe_dir.mkdir()
    (moe_dir / "config.json").write_text(json.dumps(QWEN3_MOE))
    check_backend(spec(moe_dir, tp=1, ep=4, etp=2))
    with pytest.raises(PreflightError, match=r"parallelism: .*tp 1"):
        check_backend(spec(moe_dir, tp=2))
    (moe_dir / "config.json").write_text(json.dumps({**QWEN3_MOE, "num_experts": 6}))
    with pytest.raises(PreflightError, match=r"ep 4 must divide the number of experts \(6\)"):
        check_backend(spec(moe_dir, tp=1, ep=4))
    with pytest.raises(PreflightError, match="apply to mixture-of-experts models"):
        check_backend(spec(model, tp=1, ep=2))
