"""reward.type model end to end: the tiny reward model (a score head on the tiny policy's body)
and the tiny policy as a judge, each served by reference engines that the trainer's own code
starts (engines/reward_engines.py, as a run's start-up does, on the test session's Ray), score
exactly what the same models score in-process; a training run graded by the served reward
model trains exactly what the same job graded by the model in-process trains; a checkpoint of
the other form is refused before anything starts. (The codecs, the client's batching, retries
and drop, the command line and the resources: tests/unit/test_reward_model.py; the engine's
/classify itself: tests/integration/test_reference_engine.py.)"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

from kuberl_api import load
from kuberl_api.spec.reward import DEFAULT_SCORE_PATTERN
from kuberl_trainer.engines.client import EngineClient
from kuberl_trainer.engines.reward_engines import RewardEngines
from kuberl_trainer.placement import layout
from kuberl_trainer.rollout.reward_client import RemoteScorer
from kuberl_trainer.rollout.rewards.model_io import chat_render, judge_score
from kuberl_trainer.rollout.rewards.scorer import RewardInput
from kuberl_trainer.tiny.data import read_jsonl
from tests.integration.local_run import (
    SHARED_RAY,
    failed,
    kuberl_run,
    manifest,
    metrics,
    tiny_reward_model,
)
from tests.integration.test_local_run import RESUMABLE
from tests.integration.toy_rewards import REWARD_MODEL_ENV, scalar_score

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

JUDGE = {"prompt": "{response}+{label}=", "maxNewTokens": 4}  # (the tiny vocabulary: digits)


@pytest.fixture(scope="module")
def reward_model(tiny: Path) -> Path:
    return tiny_reward_model(tiny)


def samples(tiny: Path, count: int = 12) -> list[RewardInput]:
    """Eval problems with a right answer, a near miss and a far one each, and an empty
    response: batches of 5 cross problems."""
    rows = read_jsonl(tiny / "data" / "eval.jsonl")[:count // 3]
    out = []
    for i, row in enumerate(rows):
        label = str(row["label"])
        for k, response in enumerate((label, str(int(label) + 1), str(int(label) + 37), "")):
            out.append(RewardInput(id=f"0:0:{i}:{k}", prompt=row["prompt"], response=response,
                                   label=label))
    return out


@pytest.fixture(scope="module")
def on_ray() -> Iterator[None]:
    """This process joined to the test session's Ray, as a Session started here is."""
    ray.init(address=os.environ[SHARED_RAY], logging_level="ERROR")
    try:
        yield
    finally:
        ray.shutdown()


def served(job: Path, tmp: Path, items: list[RewardInput]) -> list[float | None]:
    """`job`'s reward model started as a run starts it, and `items` scored through it as a
    run's grading stage scores them (batches of 5 over its replicas; a judge's answer without
    a score dropped, so that it shows as None)."""
    spec = load(job).spec
    assert spec.reward.model is not None
    engines = RewardEngines(spec, layout(spec), seed=0, one_machine=True, log_dir=tmp)
    try:
        async def score() -> list[float | None]:
            client = EngineClient(engines.urls)
            try:
                await client.wait_healthy(timeout_s=120, exited=engines.dead)
            finally:
                await client.close()
            render = chat_render(AutoTokenizer.from_pretrained(spec.reward.model.tokenizer_path))
            scorer = RemoteScorer.for_model(spec.reward, engines.urls, render)
            return (await scorer.score(items)).rewards
        return asyncio.run(score())
    finally:
        engines.stop()


