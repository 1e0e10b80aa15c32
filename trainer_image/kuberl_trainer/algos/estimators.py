"""The job's advantage estimator, by name: scores (one per response) -> per-token advantages.

The estimators themselves are pure functions in ``advantages`` (per sequence, relative to the
prompt's group) and ``returns`` (per token); this module only picks one and feeds it.
"""

from __future__ import annotations

from torch import Tensor

from kuberl_api.spec import TOKEN_LEVEL_ESTIMATORS, AlgorithmSpec
from kuberl_trainer.algos import advantages, returns


def needs_reference(algo: AlgorithmSpec) -> bool:
    """Whether advantages need the trainer's frozen model's log-probs: the reference's for a
    KL penalty in the rewards, the teacher's for on-policy distillation."""
    return kl_in_reward(algo) or algo.advantage_estimator == "on_policy_distillation"


def kl_in_reward(algo: AlgorithmSpec) -> bool:
    """Whether the KL penalty goes into the rewards (so advantages need reference log-probs)."""
    return (algo.kl_penalty == "reward" and algo.kl_coef > 0
            and algo.advantage_estimator in TOKEN_LEVEL_ESTIMATORS)


def token_advantages(algo: AlgorithmSpec, scores: Tensor, group_size: int, mask: Tensor, *,
                     kl: Tensor | None = None, rows: int = 1) -> Tensor:
    """``[B, T]`` advantages, 0 off ``mask``.

    Args:
        algo: the job's algorithm section (``advantageEstimator``, ``gamma``, ``klCoef``).
        scores: ``[B / rows]`` shaped rewards, one per trajectory, prompt groups contiguous
            runs of ``group_size``.
        mask: ``[B, T]`` 1 on the response tokens that are trained on (dropped groups are 0
            here, so token-level estimators whiten over the tokens that count).
        kl: ``[B, T]`` per-token KL estimate (sampling policy vs reference), required when
            ``kl_in_reward(algo)``.
        rows: each trajectory's rows in ``mask``, consecutive (rollout.maxRowsPerSample): a
            trajectory counts once in its group, and every row of it takes its advantage.
            Above 1 for the group-relative sequence estimators only (grpo, dr_grpo, rloo).
    """
    est = algo.advantage_estimator
    if rows < 1 or scores.dim() != 1 or scores.shape[0] * rows != mask.shape[0]:
        raise ValueError(f"{tuple(scores.shape)} scores of {rows} rows each do not match "
                         f"the mask's {mask.shape[0]} rows")
    if est in ("grpo", "dr_grpo", "rloo"):
        # Dr.GRPO drops the std normalisation (its length normalisation is a loss aggregation).
        seq = (advantages.rloo(scores, group_size) if est == "rloo" else
               advantages.grpo(scores, group_size, normalize_std=est == "grpo"))
        return advantages.to_tokens(seq.repeat_interleave(rows), mask)
    if rows != 1:
        raise ValueError(f"advantageEstimator {est} scores each row as an episode: several "
                         "rows per trajectory need grpo, dr_grpo or rloo")
    kl_coef = algo.kl_coef if kl_in_reward(algo) else 0.0
    if kl_coef > 0 and kl is None:
        raise ValueError(f"klPenalty: reward with {est} needs the per-token KL")
    if est == "reinforce_plus_plus":
        return returns.reinforce_plus_plus(scores, mask, kl=kl if kl_coef else None,
                                           kl_coef=kl_coef, gamma=algo.gamma)
    if est == "reinforce_plus_plus_baseline":
        return returns.reinforce_plus_plus_baseline(scores, group_size, mask,
                                                    kl=kl if kl_coef else None, kl_coef=kl_coef)
    if est == "ppo":
        raise ValueError("ppo's advantages need the critic's values: use ppo_targets")
    if est == "on_policy_distillation":
        raise ValueError("distillation's advantages come from the teacher: use "
                         "distillation.reverse_kl_advantages")
    raise ValueError(f"unknown advantageEstimator {est!r}")


def ppo_targets(algo: AlgorithmSpec, scores: Tensor, mask: Tensor, values: Tensor, *,
                kl: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """PPO's ``(advantages, returns)``, both ``[B, T]``: GAE over the token rewards (the
    score on the last response token, the KL penalty on every token when it is in the
    reward) with the critic's rollout-time ``values``; the advantages whitened over the
    batch (the returns, the value model's targets, are not)."""
    kl_coef = algo.kl_coef if kl_in_reward(algo) else 0.0
    if kl_coef > 0 and kl is None:
        raise ValueError("klPenalty: reward with ppo needs the per-token KL")
    token_rewards = returns.kl_penalised_rewards(
        scores, kl if kl is not None else mask.new_zeros(mask.shape), mask, kl_coef)
    adv, ret = returns.gae(token_rewards, values, mask, algo.gamma, algo.gae_lambda)
    return returns.whiten(adv, mask), ret
