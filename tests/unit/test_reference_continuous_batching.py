"""Continuous batching in the reference engine (engine.step, kv_batch): a request that joins a
running batch mid-way, or that others join or leave around, gets the tokens and logprobs it
gets alone (same seed), greedy or sampled; so does a request retracted mid-batch and resumed.
In-process on the tiny model: the test decides at which step each request joins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from kuberl_rollout.reference.engine import GenRequest, ReferenceEngine
from kuberl_rollout.reference.sampling import parse_sampling
from tests.integration.tiny_model import build_tiny_model

GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.9, "top_p": 0.95}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> ReferenceEngine:
    return ReferenceEngine(str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")))


def request(engine: ReferenceEngine, prompt: list[int], new: int, params: dict[str, Any],
            seed: int) -> GenRequest:
    sampling = parse_sampling({**params, "max_new_tokens": new, "ignore_eos": True,
                               "sampling_seed": seed})
    return engine.make_request(prompt, sampling, rid=f"r{seed}", seq=seed, return_logprob=True)


def alone(engine: ReferenceEngine, prompt: list[int], new: int, params: dict[str, Any],
          seed: int) -> dict[str, Any]:
    [result] = engine.run_alone([request(engine, prompt, new, params, seed)])
    assert result is not None
    return result


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["output_ids"] == want["output_ids"]
    have = [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]]
    expect = [lp for lp, _, _ in want["meta_info"]["output_token_logprobs"]]
    assert have == pytest.approx(expect, abs=1e-4)  # (float rounding: padded shapes)


# (prompt, max_new_tokens, joins at step): the second joins a batch narrower than its prompt,
# the third one wider; the fourth leaves early (the batch's cache is compacted around it).
SCHEDULE = [([8, 9, 10], 30, 0), ([4, 5, 40, 6, 44, 7, 11, 12, 13, 14], 12, 5),
            ([7], 9, 7), ([20, 21], 3, 7)]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_requests_joining_a_running_batch_get_what_they_get_alone(
        engine: ReferenceEngine, params: dict[str, Any]) -> None:
    want = [alone(engine, prompt, new, params, seed)
            for seed, (prompt, new, _) in enumerate(SCHEDULE)]
    reqs = [request(engine, prompt, new, params, seed)
            for seed, (prompt, new, _) in enumerate(SCHEDULE)]
    got: dict[str, dict[str, Any]] = {}
    widest = 0
    for step in range(60):
        out = engine.step(join=[r for r, (_, _, at) in zip(reqs, SCHEDULE, strict=True)
                                if at == step])
        got.update((req.rid, result) for req, result in out.finished)
        if engine._batch is not None:
            widest = max(widest, len(engine._batch.reqs))
        if len(got) == len(reqs):
            break
    assert widest == 4  # all four ran together (the fourth then left first)
    for req, expect in zip(reqs, want, strict=True):
        assert_same(got[req.rid], expect)
    assert engine._batch is None


def test_a_request_retracted_mid_batch_resumes_as_if_never_paused(
        engine: ReferenceEngine) -> None:
    want = [alone(engine, [4, 5, 6], 20, SAMPLED, 1), alone(engine, [9], 20, SAMPLED, 2)]
    first, second = request(engine, [4, 5, 6], 20, SAMPLED, 1), request(engine, [9], 20,
                                                                        SAMPLED, 2)
    engine.step(join=[first])
    for _ in range(4):
        engine.step()
    engine.step(join=[second])
    engine.suspend = True
    try:
        out = engine.step()
    finally:
        engine.suspend = False
    assert out.suspended == [first, second] and not out.finished
    assert (len(first.output_ids), len(second.output_ids)) == (6, 1)
    results = dict((req.rid, res) for req, res in engine.step(join=[second]).finished)
    for _ in range(3):
        engine.step()
    results.update((req.rid, res) for req, res in engine.step(join=[first]).finished)
    while engine._batch is not None:
        results.update((req.rid, res) for req, res in engine.step().finished)
    assert_same(results[first.rid], want[0])
    assert_same(results[second.rid], want[1])


def test_rows_leave_and_the_cache_shrinks_to_the_longest_row(engine: ReferenceEngine) -> None:
    """A batch that runs for long stays as wide as its longest row: the columns left as
    padding for everyone by rows that finished are dropped."""
    long_prompt = list(range(4, 40))
    engine.step(join=[request(engine, long_prompt, 4, GREEDY, 1)])
    engine.step(join=[request(engine, [5], 12, GREEDY, 2)])
    for _ in range(3):
        engine.step()
    batch = engine._batch
    assert batch is not None and len(batch.reqs) == 1
    # its prompt and the tokens fed so far (all but the last, sampled, one)
    assert batch.cache.width == 1 + len(batch.reqs[0].output_ids) - 1
    while engine._batch is not None:
        engine.step()



def test_a_dropped_request_leaves_and_the_others_go_on(engine: ReferenceEngine) -> None:
    """A request whose caller went away leaves at the next step, unanswered."""
    want = alone(engine, [6, 7], 10, SAMPLED, 5)
    gone, stays = request(engine, [8], 30, SAMPLED, 4), request(engine, [6, 7], 10, SAMPLED, 5)
    engine.step(join=[gone, stays])
    out = engine.step(drop=[gone])
    assert engine._batch is not None and engine._batch.reqs == [stays] and not out.finished
    results = {}
    while engine._batch is not None:
        results.update((req.rid, res) for req, res in engine.step().finished)
    assert list(results) == [stays.rid]
    assert_same(results[stays.rid], want)


def test_a_sliding_window_model_batches_whole_batches(tmp_path: Path) -> None:
    """A model with sliding-window layers cannot take rows mid-batch (kv_batch.joinable): its
    engine admits only into an empty batch, and rows still leave it, each answering as alone."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.integration.tiny_model import build_tokenizer, tiny_config

    fields = {k: v for k, v in tiny_config().to_dict().items() if k != "layer_types"}
    config = Qwen2Config(**{**fields, "use_sliding_window": True, "sliding_window": 4,
                            "max_window_layers": 1})
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    engine = ReferenceEngine(str(tmp_path))
    assert not engine.joins_running_batch
    # (the longest row leaves first: the columns only it needed are left in place)
    work = [([4, 5, 6, 7, 8, 9], 3), ([7], 12), ([9, 10], 8)]
    want = [alone(engine, prompt, new, GREEDY, i) for i, (prompt, new) in enumerate(work)]
    got = engine.run_alone([request(engine, prompt, new, GREEDY, i)
                            for i, (prompt, new) in enumerate(work)])
    for have, expect in zip(got, want, strict=True):
        assert have is not None
        assert_same(have, expect)
