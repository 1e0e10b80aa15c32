"""A reward model the job serves (reward.type model): its requests and answers as pure functions
(rollout/rewards/model_io.py: SGLang's /classify for a scalar head, /generate for a judge, the
chat template, the judge's score), the reward service's client speaking them to a real HTTP
server on loopback (batches over the replicas, the engines' API key, a judge's answer without
a score failing the job or dropping its group), the engines' command line, their Ray resources,
and preflight's refusals of a checkpoint of the wrong form."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kuberl_api import parse
from kuberl_api.runtime import RESOURCE_REWARD, RESOURCE_ROLLOUT, RESOURCE_TRAIN
from kuberl_api.spec import RLJobSpec
from kuberl_trainer.engines.actors import EngineServer
from kuberl_trainer.placement import local_resources, reward_actor
from kuberl_trainer.preflight import PreflightError, check_reward_model
from kuberl_trainer.rollout.reward_client import RemoteScorer
from kuberl_trainer.rollout.rewards.model_io import (
    JudgeCodec,
    ScalarCodec,
    chat_render,
    judge_score,
)
from kuberl_trainer.rollout.rewards.protocol import AnswerError, Result
from kuberl_trainer.rollout.rewards.scorer import RewardError, RewardInput
from kuberl_trainer.tiny.tokenizer import make_tokenizer

CPU_ROLLOUT = {"engine": "reference", "gpus": 0}
SCALAR = {"type": "model", "model": {"path": "/rm", "engine": "reference",
                                     "gpusPerReplica": 0, "replicas": 2}}
JUDGE_PROMPT = "Problem {prompt}; answer {response}; grade it 0-9 (the label is {label})."


def spec(**body: Any) -> RLJobSpec:
    doc = {"model": {"path": "/m"}, "data": {"prompts": "/d.jsonl"}} | body
    return parse({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
                  "metadata": {"name": "rm"}, "spec": doc}).spec


def items(count: int) -> list[RewardInput]:
    return [RewardInput(id=f"0:0:{i}:0", prompt=f"{i}+1=", response=str(i + 1 + i % 2),
                        label=str(i + 1)) for i in range(count)]


def templated() -> Any:
    """The tiny tokenizer with a chat template of its own (the tiny one has none)."""
    tok = make_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    return tok


# --- requests and answers ---------------------------------------------------------------------

def test_a_scalar_model_scores_the_conversation_through_the_chat_template() -> None:
    (item,) = items(1)
    assert ScalarCodec(chat_render(templated())).body([item]) == {
        "text": ["<user>0+1=<assistant>1"]}
    # no template (the tiny tokenizer's case): the prompt, then the response
    assert ScalarCodec(chat_render(make_tokenizer())).body([item]) == {"text": ["0+1=1"]}


def test_a_judge_is_asked_its_prompt_filled_in_greedily() -> None:
    (item,) = items(1)
    codec = JudgeCodec(chat_render(templated()), JUDGE_PROMPT, r"-?\d+(?:\.\d+)?", 16)
    assert codec.body([item]) == {
        "text": ["<user>Problem 0+1=; answer 1; grade it 0-9 (the label is 1).<assistant>"],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 16}}


def test_classify_answers_are_the_rewards_in_order() -> None:
    codec = ScalarCodec(chat_render(make_tokenizer()))
    two = items(2)
    answer = [{"embedding": [0.25], "meta_info": {}}, {"embedding": [-1.5], "meta_info": {}}]
    assert codec.parse(json.dumps(answer), two) == [Result(0.25), Result(-1.5)]
    assert codec.parse(json.dumps(answer[0]), two[:1]) == [Result(0.25)]  # one: an object


@pytest.mark.parametrize("answer, words", [
    ("[]", "0 entries for 1 samples"),
    ('[{"embedding": [0.1, 0.9]}]', "holds 2 scores: a scalar reward model's head gives one"),
    ('[{"embedding": []}]', "no embedding"),
    ('[{"embedding": ["0.5"]}]', "not a finite number"),
    ("not json", "not JSON"),
])
def test_a_malformed_classify_answer_says_what_is_wrong(answer: str, words: str) -> None:
    with pytest.raises(AnswerError, match=words):
        ScalarCodec(chat_render(make_tokenizer())).parse(answer, items(1))


@pytest.mark.parametrize("answer, pattern, score", [
    ("Score: 7", r"-?\d+(?:\.\d+)?", 7.0),
    ("3 mistakes, so 2.5 of 10", r"-?\d+(?:\.\d+)?", 10.0),  # the last number
    ("3 mistakes, so 2.5 of 10", r"so (-?\d+(?:\.\d+)?)", 2.5),  # the group
    ("score -1", r"-?\d+", -1.0),
    ("no digits here", r"-?\d+", None),
    ("grade: A", r"grade: (\w)", None),  # a match that is not a number: no score
])
def test_a_judges_score_is_the_last_match(answer: str, pattern: str,
                                          score: float | None) -> None:
    assert judge_score(answer, pattern) == score


# --- the client, against a real server ----------------------------------------------------------

class Engines:
    """Loopback stand-ins of a reward model's replicas: /classify scores a text by its length
    (tenths), /generate answers "score <last char>" (or "no idea" for a text ending in "9");
    every request's path, replica, size and Authorization header is recorded."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int, str | None]] = []

    @asynccontextmanager
    async def serving(self, replicas: int) -> AsyncIterator[list[str]]:
        runners = []
        for k in range(replicas):
            app = web.Application()
            app.router.add_post("/classify", partial(self._classify, k=k))
            app.router.add_post("/generate", partial(self._generate, k=k))
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
        try:
            yield [f"http://127.0.0.1:{r.addresses[0][1]}" for r in runners]
        finally:
            for r in runners:
                await r.cleanup()

    async def _texts(self, request: web.Request, k: int) -> list[str]:
        body = await request.json()
        self.seen.append((request.path, k, len(body["text"]),
                          request.headers.get("Authorization")))
        texts: list[str] = body["text"]
        return texts

    async def _classify(self, request: web.Request, k: int) -> web.Response:
        texts = await self._texts(request, k)
        return web.json_response([{"embedding": [len(t) / 10], "meta_info": {}}
                                  for t in texts])

    async def _generate(self, request: web.Request, k: int) -> web.Response:
        texts = await self._texts(request, k)
        return web.json_response([{"text": "no idea" if t.endswith("9") else f"score {t[-1]}"}
                                  for t in texts])


