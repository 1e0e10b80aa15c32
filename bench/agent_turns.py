"""A rollout function for the GPU loop's multi-turn runs (`bench/gpu_loop.py --turns N`):
N model turns sharing the trajectory's budget, a fixed observation between them. The model is
random, so its turns rarely end before their share: what this measures is the cost of turns
(each a new request on the whole trajectory's ids), not what an agent would learn."""

from __future__ import annotations

from kuberl_trainer.agents import RolloutContext, Trajectory


async def turns(ctx: RolloutContext, *, turns: str, observation: str, rows: str = "1"
                ) -> list[Trajectory]:
    """`rows` trajectories of the sample (rollout.maxRowsPerSample: one group member, one
    reward), one after the other, each of `turns` turns."""
    out = []
    for _ in range(int(rows)):
        traj = ctx.trajectory()
        n, obs = int(turns), ctx.tokenize(observation)
        share = (traj.budget - (n - 1) * len(obs)) // n
        for k in range(n):
            await ctx.generate(traj, max_new_tokens=share)
            if k < n - 1:
                traj.append_env(obs)
        out.append(traj)
    return out
