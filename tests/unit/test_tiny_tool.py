"""The tiny agent's task (kuberl_trainer.tiny.tool): problems, the SFT rows that show a result
but never a call, the calculator environment, the tool build and its exact measures."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import torch

from kuberl_trainer.agents.environment import as_observation, as_step_result
from kuberl_trainer.tiny import sft, tokenizer as tok
from kuberl_trainer.tiny.build import MANIFEST, TRAIN_FILE, BuildConfig, build
from kuberl_trainer.tiny.evaluate import sequence_logprob
from kuberl_trainer.tiny.tool import Calculator, ToolProblem, evaluate, split
from kuberl_trainer.tiny.vocab import EQUALS_ID, VOCAB


def test_problems_are_three_operands_and_their_sum() -> None:
    p = ToolProblem(23, 58, 11)
    assert p.record() == {"prompt": "23+58+11=", "label": "92"}
    train, held = split(0, 200, 50)
    assert len(train) == 200 and len(held) == 50
    assert not {q.prompt for q in train} & {q.prompt for q in held}
    assert all(10 <= x <= 99 for q in train + held for x in (q.a, q.b, q.c))
    assert split(0, 200, 50) == (train, held) and split(1, 200, 50) != (train, held)


def test_sft_rows_show_the_result_but_keep_the_call_and_result_out_of_the_loss() -> None:
    tokenizer = tok.make_tokenizer()
    p = ToolProblem(23, 58, 11)
    ids, _, labels = sft.tool_rows(tokenizer, [p], read_fraction=1.0, seed=0)
    text = tokenizer.decode(ids[0].tolist())
    assert text == "23+58+11==92=92<eos>"
    trained = [tokenizer.decode([t]) for t in labels[0].tolist() if t != sft.IGNORE]
    assert trained == ["9", "2", "<eos>"]  # the answer only: never "=" (the call)
    direct, _, labels = sft.tool_rows(tokenizer, [p], read_fraction=0.0, seed=0)
    assert tokenizer.decode(direct[0].tolist()) == "23+58+11=92<eos>"
    assert int((labels[0] != sft.IGNORE).sum()) == 3


def _episode(env: Calculator, sample: dict[str, str], turns: list[list[int]],
             **args: str) -> list[Any]:
    async def run() -> list[Any]:
        out: list[Any] = [as_observation(await env.reset(sample, **args), "reset")]
        for action in turns:
            text = "".join(k for t in action for k, v in VOCAB.items() if v == t and k in
                           tok.SYMBOLS and t != EQUALS_ID)
            out.append(as_step_result(await env.step(action, text), "step"))
        await env.close()
        return out
    return asyncio.run(run())


def _ids(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def test_a_turn_ending_in_equals_is_a_call_and_the_answer_ends_the_episode() -> None:
    sample = {"prompt": "23+58+11=", "label": "92"}
    reset, call, answer = _episode(Calculator(), sample, [_ids("="), [*_ids("92"), 1]])
    assert reset.stop_token_ids == (EQUALS_ID,) and reset.ids is None and not reset.text
    assert call.observation.text == "92=" and not call.done and call.reward == 0.0
    assert answer.done and answer.reward == 1.0 and answer.metrics == {"calls": 1.0}
    # a lying calculator's result is 10 off; answering without a call is scored the same way
    _, lie = _episode(Calculator(), sample, [_ids("=")], lie="1")[:2]
    assert lie.observation.text == "102="
    _, wrong = _episode(Calculator(), sample, [[*_ids("91"), 1]])
    assert wrong.done and wrong.reward == 0.0 and wrong.metrics == {"calls": 0.0}


def test_the_calculator_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="lie must be"):
        _episode(Calculator(), {"prompt": "1+2+3=", "label": "6"}, [], lie="yes")
    assert evaluate("23+58+11") == 92
    with pytest.raises(ValueError, match="not a sum"):
        evaluate("2*3")


def test_sequence_logprob_is_the_sum_of_the_continuations_token_logprobs() -> None:
    """Against a direct computation, with prefixes and continuations of mixed lengths."""
    from kuberl_trainer.tiny.model import ModelShape, make_model

    model, tokenizer = make_model(ModelShape(hidden=32, layers=1, heads=2, intermediate=32),
                                  0), tok.make_tokenizer()
    prefixes, conts = ["1+2=", "11+2=", "1+2="], ["3", "13", "45"]
    got = sequence_logprob(model, tokenizer, prefixes, conts)
    for i, (p, c) in enumerate(zip(prefixes, conts, strict=True)):
        ids = torch.tensor([_ids(p) + _ids(c)])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        want = sum(float(logp[len(p) - 1 + k, VOCAB[ch]]) for k, ch in enumerate(c))
        assert float(got[i]) == pytest.approx(want, abs=1e-5)


def test_the_tool_build_records_its_measures_and_keeps_the_add_builds_key(
        tmp_path: Path) -> None:
    config = BuildConfig(sft_steps=3, n_eval=16, eval_samples=2, variant="tool", n_train=64)
    record = build(tmp_path, config, log=lambda _: None)
    assert json.loads((tmp_path / MANIFEST).read_text())["config"]["variant"] == "tool"
    assert record["train_problems"] == 64 and record["eval_problems"] == 16
    for key in ("call_prob", "read_accuracy", "direct_accuracy", "expected_reward_truthful"):
        assert 0.0 <= record[key] <= 1.0, key
    first = json.loads((tmp_path / TRAIN_FILE).read_text().splitlines()[0])
    assert first["prompt"].count("+") == 2
    # the add build's cache key is what it was before the variants (caches stay valid)
    assert "variant" not in BuildConfig().key()
