"""User code the agent tests name in their manifests (rollout.function, environment.class),
as a user's module would be: importable on the head."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kuberl_trainer.agents import RolloutContext, Trajectory


async def ask_twice(ctx: RolloutContext, *, note: str) -> Trajectory:
    """Answer, read a note (the environment's tokens), answer again: 4 tokens a turn at most,
    so every trajectory has exactly two model turns within the budget."""
    traj = ctx.trajectory()
    await ctx.generate(traj, max_new_tokens=4)
    traj.append_env(ctx.tokenize(note))
    await ctx.generate(traj, max_new_tokens=4)
    return traj


class Checker:
    """An environment: after the model's first answer it says "+" (one token of the tiny
    vocabulary), after the second it is done; each step's reward is 1 (the job grades with
    reward.type exact, not these)."""

    def __init__(self) -> None:
        self.steps = 0

    async def reset(self, sample: Any, **args: str) -> dict[str, Any]:
        assert args == {"mode": "strict"}, args
        return {}

    async def step(self, action_ids: list[int], action_text: str) -> dict[str, Any]:
        self.steps += 1
        return {"observation": {"text": "+"}, "reward": 1.0, "done": self.steps == 2,
                "metrics": {"steps": float(self.steps)}}

    async def close(self) -> None:
        pass


async def two_rows(ctx: RolloutContext, *, note: str) -> list[Trajectory]:
    """Two rows of one sample (rollout.maxRowsPerSample 2), each as ask_twice makes it; the
    sample's reward (reward.type environment) set on the second: 1 when its answer is the
    sample's label, read from its metadata (data.metadataKeys: [label])."""
    rows = [await ask_twice(ctx, note=note) for _ in range(2)]
    rows[1].reward = float(rows[1].texts[-1].strip() == str(ctx.sample.metadata["label"]))
    return rows


class FlakyChecker(Checker):
    """Checker whose every eighth episode fails at its reset, as a remote tool might
    (environment.onError drop): two of each 16-episode step."""

    resets = 0

    async def reset(self, sample: Any, **args: str) -> dict[str, Any]:
        FlakyChecker.resets += 1
        if FlakyChecker.resets % 8 == 1:
            raise ConnectionError("checker unreachable")
        return await super().reset(sample, **args)


async def ask_twice_recorded(ctx: RolloutContext, *, note: str, record: str,
                             pause: str = "0") -> Trajectory:
    """ask_twice, waiting `pause` seconds between the turns (a slow tool: in mode async the
    trainers' update lands meanwhile), each trajectory written to the file `record` (one JSON
    line: its seed, tokens, log-probs, per-token weight versions and its turns' reported ones)
    for the test to check versions and compare runs with."""
    traj = ctx.trajectory()
    await ctx.generate(traj, max_new_tokens=4)
    await asyncio.sleep(float(pause))
    traj.append_env(ctx.tokenize(note))
    await ctx.generate(traj, max_new_tokens=4)
    with open(record, "a") as f:
        f.write(json.dumps({"seed": ctx.sampling["sampling_seed"],
                            "sample": [ctx.sample.epoch, ctx.sample.index],
                            "prompt": traj.prompt_ids, "ids": traj.ids,
                            "trainable": traj.trainable, "logprobs": traj.logprobs,
                            "versions": traj.versions,
                            "turn_versions": traj.turn_versions}) + "\n")
    return traj
