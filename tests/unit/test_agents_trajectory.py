"""Trajectories, token in and token out (kuberl_trainer.agents): what reaches the loss is
exactly what the engine sampled; environment tokens never do; the budget is never exceeded
or cut silently; each turn has its own seed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kuberl_trainer.agents import RolloutContext, Trajectory, TrajectoryError, turn_seed
from kuberl_trainer.engines.client import GenerateResult
from kuberl_trainer.rollout.batch import pack
from kuberl_trainer.rollout.generate import Response
from kuberl_trainer.rollout.prompts import Sample

SAMPLE = Sample(prompt="1+2=", label="3", index=0, epoch=0)


class Engine:
    """Answers /generate as an engine would, recording each request (the real engine's
    version of this test: tests/integration/test_reference_engine.py)."""

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns, self.requests = list(turns), []  # type: list[list[int]], list[Any]

    async def generate_one(self, input_ids: list[int], params: dict[str, Any], *,
                           url: str | None = None) -> GenerateResult:
        self.requests.append((list(input_ids), dict(params), url))
        ids = self.turns.pop(0)[:params["max_new_tokens"]]
        return GenerateResult(output_ids=ids, text="", finish_reason="stop",
                              prompt_tokens=len(input_ids), completion_tokens=len(ids),
                              logprobs=[-0.5] * len(ids), weight_version="3",
                              engine_url="http://e0")


async def two_turns(budget: int = 10) -> tuple[Trajectory, Engine]:
    engine = Engine([[7, 8], [9, 2]])
    ctx = RolloutContext(engine, {"temperature": 1.0, "max_new_tokens": 99,  # type: ignore[arg-type]
                                  "sampling_seed": 11})
    traj = Trajectory(prompt_ids=[1, 2, 3], budget=budget)
    await ctx.generate(traj)
    traj.append_env([40, 41])
    await ctx.generate(traj)
    return traj, engine


async def test_each_turn_sends_the_whole_trajectory_and_gets_what_is_left() -> None:
    traj, engine = await two_turns()
    (first, p1, _), (second, p2, url) = engine.requests
    assert first == [1, 2, 3] and second == [1, 2, 3, 7, 8, 40, 41]
    assert p1["max_new_tokens"] == 10 and p2["max_new_tokens"] == 6  # the budget left
    assert p1["sampling_seed"] == 11 == turn_seed(11, 0)  # turn 0: the sample's own seed
    assert p2["sampling_seed"] == turn_seed(11, 1) != 11
    assert url == "http://e0"  # the trajectory stays on its engine (its prefix is cached there)
    assert traj.ids == [7, 8, 40, 41, 9, 2] and traj.turns == 2
    assert traj.loss_mask() == [1, 1, 0, 0, 1, 1]
    assert (traj.model_tokens, traj.env_tokens) == (4, 2)
    assert traj.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert traj.versions == ["3", "3", None, None, "3", "3"]


async def test_the_packed_row_trains_the_model_tokens_only() -> None:
    traj, _ = await two_turns()
    row = pack([Response.from_trajectory(SAMPLE, traj, text="3")],
               torch.tensor([2.0]), pad_id=0)
    assert row.input_ids.tolist() == [[1, 2, 3, 7, 8, 40, 41, 9, 2]]
    assert row.loss_mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 1, 1]]
    assert row.advantages.tolist() == [[0, 0, 0, 2, 2, 0, 0, 2, 2]]
    assert row.rollout_logprobs.tolist() == [[0, 0, 0, -0.5, -0.5, 0, 0, -0.5, -0.5]]


async def test_the_budget_is_never_exceeded_nor_cut() -> None:
    traj, _ = await two_turns(budget=6)  # 2 + 2 + 2: exactly full
    assert traj.remaining == 0
    with pytest.raises(TrajectoryError, match="do not fit the trajectory's budget"):
        traj.append_env([1])
    ctx = RolloutContext(Engine([[5]]), {})  # type: ignore[arg-type]
    with pytest.raises(TrajectoryError, match="no budget left"):
        await ctx.generate(traj)
    # a turn of no tokens is a mistake, not "whatever is left"
    with pytest.raises(TrajectoryError, match="max_new_tokens must be at least 1, got 0"):
        await ctx.generate(Trajectory(prompt_ids=[1], budget=4), max_new_tokens=0)


@pytest.mark.parametrize("tamper, why", [
    (lambda t: t.ids.__setitem__(0, 99), "were changed after the engine sampled them"),
    (lambda t: t.trainable.__setitem__(2, True), "did not come from ctx.generate"),
    (lambda t: t.ids.append(5), "per-token lists have other lengths"),
])
async def test_a_trajectory_changed_by_hand_is_refused_naming_its_maker(tamper: Any,
                                                                        why: str) -> None:
    traj, _ = await two_turns()
    tamper(traj)
    with pytest.raises(TrajectoryError, match=f"^my_agent:run: .*{why}"):
        traj.check("my_agent:run")


def test_a_trajectory_without_a_model_token_is_refused() -> None:
    traj = Trajectory(prompt_ids=[1], budget=4)
    traj.append_env([5, 6])
    with pytest.raises(TrajectoryError, match="has no model token"):
        traj.check("my_agent:run")


def test_a_row_is_as_old_as_its_oldest_model_token() -> None:
    traj = Trajectory(prompt_ids=[1], budget=8)
    traj.append_model([4, 5], [-1.0, -1.0], "9", "stop")
    traj.append_env([6])
    traj.append_model([7], [-1.0], "10", "length")
    row = Response.from_trajectory(SAMPLE, traj, text="")
    assert row.weight_version == "9" and row.truncated  # (the last turn hit its limit)


class UpdatingEngine:
    """An engine whose weights the trainer updates while it generates (mode async, partial
    rollouts): each answer is (ids, finish reason, the version it reports), and `held` is what
    the loop knows the engines hold as each request goes."""

    def __init__(self, answers: list[tuple[list[int], str, str]], held: list[int]) -> None:
        self.answers, self.held, self.requests = list(answers), list(held), []  # type: ignore[var-annotated]
        self.now = self.held[0]

    def version_held(self) -> int:
        self.now = self.held.pop(0)
        return self.now

    async def generate_one(self, input_ids: list[int], params: dict[str, Any], *,
                           url: str | None = None) -> GenerateResult:
        self.requests.append((list(input_ids), dict(params)))
        ids, finish, version = self.answers.pop(0)
        return GenerateResult(output_ids=ids, text="".join(f"<{t}>" for t in ids),
                              finish_reason=finish, prompt_tokens=len(input_ids),
                              completion_tokens=len(ids),
                              logprobs=[-0.1 * t for t in ids], weight_version=version,
                              engine_url="http://e0")


async def test_a_turn_that_spans_an_update_counts_as_its_oldest_weights() -> None:
    # turn 0 sent while the engines held 3, paused by the update to 4 mid-turn, finished
    # under 4 (it reports 4): its tokens may be 3's, so each is recorded as 3's. Turn 1 sent
    # after the loop saw the update land (held 4), reporting 4: exactly 4's. Turn 2 sent
    # under 4 and ending under 5: 4's.
    engine = UpdatingEngine([([7, 8, 9], "stop", "4"), ([5], "stop", "4"),
                             ([6, 2], "stop", "5")], held=[3, 4, 4])
    ctx = RolloutContext(engine, {"max_new_tokens": 99, "sampling_seed": 1},  # type: ignore[arg-type]
                         held=engine.version_held)
    traj = Trajectory(prompt_ids=[1], budget=12)
    first = await ctx.generate(traj)
    traj.append_env([40])
    await ctx.generate(traj)
    traj.append_env([41])
    await ctx.generate(traj)
    assert first.versions == ("3", "3", "3") and first.weight_version == "4"
    assert traj.versions == ["3", "3", "3", None, "4", None, "4", "4"]
    assert traj.turn_versions == ["4", "4", "5"]  # what the engine reported, per turn
    row = Response.from_trajectory(SAMPLE, traj, "")
    assert (row.weight_version, row.newest_version) == ("3", "5")  # oldest token, newest
    # without updates during the rollout (sync mode: no `held`), the engine's own versions
    plain = UpdatingEngine([([7], "stop", "default"), ([8], "stop", "default")], held=[0])
    ctx = RolloutContext(plain, {"max_new_tokens": 9})  # type: ignore[arg-type]
    traj = Trajectory(prompt_ids=[1], budget=4)
    await ctx.generate(traj)
    await ctx.generate(traj)
    assert traj.versions == ["default", "default"]
    assert Response.from_trajectory(SAMPLE, traj, "").weight_version == "default"


async def test_an_aborted_turn_is_continued_into_the_same_turn() -> None:
    # the engine aborts the turn after two tokens (under version 3); the rest is asked for
    # with those tokens as input and what is left of the turn's budget, and comes under 4:
    # one turn of every token once, each with the engine's log-prob and its part's version
    engine = UpdatingEngine([([7, 8], "abort", "3"), ([9, 2], "stop", "4")], held=[3, 4])
    ctx = RolloutContext(engine, {"max_new_tokens": 99, "sampling_seed": 11},  # type: ignore[arg-type]
                         held=engine.version_held)
    traj = Trajectory(prompt_ids=[1, 2], budget=6)
    turn = await ctx.generate(traj)
    (sent, p0), (again, p1) = engine.requests
    assert sent == [1, 2] and again == [1, 2, 7, 8]  # the prompt, then its own tokens
    assert (p0["max_new_tokens"], p1["max_new_tokens"]) == (6, 4)
    assert p0["sampling_seed"] == 11 and p1["sampling_seed"] not in (11, turn_seed(11, 1))
    assert traj.ids == turn.ids == [7, 8, 9, 2] and traj.turns == 1
    assert traj.logprobs == pytest.approx([-0.7, -0.8, -0.9, -0.2])
    assert traj.versions == ["3", "3", "4", "4"] and traj.turn_versions == ["4"]
    assert turn.finish_reason == "stop" and turn.text == "<7><8><9><2>"
    traj.check(where="f")  # one model turn, as sampled
    # aborted with the turn's budget spent: the turn ends there, as cut by its length
    engine = UpdatingEngine([([7, 8], "abort", "3")], held=[3])
    traj = Trajectory(prompt_ids=[1], budget=2)
    turn = await RolloutContext(engine, {"max_new_tokens": 9},  # type: ignore[arg-type]
                                held=engine.version_held).generate(traj)
    assert turn.finish_reason == "length" and len(engine.requests) == 1
    # an engine that keeps aborting: an error, not an endless turn
    engine = UpdatingEngine([([7], "abort", "3")] * 5, held=[3] * 5)
    with pytest.raises(TrajectoryError, match="aborted a turn 5 times"):
        await RolloutContext(engine, {"max_new_tokens": 99},  # type: ignore[arg-type]
                             held=engine.version_held).generate(Trajectory([1], budget=20))
