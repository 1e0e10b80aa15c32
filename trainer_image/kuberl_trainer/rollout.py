"""Rollout manager: prompts -> engines -> rewards -> advantages -> a TrainBatch.

One step's rollout: take `rolloutBatchSize` prompts from the data source, ask the engines for
`nSamplesPerPrompt` responses each (concurrently, load-balanced by the engine client), grade
them, compute GRPO advantages per prompt group, optionally drop groups whose rewards are all
equal, and pack token tensors for the trainer.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.algos import advantages as adv_fn
from kuberl_trainer.algos.filters import expand_to_samples, nonconstant_groups
from kuberl_trainer.backends.base import TrainBatch
from kuberl_trainer.data import PromptSource, Sample
from kuberl_trainer.engine_client import EngineClient


@dataclass
class Response:
    sample: Sample
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    text: str
    truncated: bool
    reward: float = 0.0


@dataclass
class Rollout:
    batch: TrainBatch
    metrics: dict[str, Any] = field(default_factory=dict)


class RolloutManager:
    def __init__(self, spec: RLJobSpec, source: PromptSource, client: EngineClient,
                 tokenizer: Any, reward_fn: Callable[[str, str], float], *,
                 seed: int = 0) -> None:
        self.spec, self.source, self.client, self.seed = spec, source, client, seed
        self.tokenizer, self.reward_fn = tokenizer, reward_fn
        self.eval_sets = [
            (e.name, PromptSource(e.path, spec.data.input_key, spec.data.label_key,
                                  seed=seed).samples(), e.n_samples_per_prompt)
            for e in spec.data.eval_sets]

    def sampling_params(self, step: int, sample: Sample, k: int) -> dict[str, Any]:
        """Each response gets its own seed, a function of (run seed, step, prompt, k): the same
        sample comes out whichever engine serves it, so a resumed run regenerates exactly what
        an uninterrupted one would have."""
        return {
            "temperature": self.spec.algorithm.temperature,
            "top_p": 1.0,
            "max_new_tokens": self.spec.data.max_response_len,
            "stop_token_ids": [self.tokenizer.eos_token_id],
            "sampling_seed": sample_seed(self.seed, step, sample, k),
        }

    async def _sample(self, step: int, samples: list[Sample], n: int, *,
                      greedy: bool = False) -> list[Response]:
        """`n` responses per sample, groups consecutive, from one request per engine."""
        encoded = self.tokenizer([s.prompt for s in samples], add_special_tokens=False)
        cut = self.spec.data.max_prompt_len
        prompt_ids = [list(ids[-cut:]) for ids in encoded["input_ids"]]
        params = [self.sampling_params(step, s, k) for s in samples for k in range(n)]
        if greedy:
            params = [p | {"temperature": 0.0} for p in params]
        outs = await self.client.generate_spread(
            [ids for ids in prompt_ids for _ in range(n)], params, group=n)
        return [Response(sample=samples[i // n], prompt_ids=prompt_ids[i // n],
                         output_ids=list(o.output_ids), logprobs=list(o.logprobs or []),
                         text=o.text, truncated=o.finish_reason == "length")
                for i, o in enumerate(outs)]

    async def generate(self, step: int) -> Rollout:
        d = self.spec.data
        samples = self.source.next_batch(d.rollout_batch_size)
        responses = await self._sample(step, samples, d.n_samples_per_prompt)
        for r in responses:
            r.reward = float(self.reward_fn(r.text, r.sample.label))
        rewards = torch.tensor([r.reward for r in responses], dtype=torch.float32)
        metrics: dict[str, Any] = dict(self._metrics(responses, rewards))
        # Which prompts this step saw: a resumed run must see exactly the same ones.
        metrics["prompts_sha"] = hashlib.sha256(
            "\n".join(f"{s.epoch}:{s.index}" for s in samples).encode()).hexdigest()[:16]
        # Dr.GRPO drops the std normalisation (the length normalisation lives in the loss).
        normalize = self.spec.algorithm.advantage_estimator != "dr_grpo"
        advantages = adv_fn.grpo(rewards, d.n_samples_per_prompt, normalize_std=normalize)
        batch = pack(responses, advantages, self.tokenizer.pad_token_id)
        if self.spec.algorithm.drop_constant_groups:
            # Dropped groups stay in the batch (shapes, and so data-parallel shards, stay fixed)
            # but leave the loss: their mask is zero, so they don't dilute the token mean.
            keep = expand_to_samples(nonconstant_groups(rewards, d.n_samples_per_prompt),
                                     d.n_samples_per_prompt)
            batch.loss_mask *= keep[:, None].to(batch.loss_mask.dtype)
            batch.advantages *= batch.loss_mask
            metrics["kept_group_fraction"] = float(keep.float().mean())
        return Rollout(batch=batch, metrics=metrics)

    async def evaluate(self, step: int) -> dict[str, float]:
        """Mean reward on each eval set: `nSamplesPerPrompt` samples per problem at the job's
        temperature, or greedy when that is 1 (the usual "accuracy" number)."""
        out: dict[str, float] = {}
        for name, samples, n in self.eval_sets:
            responses = await self._sample(step, samples, n, greedy=n == 1)
            rewards = [float(self.reward_fn(r.text, r.sample.label)) for r in responses]
            out[f"eval_{name}_reward"] = statistics.fmean(rewards)
        return out

    @staticmethod
    def _metrics(responses: list[Response], rewards: torch.Tensor) -> dict[str, float]:
        lengths = [len(r.output_ids) for r in responses]
        return {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "response_length_mean": statistics.fmean(lengths),
            "response_length_max": float(max(lengths)),
            "truncated_fraction": sum(r.truncated for r in responses) / len(responses),
        }


def sample_seed(seed: int, step: int, sample: Sample, k: int) -> int:
    digest = hashlib.sha256(f"{seed}:{step}:{sample.epoch}:{sample.index}:{k}".encode())
    return int.from_bytes(digest.digest()[:4], "little") & 0x7FFFFFFF


def pack(responses: list[Response], advantages: torch.Tensor, pad_id: int) -> TrainBatch:
    """Right-padded [B, T] tensors of prompt+response; loss on response tokens only.

    Token-level tensors (advantages, rollout logprobs) sit at the response tokens' positions in
    input_ids, the convention the backend's log-probs use (position t scores token t).
    """
    width = max((len(r.prompt_ids) + len(r.output_ids) for r in responses), default=1)
    # Rows built as Python lists, then one tensor each: per-row tensor writes cost more than
    # the rest of a tiny step's packing.
    ids, attention, loss, logprobs = [], [], [], []
    for r in responses:
        p, o = len(r.prompt_ids), len(r.output_ids)
        pad = width - p - o
        ids.append(r.prompt_ids + r.output_ids + [pad_id] * pad)
        attention.append([1] * (p + o) + [0] * pad)
        loss.append([0.0] * p + [1.0] * o + [0.0] * pad)
        lp = list(r.logprobs[:o]) if r.logprobs else []
        logprobs.append([0.0] * p + lp + [0.0] * (o - len(lp) + pad))
    input_ids = torch.tensor(ids, dtype=torch.long)
    attention_mask = torch.tensor(attention, dtype=torch.long)
    loss_mask = torch.tensor(loss, dtype=torch.float32)
    rollout_lp = torch.tensor(logprobs, dtype=torch.float32)
    token_adv = advantages[:, None] * loss_mask
    return TrainBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                      advantages=token_adv, rollout_logprobs=rollout_lp)
