"""A step of an agent job through the rollout manager: a sample's rows keep one GRPO group
member and one reward (rollout.maxRowsPerSample), a failed episode drops its group and is never
scored 0 (environment.onError drop), reward.type environment, the sample's metadata; the
advantages and metrics are computed by hand.

The engine is a stand-in: each turn answers "7" on an even seed and "8" on an odd one."""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from kuberl_api import parse
from kuberl_trainer.agents import EnvironmentFailure, RolloutContext, Trajectory
from kuberl_trainer.engines.client import GenerateResult
from kuberl_trainer.rollout.generate import sample_seed
from kuberl_trainer.rollout.grading import load_grader
from kuberl_trainer.rollout.manager import RolloutError, RolloutManager
from kuberl_trainer.rollout.prompts import PromptSource
from tests.integration.tiny_model import build_tokenizer

TOK = build_tokenizer()
SEED, STEP = 7, 2


class Engine:
    def __init__(self) -> None:
        self.requests = 0

    async def generate_one(self, input_ids: list[int], params: dict[str, Any], *,
                           url: str | None = None) -> GenerateResult:
        self.requests += 1
        text = "7" if params["sampling_seed"] % 2 == 0 else "8"
        ids = [*TOK(text, add_special_tokens=False)["input_ids"], TOK.eos_token_id]
        return GenerateResult(output_ids=ids, text=text, finish_reason="stop",
                              prompt_tokens=len(input_ids), completion_tokens=len(ids),
                              logprobs=[-0.5] * len(ids), weight_version="3",
                              engine_url=url or "http://e")


def manager(tmp_path: Path, rows: list[dict[str, Any]], agent: dict[str, Any], *,
            function: Any = None, environment: Any = None, batch: int = 2,
            **algorithm: Any) -> tuple[RolloutManager, Engine]:
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    spec = parse({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "x"},
                  "spec": {"model": {"path": "/m"},
                           "data": {"prompts": str(data), "rolloutBatchSize": batch,
                                    "nSamplesPerPrompt": 2, "maxResponseLen": 8,
                                    "metadataKeys": ["kind"],
                                    "evalSets": [{"name": "e", "path": str(data),
                                                  "nSamplesPerPrompt": 2}]},
                           "schedule": {"evalInterval": 1}, "algorithm": algorithm,
                           "training": {"backend": "fsdp", "gpusPerNode": 0},
                           **agent, "rollout": {"engine": "reference",
                                                **agent.get("rollout", {})}}}).spec
    engine = Engine()
    source = PromptSource(data, "prompt", "label", seed=0, metadata_keys=["kind"])
    return RolloutManager(spec, source, engine, TOK, load_grader(spec.reward),  # type: ignore[arg-type]
                          seed=SEED, rollout_function=function,
                          environment_class=environment), engine


def seed_index(ctx: RolloutContext) -> int:
    """Which of its group's seeds (k) a trajectory is."""
    return next(k for k in range(2) if sample_seed(SEED, STEP, ctx.sample, k)
                == ctx.sampling["sampling_seed"])


async def agents(ctx: RolloutContext) -> list[Trajectory]:
    """Seed 0 of a sample: two trajectories (rows); seed 1: one. Their rewards, by the
    sample's kind column: "spread": 0.25 + 0.75 for seed 0, 0 for seed 1; "flat": 0.5 each."""
    k, flat = seed_index(ctx), ctx.sample.metadata["kind"] == "flat"
    rewards = ([0.25, 0.25] if flat else [0.25, 0.75]) if k == 0 else ([0.5] if flat else [0.0])
    out = []
    for reward in rewards:
        traj = ctx.trajectory()
        await ctx.generate(traj)
        traj.reward = reward
        out.append(traj)
    return out


def test_a_samples_rows_are_one_member_of_its_group_with_one_advantage(tmp_path: Path
                                                                       ) -> None:
    rows = [{"prompt": "1+1=", "label": "2", "kind": "spread"},
            {"prompt": "2+2=", "label": "4", "kind": "flat"}]
    mgr, _ = manager(tmp_path, rows, {"rollout": {"function": "a:agents", "maxRowsPerSample": 3},
                                      "reward": {"type": "environment"}},
                     function=agents, advantageEstimator="rloo")
    rollout = asyncio.run(mgr.generate(STEP))
    b, m = rollout.batch, rollout.metrics
    assert len(b) == 2 * 2 * 3  # prompts x seeds x maxRowsPerSample: the same every step
    answer = 2  # tokens of "7" (or "8") and EOS
    assert b.loss_mask.sum(1).tolist() == [answer, answer, 0, answer, 0, 0] * 2
    # RLOO over the group's 2 trajectories: spread [1.0, 0.0] -> [+1, -1] on every row of
    # each; flat [0.5, 0.5] -> 0. (Its 3 rows counted as samples, [1, 1, 0], would give 0.5.)
    by_row = (b.advantages.sum(1) / b.loss_mask.sum(1).clamp(min=1)).tolist()
    first = TOK.decode(b.input_ids[0][b.attention_mask[0].bool()].tolist())
    spread = 0 if first.startswith("1+1=") else 6  # which group is the "spread" sample's
    assert by_row[spread:spread + 6] == [1.0, 1.0, 0.0, -1.0, 0.0, 0.0]
    assert by_row[6 - spread:12 - spread] == [0.0] * 6
    assert m["reward_mean"] == 0.5  # (1 + 0 + 0.5 + 0.5) / 4 trajectories, not rows
    assert m["reward_std"] == pytest.approx(statistics.pstdev([1.0, 0.0, 0.5, 0.5]))
    assert m["rows_mean"] == 1.5 and m["env_errors"] == 0
    assert m["response_length_mean"] == answer  # real rows only: fillers are not responses
    assert rollout.versions == [("3", "3")] * 6  # the real rows: (oldest, newest)
    assert "kept_group_fraction" not in m  # nothing dropped


