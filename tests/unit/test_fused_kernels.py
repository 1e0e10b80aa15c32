"""training.fusedKernels reaches the fsdp backend's models, and what cannot be applied is an
error naming the field, never a model that silently runs without the kernels.

Liger Kernel's Triton kernels run only on GPUs (its real application is checked there:
bench/fsdp_backend_check.py --fused-kernels liger); on CPU, where the package is absent, the
spec's path up to the import runs for real, and the model-type check and the call into Liger
run against a stand-in of its patch table.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from transformers import AutoModelForCausalLM

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.backends.fsdp import FSDPBackend
from kuberl_trainer.backends.fused_kernels import LIGER_OPS, apply_fused_kernels
from tests.unit.tiny_lm import save_tiny_qwen2

LIGER_MODULE = "liger_kernel.transformers.monkey_patch"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


def liger_spec(model_dir: str) -> RLJobSpec:
    return RLJobSpec.model_validate({
        "model": {"path": model_dir},
        "data": {"prompts": "/data/prompts.jsonl", "rolloutBatchSize": 4,
                 "nSamplesPerPrompt": 2, "maxPromptLen": 4, "maxResponseLen": 8},
        "training": {"backend": "fsdp", "gpusPerNode": 1, "fusedKernels": "liger"},
        "algorithm": {"lr": 1e-3, "klCoef": 0.01},
    })


@pytest.fixture
def fake_liger(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Liger's patch table with one family, recording what it is asked to patch."""
    calls: list[dict[str, Any]] = []
    module = types.ModuleType(LIGER_MODULE)
    module.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": None}  # type: ignore[attr-defined]
    module._apply_liger_kernel_to_instance = (  # type: ignore[attr-defined]
        lambda **kwargs: calls.append(kwargs))
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, LIGER_MODULE, module)
    yield {"calls": calls, "table": module.MODEL_TYPE_TO_APPLY_LIGER_FN}


def test_the_backend_builds_its_models_with_the_specs_kernels(model_dir: str) -> None:
    """Without the package (this machine), a liger job's backend fails to build with the
    field and the package named, before anything trains."""
    assert "liger_kernel" not in sys.modules
    with pytest.raises(RuntimeError, match=r"training.fusedKernels: liger needs the "
                                           r"liger-kernel package"):
        FSDPBackend(liger_spec(model_dir), rank=0, world_size=1, device="cpu")


def test_liger_patches_the_policy_and_reference_with_rope_rmsnorm_swiglu(
        model_dir: str, fake_liger: dict[str, Any]) -> None:
    fake_liger["table"]["qwen2"] = None
    backend = FSDPBackend(liger_spec(model_dir), rank=0, world_size=1, device="cpu")
    patched = [call.pop("model") for call in fake_liger["calls"]]
    assert patched == [backend.module, backend.ref]
    assert fake_liger["calls"] == [LIGER_OPS, LIGER_OPS]
    assert {op for op, on in LIGER_OPS.items() if on} == {"rope", "rms_norm", "swiglu"}


def test_a_family_liger_lacks_is_refused_by_name(model_dir: str,
                                                 fake_liger: dict[str, Any]) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"no kernels for model_type 'qwen2' \(it has: llama\)"):
        apply_fused_kernels(model, "liger")
    assert fake_liger["calls"] == []


def test_none_leaves_the_model_as_loaded(model_dir: str, fake_liger: dict[str, Any]) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    apply_fused_kernels(model, "none")
    assert fake_liger["calls"] == []
