"""The tool variant's task: three 2-digit operands ("23+58+11=" -> "92"), and a calculator.

Adding three numbers is hard for the tiny model; reading a result is easy. The fixture's SFT
(`sft.tool_rows`) shows two kinds of sequence, with the loss on the final answer only:

    23+58+11=92<eos>                 answer directly
    23+58+11= = 92= 92<eos>          read a result placed mid-sequence, then copy it

The second kind's "=" (the call) and "92=" (the result) are out of the SFT loss: the model
never learns to call, only to read what follows a call. RL with the calculator environment
(`Calculator`) must discover that a turn ending in "=" brings the result, and learn to call;
with a lying calculator, calling pays nothing.

The calculator imports nothing heavy (no torch), so an environment server can serve it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from kuberl_trainer.tiny.vocab import EQUALS_ID

OPERANDS = range(10, 100)
PROMPT_KEY = "prompt"
LABEL_KEY = "label"


@dataclass(frozen=True)
class ToolProblem:
    a: int
    b: int
    c: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}+{self.c}="

    @property
    def label(self) -> str:
        return str(self.a + self.b + self.c)

    def record(self) -> dict[str, str]:
        return {PROMPT_KEY: self.prompt, LABEL_KEY: self.label}


def split(seed: int, n_train: int, n_eval: int) -> tuple[list[ToolProblem], list[ToolProblem]]:
    """`n_train` and `n_eval` distinct problems (disjoint) drawn by `seed` from the 729000."""
    space = len(OPERANDS) ** 3
    if n_eval < 1 or n_train < 1 or n_train + n_eval > space:
        raise ValueError(f"n_train and n_eval must be at least 1 and sum to at most {space}")
    picks = random.Random(seed).sample(range(space), n_train + n_eval)
    problems = [ToolProblem(*(OPERANDS[i // 90 ** k % 90] for k in (2, 1, 0))) for i in picks]
    return problems[n_eval:], problems[:n_eval]


def evaluate(expression: str) -> int:
    """The value of "a+b+...": non-negative integers and '+' only (the tiny vocabulary)."""
    terms = expression.split("+")
    if not terms or not all(t.isdigit() for t in terms):
        raise ValueError(f"not a sum of integers: {expression!r}")
    return sum(int(t) for t in terms)


class Calculator:
    """The tool task's environment, one instance per trajectory (environment.class
    `kuberl_trainer.tiny.tool:Calculator`, args `lie`).

    The model's turns end at "=". A turn ending in "=" is a call: the observation is the value
    of the prompt's expression and "=" (out of the loss); any other turn is the answer and
    ends the episode, with a step reward of 1 when it equals the label (for
    reward.type environment; reward.type exact grades the same text). `lie: "1"` makes every
    result wrong (the value plus 10), so copying it never pays. Metrics: `calls` per episode.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.expression = ""
        self.label = ""
        self.lie = False

    async def reset(self, sample: Any, *, lie: str = "0") -> dict[str, Any]:
        if lie not in ("0", "1"):
            raise ValueError(f"lie must be '0' or '1', got {lie!r}")
        self.lie = lie == "1"
        prompt = sample.prompt if hasattr(sample, "prompt") else sample[PROMPT_KEY]
        self.expression = prompt.removesuffix("=")
        self.label = str(sample.label if hasattr(sample, "label") else sample[LABEL_KEY])
        return {"stop_token_ids": [EQUALS_ID]}

    async def step(self, action_ids: list[int], action_text: str) -> dict[str, Any]:
        if action_ids and action_ids[-1] == EQUALS_ID:
            self.calls += 1
            value = evaluate(self.expression) + (10 if self.lie else 0)
            return {"observation": {"text": f"{value}=", "stop_token_ids": [EQUALS_ID]},
                    "reward": 0.0, "done": False}
        return {"reward": float(action_text.strip() == self.label), "done": True,
                "metrics": {"calls": float(self.calls)}}

    async def close(self) -> None:
        pass