class Calculator:
    """Down for samples of kind "down" (reset raises); otherwise one step, rewarded 2 for
    "7" and 1 for "8" (never 0: a failed episode counted as 0 would show in the mean)."""

    async def reset(self, sample: Any, **args: str) -> None:
        if sample.metadata["kind"] == "down":
            raise ConnectionError("calculator unreachable")

    async def step(self, action_ids: list[int], action_text: str) -> dict[str, Any]:
        return {"reward": 2.0 if action_text == "7" else 1.0, "done": True}

    async def close(self) -> None:
        pass


DROP = {"environment": {"class": "e:Calculator", "onError": "drop"},
        "reward": {"type": "environment"}}


def test_a_failed_episode_drops_its_group_and_the_others_train(tmp_path: Path) -> None:
    rows = [{"prompt": "1+1=", "label": "2", "kind": "down"},
            {"prompt": "2+2=", "label": "4", "kind": "up"}]
    mgr, _ = manager(tmp_path, rows, DROP, environment=Calculator)
    rollout = asyncio.run(mgr.generate(STEP))
    b, m = rollout.batch, rollout.metrics
    assert len(b) == 4 and m["env_errors"] == 2 and m["kept_group_fraction"] == 0.5
    down = [i for i in range(4) if b.attention_mask[i].sum() == 1]  # fillers: one pad token
    assert len(down) == 2 and b.loss_mask[down].sum() == 0
    up = [i for i in range(4) if i not in down]
    texts = ["7" if TOK.decode(b.input_ids[i][b.loss_mask[i].bool()].tolist()).startswith("7")
             else "8" for i in up]
    rewards = [2.0 if t == "7" else 1.0 for t in texts]
    assert m["reward_mean"] == statistics.fmean(rewards)  # the failed episodes: not counted
    # an environment job reports its turns even when every episode was one turn
    assert m["turns_mean"] == 1.0 and m["response_env_tokens_mean"] == 0.0
    if rewards[0] != rewards[1]:  # GRPO over the healthy group: +-1/sqrt(2) (unbiased std)
        adv = b.advantages[up].sum(1) / b.loss_mask[up].sum(1)
        assert adv.abs().tolist() == pytest.approx([2 ** -0.5] * 2, rel=1e-4)
    assert b.loss_mask[up].sum() > 0


def test_a_step_whose_groups_all_fail_is_rolled_out_again_then_fails(tmp_path: Path) -> None:
    rows = [{"prompt": f"{a}+{a}=", "label": str(2 * a), "kind": "down"} for a in range(8)]
    mgr, engine = manager(tmp_path, rows, DROP, environment=Calculator)
    with pytest.raises(RolloutError, match=r"^step 2: every group of 3 rollouts in a row had an "
                       r"episode that failed.*the last error: e:Calculator\.reset failed: "
                       r"ConnectionError: calculator unreachable$"):
        asyncio.run(mgr.generate(STEP))
    assert mgr.source.state_dict()["position"] == 3 * 2  # the next prompts, twice
    assert engine.requests == 0


def test_a_step_rolled_out_again_trains_on_the_next_prompts(tmp_path: Path) -> None:
    order = [s.index for s in PromptSource(_rows_file(tmp_path, 8), "prompt", "label",
                                           seed=0).next_batch(4)]
    rows = [{"prompt": f"{a}+{a}=", "label": str(2 * a),
             "kind": "down" if a in order[:2] else "up"} for a in range(8)]
    mgr, _ = manager(tmp_path, rows, DROP, environment=Calculator)
    rollout = asyncio.run(mgr.generate(STEP))
    m = rollout.metrics
    assert m["env_errors"] == 4 and "kept_group_fraction" not in m  # the first 2 groups
    assert rollout.batch.attention_mask.sum(1).min() > 1  # no filler: the second draw's rows
    assert mgr.source.state_dict()["position"] == 4


def test_without_drop_a_failed_episode_fails_the_step(tmp_path: Path) -> None:
    rows = [{"prompt": "1+1=", "label": "2", "kind": "down"}]
    mgr, _ = manager(tmp_path, rows, {"environment": {"class": "e:Calculator"},
                                      "reward": {"type": "environment"}},
                     environment=Calculator, batch=1)
    with pytest.raises(EnvironmentFailure, match="calculator unreachable"):
        asyncio.run(mgr.generate(STEP))


def test_evaluation_leaves_failed_episodes_out(tmp_path: Path) -> None:
    rows = [{"prompt": "1+1=", "label": "2", "kind": "down"},
            {"prompt": "2+2=", "label": "4", "kind": "up"}]
    mgr, _ = manager(tmp_path, rows, DROP, environment=Calculator)
    out = asyncio.run(mgr.evaluate(STEP))
    assert out["eval_e_env_errors"] == 2.0
    assert out["eval_e_reward"] in (1.0, 1.5, 2.0)  # the 2 healthy episodes' mean, never 0.x
    assert set(out) == {"eval_e_reward", "eval_e_env_errors"}


def _rows_file(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "order.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": "p", "label": "l"}) for _ in range(n)))
    return path

