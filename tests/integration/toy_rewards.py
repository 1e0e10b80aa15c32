"""A custom reward (imported by `module:function`, as users' rewards are) that a policy can
learn in a handful of steps, so integration tests can check that training moves the policy;
and the tiny reward model called in-process."""

from __future__ import annotations

import os
from typing import Any


def leading_one(response: str, label: str) -> float:
    return 1.0 if response.startswith("1") else 0.0


# --- the tiny reward model called in-process: what a served one must score like --------------
# (reward.batch functions, as a user's judge would be; the model's directory comes from
# $KUBERL_TEST_REWARD_MODEL, set by the test for its run)

REWARD_MODEL_ENV = "KUBERL_TEST_REWARD_MODEL"
_LOADED: dict[str, Any] = {}


def _reward_model() -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = os.environ[REWARD_MODEL_ENV]
    if path not in _LOADED:
        model = AutoModelForSequenceClassification.from_pretrained(
            path, torch_dtype=torch.float32).eval()
        _LOADED[path] = (model, AutoTokenizer.from_pretrained(path))
    return _LOADED[path]


def scalar_score(model: Any, tokenizer: Any, text: str) -> float:
    """The head's output at the text's last token, the text alone (no batch, no padding)."""
    import torch

    with torch.no_grad():
        ids = tokenizer(text, return_tensors="pt")
        return float(model(**ids).logits[0, 0])


def tiny_reward_model(samples: list[Any]) -> list[float]:
    """The tiny reward model's score of each sample's prompt followed by its response (the
    tiny tokenizer has no chat template)."""
    model, tokenizer = _reward_model()
    assert not getattr(tokenizer, "chat_template", None)
    return [scalar_score(model, tokenizer, s.prompt + s.response) for s in samples]
