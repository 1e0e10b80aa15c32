"""/classify (a reward model served with --is-embedding) against the pinned SGLang's own code:
the bodies the reference engine accepts build SGLang's EmbeddingReqInput with the same batch
shape, the bodies it refuses SGLang refuses with the same message, SGLang serves the tiny
reward model's architecture as an embedding model, and pools it at the last token unnormalised
(what kuberl_rollout/reference/classifier.py does)."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kuberl_rollout.reference.classify_server import HttpError, parse_inputs
from tests.sglang_contract.conftest import load_io_struct

io_struct = load_io_struct()
import sglang  # noqa: E402  isort: skip  (the pinned wheel's: conftest)

SRT = Path(sglang.__file__).parent / "srt"


def tokenize(text: str) -> list[int]:
    return [1] * len(text)


def embedding_request(body: dict[str, Any]) -> Any:
    cls = io_struct.EmbeddingReqInput
    assert set(body) <= {f.name for f in dataclasses.fields(cls)}
    req = cls(**body)
    req.normalize_batch_and_arguments()  # what SGLang's tokenizer manager does first
    return req


@pytest.mark.parametrize("body", [
    {"text": "1+1=2"}, {"text": "1+1=2", "rid": "r"}, {"text": ["1+1=2", "2+2=5"]},
    {"text": ["a", "b"], "rid": ["x", "y"]}, {"input_ids": [3, 4, 5]},
    {"input_ids": [[3, 4], [5]]}, {"input_ids": [[3, 4]], "rid": ["only"]},
])
def test_accepted_bodies_are_sglangs_batches(body: dict[str, Any]) -> None:
    req = embedding_request(body)
    rows, rids, single = parse_inputs(body, tokenize)
    assert (single, len(rows)) == (req.is_single, req.batch_size)
    assert rids == ([req.rid] if req.is_single else req.rid) or body.get("rid") is None


@pytest.mark.parametrize("body", [{}, {"rid": "r"}, {"text": "a", "input_ids": [1]}])
def test_refused_bodies_have_sglangs_messages(body: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as sglang_error:
        embedding_request(body)
    with pytest.raises(HttpError) as reference_error:
        parse_inputs(body, tokenize)
    assert reference_error.value.message == str(sglang_error.value)


def test_a_batch_with_one_rid_is_refused_as_sglang_asserts() -> None:
    body = {"text": ["a", "b"], "rid": "r"}
    with pytest.raises(AssertionError) as sglang_error:
        embedding_request(body)
    with pytest.raises(HttpError) as reference_error:
        parse_inputs(body, tokenize)
    assert reference_error.value.message == str(sglang_error.value)


def _function(path: Path, name: str) -> Callable[..., Any]:
    """A pure function of the pinned wheel's source, compiled alone (its module imports
    CUDA-only kernels)."""
    tree = ast.parse(path.read_text(), str(path))
    [node] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    header = ast.parse("from typing import List, Optional").body
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=[*header, node], type_ignores=[]), str(path), "exec"),
         namespace)
    return namespace[name]  # type: ignore[no-any-return]


def test_sglang_serves_the_tiny_reward_models_architecture_as_an_embedding_model() -> None:
    is_generation = _function(SRT / "configs" / "model_config.py", "is_generation_model")
    # (kuberl_trainer.tiny.reward_model writes this architecture)
    assert is_generation(["Qwen2ForSequenceClassification"]) is False
    assert is_generation(["Qwen2ForCausalLM"]) is True


# (qwen3_classification.py normalises only for a config with neither id2label nor label2id,
# which a checkpoint saved by HF transformers always has)
@pytest.mark.parametrize("module", ["qwen2_classification", "llama_classification"])
def test_sglang_pools_classification_models_at_the_last_token_unnormalised(module: str) -> None:
    tree = ast.parse((SRT / "models" / f"{module}.py").read_text(encoding="utf-8-sig"))
    poolers = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
               and isinstance(n.func, ast.Name) and n.func.id == "Pooler"]
    assert poolers, module
    for call in poolers:
        kwargs = {k.arg: ast.unparse(k.value) for k in call.keywords}
        assert kwargs == {"pooling_type": "PoolingType.LAST", "normalize": "False"}, module
