"""Rollout manager: prompts -> engines -> rewards -> advantages -> a TrainBatch.

One step's rollout (`RolloutManager.generate`, top to bottom): take `rolloutBatchSize` prompts
from the data source, have `nSamplesPerPrompt` responses made of each (generate.py: one batched
request per engine; agentic.py: a trajectory per sample and seed, in one row or, from a
rollout function, up to `rollout.maxRowsPerSample`), grade them (grading.py: each trajectory
once, the whole batch in one call to the job's scorer), and then:

0. a group with an episode that failed (environment.onError drop) or a sample without a
   reward (reward.onError drop) leaves the loss; a step whose every group did is rolled out
   again with the next prompts (ALL_DROPPED_RETRIES);
1. dynamic sampling (DAPO, `dynamicSamplingRounds`): replace groups whose rewards are all
   equal by the groups of fresh prompts, for up to that many extra rounds;
2. shape the scores (DAPO's overlong penalty, `overlongBuffer`);
3. pack token tensors (batch.py); groups with no reward spread leave the loss when asked
   (`dropConstantGroups`, or those dynamic sampling could not replace);
4. advantages by the job's estimator over the tokens that stay in the loss (with the KL
   penalty in the rewards, the trainer's reference log-probs first), one per trajectory
   (every row of it takes its advantage: its rows are not extra samples of the group).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.algos import distillation, estimators, shaping, value_loss
from kuberl_trainer.algos.filters import expand_to_samples, nonconstant_groups
from kuberl_trainer.backends.base import TrainBatch
from kuberl_trainer.engines.client import EngineClient
from kuberl_trainer.rollout.agentic import AgentRollout, agent_rollout
from kuberl_trainer.rollout.batch import (
    engine_throughput,
    failed_groups,
    failure,
    pack,
    step_metrics,
    trajectories,
)
from kuberl_trainer.rollout.evaluation import Evaluator, eval_source
from kuberl_trainer.rollout.generate import Response, SingleTurn
from kuberl_trainer.rollout.grading import Grader, RewardTally
from kuberl_trainer.rollout.prompts import PromptSource, Sample
from kuberl_wire.moe_routes import MoeShape, moe_shape

# A step whose every group lost an episode or a reward (environment.onError or reward.onError
# drop) is rolled out again with the next prompts, this many times at most; then the job fails
# with the last error.
ALL_DROPPED_RETRIES = 2


class RolloutError(RuntimeError):
    """A step that has nothing to train on; the message says why."""


@dataclass(frozen=True)
class DataPosition:
    """The prompt sources' states (PromptSource.state_dict): the RL prompts' and, with
    data.sft, the demonstrations'."""

    data: dict[str, int]
    sft_data: dict[str, int]


@dataclass
class Rollout:
    batch: TrainBatch
    metrics: dict[str, Any] = field(default_factory=dict)
    sft: TrainBatch | None = None  # the step's demonstrations (algorithm.sftCoef)
    # Each row's (oldest token's, newest reported) weight version (Response.weight_version,
    # .newest_version; fillers have none)
    versions: list[tuple[str | None, str | None]] = field(default_factory=list)
    seconds: float = 0.0  # generating, grading and packing it


TokenFn = Callable[[TrainBatch], torch.Tensor]