def scorer(urls: list[str], codec: Any, **kwargs: Any) -> RemoteScorer:
    settings: dict[str, Any] = {"timeout_s": 5.0, "max_retries": 1, "batch_size": 3,
                                "max_concurrent": 4, "rng": random.Random(0),
                                "backoff_base_s": 0.001, "headers": {"Authorization": "Bearer k"},
                                "codec": codec, "name": "the reward model"}
    return RemoteScorer(urls, **(settings | kwargs))


def test_a_scalar_models_batches_go_round_its_replicas_with_the_engines_key() -> None:
    async def run() -> None:
        engines = Engines()
        async with engines.serving(2) as urls:
            its = items(7)
            scored = await scorer(urls, ScalarCodec(chat_render(make_tokenizer()))).score(its)
        assert scored.rewards == [len(i.prompt + i.response) / 10 for i in its]
        assert sorted(engines.seen) == [("/classify", 0, 1, "Bearer k"),
                                        ("/classify", 0, 3, "Bearer k"),
                                        ("/classify", 1, 3, "Bearer k")]
    asyncio.run(run())


def test_identical_samples_are_scored_once_and_get_one_reward() -> None:
    """A group's repeated answers: each distinct text is sent once (batches of 3 over the
    distinct ones), and every copy gets its reward."""
    its = items(4) * 3  # (the same 4 samples, thrice, with their own ids)
    its = [RewardInput(id=f"0:0:{k}:0", prompt=i.prompt, response=i.response, label=i.label)
           for k, i in enumerate(its)]

    async def run(once: bool) -> tuple[Any, Engines]:
        engines = Engines()
        async with engines.serving(1) as urls:
            codec = ScalarCodec(chat_render(make_tokenizer()))
            return await scorer(urls, codec, once=once).score(its), engines

    scored, engines = asyncio.run(run(True))
    assert scored.rewards == [len(i.prompt + i.response) / 10 for i in its]
    assert sorted(n for _, _, n, _ in engines.seen) == [1, 3]  # 4 distinct texts
    _, engines = asyncio.run(run(False))
    assert sum(n for _, _, n, _ in engines.seen) == 12


def test_a_judges_answer_without_a_score_fails_the_job_or_drops_its_sample() -> None:
    """Item 8's judge prompt ends in "9" (its label): the stand-in answers it without a
    score. fail: the job fails naming the sample and quoting the answer; drop: that sample
    alone has no reward, the others are scored."""
    codec = JudgeCodec(chat_render(make_tokenizer()), "{response} {label}", r"\d", 8)

    async def run(drop: bool) -> Any:
        async with Engines().serving(2) as urls:
            return await scorer(urls, codec, drop=drop).score(items(10))

    with pytest.raises(RewardError, match=r"the reward model http://127\.0\.0\.1:\d+/generate: "
                       r"sample 0:0:8:0: the judge's answer holds no score \(reward\.model\."
                       r"judge\.scorePattern '\\\\d'\): 'no idea'"):
        asyncio.run(run(False))
    scored = asyncio.run(run(True))
    assert scored.rewards == [float(i.label[-1]) if k != 8 else None
                              for k, i in enumerate(items(10))]
    assert scored.errors[8] is not None and "no score" in scored.errors[8]
    assert scored.errors[:8] == [None] * 8


# --- the engines: command line, resources -------------------------------------------------------

