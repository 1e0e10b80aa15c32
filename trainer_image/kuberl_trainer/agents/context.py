"""What a rollout function is handed for one sample: `generate` on the job's engines, with the
job's sampling settings and a seed per (sample, turn).

Weight versions per token: in mode async with partial rollouts the engines may take new weights
while a turn is generated (the update pauses them, and the turn goes on under the new weights).
An engine reports only the version it held when the turn finished, so each token is recorded
with the oldest version that can have sampled it: the reported one when it is the version the
engines held as the turn was sent (`held`), else that held version. A row's staleness is its
oldest token's, so the bound holds per token however the update split a turn.

A turn the engine answers as aborted (finish_reason "abort": SGLang's /abort_request, or a
pause in abort mode) is continued: its tokens so far go back as input, and the continuation is
appended to the same turn, each part's tokens with its own version, MAX_CONTINUATIONS times at
most."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kuberl_trainer.agents.trajectory import Trajectory, TrajectoryError, version_number
from kuberl_trainer.engines.client import EngineClient
from kuberl_wire.moe_routes import ROUTES_FIELD

MAX_CONTINUATIONS = 4  # continuations of one aborted turn, before it is an error


@dataclass(frozen=True)
class Turn:
    """One model turn as the engine returned it (already appended to the trajectory)."""

    ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    weight_version: str | None  # the engine's when the turn finished: its newest token's
    versions: tuple[str | None, ...] = ()  # each token's oldest possible (see the module)


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of a sample's turn `turn`: the sample's own seed for the first turn
    (a single-turn job samples exactly as before), a hash of it and the turn after that."""
    if turn == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:turn:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def continuation_seed(seed: int, done: int) -> int:
    """The seed of an aborted turn's continuation after `done` of its tokens."""
    digest = hashlib.sha256(f"{seed}:continue:{done}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def oldest_version(reported: str | None, held: int | None) -> str | None:
    """The oldest weight version that can have sampled a request's tokens: `reported` (the
    engine's, when it finished) unless it is newer than `held` (what the engines held at least
    when it was sent: None, nothing changes them during a rollout), then `held`."""
    if held is None:
        return reported
    number = version_number(reported)
    return reported if number is not None and number <= held else str(held)


class RolloutContext:
    """What a rollout function gets for one sample: `sample` (its prompt, label, metadata),
    `trajectory()` (a new one: the prompt's ids and the budget) and `generate`.

    `sampling`: the job's sampling params for this sample (SGLang's names; its
    `sampling_seed` is the sample's seed, and each turn gets `turn_seed` of it); `url`: the
    engine every turn goes to (None: the client picks one for the first turn, and the rest
    follow: a trajectory's prefix is in that engine's cache)."""

    def __init__(self, client: EngineClient, sampling: dict[str, Any], *,
                 url: str | None = None, sample: Any = None,
                 prompt_ids: list[int] | None = None, budget: int = 0,
                 tokenize: Callable[[str], list[int]] | None = None,
                 max_turns: int | None = None,
                 held: Callable[[], int] | None = None) -> None:
        self.client, self.sampling, self.url = client, dict(sampling), url
        # The weight version the engines hold at least, now (mode async: the loop's count);
        # None when nothing changes their weights during a rollout
        self.held = held
        self.max_turns = max_turns  # (rollout.maxTurns: a trajectory's model turns at most)
        self.sample, self.prompt_ids, self.budget = sample, list(prompt_ids or []), budget
        self._tokenize = tokenize

    @property
    def seed(self) -> int | None:
        """The trajectory's seed (its first turn's sampling seed): for the randomness of
        whatever the function or environment does besides sampling, so that a resumed run
        makes the same trajectories. None when the job samples without seeds."""
        seed = self.sampling.get("sampling_seed")
        return None if seed is None else int(seed)

    def trajectory(self) -> Trajectory:
        """A new trajectory of this sample: its prompt, the job's budget."""
        return Trajectory(prompt_ids=list(self.prompt_ids), budget=self.budget)

    def tokenize(self, text: str) -> list[int]:
        """The job's tokenizer, without special tokens (for an observation's text)."""
        if self._tokenize is None:
            raise TrajectoryError("this context has no tokenizer")
        return self._tokenize(text)

    async def generate(self, traj: Trajectory, *, stop: tuple[str, ...] = (),
                       stop_token_ids: tuple[int, ...] = (),
                       max_new_tokens: int | None = None) -> Turn:
        """The model's next turn on the trajectory's whole token ids, appended to it. It gets
        what is left of the budget (or less, `max_new_tokens`); none left is an error."""
        if self.max_turns is not None and traj.turns >= self.max_turns:
            raise TrajectoryError(f"rollout.maxTurns is {self.max_turns}: the trajectory "
                                  "has had all its turns")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise TrajectoryError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        left = traj.remaining
        if left <= 0:
            raise TrajectoryError(f"no budget left for another turn (data.maxResponseLen "
                                  f"{traj.budget}, {traj.turns} turns so far)")
        params = dict(self.sampling)
        params["max_new_tokens"] = min(left, max_new_tokens or left,
                                       int(params.get("max_new_tokens", left)))
        if "sampling_seed" in params:
            params["sampling_seed"] = turn_seed(int(params["sampling_seed"]), traj.turns)
        if stop:
            params["stop"] = list(stop)
        if stop_token_ids:
            params["stop_token_ids"] = [*params.get("stop_token_ids", []), *stop_token_ids]
        limit, seed = params["max_new_tokens"], params.get("sampling_seed")
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[str | None] = []
        texts: list[str] = []
        for part in range(MAX_CONTINUATIONS + 1):
            if part:  # an aborted turn: the rest of it, after the tokens it has
                params["max_new_tokens"] = limit - len(ids)
                if seed is not None:
                    params["sampling_seed"] = continuation_seed(int(seed), len(ids))
            held = self.held() if self.held is not None else None
            out = await self.client.generate_one([*traj.input_ids, *ids], params, url=self.url)
            self.url = out.engine_url
            ids += out.output_ids
            logprobs += list(out.logprobs or [])
            versions += [oldest_version(out.weight_version, held)] * len(out.output_ids)
            texts.append(out.text)
            if out.finish_reason != "abort" or len(ids) >= limit:
                break
        else:
            raise TrajectoryError(f"the engine aborted a turn {MAX_CONTINUATIONS + 1} times "
                                  f"(trajectory turn {traj.turns}, {len(ids)} tokens)")
        finish = "length" if out.finish_reason == "abort" else out.finish_reason
        text = "".join(texts)
        traj.append_model(ids, logprobs, out.weight_version, finish, text, versions=versions)
        traj.routes = out.meta_info.get(ROUTES_FIELD, traj.routes)
        return Turn(ids=ids, text=text, logprobs=logprobs, finish_reason=finish,
                    weight_version=out.weight_version, versions=tuple(versions))