class RolloutManager:
    """`grader`: the job's reward (grading.Grader); `ref_logprobs`: the trainer's reference
    log-probs of a batch (`TrainGroup.ref_logprobs`), needed only when the KL penalty is in
    the rewards; `values`: the critic's value estimates (`CriticGroup.values`), needed for
    ppo."""

    def __init__(self, spec: RLJobSpec, source: PromptSource, client: EngineClient,
                 tokenizer: Any, grader: Grader, *,
                 seed: int = 0, ref_logprobs: TokenFn | None = None,
                 values: TokenFn | None = None, sft_source: PromptSource | None = None,
                 sampled: Callable[[], Awaitable[None]] | None = None,
                 rollout_function: Callable[..., Any] | None = None,
                 environment_class: Callable[[], Any] | None = None) -> None:
        self.spec, self.source, self.client, self.seed = spec, source, client, seed
        # Called once a step's sampling is over, before the trainers' passes over the batch
        # (colocated: the GPUs go from the engines to the trainers, memory_handoff.py).
        self.sampled = sampled
        self.tokenizer, self.grader = tokenizer, grader
        self._tally: RewardTally = grader.tally()  # the step's grading, for its metrics
        # How prompts become responses (generate.py, the seam): one turn each, or trajectories
        # from the user's rollout function or environment (agentic.py)
        single = SingleTurn(spec, client, tokenizer, seed)
        self._sample: SingleTurn | AgentRollout = (
            agent_rollout(single, rollout_function, environment_class) or single)
        self.rows = spec.rollout.max_rows_per_sample  # each trajectory's rows in the batch
        # routingReplay rollout: the engines report each token's experts, the batch keeps them
        self.route_shape = rollout_route_shape(spec)
        client.return_routes = self.route_shape is not None
        if estimators.needs_reference(spec.algorithm) and ref_logprobs is None:
            raise ValueError("klPenalty: reward and on_policy_distillation need the trainer's "
                             "reference (teacher) log-probs")
        if spec.has_critic and values is None:
            raise ValueError("advantageEstimator ppo needs the critic's values")
        self.ref_logprobs, self.values = ref_logprobs, values
        if (spec.data.sft is not None) != (sft_source is not None):
            raise ValueError("data.sft and the SFT prompt source come together")
        self.sft_source = sft_source
        self._positions: dict[int, DataPosition] = {}  # see position_at
        self._held: Callable[[], int] | None = None  # generate's, for the rollout under way
        self.evaluator = Evaluator(
            spec.data.eval_sets, lambda e: eval_source(spec, e, seed), self._sample, grader,
            self.rows)

    def position_at(self, step: int) -> DataPosition:
        """Where the prompt sources stood when step `step`'s rollout began drawing, or stand
        now if it has not begun: what a checkpoint after `step` steps records (mode async may
        have drawn the prompts of the next steps already), so a resumed run draws them
        again."""
        for done in [s for s in self._positions if s < step]:  # trained: never needed again
            del self._positions[done]
        return self._positions.get(step) or self._position_now()

    def _position_now(self) -> DataPosition:
        return DataPosition(self.source.state_dict(),
                            self.sft_source.state_dict() if self.sft_source is not None else {})

    async def generate(self, step: int, *, held: Callable[[], int] | None = None) -> Rollout:
        """Step `step`'s rollout, in the order its parts happen. `held`: the weight version
        the engines hold at least, now (mode async, where an update may come during the
        rollout); None when their weights do not change during it."""
        self._held = held
        d, algo = self.spec.data, self.spec.algorithm
        n, rows = d.n_samples_per_prompt, self.rows
        started = time.perf_counter()
        self._positions[step] = self._position_now()
        self._tally = self.grader.tally()
        # generate and grade (each trajectory's score: its reward plus the shaping)
        samples = self.source.next_batch(d.rollout_batch_size)
        responses = await self._graded(step, samples, n)
        errors = _errors(responses)
        for retry in range(ALL_DROPPED_RETRIES + 1):  # every group dropped: the next prompts
            if not bool(failed_groups(responses, n, rows).all()):
                break
            if retry == ALL_DROPPED_RETRIES:
                raise RolloutError(
                    f"step {step}: every group of {retry + 1} rollouts in a row had an episode "
                    "that failed or a sample without a reward, so none is left to train on "
                    "(environment.onError or reward.onError: drop); the last error: "
                    f"{failure(responses)}")
            fresh = self.source.next_batch(d.rollout_batch_size)
            samples, responses = samples + fresh, await self._graded(step, fresh, n)
            errors += _errors(responses)
        metrics: dict[str, Any] = {}
        if algo.dynamic_sampling_rounds:  # replace groups without spread by fresh ones
            responses, extra, rounds, refill_errors = await self._refill(step, responses)
            samples, errors = samples + extra, errors + refill_errors
            metrics["dynamic_sampling_rounds"] = rounds
        if isinstance(self._sample, AgentRollout):
            metrics["env_errors"] = errors  # episodes that failed and were dropped
        if self.grader.scorer is not None:  # (reward.type environment grades nothing)
            metrics.update(self._tally.metrics())
        # Which prompts this step saw: a resumed run must see exactly the same ones.
        metrics["prompts_sha"] = hashlib.sha256(
            "\n".join(f"{s.epoch}:{s.index}" for s in samples).encode()).hexdigest()[:16]
        if self.sampled is not None:
            await self.sampled()
        # pack, and filter: groups with a failed episode, and those without spread when
        # asked, leave the loss. They stay in the batch (shapes, and so data-parallel shards,
        # stay fixed) with a mask of zero, so they don't dilute its mean.
        scores = torch.tensor([t[0].score for t in trajectories(responses, rows)],
                              dtype=torch.float32)  # [trajectories]: one per sample and seed
        batch = pack(responses, torch.zeros(len(responses)), self.tokenizer.pad_token_id,
                     routes=self.route_shape)
        keep = ~failed_groups(responses, n, rows)
        if algo.drop_constant_groups or algo.dynamic_sampling_rounds:
            keep &= nonconstant_groups(scores, n)
        if not bool(keep.all()) or algo.drop_constant_groups or algo.dynamic_sampling_rounds:
            batch.loss_mask *= expand_to_samples(keep, n * rows)[:, None].to(
                batch.loss_mask.dtype)
            metrics["kept_group_fraction"] = float(keep.float().mean())
        # advantages, over the tokens that stay in the loss
        metrics.update(self._advantages(batch, scores, n))
        metrics.update(step_metrics(responses, batch, rows,
                                    agentic=isinstance(self._sample, AgentRollout)))
        metrics.update(engine_throughput(responses))
        return Rollout(batch=batch, metrics=metrics, sft=self._demonstrations(),
                       versions=[(r.weight_version, r.newest_version) for r in responses
                                 if not r.filler],
                       seconds=time.perf_counter() - started)

    def _advantages(self, batch: TrainBatch, scores: torch.Tensor, n: int
                    ) -> dict[str, float]:
        """Set the batch's advantages (and ppo's values and returns) by the job's estimator;
        the metrics only some estimators have."""
        algo, metrics = self.spec.algorithm, {}
        kl = None
        if self.ref_logprobs is not None and estimators.needs_reference(algo):
            # The sampling policy's log-probs are the engines' (the trainer's would need one
            # more forward pass; TIS corrects for the difference where it matters).
            batch.ref_logprobs = self.ref_logprobs(batch)
            kl = (batch.rollout_logprobs - batch.ref_logprobs) * batch.loss_mask
        if algo.advantage_estimator == "on_policy_distillation":
            assert batch.ref_logprobs is not None  # the teacher's
            batch.advantages, metrics["teacher_kl"] = distillation.reverse_kl_advantages(
                batch.ref_logprobs, batch.rollout_logprobs, batch.loss_mask)
        elif self.values is not None and algo.advantage_estimator == "ppo":
            batch.values = self.values(batch)
            batch.advantages, batch.returns = estimators.ppo_targets(
                algo, scores, batch.loss_mask, batch.values, kl=kl)
            explained = value_loss.explained_variance(batch.values, batch.returns,
                                                      batch.loss_mask)
            if math.isfinite(explained):  # NaN when every return is equal: nothing to explain
                metrics["explained_variance"] = explained
        else:
            batch.advantages = estimators.token_advantages(algo, scores, n, batch.loss_mask,
                                                           kl=kl, rows=self.rows)
        return metrics

    def _demonstrations(self) -> TrainBatch | None:
        """`data.sft.batchSize` demonstrations, packed like responses: the prompt, then the
        target and EOS (the tokens the NLL term trains on), each cut to its length limit."""
        d = self.spec.data
        if self.sft_source is None or d.sft is None:
            return None
        samples = self.sft_source.next_batch(d.sft.batch_size)
        tok = self.tokenizer
        prompts = tok([s.prompt for s in samples], add_special_tokens=False)["input_ids"]
        targets = tok([s.label for s in samples], add_special_tokens=False)["input_ids"]
        rows = [Response(sample=s, prompt_ids=list(p[-d.max_prompt_len:]),
                         output_ids=[*t, tok.eos_token_id][:d.max_response_len],
                         logprobs=[], text=s.label, truncated=False)
                for s, p, t in zip(samples, prompts, targets, strict=True)]
        return pack(rows, torch.zeros(len(rows)), tok.pad_token_id)

    async def _graded(self, step: int, samples: list[Sample], n: int) -> list[Response]:
        """The samples' trajectories, all graded in one call (grading.py: each by its last
        real row's answer, or its environment's reward), its reward and score on every row.
        A failed episode is never graded, and a trajectory the scorer could not grade
        carries the reason (`reward_error`): either's group leaves the step, its reward a
        placeholder 0 that nothing reads."""
        responses = await self._sample(step, samples, n, held=self._held)
        trajs = trajectories(responses, self.rows)
        grades = await self.grader.grade(step, trajs, n)
        self._tally.add(grades, n)
        penalties = self._overlong(trajs).tolist()
        for traj, reward, error, scored, penalty in zip(
                trajs, grades.rewards, grades.errors, grades.metrics, penalties, strict=True):
            for r in traj:
                r.reward = reward if reward is not None else 0.0
                r.score, r.reward_error, r.reward_metrics = r.reward + penalty, error, scored
        return responses

    async def _refill(self, step: int, responses: list[Response]
                      ) -> tuple[list[Response], list[Sample], int, int]:
        """DAPO's dynamic sampling: draw fresh prompts for the groups whose rewards are all
        equal (or that lost an episode), up to `dynamicSamplingRounds` times, keeping the
        batch at `rolloutBatchSize` groups. Returns (groups with spread first, then the ones
        left over; the extra prompts drawn; the rounds used; the episodes that failed). Each
        fresh sample has its own seed (its prompt differs), so a resumed run redraws the
        same."""
        groups, spread = self._groups(responses)
        rich = [g for g, ok in zip(groups, spread, strict=True) if ok]
        flat = [g for g, ok in zip(groups, spread, strict=True) if not ok]
        extra: list[Sample] = []
        rounds = errors = 0
        while flat and rounds < self.spec.algorithm.dynamic_sampling_rounds:
            rounds += 1
            fresh = self.source.next_batch(len(flat))
            extra += fresh
            new = await self._graded(step, fresh, self.spec.data.n_samples_per_prompt)
            errors += _errors(new)
            new_groups, new_spread = self._groups(new)
            gained = [g for g, ok in zip(new_groups, new_spread, strict=True) if ok]
            rich += gained
            flat = flat[len(gained):]
        return [r for g in rich + flat for r in g], extra, rounds, errors

    def _groups(self, responses: list[Response]) -> tuple[list[list[Response]], list[bool]]:
        """The prompt groups' rows, and which have score spread (the same test as
        dropConstantGroups: ``filters.nonconstant_groups``) and no failed episode or
        reward."""
        n, rows = self.spec.data.n_samples_per_prompt, self.rows
        scores = torch.tensor([t[0].score for t in trajectories(responses, rows)],
                              dtype=torch.float32)
        size = n * rows
        groups = [responses[i:i + size] for i in range(0, len(responses), size)]
        keep = nonconstant_groups(scores, n) & ~failed_groups(responses, n, rows)
        return groups, keep.tolist()

    def _overlong(self, trajs: list[list[Response]]) -> torch.Tensor:
        """DAPO's overlong penalty of each trajectory, by its longest row."""
        algo = self.spec.algorithm
        if algo.overlong_buffer is None:
            return torch.zeros(len(trajs))
        lengths = torch.tensor([max(len(r.output_ids) for r in t) for t in trajs])
        return shaping.overlong_penalty(lengths, self.spec.data.max_response_len,
                                        algo.overlong_buffer, algo.overlong_penalty)

    async def evaluate(self, step: int) -> dict[str, float]:
        """The eval sets' scores under the engines' weights after step `step` (evaluation.py:
        their seeds do not depend on the step)."""
        return await self.evaluator.evaluate()


def _errors(responses: list[Response]) -> int:
    """The episodes among `responses` that failed (and were dropped)."""
    return sum(r.error is not None for r in responses)


def rollout_route_shape(spec: RLJobSpec) -> MoeShape | None:
    """The policy's MoE shape when the engines' routes are replayed (routingReplay: rollout),
    read from its config.json (the head reads the model's directory for its tokenizer too);
    None otherwise."""
    if spec.algorithm.routing_replay != "rollout":
        return None
    config = json.loads((Path(spec.model.path) / "config.json").read_text())
    shape = moe_shape(config)
    if shape is None:
        raise ValueError(f"algorithm.routingReplay rollout: {spec.model.path} is a dense "
                         "model (its config.json names no experts)")
    return shape
