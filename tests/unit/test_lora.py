"""training.lora on the fsdp backend (CPU, a tiny random Qwen2 with tied embeddings).

What a user relies on: only the adapter trains (the base stays bit-for-bit the base), the KL
reference is the base model, the engines get W + (alpha / r) B A for every targeted weight
and the base elsewhere, a checkpoint resumes exactly and holds a PEFT adapter, and a
targetModules name that matches nothing is refused before anything starts.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import Qwen2ForCausalLM

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.backends.fsdp import FSDPBackend
from kuberl_trainer.backends.optim import OptimConfig
from kuberl_trainer.preflight import PreflightError, check_lora
from tests.unit.test_fsdp_backend import make_batch, make_spec, with_old
from tests.unit.tiny_lm import save_tiny_qwen2

RANK, ALPHA = 4, 12.0  # scaling 3: not PEFT's default, so a wrong alpha shows
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


def lora_spec(model_dir: str, *, kl: float = 0.1, **lora: Any) -> RLJobSpec:
    spec = make_spec(model_dir, klCoef=kl)
    raw = spec.model_dump(by_alias=True, exclude_none=True)
    raw["training"]["lora"] = {"rank": RANK, "alpha": ALPHA} | lora
    return RLJobSpec.model_validate(raw)


def lora_backend(model_dir: str, **kw: Any) -> FSDPBackend:
    return FSDPBackend(lora_spec(model_dir, **kw), rank=0, world_size=1, device="cpu",
                       optim=OptimConfig(warmup_steps=4))


def base_state(model_dir: str) -> dict[str, torch.Tensor]:
    return dict(Qwen2ForCausalLM.from_pretrained(model_dir).state_dict())


def export(backend: FSDPBackend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in backend.named_tensor_buckets(1 << 20) for n, t in bucket}


def train(backend: FSDPBackend, steps: int = 3) -> None:
    for i in range(steps):
        backend.train_step(with_old(backend, make_batch(i)))


def adapters(backend: FSDPBackend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.module.named_parameters()
            if "lora_" in n}


def test_only_the_adapter_trains_and_is_in_the_optimizer(model_dir: str) -> None:
    backend = lora_backend(model_dir)
    trainable = {n for n, p in backend.module.named_parameters() if p.requires_grad}
    optimized = {id(p) for g in backend.optimizer.param_groups for p in g["params"]}
    by_id = {id(p): n for n, p in backend.module.named_parameters()}
    assert {by_id[i] for i in optimized} == trainable
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # every linear layer of both decoder layers, not the LM head: r (in + out) each
    # (hidden 32, intermediate 64)
    dims = {"q_proj": (32, 32), "k_proj": (32, 32), "v_proj": (32, 32), "o_proj": (32, 32),
            "gate_proj": (32, 64), "up_proj": (32, 64), "down_proj": (64, 32)}
    want = 2 * sum(RANK * (i + o) for i, o in dims.values())
    metrics = backend.train_step(with_old(backend, make_batch(0)))
    assert metrics["lora_trainable_params"] == want == sum(
        p.numel() for p in backend.module.parameters() if p.requires_grad)
    assert not any("lm_head.lora" in n for n in trainable)


def test_training_moves_the_adapter_and_leaves_the_base_bit_for_bit(model_dir: str) -> None:
    backend = lora_backend(model_dir)
    norms = [backend.train_step(with_old(backend, make_batch(i)))["lora_adapter_norm"]
             for i in range(3)]
    base = base_state(model_dir)
    live = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
            for k, v in backend.module.state_dict().items() if ".lora_" not in k}
    assert set(live) == set(base)
    for name, value in base.items():
        assert torch.equal(live[name], value), name
    moved = adapters(backend)
    assert any(t.abs().max() > 0 for n, t in moved.items() if ".lora_B." in n)  # B starts at 0
    want_norm = torch.stack([t.pow(2).sum() for t in moved.values()]).sum().sqrt()
    assert norms[-1] == pytest.approx(float(want_norm), rel=1e-6)
    assert len(set(norms)) == 3  # it grows as the adapter moves


def test_merged_export_is_w_plus_scaled_ba_by_hand(model_dir: str) -> None:
    backend = lora_backend(model_dir)
    train(backend)
    sent = export(backend)
    base = base_state(model_dir)
    # a plain HF model's keys, the tied LM head once (as save_pretrained writes them)
    assert set(sent) == set(base) - {"lm_head.weight"}
    params = dict(backend.module.named_parameters())
    targeted = 0
    for name, weight in base.items():
        if name == "lm_head.weight":
            continue
        module = name.removesuffix(".weight")
        a_name = f"base_model.model.{module}.lora_A.default.weight"
        if a_name in params and name.endswith(".weight"):
            a = params[a_name].detach()
            b = params[a_name.replace("lora_A", "lora_B")].detach()
            want = weight + (ALPHA / RANK) * (b @ a)
            torch.testing.assert_close(sent[name], want, rtol=0, atol=1e-6)
            assert not torch.equal(sent[name], weight), name
            targeted += 1
        else:
            assert torch.equal(sent[name], weight), name
    assert targeted == 2 * len(LINEAR)


def test_reference_is_the_base_model(model_dir: str) -> None:
    """ref log-probs come from the policy's own model with the adapter off: exactly a plain
    model's from model.path, however far the adapter has moved."""
    backend = lora_backend(model_dir)
    train(backend)
    plain = FSDPBackend(make_spec(model_dir), rank=0, world_size=1, device="cpu")
    batch = make_batch(7)
    ref = backend.ref_logprobs(batch)
    assert ref is not None and torch.equal(ref, plain.logprobs(batch))
    assert not torch.equal(backend.logprobs(batch), ref)  # the policy itself has moved
    assert backend.ref is None  # no second copy of the model


