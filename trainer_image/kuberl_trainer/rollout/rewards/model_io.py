"""A served reward model's requests and answers (reward.type model, docs/rewards.md), as pure
functions: what a batch of samples becomes on the engine's HTTP API, and how its answer becomes
one reward per sample. The client that sends them (batches, concurrency, retries, fail or drop)
is the reward service's, rollout/reward_client.py's RemoteScorer; this is its codec.

- form scalar: ``POST /classify {"text": [conversation, ...]}`` (SGLang's native endpoint for a
  model served with --is-embedding; the reference engine's too); the answer is one
  ``{"embedding": [score], "meta_info": ...}`` per text, in order, and the score is the reward.
  The conversation is the sample's prompt as the user's turn and its response as the
  assistant's, through the reward model tokenizer's chat template (what a reward model such as
  Skywork's was trained on), or the prompt followed by the response when it has none.
- form judge: ``POST /generate {"text": [judge prompt, ...], "sampling_params": {temperature 0,
  max_new_tokens}}``, the judge prompt being judge.prompt filled with the sample's prompt,
  response and label, as the user's turn through the chat template with the assistant's turn
  opened (or as it is, without a template); the answer is one ``{"text": ...}`` per prompt, and
  the reward is the last match of judge.scorePattern in it. An answer without a score is that
  sample's error, never a reward of 0: it fails the job or, with onError drop, drops the
  sample's group, as a failed batch does.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kuberl_api.spec import RewardModelSpec
from kuberl_trainer.rollout.rewards.protocol import AnswerError, Result, trimmed
from kuberl_trainer.rollout.rewards.scorer import RewardInput

CLASSIFY_PATH = "/classify"
GENERATE_PATH = "/generate"
ANSWER_QUOTE = 200  # characters of a judge's answer quoted when it holds no score

# (messages, open the assistant's turn) -> the text the model reads
ChatRender = Callable[[list[dict[str, str]], bool], str]


class Codec(Protocol):
    """How a batch is asked for and its answer read (RemoteScorer's `codec`). `parse`
    returns one Result per item, or the item's error (str) where the answer gave it none."""

    @property
    def path(self) -> str:
        """Appended to each URL."""
        ...

    def body(self, batch: Sequence[RewardInput]) -> dict[str, Any]: ...

    def parse(self, text: str, batch: Sequence[RewardInput]) -> list[Result | str]: ...


def chat_render(tokenizer: Any) -> ChatRender:
    """The tokenizer's chat template as a ChatRender, or plain concatenation of the messages'
    contents when it has none."""
    if getattr(tokenizer, "chat_template", None):
        def render(messages: list[dict[str, str]], open_turn: bool) -> str:
            text: str = tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=open_turn)
            return text
        return render
    return lambda messages, _open: "".join(m["content"] for m in messages)


def _answers(text: str, count: int, what: str) -> list[dict[str, Any]]:
    """The engine's JSON answer as `count` objects (a batch's list; one object alone)."""
    try:
        body = json.loads(text)
    except ValueError:
        raise AnswerError(f"the {what} answer is not JSON") from None
    if isinstance(body, dict):
        body = [body]
    if not isinstance(body, list) or not all(isinstance(b, dict) for b in body):
        raise AnswerError(f"the {what} answer is not a list of objects")
    if len(body) != count:
        raise AnswerError(f"the {what} answer has {len(body)} entries for {count} samples")
    return body


@dataclass(frozen=True)
class ScalarCodec:
    render: ChatRender
    path: str = CLASSIFY_PATH

    def text(self, item: RewardInput) -> str:
        return self.render([{"role": "user", "content": item.prompt},
                            {"role": "assistant", "content": item.response}], False)

    def body(self, batch: Sequence[RewardInput]) -> dict[str, Any]:
        return {"text": [self.text(i) for i in batch]}

    def parse(self, text: str, batch: Sequence[RewardInput]) -> list[Result | str]:
        out: list[Result | str] = []
        for k, entry in enumerate(_answers(text, len(batch), "/classify")):
            scores = entry.get("embedding")
            if not isinstance(scores, list) or not scores:
                raise AnswerError(f"answer[{k}] has no embedding (the reward model's scores)")
            if len(scores) != 1:
                raise AnswerError(f"answer[{k}] holds {len(scores)} scores: a scalar reward "
                                  "model's head gives one (num_labels 1)")
            score = scores[0]
            if isinstance(score, bool) or not isinstance(score, int | float) or not (
                    math.isfinite(score)):
                raise AnswerError(f"answer[{k}]'s score is {json.dumps(score)[:80]}, not a "
                                  "finite number")
            out.append(Result(float(score)))
        return out


@dataclass(frozen=True)
class JudgeCodec:
    render: ChatRender
    prompt: str  # judge.prompt: a format string over prompt, response, label
    score_pattern: str
    max_new_tokens: int
    path: str = GENERATE_PATH

    def text(self, item: RewardInput) -> str:
        ask = self.prompt.format(prompt=item.prompt, response=item.response, label=item.label)
        return self.render([{"role": "user", "content": ask}], True)

    def body(self, batch: Sequence[RewardInput]) -> dict[str, Any]:
        return {"text": [self.text(i) for i in batch],
                "sampling_params": {"temperature": 0.0, "max_new_tokens": self.max_new_tokens}}

    def parse(self, text: str, batch: Sequence[RewardInput]) -> list[Result | str]:
        return [self.score(entry.get("text"), k)
                for k, entry in enumerate(_answers(text, len(batch), "/generate"))]

    def score(self, answer: Any, k: int = 0) -> Result | str:
        """The judge's `answer`'s score, or why it has none."""
        if not isinstance(answer, str):
            raise AnswerError(f"answer[{k}] has no text (the judge's answer)")
        found = judge_score(answer, self.score_pattern)
        if found is None:
            return (f"the judge's answer holds no score (reward.model.judge.scorePattern "
                    f"{self.score_pattern!r}): {trimmed(answer, ANSWER_QUOTE)!r}")
        return Result(found)


def judge_score(answer: str, pattern: str) -> float | None:
    """The last match of `pattern` in `answer` (its group when it has one) as a finite
    number; None when there is no match or it is not one."""
    matches = list(re.finditer(pattern, answer))
    if not matches:
        return None
    last = matches[-1]
    try:
        score = float(last.group(1) if last.re.groups else last.group(0))
    except (TypeError, ValueError):  # (an optional group that did not take part: None)
        return None
    return score if math.isfinite(score) else None


def codec_for(model: RewardModelSpec, render: ChatRender) -> ScalarCodec | JudgeCodec:
    if model.form == "scalar":
        return ScalarCodec(render)
    assert model.judge is not None  # (required for form judge: the spec's rule)
    j = model.judge
    return JudgeCodec(render, j.prompt, j.score_pattern, j.max_new_tokens)
