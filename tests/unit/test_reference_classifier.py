"""The reference engine's --is-embedding mode in-process: the classifier's scores (a batch as
each row alone, as HF's own model scores the same text, SGLang's LAST pooling) and the
/classify server's answers and refusals (SGLang 0.5.6's shapes and messages), on a random tiny
Qwen2ForSequenceClassification."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from aiohttp.test_utils import TestClient, TestServer
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from kuberl_rollout.reference.classifier import Classifier
from kuberl_rollout.reference.classify_server import ClassifierServer
from tests.integration.tiny_model import PAD_ID, build_tiny_classifier

TEXTS = ["what is 2+2?4", "hello", "a much longer input, to be padded around.", "x"]
TIGHT = {"atol": 1e-5, "rtol": 1e-5}  # float32 rounding of a padded batch vs a row alone
KEY = "classifier-key-1"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_classifier(tmp_path_factory.mktemp("rm") / "model", num_labels=2)


@pytest.fixture(scope="module")
def classifier(model_dir: Path) -> Classifier:
    return Classifier(str(model_dir))


def hf_scores(model_dir: Path, text: str) -> torch.Tensor:
    """HF's own AutoModelForSequenceClassification and tokenizer on `text` alone: its logits."""
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        return model(**tokenizer(text, return_tensors="pt")).logits[0]


def test_a_batch_scores_each_row_as_alone_and_as_hf(classifier: Classifier,
                                                    model_dir: Path) -> None:
    rows = [classifier.tokenize(t) for t in TEXTS]
    batch = torch.tensor(classifier.score(rows))
    assert batch.shape == (len(TEXTS), 2)  # num_labels raw outputs each
    for i, (row, text) in enumerate(zip(rows, TEXTS, strict=True)):
        alone = torch.tensor(classifier.score([row])[0])
        assert torch.allclose(batch[i], alone, **TIGHT), (text, batch[i], alone)
        assert torch.allclose(alone, hf_scores(model_dir, text), **TIGHT), text
    # the head's outputs, not probabilities: no softmax or normalisation
    assert not torch.allclose(batch.sum(-1), torch.ones(len(TEXTS)))


def test_forwards_split_by_the_batch_limits_score_the_same(model_dir: Path,
                                                           classifier: Classifier) -> None:
    rows = [classifier.tokenize(t) for t in TEXTS * 3]
    small = Classifier(str(model_dir), max_batch_size=2, max_prefill_tokens=20)
    assert len(small._groups(sorted(len(r) for r in rows))) > len(rows) // 2
    assert torch.allclose(torch.tensor(small.score(rows)),
                          torch.tensor(classifier.score(rows)), **TIGHT)


def test_the_last_token_is_pooled_even_when_it_is_the_pad_token(
        classifier: Classifier, model_dir: Path) -> None:
    """SGLang's Pooler(LAST) takes the input's last token; HF's forward would skip a trailing
    pad token, so the reference engine scores as HF does with no pad token to skip."""
    row = [*classifier.tokenize("hello"), PAD_ID]
    [got] = classifier.score([row])
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    model.config.pad_token_id = None
    with torch.no_grad():
        want = model(input_ids=torch.tensor([row])).logits[0]
    assert torch.allclose(torch.tensor(got), want, **TIGHT)
    assert not torch.allclose(torch.tensor(got), torch.tensor(classifier.score([row[:-1]])[0]))


def test_inputs_are_checked(classifier: Classifier) -> None:
    with pytest.raises(ValueError, match="longer than the model's context length"):
        classifier.check([3] * classifier.context_len)
    with pytest.raises(ValueError, match="out of range"):
        classifier.check([1, classifier.vocab_size])
    with pytest.raises(ValueError, match="no tokens"):
        classifier.check([])


def test_a_causal_lm_is_refused(tmp_path: Path) -> None:
    from tests.integration.tiny_model import build_tiny_model

    with pytest.raises(ValueError, match="--is-embedding"):
        Classifier(str(build_tiny_model(tmp_path / "lm")))


# ---- over HTTP (aiohttp's test server, in-process) ----------------------------------------

Call = Callable[[TestClient[Any, Any]], Coroutine[Any, Any, None]]


def serve(classifier: Classifier, call: Call, api_key: str = "") -> None:
    async def run() -> None:
        server = ClassifierServer(classifier, api_key=api_key)
        async with TestClient(TestServer(server.app())) as client:
            await call(client)

    asyncio.run(run())