def test_served_reward_models_score_as_the_models_do_in_process(
        tiny: Path, reward_model: Path, tmp_path: Path, on_ray: None) -> None:
    items = samples(tiny)
    base = {"batchSize": 5, "maxRetries": 0, "onError": "drop"}
    scalar = manifest(tiny, tmp_path, "scalar", reward={"type": "model", **base, "model": {
        "path": str(reward_model), "engine": "reference", "gpusPerReplica": 0,
        "replicas": 2}})
    judge = manifest(tiny, tmp_path, "judge", reward={"type": "model", **base, "model": {
        "path": str(tiny / "model"), "form": "judge", "engine": "reference",
        "gpusPerReplica": 0, "judge": JUDGE}})

    # the scalar head: its score of the prompt followed by the response (no chat template)
    model = AutoModelForSequenceClassification.from_pretrained(
        reward_model, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(reward_model)
    want = [scalar_score(model, tok, i.prompt + i.response) for i in items]
    got = served(scalar, tmp_path / "scalar-logs", items)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert len(set(got)) == len(got)  # (every text its own score: nothing stood in)

    # the judge: the last number of its greedy answer to the filled-in prompt, or no score
    lm = AutoModelForCausalLM.from_pretrained(tiny / "model", torch_dtype=torch.float32).eval()
    ltok = AutoTokenizer.from_pretrained(tiny / "model")

    def judged(item: RewardInput) -> float | None:
        ids = ltok(JUDGE["prompt"].format(response=item.response, label=item.label),
                   return_tensors="pt")
        with torch.no_grad():
            out = lm.generate(**ids, do_sample=False, max_new_tokens=JUDGE["maxNewTokens"])
        answer = ltok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        return judge_score(answer, DEFAULT_SCORE_PATTERN)  # (the spec's default)

    assert served(judge, tmp_path / "judge-logs", items) == [judged(i) for i in items]


def test_a_job_graded_by_its_served_reward_model_trains_as_with_the_model_in_process(
        tiny: Path, reward_model: Path, tmp_path: Path) -> None:
    """A step graded by the tiny reward model on two reference engines (batches of 5
    crossing groups of 8), and the same step graded by a batch function that calls the model
    in-process: the same rewards to float rounding, so the same advantages and loss. (One
    step: the next one samples from weights that differ in their last bits, and a sampled
    token near a tie may go the other way on another machine.)"""
    steps = {"numRollouts": 1, "saveInterval": 1}
    job = manifest(tiny, tmp_path, "served", schedule=steps, reward={
        "type": "model", "batchSize": 5, "model": {
            "path": str(reward_model), "engine": "reference", "gpusPerReplica": 0,
            "replicas": 2}})
    res = kuberl_run(job, tmp_path / "served")
    assert res.returncode == 0, failed(res)
    local = manifest(tiny, tmp_path, "local", schedule=steps, reward={
        "type": "custom", "batch": True,
        "function": "tests.integration.toy_rewards:tiny_reward_model"})
    res = kuberl_run(local, tmp_path / "local", env={REWARD_MODEL_ENV: str(reward_model)})
    assert res.returncode == 0, failed(res)
    (row,), (want,) = metrics(tmp_path / "served"), metrics(tmp_path / "local")
    assert row["prompts_sha"] == want["prompts_sha"]
    for key in (*RESUMABLE["grpo"][1], "reward_std", "advantage_mean", "loss", "grad_norm"):
        if key in want:
            assert row[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    assert row["reward_retries"] == row["reward_errors"] == 0 and row["reward_s"] > 0
    logs = sorted(p.name for p in (tmp_path / "served" / "logs").glob("reward-model-*.log"))
    assert logs == ["reward-model-0.log", "reward-model-1.log"]


@pytest.mark.parametrize("form, extra, words", [
    ("scalar", {}, "form scalar needs a model whose architectures end in "
                   "ForSequenceClassification or ForRewardModel"),
    ("judge", {"judge": JUDGE}, "form judge needs a model whose architectures end in "
                                "ForCausalLM or ForConditionalGeneration"),
])
def test_a_checkpoint_of_the_other_form_is_refused_before_anything_starts(
        tiny: Path, reward_model: Path, tmp_path: Path, form: str, extra: dict[str, Any],
        words: str) -> None:
    path = tiny / "model" if form == "scalar" else reward_model
    job = manifest(tiny, tmp_path, "wrong", reward={"type": "model", "model": {
        "path": str(path), "form": form, "engine": "reference", "gpusPerReplica": 0,
        **extra}})
    res = kuberl_run(job, tmp_path / "out", timeout=120)
    assert res.returncode != 0 and f"spec.reward.model.path: {words}" in res.stderr, failed(res)
    assert not (tmp_path / "out" / "logs").exists()  # (nothing started)

