"""The training objective of one micro-batch, from per-token pieces to the number a backend
backpropagates: policy loss (PPO clip, GSPO, CISPO, SAPO, GPG or the job's own,
``algos.custom_loss``), optionally reweighted by
truncated or masked importance sampling, plus the KL and entropy terms, aggregated by the job's
loss-aggregation mode.

Backends compute log-probs and entropies (model forwards); everything about how they combine
lives here, so every backend trains on the same objective::

    loss = agg( w * pg + klCoef * kl - entropyCoef * H )

with ``pg`` the per-token policy loss on the ratio ``pi / pi_old``, where ``pi_old`` is the
trainer's own log-probs of the sampling policy (``oldLogprobs: trainer``) or the engines'
(``engine``), ``w`` the TIS weights (1 without ``tisCap``) times the
masked-IS weights (0 or 1; 1 without ``importanceMask``), ``kl`` a per-token estimate of
KL(policy || reference) (only when ``klPenalty: loss``; with ``reward`` the penalty is in the
advantages instead), ``H`` the per-token entropy.

A batch cut into micro-batches and data-parallel ranks trains exactly as the whole: each
micro-batch returns the aggregation's *partial sum*; the backend divides by the units of the
whole global batch (``units``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kuberl_api.spec import (
    ASYNC_DEFAULT_TIS_CAP,
    ImportanceMaskSpec,
    KlType,
    LossAggregation,
    OldLogprobs,
    PolicyLoss,
    RLJobSpec,
)
from kuberl_trainer.algos import aggregation, importance, kl as kl_estimators, policy_loss
from kuberl_trainer.algos.custom_loss import CustomLoss, LossInputs


@dataclass(frozen=True)
class Objective:
    policy_loss: PolicyLoss = "ppo"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    clip_c: float | None = None
    cispo_eps_high: float = 0.28
    cispo_eps_low: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    kl_coef: float = 0.0          # the loss term's weight (0 when the KL is in the reward)
    kl_type: KlType = "low_var_kl"
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    importance_mask: ImportanceMaskSpec | None = None
    aggregation: LossAggregation = "token-mean"
    horizon: int | None = None    # the generation budget, for seq-mean-token-sum-norm
    old_logprobs: OldLogprobs = "trainer"  # whose log-probs are pi_old
    custom_loss: CustomLoss | None = None  # policyLoss custom: lossFunction, imported

    def __post_init__(self) -> None:
        if (self.policy_loss == "custom") != (self.custom_loss is not None):
            raise ValueError("policyLoss custom needs its loss function (custom_loss), and "
                             "only it takes one")

    @classmethod
    def from_spec(cls, spec: RLJobSpec) -> Objective:
        a = spec.algorithm
        return cls(policy_loss=a.policy_loss, eps_clip=a.eps_clip, eps_clip_high=a.eps_clip_high,
                   clip_c=a.eps_clip_c, cispo_eps_high=a.cispo_eps_high,
                   cispo_eps_low=a.cispo_eps_low, sapo_tau_pos=a.sapo_tau_pos,
                   sapo_tau_neg=a.sapo_tau_neg,
                   kl_coef=a.kl_coef if a.kl_penalty == "loss" else 0.0,
                   kl_type=a.kl_loss_type, entropy_coef=a.entropy_coef,
                   tis_cap=effective_tis_cap(spec), importance_mask=a.importance_mask,
                   aggregation=a.loss_aggregation, horizon=spec.data.max_response_len,
                   old_logprobs=a.old_logprobs,
                   # (imported here, where the ranks build their backends: every training
                   # process imports the user's module, as preflight did on the head)
                   custom_loss=(CustomLoss.load(a.loss_function, a.loss_args)
                                if a.policy_loss == "custom" and a.loss_function else None))

    @property
    def needs_entropy_grad(self) -> bool:
        return self.entropy_coef > 0

    def units(self, mask: Tensor) -> float:
        """This batch's share of the aggregation's denominator (sum it over micro-batches and
        ranks to normalise the partial sums)."""
        return aggregation.units(mask, self.aggregation, self.horizon)

    def partial_loss(self, logp: Tensor, old_logp: Tensor | None, adv: Tensor, mask: Tensor, *,
                     entropy: Tensor, rollout_logp: Tensor | None = None,
                     ref_logp: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """The aggregation's numerator over these rows, and token-mean metrics.

        Args (all ``[B, T]``, aligned to input_ids positions, ``mask`` 1 on response tokens):
            logp: the policy's log-probs (with gradient).
            old_logp: the sampling policy's, as the trainer computes them (no gradient): the
                ratio's denominator with ``oldLogprobs: trainer``. With ``engine`` the
                engines' ``rollout_logp`` is, and ``old_logp`` serves only the gap metrics;
                None there when the trainer has none (the rollout's optimizer steps after
                its first: its forward no longer sees the sampling policy).
            adv: per-token advantages.
            entropy: per-token entropy of the policy (with gradient if entropyCoef > 0).
            rollout_logp: the engines' log-probs, for the gap metrics, TIS and masked IS
                (needed when tisCap or importanceMask is set, or with ``oldLogprobs:
                engine``).
            ref_logp: the reference's log-probs (needed when the KL term is on).

        Returns:
            ``(partial_sum, metrics)``; metrics are token-means over this micro-batch:
            ``pg_loss``, ``pg_clipfrac`` (and ``pg_clipfrac_lower`` with dual clip; neither
            with a custom loss, which reports its own as ``loss_<name>``),
            ``ratio_mean``/``ratio_max``/``ratio_min``, ``approx_kl`` (k1 of KL(old || policy)),
            ``entropy``, ``kl_ref`` (when a reference is given), TIS metrics with tisCap, the
            train-inference gap (``importance.gap_metrics``) whenever both the trainer's and
            the engines' log-probs of the sampling policy are given; each
            a detached 0-d tensor on the inputs' device, so that a backend reads a whole
            step's metrics back in one transfer (``backends.step_metrics``) instead of
            stalling the GPU once per micro-batch.
        """
        pi_old = self._pi_old(old_logp, rollout_logp)
        metrics: dict[str, Tensor] = {}
        if self.custom_loss is not None:
            pg, flags, own = self._custom_term(logp, pi_old, adv, mask, entropy=entropy,
                                               rollout_logp=rollout_logp, ref_logp=ref_logp)
            metrics.update(own)
        else:
            pg, flags = POLICY_LOSSES[self.policy_loss](self, logp, pi_old, adv, mask)
        if old_logp is not None and rollout_logp is not None:
            metrics.update(importance.gap_metrics(old_logp, rollout_logp, mask))
        if self.tis_cap is not None:
            if rollout_logp is None or old_logp is None:
                raise ValueError("tisCap needs the trainer's and the engines' log-probs "
                                 "(old_logp, rollout_logp)")
            weights, tis_metrics = importance.truncated_weights(old_logp, rollout_logp, mask,
                                                                self.tis_cap)
            pg = pg * weights
            metrics.update(tis_metrics)
        if self.importance_mask is not None:
            if rollout_logp is None or old_logp is None:
                raise ValueError("importanceMask needs the trainer's and the engines' "
                                 "log-probs (old_logp, rollout_logp)")
            m = self.importance_mask
            kept, mis_metrics = importance.masked_weights(old_logp, rollout_logp, mask,
                                                          level=m.level, low=m.low, high=m.high)
            pg = pg * kept  # (dropped tokens stay in the aggregation's denominator)
            metrics.update(mis_metrics)
        total = pg - self.entropy_coef * entropy if self.entropy_coef > 0 else pg
        kl_ref = None
        if ref_logp is not None:
            kl_ref = kl_estimators.estimate(logp, ref_logp, self.kl_type)
            if self.kl_coef > 0:
                total = total + self.kl_coef * kl_ref
        elif self.kl_coef > 0:
            raise ValueError("klCoef > 0 with klPenalty: loss needs the reference log-probs")
        partial = aggregation.partial_sum(total, mask, self.aggregation)

        metrics.update(_token_metrics(mask.bool(), pg=pg, flags=flags, logp=logp,
                                      old_logp=pi_old, entropy=entropy, kl_ref=kl_ref))
        return partial, metrics

    def _custom_term(self, logp: Tensor, pi_old: Tensor, adv: Tensor, mask: Tensor, *,
                     entropy: Tensor, rollout_logp: Tensor | None, ref_logp: Tensor | None
                     ) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
        """The job's own per-token term, its ratio (for the ratio metrics, as the built-in
        losses report it) and its own metrics (``loss_<name>``). Off the mask the result is
        0 whatever the function put there."""
        assert self.custom_loss is not None
        if rollout_logp is None:
            raise ValueError("policyLoss custom needs the engines' log-probs (rollout_logp)")
        inp = LossInputs.of(logp=logp, old_logp=pi_old, rollout_logp=rollout_logp,
                            ref_logp=ref_logp, advantages=adv, mask=mask, entropy=entropy)
        per_token, own = self.custom_loss(inp)
        on = mask.bool()
        pg = torch.where(on, per_token, torch.zeros_like(per_token))
        ratio = torch.exp(torch.where(on, logp.detach() - pi_old, torch.zeros_like(logp)))
        return pg, {"ratio": ratio}, own

    def _pi_old(self, old_logp: Tensor | None, rollout_logp: Tensor | None) -> Tensor:
        """The ratio's denominator: the engines' log-probs with ``oldLogprobs: engine``,
        else the trainer's."""
        if self.old_logprobs == "engine":
            if rollout_logp is None:
                raise ValueError("oldLogprobs: engine needs the engines' log-probs "
                                 "(rollout_logp)")
            return rollout_logp
        if old_logp is None:
            raise ValueError("oldLogprobs: trainer needs the trainer's log-probs (old_logp)")
        return old_logp


