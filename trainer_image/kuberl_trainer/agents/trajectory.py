"""A trajectory's tokens and which of them the model sampled (see the package docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# What an engine reports before its first weight update (SGLang's default, and the reference
# engine's): the base model, version 0.
INITIAL_VERSION = "default"


def version_number(reported: str | None) -> int | None:
    """A weight version as an engine reports it, as the trainer's update count (None: not
    reported). kuberl sets integers; anything else is an engine updated by something else."""
    if reported is None:
        return None
    if reported == INITIAL_VERSION:
        return 0
    try:
        return int(reported)
    except ValueError:
        raise ValueError(f"engine reported weight_version {reported!r}: kuberl sets "
                         "integers (the trainer's update count); was the engine updated by "
                         "something else?") from None


class TrajectoryError(ValueError):
    """A trajectory the trainer must not train on: the message names what is wrong and where
    (the rollout function that made it)."""


@dataclass
class Trajectory:
    """`prompt_ids`, then `ids`: every token after the prompt, model's and environment's, in
    order. Per token of `ids`: `trainable` (the model sampled it), `logprobs` (the engine's;
    0.0 for environment tokens) and `versions` (the oldest weight version that can have sampled
    it: the engine's, unless weights changed while its turn was generated; None for
    environment tokens). Per model turn: `turn_versions` (the version its engine reported
    when the turn finished: the newest of its tokens'). `budget`: how many tokens `ids` may
    hold."""

    prompt_ids: list[int]
    budget: int
    ids: list[int] = field(default_factory=list)
    trainable: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str | None] = field(default_factory=list)
    turns: int = 0  # the model's turns so far
    turn_versions: list[str | None] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # each model turn's text, as decoded
    finish_reason: str = ""  # the last turn's ("stop", "length", "abort")
    # Set by a rollout function under reward.type environment: the trajectory's reward (a
    # sample's trajectories add up to its one reward)
    reward: float | None = None
    # The experts the engine routed its tokens to (routingReplay: rollout): the last turn's
    # answer, which covers every token before that turn's last (kuberl_wire.moe_routes)
    routes: str | None = None
    # (start, tokens) of each model turn, as generate appended it: `check` compares, so a
    # token changed or added by hand is caught before it reaches the loss
    _sampled: list[tuple[int, tuple[int, ...]]] = field(default_factory=list, repr=False)

    @property
    def input_ids(self) -> list[int]:
        """What the next turn is conditioned on: the prompt and everything after it."""
        return [*self.prompt_ids, *self.ids]

    @property
    def remaining(self) -> int:
        return self.budget - len(self.ids)

    @property
    def model_tokens(self) -> int:
        return sum(self.trainable)

    @property
    def env_tokens(self) -> int:
        return len(self.ids) - self.model_tokens

    def append_env(self, ids: list[int]) -> None:
        """The environment's tokens (out of the loss). Refused past the budget: a trajectory
        is never cut silently."""
        ids = [int(t) for t in ids]
        if len(ids) > self.remaining:
            raise TrajectoryError(
                f"the environment's {len(ids)} tokens do not fit the trajectory's budget "
                f"(data.maxResponseLen {self.budget}, {self.remaining} left)")
        self._extend(ids, trainable=False, logprobs=[0.0] * len(ids), version=None)

    def append_model(self, ids: list[int], logprobs: list[float], version: str | None,
                     finish_reason: str, text: str = "", *,
                     versions: list[str | None] | None = None) -> None:
        """A model turn, as the engine returned it (RolloutContext.generate calls this).
        `version`: what the engine reported with it; `versions`: each token's, when they
        differ from it (weights changed during the turn)."""
        if len(logprobs) != len(ids):
            raise TrajectoryError(f"{len(logprobs)} log-probs for {len(ids)} sampled tokens")
        if versions is not None and len(versions) != len(ids):
            raise TrajectoryError(f"{len(versions)} weight versions for {len(ids)} sampled "
                                  "tokens")
        if len(ids) > self.remaining:
            raise TrajectoryError(
                f"the engine returned {len(ids)} tokens with {self.remaining} left of the "
                f"budget (data.maxResponseLen {self.budget})")
        self._sampled.append((len(self.ids), tuple(int(t) for t in ids)))
        self._extend([int(t) for t in ids], trainable=True, logprobs=list(logprobs),
                     version=version)
        if versions is not None:
            self.versions[len(self.ids) - len(ids):] = list(versions)
        self.turn_versions.append(version)
        self.turns += 1
        self.texts.append(text)
        self.finish_reason = finish_reason

    def _extend(self, ids: list[int], *, trainable: bool, logprobs: list[float],
                version: str | None) -> None:
        self.ids += ids
        self.trainable += [trainable] * len(ids)
        self.logprobs += logprobs
        self.versions += [version] * len(ids)

    def check(self, where: str) -> None:
        """Refuse what must not be trained, naming `where` (the function that made it): no
        model token, tokens over the budget, per-token lists of other lengths, or a trainable
        token that is not the one generate appended there."""
        n = len(self.ids)
        reward = self.reward
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)
                                   or not math.isfinite(reward)):
            raise TrajectoryError(f"{where}: the trajectory's reward is {reward!r}; expected a "
                                  "finite number")
        if not (len(self.trainable) == len(self.logprobs) == len(self.versions) == n):
            raise TrajectoryError(f"{where}: the trajectory's per-token lists have other "
                                  f"lengths than its {n} tokens (change it only through "
                                  "ctx.generate and append_env)")
        if n > self.budget:
            raise TrajectoryError(f"{where}: {n} tokens over the budget "
                                  f"(data.maxResponseLen {self.budget})")
        if not self._sampled:
            raise TrajectoryError(f"{where}: the trajectory has no model token (call "
                                  "ctx.generate at least once)")
        sampled = [False] * n
        for start, tokens in self._sampled:
            if tuple(self.ids[start:start + len(tokens)]) != tokens:
                raise TrajectoryError(f"{where}: the model's tokens at {start} were changed "
                                      "after the engine sampled them")
            sampled[start:start + len(tokens)] = [True] * len(tokens)
        if sampled != self.trainable:
            first = next(i for i, (a, b) in enumerate(zip(sampled, self.trainable,
                                                           strict=True)) if a != b)
            raise TrajectoryError(f"{where}: token {first} is marked trainable but did not "
                                  "come from ctx.generate (environment tokens go through "
                                  "append_env, out of the loss)")

    def loss_mask(self) -> list[float]:
        return [1.0 if t else 0.0 for t in self.trainable]
