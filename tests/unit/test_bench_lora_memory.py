"""bench/lora_memory_check.py's LoRA arm on CPU (the tiny shape, in this process): its checks
pass on a real run, and each fails when what it guards goes wrong (an adapter that did not
train, a sync that sent the base, one changed bit in a frozen weight)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import lora_memory_arm
import lora_memory_check


@pytest.fixture(autouse=True)
def loader_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """The arm replaces the backend's model loader for its process (patch_loader); here the
    process is the test worker's, whose other tests load real checkpoints: put it back."""
    import kuberl_trainer.backends.fsdp as fsdp
    import kuberl_trainer.backends.fsdp_models as fsdp_models

    for module in (fsdp, fsdp_models):
        monkeypatch.setattr(module, "load_model", module.load_model)


def run_lora(tmp_path: Path) -> dict[str, Any]:
    lora_memory_check.write_config("tiny", tmp_path / "model")
    args = argparse.Namespace(device="cpu", shape="tiny", steps=2, rows=2, tokens=32, lr=1e-3,
                              rank=4, engine_kv_gib=0.001, child="lora", work=str(tmp_path))
    result: dict[str, Any] = lora_memory_arm.run_arm(args, lora_memory_check.ARMS["lora"])
    return result


def test_the_lora_arm_passes_its_checks(tmp_path: Path) -> None:
    result = run_lora(tmp_path)
    checks = lora_memory_check.checks({"lora": result})
    assert all(checks.values()), checks
    # the engine got the HF model's weights (the adapter's own tensors are not sent), float32
    assert result["sync_bytes"] == 4 * (result["total_params"] - result["trainable_params"])
    assert result["adapter_bytes"] > 4 * result["trainable_params"]  # (+ adapter_config.json)
    assert (tmp_path / "adapter-lora" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("fault", ["zero advantages", "sync sends the base"])
def test_the_checks_fail_when_the_adapter_does_not_train_or_reach_the_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    if fault == "zero advantages":  # zero gradients: AdamW leaves B at its zeros
        original = lora_memory_arm.random_batch

        def no_signal(*args: Any, **kwargs: Any) -> Any:
            batch = original(*args, **kwargs)
            return dataclasses.replace(batch, advantages=torch.zeros_like(batch.advantages))

        monkeypatch.setattr(lora_memory_arm, "random_batch", no_signal)
    else:  # the test switch of backends/lora.py: the export leaves the adapter out
        monkeypatch.setenv("KUBERL_TEST_LORA_UNMERGED", "1")
    checks = lora_memory_check.checks({"lora": run_lora(tmp_path)})
    assert checks["lora fits beside the engine"] and checks["lora base unchanged"]
    assert checks["lora adapter trained (B != 0)"] == (fault != "zero advantages")
    assert not checks["lora merged sync != base"]


def test_the_fingerprint_sees_one_changed_bit() -> None:
    layer = torch.nn.Linear(16, 16).requires_grad_(False)
    before = lora_memory_arm.fingerprint(layer)
    with torch.no_grad():
        layer.weight[3, 4] = torch.nextafter(layer.weight[3, 4], torch.tensor(1.0))
    assert lora_memory_arm.fingerprint(layer) != before


def test_a_missing_or_out_of_memory_lora_arm_fails_every_check() -> None:
    assert not any(lora_memory_check.checks({}).values())
    oom = {"arm": "lora", "oom_at": "train step 1", "base_unchanged": True,
           "lora_b_max": 1.0, "merged_changed": 5}
    assert not any(lora_memory_check.checks({"lora": oom}).values())
