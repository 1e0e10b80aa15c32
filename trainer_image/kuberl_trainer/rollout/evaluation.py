"""The eval sets' scores under the engines' current weights: what a training run reports every
schedule.evalInterval steps and what mode eval reports once (docs/algorithms.md, "Evaluation").

Each problem of a set gets the set's `nSamplesPerPrompt` samples (greedy when that is 1), each
graded once by the job's reward (grading.py: a set's samples in one call); the set's mean
reward (`eval_<name>_reward`) and, for each k
of its `passK`, avg@k, pass@k and maj@k (algos/eval_metrics.py) come from them. A sample's seed
is a function of the run's seed, the set, the problem and the sample's index, never of the
training step: the same weights score the same whether a training run evaluates them after
step N or mode eval evaluates the checkpoint of step N.
"""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kuberl_api.spec import EvalSet, RLJobSpec
from kuberl_trainer.algos import eval_metrics
from kuberl_trainer.algos.eval_metrics import Sampled
from kuberl_trainer.engines.client import EngineClient
from kuberl_trainer.rollout.agentic import agent_rollout
from kuberl_trainer.rollout.batch import failed, graded_row, trajectories
from kuberl_trainer.rollout.generate import Response, SingleTurn
from kuberl_trainer.rollout.grading import Grader
from kuberl_trainer.rollout.prompts import PromptSource, Sample


class SampleFn(Protocol):
    """generate.SingleTurn or agentic.AgentRollout."""

    def __call__(self, step: int | str, samples: list[Sample], n: int, *,
                 greedy: bool = False) -> Awaitable[list[Response]]: ...


@dataclass(frozen=True)
class LoadedSet:
    spec: EvalSet
    samples: list[Sample]


def seed_key(name: str) -> str:
    """What an eval set's samples' seeds take in place of the training step."""
    return f"eval:{name}"


def metric_names(eval_set: EvalSet) -> list[str]:
    """The scores a set can report, as in `<metric>` of `eval_<name>_<metric>` (maj@k only
    where answers can be compared)."""
    return ["reward", *(f"{m}@{k}" for k in eval_set.pass_k for m in ("avg", "pass", "maj"))]


def scores_of(eval_sets: list[EvalSet], record: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each set's scores in a metrics row (none for a set the row has no score of): what the
    RLJob's status shows."""
    out: dict[str, dict[str, float]] = {}
    for e in eval_sets:
        found = {m: float(record[f"eval_{e.name}_{m}"]) for m in metric_names(e)
                 if f"eval_{e.name}_{m}" in record}
        if found:
            out[e.name] = found
    return out


def eval_source(spec: RLJobSpec, eval_set: EvalSet, seed: int) -> PromptSource:
    """An eval set's file, read as the job reads its prompts."""
    d = spec.data
    return PromptSource(eval_set.path, d.input_key, d.label_key, seed=seed,
                        metadata_keys=d.metadata_keys)


def evaluator(spec: RLJobSpec, client: EngineClient, tokenizer: Any, grader: Grader, *,
              seed: int,
              rollout_function: Callable[..., Any] | None = None,
              environment_class: Callable[[], Any] | None = None) -> Evaluator:
    """The job's eval sets, sampled as its rollouts are (a single turn, or its rollout
    function or environment), on their own: mode eval, with no training."""
    single = SingleTurn(spec, client, tokenizer, seed)
    sample: SampleFn = agent_rollout(single, rollout_function, environment_class) or single
    return Evaluator(spec.data.eval_sets, lambda e: eval_source(spec, e, seed), sample,
                     grader, spec.rollout.max_rows_per_sample)


class Evaluator:
    """`sample`: how prompts become responses; `grader`: the job's reward (and how to read a
    response's answer: None, no maj@k); `rows`: each sample's rows
    (rollout.maxRowsPerSample)."""

    def __init__(self, eval_sets: list[EvalSet], source: Callable[[EvalSet], PromptSource],
                 sample: SampleFn, grader: Grader, rows: int) -> None:
        self.sets = [LoadedSet(e, source(e).samples()) for e in eval_sets]
        self.sample, self.grader, self.rows = sample, grader, rows

    async def evaluate(self) -> dict[str, float]:
        """Every set's scores, as `eval_<name>_<metric>`; a failed episode
        (environment.onError drop) is left out, and counted as eval_<name>_env_errors, as is
        a sample without a reward (reward.onError drop), counted as
        eval_<name>_reward_errors."""
        out: dict[str, float] = {}
        for loaded in self.sets:
            e = loaded.spec
            n = e.n_samples_per_prompt
            responses = await self.sample(seed_key(e.name), loaded.samples, n, greedy=n == 1)
            trajs = trajectories(responses, self.rows)
            grades = await self.grader.grade(seed_key(e.name), trajs, n)
            problems = [self._problem(trajs[i:i + n], grades.rewards[i:i + n],
                                      e.pass_threshold)
                        for i in range(0, len(trajs), n)]
            rewards = [s.reward for p in problems for s in p]
            prefix = f"eval_{e.name}_"
            if rewards:
                out[prefix + "reward"] = statistics.fmean(rewards)
                scored = eval_metrics.scores([p for p in problems if p], e.pass_k,
                                             majority=self.grader.answer is not None)
                out.update({prefix + m: v for m, v in scored.items()})
            episodes = sum(failed(t) for t in trajs)
            if episodes:
                out[prefix + "env_errors"] = float(episodes)
            if any(grades.errors):
                out[prefix + "reward_errors"] = float(sum(x is not None for x in grades.errors))
        return out

    def _problem(self, trajs: list[list[Response]], rewards: list[float | None],
                 threshold: float) -> list[Sampled]:
        """A problem's samples that have a reward, in their sample order."""
        out = []
        answer = self.grader.answer
        for t, reward in zip(trajs, rewards, strict=True):
            row = graded_row(t)
            if reward is None or row is None:
                continue
            out.append(Sampled(reward, reward >= threshold,
                               answer(row.text) if answer is not None else None))
        return out