def reward_command(**reward: Any) -> list[str]:
    s = spec(rollout=CPU_ROLLOUT, training={"gpusPerNode": 0, "backend": "fsdp"},
             reward={"type": "model"} | reward)
    server = EngineServer(s.model_dump_json(by_alias=True), index=1, seed=8, role="reward")
    return server._command(s.model.path, 30001, 30002)


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_a_scalar_model_on_the_reference_engine_is_served_as_an_embedding_model() -> None:
    cmd = reward_command(model={"path": "/rm", "tokenizer": "/rt", "engine": "reference",
                                "gpusPerReplica": 0,
                                "engineArgs": {"max-batch-size": "64"}})
    assert cmd[1:3] == ["-m", "kuberl_rollout.reference"]
    assert flag(cmd, "--model-path") == "/rm" and flag(cmd, "--tokenizer-path") == "/rt"
    assert flag(cmd, "--device") == "cpu" and flag(cmd, "--tp-size") == "1"
    assert flag(cmd, "--seed") == "8" and flag(cmd, "--port") == "30001"
    assert "--is-embedding" in cmd and flag(cmd, "--max-batch-size") == "64"
    assert "--enable-metrics" in cmd


def test_a_judge_on_sglang_generates_over_its_gpus() -> None:
    cmd = reward_command(model={"path": "/judge", "form": "judge", "gpusPerReplica": 2,
                                "judge": {"prompt": "{response}"}})
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert flag(cmd, "--tp-size") == "2" and flag(cmd, "--random-seed") == "8"
    assert flag(cmd, "--nccl-port") == "30002" and flag(cmd, "--model-path") == "/judge"
    assert "--is-embedding" not in cmd


def test_reward_engines_ask_for_the_reward_pods_and_fit_one_machine() -> None:
    cpu = spec(rollout=CPU_ROLLOUT, training={"gpusPerNode": 0, "backend": "fsdp"},
               reward=SCALAR)
    shape = reward_actor(cpu)
    assert shape is not None and shape.num_gpus == 0
    assert shape.resources == {RESOURCE_REWARD: 1}
    assert local_resources(cpu) == {RESOURCE_TRAIN: 1, RESOURCE_ROLLOUT: 1, RESOURCE_REWARD: 2}
    gpu = spec(reward={"type": "model", "model": {"path": "/rm", "gpusPerReplica": 2}})
    shape = reward_actor(gpu)
    assert shape is not None and shape.num_gpus == 2
    assert shape.resources == {RESOURCE_REWARD: 2}
    assert reward_actor(spec()) is None


# --- preflight -----------------------------------------------------------------------------------

def checkpoint(where: Path, **config: Any) -> str:
    where.mkdir()
    (where / "config.json").write_text(json.dumps(config))
    (where / "model.safetensors").write_bytes(b"")
    (where / "tokenizer.json").write_text("{}")
    return str(where)


def test_preflight_refuses_a_checkpoint_of_the_other_form(tmp_path: Path) -> None:
    lm = checkpoint(tmp_path / "lm", architectures=["Qwen2ForCausalLM"],
                    num_attention_heads=4, num_key_value_heads=4, intermediate_size=256)
    head = checkpoint(tmp_path / "head", architectures=["Qwen2ForSequenceClassification"],
                      id2label={"0": "LABEL_0"})
    two = checkpoint(tmp_path / "two", architectures=["LlamaForSequenceClassification"],
                     id2label={"0": "bad", "1": "good"})

    def check(path: str, **model: Any) -> None:
        check_reward_model(spec(reward={"type": "model",
                                        "model": {"path": path, "gpusPerReplica": 1} | model}))

    check(head)
    check(lm, form="judge", judge={"prompt": "{response}"})
    with pytest.raises(PreflightError, match=r"spec.reward.model.path: form scalar needs a "
                       r"model whose architectures end in ForSequenceClassification or "
                       r"ForRewardModel; .*\['Qwen2ForCausalLM'\] \(form judge serves a "
                       r"causal LM\)"):
        check(lm)
    with pytest.raises(PreflightError, match=r"form judge needs a model whose architectures "
                       r"end in ForCausalLM or ForConditionalGeneration"):
        check(head, form="judge", judge={"prompt": "{response}"})
    with pytest.raises(PreflightError, match=r"a scalar reward model scores with one output; "
                       r".* has 2 labels"):
        check(two)
    with pytest.raises(PreflightError, match=r"spec\.reward\.model\.gpusPerReplica: tensor "
                       r"parallel size 3 must divide the model's 4 attention heads"):
        check(lm, form="judge", judge={"prompt": "{response}"}, gpusPerReplica=3)
    with pytest.raises(PreflightError, match=r"spec\.reward\.model\.path: .* is not a directory"):
        check(str(tmp_path / "nowhere"))


def test_preflight_refuses_reward_auth_without_its_credential(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kuberl_api.runtime import ENV_REWARD_AUTH
    from kuberl_trainer.preflight import check_reward_auth

    job = spec(reward={"type": "remote", "url": "https://g.example/score",
                       "auth": {"secret": "grader"}})
    monkeypatch.delenv(ENV_REWARD_AUTH, raising=False)
    with pytest.raises(PreflightError, match=r"spec\.reward\.auth: the credential is read "
                       r"from \$KUBERL_REWARD_AUTH, which is not set here \(set it to the "
                       r"value of key token of Secret grader"):
        check_reward_auth(job)
    monkeypatch.setenv(ENV_REWARD_AUTH, "s3cret")
    check_reward_auth(job)
