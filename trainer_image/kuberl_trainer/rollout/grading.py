"""The grading stage: a step's (or an eval set's) trajectories in, one reward each out, all of
them graded in one call to the job's scorer (rewards/scorer.py), so that a service's batches
go out together and a judge's batch function sees them all.

Each trajectory is graded once, by its last real row's answer (batch.graded_row), as a
`RewardInput` whose id is ``<step>:<epoch>:<index>:<k>`` (the step, or an eval set's seed key;
the sample's place in the data; its seed's index in the group): unique in the step and the
same on every retry. reward.type environment grades nothing: a trajectory's reward is its
environment's. A trajectory whose episode failed is not graded (its group leaves the step);
one the scorer could not grade (reward.onError drop) comes back as None, with the reason,
and its group leaves the step too. An error is never a reward of 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kuberl_api.spec import RewardSpec
from kuberl_trainer.rollout.batch import failed, graded_row
from kuberl_trainer.rollout.generate import Response
from kuberl_trainer.rollout.reward_client import RemoteScorer, reward_credential
from kuberl_trainer.rollout.rewards import load
from kuberl_trainer.rollout.rewards.answers import AnswerFn, answer_fn
from kuberl_trainer.rollout.rewards.scorer import (
    BatchFunctionScorer,
    FunctionScorer,
    RewardInput,
    Scorer,
)


@dataclass
class Grades:
    """Per trajectory, in order: its reward (None: none, its group leaves: a failed episode,
    or a grade the scorer could not get under onError drop), why its grade failed, and the
    scorer's metrics of it; the seconds grading took and the requests sent again."""

    rewards: list[float | None]
    errors: list[str | None]
    metrics: list[dict[str, float]]
    seconds: float = 0.0
    retries: int = 0


@dataclass
class RewardTally:
    """A step's grading, over its grading calls (dynamic sampling and all-dropped retries
    grade again): what the step reports as reward_s, and for a reward called over HTTP (a
    service's, a served model's: `remote`) reward_retries, reward_errors (samples without a
    reward) and reward_dropped_groups (groups that left the step for it)."""

    remote: bool
    seconds: float = 0.0
    retries: int = 0
    errors: int = 0
    dropped_groups: int = 0

    def add(self, grades: Grades, n: int) -> None:
        self.seconds += grades.seconds
        self.retries += grades.retries
        self.errors += sum(e is not None for e in grades.errors)
        self.dropped_groups += len({j // n for j, e in enumerate(grades.errors)
                                    if e is not None})

    def metrics(self) -> dict[str, float]:
        out = {"reward_s": self.seconds}
        if self.remote:
            out |= {"reward_retries": float(self.retries), "reward_errors": float(self.errors),
                    "reward_dropped_groups": float(self.dropped_groups)}
        return out


class Grader:
    """The job's reward as the grading stage: its scorer (None under reward.type
    environment), and how to read a response's answer (None: answers cannot be compared,
    no maj@k)."""

    def __init__(self, spec: RewardSpec, scorer: Scorer | None, answer: AnswerFn | None
                 ) -> None:
        self.spec, self.scorer, self.answer = spec, scorer, answer

    @classmethod
    def of(cls, spec: RewardSpec, fn: Callable[..., Any] | None,
           model: Scorer | None = None) -> Grader:
        """The grader of `spec`, whose function (built-in or the user's, imported by
        rewards.load) is `fn`; `model`: the served reward model's scorer (reward.type model:
        RemoteScorer.for_model, at its replicas' URLs)."""
        if spec.type == "environment":
            return cls(spec, None, None)
        if spec.type == "remote":
            return cls(spec, RemoteScorer.from_spec(spec, reward_credential()), None)
        if spec.type == "model":
            if model is None:
                raise ValueError("reward.type model needs the served reward model's scorer")
            return cls(spec, model, None)
        assert fn is not None
        name = spec.function or spec.type
        scorer: Scorer = (BatchFunctionScorer(fn, name) if spec.batch
                          else FunctionScorer(fn, name))
        return cls(spec, scorer, answer_fn(spec, fn))

    def tally(self) -> RewardTally:
        return RewardTally(remote=self.spec.called)

    async def grade(self, key: int | str, trajs: list[list[Response]], n: int) -> Grades:
        """`trajs`: groups of `n` consecutive trajectories; `key`: the step, or an eval set's
        seed key (what the ids start with)."""
        count = len(trajs)
        rows = [None if failed(t) else graded_row(t) for t in trajs]
        if self.scorer is None:  # reward.type environment
            env = [None if r is None else r.env_reward for r in rows]
            assert all(r is None or e is not None for r, e in zip(rows, env, strict=True))
            return Grades(env, [None] * count, [{} for _ in trajs])
        todo = [(j, row) for j, row in enumerate(rows) if row is not None]
        items = [_input(key, row, j % n) for j, row in todo]
        started = time.perf_counter()
        scored = await self.scorer.score(items) if items else None
        seconds = time.perf_counter() - started
        grades = Grades([None] * count, [None] * count, [{} for _ in trajs], seconds,
                        scored.retries if scored else 0)
        if scored is not None:
            for (j, _), reward, metrics, error in zip(todo, scored.rewards, scored.metrics,
                                                      scored.errors, strict=True):
                grades.rewards[j], grades.metrics[j] = reward, metrics
                if reward is None:
                    grades.errors[j] = error or "no reward"
        return grades


def _input(key: int | str, row: Response, k: int) -> RewardInput:
    s = row.sample
    return RewardInput(id=f"{key}:{s.epoch}:{s.index}:{k}", prompt=s.prompt, response=row.text,
                       label=s.label, metadata=s.metadata)


def load_grader(spec: RewardSpec) -> Grader:
    """`spec`'s grader, its function imported now (RewardLoadError if it cannot be)."""
    return Grader.of(spec, load(spec))
