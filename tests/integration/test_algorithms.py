"""Every advantage estimator and policy-loss option trains on CPU: `kuberl run` on the tiny
job with a reward the policy can learn in a few steps (the response starts with "1"), real Ray,
reference engines and weight sync. Each run must finish, write the metrics its options add, and
raise the policy's exact expected reward on held-out prompts (tests/integration/learning.py
says how that is measured and why it holds on any machine).

(The default, GRPO with PPO clip and token-mean, is test_local_run.py's colocated run.)

The engines' log-probs as pi_old (oldLogprobs: engine) get a short run of their own: it is an
optimisation (a forward pass skipped), not a learning signal of its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integration import learning
from tests.integration.local_run import failed, kuberl_run, manifest, metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

EXTRA_KEYS: dict[str, tuple[str, ...]] = {
    "dr_grpo": (),
    "rloo": (),
    "reinforce_plus_plus": (),
    "reinforce_plus_plus-kl_in_reward": ("kl_ref",),
    "reinforce_plus_plus_baseline": (),
    "gspo": (),
    "cispo": (),
    "sapo": (),
    "gpg": ("kept_group_fraction",),
    "lora": ("lora_trainable_params", "lora_adapter_norm", "kl_ref"),
    "ppo-shared-critic": ("value_loss", "vf_clipfrac", "critic_grad_norm"),
    "ppo-dedicated-critic": ("value_loss", "critic_lr", "kl_ref"),
    "dapo": ("dynamic_sampling_rounds", "kept_group_fraction", "score_mean",
             "tis_weight_mean", "rollout_logp_diff", "kl_ref"),
}
# The scenarios that take two optimizer steps per rollout: their second step trains off-policy,
# and those whose loss clips report it.
OFF_POLICY = {"cispo": True, "sapo": False, "gpg": False}  # name: whether pg_clipfrac > 0
COMMON = ("reward_mean", "advantage_mean", "advantage_std", "pg_loss", "pg_clipfrac",
          "approx_kl", "entropy", "ratio_mean", "ratio_max", "ratio_min",
          "response_length_min", "truncated_fraction", "loss")


@pytest.mark.parametrize("name", EXTRA_KEYS)
def test_algorithm_trains_and_raises_reward(tiny: Path, tmp_path: Path, name: str) -> None:
    scenario = learning.ALGORITHMS[name]
    outcome = scenario.run(tiny, tmp_path)
    assert [r["step"] for r in outcome.rows] == list(range(scenario.steps))
    missing = {k for k in (*COMMON, *EXTRA_KEYS[name]) for r in outcome.rows if k not in r}
    assert not missing, missing
    assert not scenario.failures(outcome), (scenario.failures(outcome), name)
    if name in OFF_POLICY:
        assert max(r["ratio_max"] for r in outcome.rows) > 1.5, outcome.rows
        assert (max(r["pg_clipfrac"] for r in outcome.rows) > 0) == OFF_POLICY[name], name


@pytest.mark.parametrize("name", learning.CUSTOM_LOSSES)
def test_a_custom_loss_is_what_trains(tiny: Path, tmp_path: Path, name: str) -> None:
    """policyLoss: custom, a user's copy of PPO clip imported by the training ranks
    (tests/user_losses.py, on the runs' PYTHONPATH as spec.code puts it in a cluster): it
    raises the reward past the built-ins' line, its sign-flipped copy makes it fall; both
    report the copy's own clip fraction (the second optimizer step of each rollout clips),
    never kuberl's."""
    scenario = learning.CUSTOM_LOSSES[name]
    outcome = scenario.run(tiny, tmp_path)
    assert [r["step"] for r in outcome.rows] == list(range(scenario.steps))
    assert not scenario.failures(outcome), (scenario.failures(outcome), name)
    assert all("loss_clipfrac" in r and "pg_clipfrac" not in r for r in outcome.rows)
    assert max(r["loss_clipfrac"] for r in outcome.rows) > 0, outcome.rows


def test_a_broken_custom_loss_is_refused_before_anything_starts(tiny: Path,
                                                                tmp_path: Path) -> None:
    """`kuberl run` calls the function once on a synthetic batch before Ray starts: one
    whose loss is detached from the log-probs fails at once, naming the field."""
    job = manifest(tiny, tmp_path, "detached", algorithm={
        "policyLoss": "custom", "lossFunction": "tests.user_losses:detached"})
    res = kuberl_run(job, tmp_path / "out")
    assert res.returncode == 1, failed(res)
    assert res.stderr.strip().splitlines()[-1].startswith(
        "error: spec.algorithm.lossFunction: loss function 'tests.user_losses:detached': no "
        "gradient reaches inp.logp"), res.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_on_policy_distillation_moves_the_student_to_the_teacher(
        tiny: Path, tmp_path: Path) -> None:
    """A teacher that answers with a leading "1" far more often than the student (the student
    after a short GRPO run on that reward) grades every token the student samples: the
    student's KL to the teacher falls, and its leading-"1" reward - which the distillation
    loss never sees - closes on the teacher's."""
    outcome = learning.DISTILLATION.run(tiny, tmp_path)
    assert all("teacher_kl" in r for r in outcome.rows)
    assert not learning.DISTILLATION.failures(outcome), learning.DISTILLATION.failures(outcome)


def test_mixed_rl_and_sft_trains_on_the_demonstrations(tiny: Path, tmp_path: Path) -> None:
    """GRPO on the exact reward plus an SFT term on demonstrations of something the reward
    never asks for (every problem answered "7"): the policy learns to answer "7" on held-out
    problems while the RL term trains on."""
    outcome = learning.MIXED_SFT.run(tiny, tmp_path)
    assert all(k in outcome.rows[-1] for k in ("sft_nll", "pg_loss", "reward_mean", "loss"))
    assert not learning.MIXED_SFT.failures(outcome), learning.MIXED_SFT.failures(outcome)


# Engines serving in bfloat16 while the trainer holds float32 on CPU: their log-probs of the
# sampled tokens lie ~6e-3 apart on average (max ~0.08), against ~3e-7 when both hold float32
# (test_local_run.py's colocated run; docs/algorithms.md, "The train-inference gap").
BF16_GAP_MEAN = 1e-3


def test_engine_old_logprobs_skip_the_trainers_forward_and_show_the_bf16_gap(
        tiny: Path, tmp_path: Path) -> None:
    """oldLogprobs: engine with two optimizer steps per rollout (globalBatchSize 64 of 128
    samples) and bfloat16 engines: the trainer never runs its forward pass for pi_old
    (trainer mode would, every step), trains (both optimizer steps, the weights move), and
    the gap measured in each rollout's first step is the bfloat16 one, far above float
    noise; the PPO ratio of that step is against the engines' log-probs, so not 1."""
    out = tmp_path / "out"
    job = manifest(tiny, tmp_path, "engine-old", schedule={"numRollouts": 2},
                   rollout={"engineArgs": {"dtype": "bfloat16"}},
                   algorithm={"oldLogprobs": "engine"}, training={"globalBatchSize": 64})
    res = kuberl_run(job, out, "--seed", str(learning.run_seed()))
    assert res.returncode == 0, failed(res)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["optimizer_steps"] == 2.0 and r["old_logprobs_recomputed"] == 0.0, r
        assert r["rollout_logp_abs_diff_mean"] > BF16_GAP_MEAN, r
        assert r["rollout_seq_log_ratio_max"] > r["rollout_seq_log_ratio_min"], r
        assert r["ratio_max"] > 1.0 > r["ratio_min"], r
        assert torch.isfinite(torch.tensor(r["grad_norm"])), r
    before = load_file(str(tiny / "model" / "model.safetensors"))
    after = load_file(str(learning.final_model(out) / "model.safetensors"))
    assert any(not torch.equal(after[k].float(), v.float()) for k, v in before.items())