async def post(client: TestClient[Any, Any], path: str, body: Any,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with client.post(path, json=body, headers=headers or {}) as resp:
        return resp.status, await resp.json()


def test_classify_answers_as_sglang(classifier: Classifier) -> None:
    async def call(client: TestClient[Any, Any]) -> None:
        ids = [classifier.tokenize(t) for t in TEXTS]
        status, by_text = await post(client, "/classify", {"text": TEXTS, "rid": list("abcd")})
        assert status == 200 and isinstance(by_text, list) and len(by_text) == len(TEXTS)
        _, by_ids = await post(client, "/classify", {"input_ids": ids})
        for text_answer, ids_answer in zip(by_text, by_ids, strict=True):
            assert text_answer["embedding"] == ids_answer["embedding"]  # one forward's numbers
        first = by_text[0]
        assert set(first) == {"embedding", "meta_info"}
        meta = first["meta_info"]
        assert (meta["id"], meta["finish_reason"], meta["prompt_tokens"]) == (
            "a", {"type": "length", "length": 0}, len(ids[0]))
        assert {"weight_version", "total_retractions", "e2e_latency"} <= set(meta)
        assert "completion_tokens" not in meta  # (SGLang's embedding meta_info has none)
        # a single input: a single object, scored as in the batch
        _, single = await post(client, "/classify", {"text": TEXTS[1], "rid": "one"})
        assert isinstance(single, dict) and single["meta_info"]["id"] == "one"
        assert torch.allclose(torch.tensor(single["embedding"]),
                              torch.tensor(by_text[1]["embedding"]), **TIGHT)
        _, single_ids = await post(client, "/encode", {"input_ids": ids[1]})
        assert single_ids["embedding"] == single["embedding"]

    serve(classifier, call)


@pytest.mark.parametrize("body, status, message", [
    ({"text": "a", "input_ids": [1]}, 400, "text and input_ids cannot be provided at the same "
     "time"),
    ({}, 400, "At least one of text, input_ids, or image should be provided"),
    ({"rid": "r"}, 400, "At least one of text, input_ids, or image should be provided"),
    ({"text": ["a", "b"], "rid": "r"}, 400, "The rid should be a list."),
    ({"text": ["a", "b"], "rid": ["r"]}, 400, "rid has 1 entries for 2 inputs"),
    ({"text": []}, 400, "empty batch"),
    ({"input_ids": []}, 400, "input_ids must be a non-empty list"),
    ({"input_ids": [[1, 2], [999]]}, 400, "out of range"),
    ({"text": "x" * 300}, 400, "longer than the model's context length"),
    ({"text": "a", "dimensions": 1}, 400, "not supported by the reference engine"),
])
def test_classify_refusals(classifier: Classifier, body: dict[str, Any], status: int,
                           message: str) -> None:
    async def call(client: TestClient[Any, Any]) -> None:
        got_status, got = await post(client, "/classify", body)
        assert got_status == status
        assert message in got["error"]["message"]

    serve(classifier, call)


def test_the_rest_of_the_api_says_it_is_a_reward_model(classifier: Classifier) -> None:
    async def call(client: TestClient[Any, Any]) -> None:
        status, answer = await post(client, "/generate", {"text": "hello"})
        assert status == 400 and "/classify" in answer["error"]["message"]
        async with client.get("/get_model_info") as resp:
            assert (await resp.json())["is_generation"] is False
        async with client.get("/health_generate") as resp:
            assert resp.status == 200
        status, answer = await post(client, "/update_weights_from_distributed",
                                    {"names": [], "dtypes": [], "shapes": [],
                                     "group_name": "g"})
        assert status == 400 and answer["success"] is False

    serve(classifier, call)


def test_the_api_key_covers_classify(classifier: Classifier) -> None:
    async def call(client: TestClient[Any, Any]) -> None:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert await post(client, "/classify", {"text": "a"}, headers) == (
                401, {"error": "Unauthorized"})
        status, _ = await post(client, "/classify", {"text": "a"},
                               {"Authorization": f"Bearer {KEY}"})
        assert status == 200
        async with client.get("/health") as resp:  # (SGLang's rule: /health* pass)
            assert resp.status == 200

    serve(classifier, call, api_key=KEY)


@pytest.mark.parametrize("flags", [["--tp-size", "2"], ["--mem-fraction-static", "0.5"],
                                   ["--enable-weights-cpu-backup"], ["--batching", "batch"],
                                   ["--weight-sync-timeout", "30"]])
def test_generation_flags_are_refused_with_is_embedding(
        flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from kuberl_rollout.reference.__main__ import parse_args

    base = ["--model-path", "m"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--is-embedding", *flags])
    assert f"{flags[0]}: not with --is-embedding" in capsys.readouterr().err
    assert parse_args([*base, *flags]).is_embedding is False  # (fine for generation)
