"""The tiny reward model's builder (kuberl_trainer.tiny.reward_model): a complete HF checkpoint
of a one-label Qwen2ForSequenceClassification on the policy's body, its head fitted, cached
like `tiny build`. On a random policy of the tiny shape (the SFT'd one's accuracy is
tests/integration/test_reference_classifier.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from kuberl_trainer.tiny import tokenizer as tok
from kuberl_trainer.tiny.__main__ import main
from kuberl_trainer.tiny.model import ModelShape, make_model
from kuberl_trainer.tiny.reward_model import RewardConfig, build_reward_model

SMALL = RewardConfig(n_pairs=200, n_eval=100)


def policy(path: Path, seed: int = 0) -> Path:
    make_model(ModelShape(), seed).save_pretrained(str(path))
    tok.save(tok.make_tokenizer(), path)
    return path


def test_the_reward_model_is_a_complete_checkpoint_on_the_policys_body(tmp_path: Path) -> None:
    body = policy(tmp_path / "policy")
    record = build_reward_model(tmp_path / "rm", body, SMALL, log=lambda _: None)
    model, loading = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "rm", local_files_only=True, output_loading_info=True)
    assert not loading["missing_keys"]
    assert type(model).__name__ == "Qwen2ForSequenceClassification"
    assert (model.config.num_labels, model.config.pad_token_id) == (1, tok.VOCAB[tok.PAD])
    source = make_model(ModelShape(), 0).model.state_dict()
    for name, tensor in model.model.state_dict().items():
        assert torch.equal(tensor, source[name]), name
    assert model.score.weight.abs().sum() > 0  # fitted, not left at zero
    # the tiny tokenizer beside it, with no chat template: the trainer sends prompt + response
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "rm", local_files_only=True)
    assert tokenizer.chat_template is None
    assert len(tokenizer("23+58=81")["input_ids"]) == 8
    assert 0 <= record["heldout_pairwise_accuracy"] <= 1
    assert (record["fit_pairs"], record["heldout_pairs"]) == (200, 100)


def test_a_build_is_reused_until_the_policy_changes(tmp_path: Path) -> None:
    body = policy(tmp_path / "policy")
    logs: list[str] = []
    first = build_reward_model(tmp_path / "rm", body, SMALL, log=logs.append)
    weights = tmp_path / "rm" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert build_reward_model(tmp_path / "rm", body, SMALL, log=logs.append) == first
    assert "reusing" in logs[-1] and weights.stat().st_mtime_ns == stamp
    policy(tmp_path / "policy", seed=1)  # other weights: a new build
    second = build_reward_model(tmp_path / "rm", body, SMALL, log=logs.append)
    assert second["config"]["policy_sha256"] != first["config"]["policy_sha256"]
    assert "built" in logs[-1]


def test_the_command_line_needs_a_model_directory(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reward-model", "--out", str(tmp_path / "rm"),
                 "--policy", str(tmp_path)]) == 2
    assert "model directory" in capsys.readouterr().err
