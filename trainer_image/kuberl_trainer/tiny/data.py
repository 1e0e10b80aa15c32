"""2-digit addition problems: "23+58=" -> "81".

Every prompt has the same length (two 2-digit operands), so prompts need no padding and
`maxPromptLen` can be exact; answers are 2 or 3 digits (20..198).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

OPERANDS = range(10, 100)  # two digits each: 90 * 90 = 8100 distinct problems
PROMPT_KEY = "prompt"
LABEL_KEY = "label"


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def label(self) -> str:
        return str(self.a + self.b)

    def record(self) -> dict[str, str]:
        return {PROMPT_KEY: self.prompt, LABEL_KEY: self.label}


def split(seed: int, n_eval: int) -> tuple[list[Problem], list[Problem]]:
    """All 8100 problems, shuffled by `seed`, as (train, eval) with `n_eval` held out.

    Splitting the enumerated set (rather than sampling problems independently) makes train and
    eval disjoint by construction. "a+b" and "b+a" are distinct prompts and may land on
    different sides: the model still has to carry out the addition for the order it sees.
    """
    problems = [Problem(a, b) for a in OPERANDS for b in OPERANDS]
    if not 0 < n_eval < len(problems):
        raise ValueError(f"n_eval must be in 1..{len(problems) - 1}, got {n_eval}")
    random.Random(seed).shuffle(problems)
    return problems[n_eval:], problems[:n_eval]


def write_jsonl(path: Path, records: Iterable[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]
