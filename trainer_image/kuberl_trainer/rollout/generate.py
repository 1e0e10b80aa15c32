"""How prompts become responses: the one place a rollout's samples are produced.

Today a sample is one turn: each prompt's `nSamplesPerPrompt` responses come from one batched
request per engine (the client spreads the groups), each response with its own seed. This is
the seam where user rollout functions and multi-turn environments plug in: whatever produces
the samples hands the manager `Response`s (token ids in and out, the engine's log-probs, which
engine and weight version made them), and the manager grades, shapes, filters and packs them
the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.agents import Trajectory
from kuberl_trainer.agents.context import oldest_version
from kuberl_trainer.agents.trajectory import version_number
from kuberl_trainer.engines.client import EngineClient
from kuberl_trainer.rollout.prompts import Sample
from kuberl_wire.moe_routes import ROUTES_FIELD


@dataclass
class Response:
    sample: Sample
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    text: str
    truncated: bool
    # The oldest weight version that can have sampled one of its model tokens (the behaviour
    # policy, as staleness counts it), and the newest its engine reported: they differ when
    # weights changed while it was generated (a partial rollout)
    weight_version: str | None = None
    newest_version: str | None = None
    engine: str = ""  # the URL of the engine that generated it
    seconds: float = 0.0  # its engine's request for it, from send to answer
    request: int = 0  # which request that was
    reward: float = 0.0  # the verifier's
    score: float = 0.0   # what advantages are computed from: reward + shaping
    # Why its trajectory has no reward (reward.onError drop: the reward service's batch failed
    # after its retries): its group leaves the step, as a failed episode's does
    reward_error: str | None = None
    reward_metrics: dict[str, float] = field(default_factory=dict)  # the reward service's
    # Per output token, whether it is in the loss (None: all of them, a single turn); a
    # trajectory's environment tokens are not
    loss_mask: list[float] | None = None
    turns: int = 1  # the model's turns in it
    env_tokens: int = 0  # the environment's tokens among output_ids
    env_step_s: float = 0.0  # the seconds its environment's steps took
    env_metrics: dict[str, float] = field(default_factory=dict)  # theirs, mean over steps
    # The trajectory's reward by its environment (the sum of its step rewards) or the one its
    # rollout function set (Trajectory.reward): what reward.type environment grades with
    env_reward: float | None = None
    # A row that only keeps the batch's shape, out of the loss: the rows a sample's rollout
    # function did not fill up to rollout.maxRowsPerSample, or those of a dropped episode
    filler: bool = False
    error: str | None = None  # why its episode failed (environment.onError: drop), on fillers
    # The experts its tokens were routed to, as the engine answered (routingReplay: rollout;
    # kuberl_wire.moe_routes, covering the row's tokens but the last)
    routes: str | None = None

    @classmethod
    def filler_row(cls, sample: Sample, pad_id: int, error: str | None = None) -> Response:
        """A row of one padding token, out of the loss (and of every metric)."""
        return cls(sample=sample, prompt_ids=[pad_id], output_ids=[], logprobs=[], text="",
                   truncated=False, loss_mask=[], turns=0, filler=True, error=error)

    @classmethod
    def from_trajectory(cls, sample: Sample, traj: Trajectory, text: str,
                        where: str = "the trajectory") -> Response:
        """A checked trajectory as one row (`where`: who made it, for the errors): its tokens
        after the prompt are the output, the environment's out of the loss, each model token
        with the engine's log-prob."""
        traj.check(where=where)
        versions = [v for v, t in zip(traj.versions, traj.trainable, strict=True) if t]
        return cls(sample=sample, prompt_ids=list(traj.prompt_ids), output_ids=list(traj.ids),
                   logprobs=list(traj.logprobs), text=text,
                   truncated=traj.finish_reason == "length",
                   weight_version=min(versions, key=_version_order) if versions else None,
                   newest_version=max(traj.turn_versions, key=_version_order, default=None),
                   loss_mask=traj.loss_mask(), turns=traj.turns, env_tokens=traj.env_tokens,
                   routes=traj.routes)


class SingleTurn:
    """One response per sample and seed: the prompt, as the tokenizer cuts it to
    `data.maxPromptLen`, then the engine's tokens up to EOS or `data.maxResponseLen`."""

    def __init__(self, spec: RLJobSpec, client: EngineClient, tokenizer: Any, seed: int
                 ) -> None:
        self.spec, self.client, self.tokenizer, self.seed = spec, client, tokenizer, seed

    def sampling_params(self, step: int | str, sample: Sample, k: int) -> dict[str, Any]:
        """Each response gets its own seed, a function of (run seed, step, prompt, k): the same
        sample comes out whichever engine serves it, so a resumed run regenerates exactly what
        an uninterrupted one would have. An eval set's samples take the set's key in place of
        the step (evaluation.seed_key): the same weights score the same at any step."""
        return {
            "temperature": self.spec.algorithm.temperature,
            "top_p": 1.0,
            "max_new_tokens": self.spec.data.max_response_len,
            "stop_token_ids": [self.tokenizer.eos_token_id],
            "sampling_seed": sample_seed(self.seed, step, sample, k),
        }

    async def __call__(self, step: int | str, samples: list[Sample], n: int, *,
                       greedy: bool = False,
                       held: Callable[[], int] | None = None) -> list[Response]:
        """`n` responses per sample, groups consecutive, from one request per engine. `held`:
        the weight version the engines hold at least, now (None: their weights do not change
        during the rollout), for each response's oldest token (agents.context)."""
        encoded = self.tokenizer([s.prompt for s in samples], add_special_tokens=False)
        cut = self.spec.data.max_prompt_len
        prompt_ids = [list(ids[-cut:]) for ids in encoded["input_ids"]]
        params = [self.sampling_params(step, s, k) for s in samples for k in range(n)]
        if greedy:
            params = [p | {"temperature": 0.0} for p in params]
        floor = held() if held is not None else None
        outs = await self.client.generate_spread(
            [ids for ids in prompt_ids for _ in range(n)], params, group=n)
        return [Response(sample=samples[i // n], prompt_ids=prompt_ids[i // n],
                         output_ids=list(o.output_ids), logprobs=list(o.logprobs or []),
                         text=o.text, truncated=o.finish_reason == "length",
                         weight_version=oldest_version(o.weight_version, floor),
                         newest_version=o.weight_version, engine=o.engine_url,
                         seconds=o.seconds, request=o.request,
                         routes=o.meta_info.get(ROUTES_FIELD))
                for i, o in enumerate(outs)]


def sample_seed(seed: int, step: int | str, sample: Sample, k: int) -> int:
    digest = hashlib.sha256(f"{seed}:{step}:{sample.epoch}:{sample.index}:{k}".encode())
    return int.from_bytes(digest.digest()[:4], "little") & 0x7FFFFFFF


def _version_order(version: str | None) -> tuple[int, str]:
    """Weight versions oldest first (numbers as numbers, "default" as 0): a row counts as old
    as its oldest model token, for the staleness bound."""
    try:
        number = version_number(version)
    except ValueError:  # (not one of kuberl's: staleness_metrics says so)
        number = None
    return (-1 if number is None else number, version or "")
