"""Agents' trajectories, token in and token out (docs/agents.md).

The public types a user rollout function or environment meets. A trajectory grows only two
ways, so that what the trainer trains is exactly what the engine sampled:

- `await ctx.generate(traj)`: the trajectory's whole token ids go to an engine (`input_ids`,
  never text) and the engine's ids and log-probs are appended as the model's turn (in the
  loss);
- `traj.append_env(ids)`: the environment's tokens (a tool's output, an observation), out of
  the loss.

`data.maxResponseLen` is the trajectory's budget (model and environment tokens after the
prompt): each `generate` gets what is left, and nothing is cut afterwards.

Environments (environment.py): one instance per trajectory, `reset`, `step`, `close`; the
built-in loop `run_episode` alternates the model's turns and the environment's steps.
"""

from kuberl_trainer.agents.context import RolloutContext, Turn, turn_seed
from kuberl_trainer.agents.environment import (
    Environment,
    EnvironmentFailure,
    Episode,
    Observation,
    StepResult,
    run_episode,
)
from kuberl_trainer.agents.trajectory import Trajectory, TrajectoryError

__all__ = ["Environment", "EnvironmentFailure", "Episode", "Observation", "RolloutContext",
           "StepResult", "Trajectory", "TrajectoryError", "Turn", "run_episode", "turn_seed"]