def effective_tis_cap(spec: RLJobSpec) -> float | None:
    """The TIS cap a job trains with: the algorithm section's, or in mode async with the
    default off-policy correction and no correction of the user's own, the async default.

    Async samples come from weights up to maxStaleness versions old; treating them as drawn
    from pi_old lost all of sync's gain on the addition task at maxStaleness 4 (the reward
    fell), where truncating pi_old / pi_rollout at 2 kept most of it (bench/RESULTS.md,
    "Async off-policy correction")."""
    a = spec.algorithm
    if (spec.mode == "async" and spec.async_.off_policy_correction == "truncated"
            and a.tis_cap is None and a.importance_mask is None):
        return ASYNC_DEFAULT_TIS_CAP
    return a.tis_cap


_LossFn = Callable[[Objective, Tensor, Tensor, Tensor, Tensor],
                   tuple[Tensor, dict[str, Tensor]]]

# Each built-in policyLoss value and the settings it reads: (objective, logp, old_logp, adv,
# mask). (custom is the job's own: Objective._custom_term.)
POLICY_LOSSES: dict[str, _LossFn] = {
    "ppo": lambda o, lp, old, adv, m: policy_loss.ppo_clip(
        lp, old, adv, m, o.eps_clip, o.eps_clip_high, clip_c=o.clip_c),
    "gspo": lambda o, lp, old, adv, m: policy_loss.gspo(
        lp, old, adv, m, o.eps_clip, o.eps_clip_high),
    "cispo": lambda o, lp, old, adv, m: policy_loss.cispo(
        lp, old, adv, m, o.cispo_eps_high, o.cispo_eps_low),
    "sapo": lambda o, lp, old, adv, m: policy_loss.sapo(
        lp, old, adv, m, o.sapo_tau_pos, o.sapo_tau_neg),
    "gpg": lambda o, lp, old, adv, m: policy_loss.gpg(lp, old, adv, m),
}


