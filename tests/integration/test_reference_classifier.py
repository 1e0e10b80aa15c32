"""The reference engine with --is-embedding as a real server process, serving the tiny reward
model (`tiny reward-model` on the SFT'd tiny policy, both built once per machine): /classify
over HTTP scores what HF's own model scores in this process, the engine says it is not
generative, and it checks the API key on /classify as SGLang's does. One engine per module
(~3 s to start on two busy cores)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from kuberl_trainer.ray_actors import free_port
from kuberl_wire.protocol import ENGINE_API_KEY_ENV
from tests.integration.local_run import _cache, tiny_job

pytestmark = pytest.mark.integration

API_KEY = "reward-engine-key-41c9"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# The texts a scalar reward model gets from the trainer for the tiny task: prompt + response
# (the tiny tokenizer has no chat template); answers right and wrong, of 2 and 3 digits.
TEXTS = ["23+58=81", "23+58=80", "99+99=198", "99+99=189", "10+10=20", "10+10="]


@pytest.fixture(scope="module")
def reward_model() -> tuple[Path, dict[str, Any]]:
    from kuberl_trainer.tiny.reward_model import build_reward_model

    policy = tiny_job() / "model"
    out = _cache() / "test-tiny-reward-sft300"
    return out, build_reward_model(out, policy, log=lambda _: None)


@pytest.fixture(scope="module")
def engine(reward_model: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("rm-engine") / "engine.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kuberl_rollout.reference", "--is-embedding", "--model-path",
         str(reward_model[0]), "--port", str(port), "--torch-threads", "1"],
        stdout=log.open("w"), stderr=subprocess.STDOUT,
        env={**os.environ, ENGINE_API_KEY_ENV: API_KEY})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # /health: 200 once the model is loaded and scores (no key needed)
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_classify_over_http_is_hf_in_process(engine: str,
                                             reward_model: tuple[Path, dict[str, Any]]) -> None:
    path = reward_model[0]
    answers = requests.post(f"{engine}/classify", json={"text": TEXTS}, headers=AUTH,
                            timeout=30).json()
    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert tokenizer.chat_template is None  # (so the trainer sends prompt + response)
    for text, answer in zip(TEXTS, answers, strict=True):
        with torch.no_grad():
            want = model(**tokenizer(text, return_tensors="pt")).logits[0]
        assert len(answer["embedding"]) == 1
        assert torch.allclose(torch.tensor(answer["embedding"]), want, atol=1e-5), text
        assert answer["meta_info"]["prompt_tokens"] == len(text)
    single = requests.post(f"{engine}/classify", json={"text": TEXTS[0]}, headers=AUTH,
                           timeout=30).json()
    assert single["embedding"] == pytest.approx(answers[0]["embedding"], abs=1e-5)


def test_the_tiny_reward_model_prefers_right_answers(
        reward_model: tuple[Path, dict[str, Any]]) -> None:
    """Its head is fitted: held-out pairs (problems it never saw) ranked better than chance."""
    assert reward_model[1]["heldout_pairwise_accuracy"] > 0.5


def test_model_info_says_not_generative(engine: str) -> None:
    info = requests.get(f"{engine}/get_model_info", headers=AUTH, timeout=10).json()
    assert info["is_generation"] is False
    refused = requests.post(f"{engine}/generate", json={"text": "1+1="}, headers=AUTH,
                            timeout=10)
    assert refused.status_code == 400 and "/classify" in refused.json()["error"]["message"]


def test_the_api_key_is_checked_on_classify(engine: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        answer = requests.post(f"{engine}/classify", json={"text": "1+1=2"}, headers=headers,
                               timeout=10)
        assert (answer.status_code, answer.json()) == (401, {"error": "Unauthorized"})
    assert requests.get(f"{engine}/health_generate", timeout=10).status_code == 200
