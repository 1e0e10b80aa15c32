"""PPO's value model (backends/value.py): built from a causal LM with a fresh (zero) scalar head,
values aligned with the policy's log-probs, trained by the clipped value loss, micro-batch
invariant, saved and loaded exactly."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.backends.base import TrainBatch
from kuberl_trainer.backends.tokens import response_mask
from kuberl_trainer.backends.value import ValueBackend
from tests.unit.tiny_lm import VOCAB, save_tiny_qwen2

B, T = 8, 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_lm"))


def spec(model_dir: str, *, mbs: int = 2, **critic: Any) -> RLJobSpec:
    return RLJobSpec.model_validate({
        "model": {"path": model_dir},
        "data": {"prompts": "/p.jsonl", "rolloutBatchSize": B // 2, "nSamplesPerPrompt": 2},
        "training": {"backend": "fsdp", "gpusPerNode": 0, "microBatchSize": mbs},
        "rollout": {"engine": "reference"},  # on CPU
        "algorithm": {"advantageEstimator": "ppo"},
        "critic": {"lr": 1e-2, **critic},
    })


def batch(seed: int = 0) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, T), generator=gen)
    attention = torch.zeros(B, T, dtype=torch.long)
    loss = torch.zeros(B, T)
    for i in range(B):
        prompt, end = 2 + i % 2, 4 + i % 5
        attention[i, :end] = 1
        loss[i, prompt:end] = 1.0
        ids[i, end:] = 0
    zeros = torch.zeros(B, T)
    returns = torch.where(loss > 0, torch.linspace(-1, 1, B)[:, None].expand(B, T), 0.0)
    return TrainBatch(input_ids=ids, attention_mask=attention, loss_mask=loss,
                      advantages=zeros, rollout_logprobs=zeros, returns=returns)


def test_a_fresh_value_head_starts_at_zero(model_dir: str) -> None:
    """Every first estimate is 0, so PPO's first advantages are the plain returns, not a
    random head's noise; training moves them off 0."""
    b = ValueBackend(spec(model_dir), rank=0, world_size=1, device="cpu")
    data = batch()
    assert torch.all(b.values(data) == 0)
    b.train_step(dataclasses.replace(data, values=b.values(data)))
    assert torch.any(b.values(data) != 0)


def test_values_come_from_the_prefix_and_only_on_the_response(model_dir: str) -> None:
    b = ValueBackend(spec(model_dir), rank=0, world_size=1, device="cpu")
    data = batch()
    for _ in range(2):  # off the zero-initialised head, so that values depend on the input
        b.train_step(dataclasses.replace(data, values=b.values(data)))
    v = b.values(data)
    assert v.shape == (B, T) and torch.all(v[data.loss_mask == 0] == 0)
    # The value at a response token depends only on the tokens before it: change the token
    # itself and its value stays; change an earlier one and it moves.
    row, first = 0, int(data.loss_mask[0].nonzero()[0])
    edited = data.input_ids.clone()
    edited[row, first] = (edited[row, first] + 1) % VOCAB
    v2 = b.values(dataclasses.replace(data, input_ids=edited))
    assert v2[row, first] == pytest.approx(float(v[row, first]))
    edited[row, first - 1] = (edited[row, first - 1] + 1) % VOCAB
    v3 = b.values(dataclasses.replace(data, input_ids=edited))
    assert v3[row, first] != pytest.approx(float(v[row, first]))


def test_training_moves_values_to_the_returns(model_dir: str) -> None:
    b = ValueBackend(spec(model_dir, valueClip=0), rank=0, world_size=1, device="cpu")
    data = batch()
    mask = data.loss_mask.bool()
    assert data.returns is not None
    first = None
    for _ in range(30):
        data = dataclasses.replace(data, values=b.values(data))
        m = b.train_step(data)
        first = first if first is not None else m["value_loss"]
    err = (b.values(data) - data.returns)[mask].square().mean()
    assert m["value_loss"] < first / 4, (first, m["value_loss"])
    assert float(err) < 2 * m["value_loss"] + 1e-3


def test_value_clip_holds_values_near_their_rollout_estimates(model_dir: str) -> None:
    clipped = ValueBackend(spec(model_dir, valueClip=0.01), rank=0, world_size=1, device="cpu")
    data = batch()
    data = dataclasses.replace(data, values=clipped.values(data))
    m = clipped.train_step(data)
    assert m["vf_clipfrac"] == 0.0  # nothing clipped before the first update
    m2 = clipped.train_step(data)  # same rollout-time values: now beyond the 0.01 band
    assert m2["vf_clipfrac"] > 0.5, m2
    # valueClip 0 is off: the same two updates clip nothing, and the loss is the plain
    # squared error (the loss of a 0-wide band would hold every value at its estimate)
    free = ValueBackend(spec(model_dir, valueClip=0), rank=0, world_size=1, device="cpu")
    free.train_step(data)
    values = free.values(data)
    m3 = free.train_step(data)
    assert m3["vf_clipfrac"] == 0.0, m3
    assert data.returns is not None
    mask = response_mask(data.loss_mask).bool()
    plain = 0.5 * (values - data.returns)[mask].square().mean()
    assert m3["value_loss"] == pytest.approx(float(plain), rel=1e-4)


def test_micro_batches_match_the_whole_batch(model_dir: str) -> None:
    whole = ValueBackend(spec(model_dir, mbs=B), rank=0, world_size=1, device="cpu")
    micro = ValueBackend(spec(model_dir, mbs=2), rank=0, world_size=1, device="cpu")
    data = batch()
    data = dataclasses.replace(data, values=whole.values(data))
    assert whole.train_step(data)["value_loss"] == pytest.approx(
        micro.train_step(data)["value_loss"], rel=1e-5)
    torch.testing.assert_close(micro.values(data), whole.values(data), rtol=1e-4, atol=1e-6)


def test_save_load_and_start_from_a_saved_critic(model_dir: str, tmp_path: Path) -> None:
    b = ValueBackend(spec(model_dir), rank=0, world_size=1, device="cpu")
    data = batch()
    b.train_step(dataclasses.replace(data, values=b.values(data)))
    b.save(tmp_path / "critic")
    fresh = ValueBackend(spec(model_dir), rank=0, world_size=1, device="cpu")
    fresh.load(tmp_path / "critic")
    torch.testing.assert_close(fresh.values(data), b.values(data))
    # The saved directory is itself a value model critic.modelPath can start from.
    again = ValueBackend(spec(model_dir, modelPath=str(tmp_path / "critic" / "model")),
                         rank=0, world_size=1, device="cpu")
    torch.testing.assert_close(again.values(data), b.values(data))


def test_refuses_a_batch_without_targets(model_dir: str) -> None:
    b = ValueBackend(spec(model_dir), rank=0, world_size=1, device="cpu")
    with pytest.raises(ValueError, match="values and returns"):
        b.train_step(dataclasses.replace(batch(), returns=None))