def test_the_merged_weights_give_the_policys_logprobs(model_dir: str) -> None:
    backend = lora_backend(model_dir)
    train(backend)
    plain = FSDPBackend(make_spec(model_dir), rank=0, world_size=1, device="cpu")
    merged = {n: t for bucket in backend.named_tensor_buckets(1 << 20, tied_aliases=True)
              for n, t in bucket}
    plain.module.load_state_dict(merged, strict=True)
    batch = make_batch(9)
    torch.testing.assert_close(plain.logprobs(batch), backend.logprobs(batch),
                               rtol=0, atol=1e-5)


def test_save_load_resumes_exactly_and_writes_a_peft_adapter(model_dir: str,
                                                             tmp_path: Path) -> None:
    first, second = make_batch(0), make_batch(1)
    a = lora_backend(model_dir)
    a.train_step(with_old(a, first))
    a.save(tmp_path / "ckpt")
    draws_a = (random.random(), np.random.rand(), torch.rand(2))
    metrics_a = a.train_step(with_old(a, second))

    random.seed(123), np.random.seed(123), torch.manual_seed(123)  # disturb every RNG
    b = lora_backend(model_dir)  # (a fresh adapter, drawn from the disturbed RNG)
    b.load(tmp_path / "ckpt")
    draws_b = (random.random(), np.random.rand(), torch.rand(2))
    metrics_b = b.train_step(with_old(b, second))

    assert draws_a[:2] == draws_b[:2] and torch.equal(draws_a[2], draws_b[2])
    assert metrics_a == metrics_b
    for name, value in adapters(a).items():
        assert torch.equal(adapters(b)[name], value), name
    # The optimizer holds the adapter's state only.
    saved = torch.load(tmp_path / "ckpt" / "optimizer.pt")
    assert len(saved["optimizer"]["state"]) == len(adapters(a))
    # adapter/: a PEFT directory that loads onto the base; model/: the merged weights.
    ckpt = tmp_path / "ckpt"
    config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    peft = PeftModel.from_pretrained(Qwen2ForCausalLM.from_pretrained(model_dir),
                                     ckpt / "adapter")
    restored = {n: p for n, p in peft.named_parameters() if "lora_" in n}
    c = lora_backend(model_dir)
    c.load(ckpt)
    for name, value in adapters(c).items():
        assert torch.equal(restored[name].detach(), value), name
    plain = Qwen2ForCausalLM.from_pretrained(ckpt / "model", output_loading_info=True)[1]
    assert not any(plain.values()), plain  # a plain HF directory: nothing missing or extra
    merged = load_file(ckpt / "model" / "model.safetensors")
    assert merged.keys() == export(c).keys()
    for name, value in export(c).items():
        assert torch.equal(merged[name], value), name


def test_lora_path_starts_from_the_given_adapter(model_dir: str, tmp_path: Path) -> None:
    a = lora_backend(model_dir)
    train(a, 2)
    a.save(tmp_path / "ckpt")
    b = lora_backend(model_dir, path=str(tmp_path / "ckpt" / "adapter"))
    for name, value in adapters(a).items():
        assert torch.equal(adapters(b)[name], value), name
    with pytest.raises(ValueError, match=r"training\.lora\.path"):  # another rank's adapter
        lora_backend(model_dir, rank=RANK * 2, path=str(tmp_path / "ckpt" / "adapter"))


def test_adapter_dropout_acts_in_training_forwards_only(model_dir: str) -> None:
    backend = lora_backend(model_dir, dropout=0.5)
    train(backend, 1)  # (B is no longer 0: dropout on A's input now changes the output)
    batch = make_batch(3)
    assert torch.equal(backend.logprobs(batch), backend.logprobs(batch))
    with backend._training_forward():
        assert not torch.equal(backend.logprobs(batch), backend.logprobs(batch))
    assert torch.equal(backend.logprobs(batch), backend.logprobs(batch))
    drops = [m for n, m in backend.module.named_modules() if n.endswith("lora_dropout.default")]
    assert drops and not any(m.training for m in drops)


@pytest.mark.parametrize(("targets", "problem"), [
    (["q_proj", "qkv_proj"], "'qkv_proj' names no module"),
    (["embed_tokens"], "not a linear layer"),
    (["lm_head"], "ties to its embedding"),
])
def test_preflight_refuses_target_modules_the_model_cannot_take(
        model_dir: str, targets: list[str], problem: str) -> None:
    with pytest.raises(PreflightError, match=problem) as refused:
        check_lora(lora_spec(model_dir, targetModules=targets))
    assert str(refused.value).startswith("spec.training.lora.targetModules: ")
    check_lora(lora_spec(model_dir, targetModules=["q_proj", "v_proj"]))  # fine
    check_lora(lora_spec(model_dir))  # the default: every linear layer


def test_preflight_refuses_an_adapter_of_another_rank(model_dir: str, tmp_path: Path) -> None:
    a = lora_backend(model_dir)
    a.save(tmp_path / "ckpt")
    adapter = str(tmp_path / "ckpt" / "adapter")
    check_lora(lora_spec(model_dir, path=adapter))
    with pytest.raises(PreflightError, match=r"spec\.training\.lora\.path: the adapter has rank 4"):
        check_lora(lora_spec(model_dir, rank=RANK * 2, path=adapter))
    with pytest.raises(PreflightError, match="not a PEFT adapter directory"):
        check_lora(lora_spec(model_dir, path=str(tmp_path)))
