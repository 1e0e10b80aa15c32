"""Every advantage estimator and policy-loss option trains on CPU: `kuberl run` on the tiny
job with a reward the policy can learn in a few steps (the response starts with "1"), real Ray,
reference engines and weight sync. Each run must finish and raise the reward; the metrics each
option adds must be in metrics.jsonl.

(The default, GRPO with PPO clip and token-mean, is test_local_run.py's colocated run.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.local_run import LEARNABLE, kuberl_run, manifest, metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

STEPS = 8
ALGORITHMS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "dr_grpo": ({"advantageEstimator": "dr_grpo", "lossAggregation": "seq-mean-token-sum-norm"},
                ()),
    "rloo": ({"advantageEstimator": "rloo"}, ()),
    "reinforce_plus_plus": ({"advantageEstimator": "reinforce_plus_plus", "gamma": 0.99}, ()),
    "reinforce_plus_plus-kl_in_reward": (
        {"advantageEstimator": "reinforce_plus_plus", "klPenalty": "reward", "klCoef": 0.01},
        ("kl_ref",)),
    "reinforce_plus_plus_baseline": ({"advantageEstimator": "reinforce_plus_plus_baseline"},
                                     ()),
    "gspo": ({"policyLoss": "gspo", "lossAggregation": "seq-mean-token-mean",
              "epsClip": 3e-4, "epsClipHigh": 4e-4}, ()),
    "ppo-shared-critic": ({"advantageEstimator": "ppo", "gamma": 1.0, "gaeLambda": 0.95},
                          ("value_loss", "vf_clipfrac", "critic_grad_norm")),
    "ppo-dedicated-critic": (
        {"advantageEstimator": "ppo", "klPenalty": "reward", "klCoef": 0.01},
        ("value_loss", "critic_lr", "kl_ref")),
    "dapo": ({"epsClipHigh": 0.28, "dynamicSamplingRounds": 3, "overlongBuffer": 2,
              "overlongPenalty": 0.5, "tisCap": 2.0, "klCoef": 0.01, "klLossType": "k3"},
             ("dynamic_sampling_rounds", "kept_group_fraction", "score_mean",
              "tis_weight_mean", "rollout_logp_diff", "kl_ref")),
}
COMMON = ("reward_mean", "advantage_mean", "advantage_std", "pg_loss", "pg_clipfrac",
          "approx_kl", "entropy", "ratio_mean", "ratio_max", "ratio_min",
          "response_length_min", "truncated_fraction", "loss")


@pytest.mark.parametrize("name", ALGORITHMS)
def test_algorithm_trains_and_raises_reward(tiny: Path, tmp_path: Path, name: str) -> None:
    algorithm, extra_keys = ALGORITHMS[name]
    extra: dict[str, Any] = {}
    if name == "ppo-dedicated-critic":  # its own CPU "node", started from the policy's weights
        extra["critic"] = {"placement": "dedicated", "gpusPerNode": 0, "lr": 1e-3}
    elif name.startswith("ppo"):
        extra["critic"] = {"lr": 1e-3}
    job = manifest(tiny, tmp_path, name.replace("_", "-"), reward=LEARNABLE,
                   algorithm=algorithm, schedule={"numRollouts": STEPS}, **extra)
    res = kuberl_run(job, tmp_path / "out")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == list(range(STEPS))
    missing = {k for k in (*COMMON, *extra_keys) for r in rows if k not in r}
    assert not missing, missing
    first = sum(r["reward_mean"] for r in rows[:2]) / 2
    last = sum(r["reward_mean"] for r in rows[-3:]) / 3
    assert last > first + 0.2, (name, [round(r["reward_mean"], 3) for r in rows])


def test_on_policy_distillation_moves_the_student_to_the_teacher(
        tiny: Path, tmp_path: Path) -> None:
    """A teacher that answers with a leading "1" far more often than the student (the student
    after a short GRPO run on that reward) grades every token the student samples: the reverse
    KL between them falls and the student's leading-"1" reward - which the distillation loss
    never sees - rises towards the teacher's."""
    grpo = manifest(tiny, tmp_path, "teacher", reward=LEARNABLE,
                    schedule={"numRollouts": 12, "saveInterval": 12})
    res = kuberl_run(grpo, tmp_path / "teacher")
    assert res.returncode == 0, res.stderr[-3000:]
    teacher_reward = metrics(tmp_path / "teacher")[-1]["reward_mean"]
    job = manifest(tiny, tmp_path, "distill", reward=LEARNABLE,
                   algorithm={"advantageEstimator": "on_policy_distillation", "lr": 2e-4,
                              "teacherPath": str(tmp_path / "teacher" / "checkpoints" /
                                                 "step_12" / "model")},
                   schedule={"numRollouts": STEPS * 2})
    res = kuberl_run(job, tmp_path / "out")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(tmp_path / "out")
    kl = [round(r["teacher_kl"], 3) for r in rows]
    reward = [round(r["reward_mean"], 3) for r in rows]
    assert sum(kl[-4:]) / 4 < 0.7 * sum(kl[:2]) / 2, kl
    first, last = sum(reward[:2]) / 2, sum(reward[-4:]) / 4
    assert last > first + 0.5 * (teacher_reward - first), (reward, teacher_reward)


def test_mixed_rl_and_sft_trains_on_the_demonstrations(tiny: Path, tmp_path: Path) -> None:
    """GRPO on the exact reward plus an SFT term on demonstrations of something the reward
    never asks for (every problem answered "7"): the demonstrations' NLL falls steeply while
    the RL term trains on, and the policy starts answering "7"."""
    problems = [json.loads(line) for line in
                (tiny / "data" / "train.jsonl").read_text().splitlines()[:256]]
    demos = tmp_path / "sevens.jsonl"
    demos.write_text("".join(json.dumps({"prompt": p["prompt"], "label": "7"}) + "\n"
                             for p in problems))
    job = manifest(tiny, tmp_path, "mixed", data={"sft": {"path": str(demos), "batchSize": 32}},
                   algorithm={"sftCoef": 1.0}, schedule={"numRollouts": STEPS})
    res = kuberl_run(job, tmp_path / "out")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(tmp_path / "out")
    nll = [round(r["sft_nll"], 3) for r in rows]
    assert sum(nll[-2:]) / 2 < 0.5 * nll[0], nll
    assert all(k in rows[-1] for k in ("pg_loss", "reward_mean", "loss")), rows[-1]