@torch.no_grad()
def _token_metrics(on: Tensor, *, pg: Tensor, flags: dict[str, Tensor], logp: Tensor,
                   old_logp: Tensor, entropy: Tensor, kl_ref: Tensor | None
                   ) -> dict[str, Tensor]:
    """Token-means (and the ratio's extremes) over the response tokens ``on``, as device
    scalars: a ``float()`` each would be a device sync, and on a GPU every sync stalls the
    launch queue of the step."""
    count = on.sum()
    denom = count.clamp(min=1).to(torch.float32)

    def mean(x: Tensor) -> Tensor:
        return torch.where(on, x.detach(), 0.0).sum() / denom

    ratio = flags["ratio"].detach()
    none = count == 0  # no response tokens: no ratio to report, so its extremes are 1

    def extreme(x: Tensor) -> Tensor:
        return torch.where(none, 1.0, x).to(torch.float32)

    values = {
        "pg_loss": mean(pg),
        "ratio_mean": mean(ratio),
        "ratio_max": extreme(torch.where(on, ratio, -math.inf).max()),
        "ratio_min": extreme(torch.where(on, ratio, math.inf).min()),
        "approx_kl": mean(old_logp - logp),
        "entropy": mean(entropy),
    }
    if "clipped" in flags:  # (a custom loss reports what it clips itself)
        values["pg_clipfrac"] = (flags["clipped"] & on).sum() / denom
    if "clipped_lower" in flags:
        values["pg_clipfrac_lower"] = (flags["clipped_lower"] & on).sum() / denom
    if kl_ref is not None:
        values["kl_ref"] = mean(kl_ref)
    return values
