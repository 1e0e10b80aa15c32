"""The algorithm section: the advantage estimator, the policy loss and its clipping, KL,
importance correction, the LR schedule and DAPO's shaping; and the rules between them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AllowInfNan, Field, Strict

from kuberl_api.base import ApiModel, Rule, rules_schema
from kuberl_api.spec.common import IMPORT_PATH_PATTERN, MAX_STR

AdvantageEstimator = Literal[
    "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo",
    "on_policy_distillation",
]
# Estimators whose advantages are per token (returns over the response), which is what a KL
# penalty folded into the rewards needs.
TOKEN_LEVEL_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
KlType = Literal["k1", "k2", "k3", "low_var_kl"]
PolicyLoss = Literal["ppo", "gspo", "cispo", "sapo", "gpg", "custom"]
# The losses that clip the ratio with epsClip / epsClipHigh (cispo clips its importance weight
# with keys of its own; sapo and gpg clip nothing; a custom loss takes its own in lossArgs).
CLIPPED_LOSSES = ("ppo", "gspo")
# lossArgs: a custom loss's settings, numbers only (its keyword arguments; a number in YAML is
# a number here, never a string that happens to parse as one).
LossArgs = dict[str, Annotated[float, Strict(), AllowInfNan(False)]]
MAX_LOSS_ARGS = 64
LossAggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
]
KlPenalty = Literal["loss", "reward"]
# Whose log-probs of the sampled tokens are PPO's pi_old: the trainer's own forward pass (or,
# with one optimizer step per rollout, its training forward's) or the engines' from sampling.
OldLogprobs = Literal["trainer", "engine"]
# Mixture-of-experts routing replay (docs/moe.md): which experts a training forward pass sends
# each token to. none: the router's own choice; training: the choice of the trainer's own
# old-log-prob pass; rollout: the engine's while it sampled the token.
RoutingReplay = Literal["none", "training", "rollout"]
# Estimators that discount token returns with algorithm.gamma (reinforce_plus_plus_baseline's
# returns are undiscounted; see kuberl_trainer.algos.estimators).
DISCOUNTED_ESTIMATORS = ("reinforce_plus_plus", "ppo")

# Settings that only mean something beside another one; each is refused where it would be
# ignored, so what a user wrote is what runs.
KL_REWARD_NEEDS_COEF = "klPenalty: reward needs klCoef > 0"
KL_TYPE_NEEDS_COEF = ("klLossType applies only with klCoef > 0 (it picks the estimator of the "
                      "KL term klCoef weighs)")
DUAL_CLIP_PPO_ONLY = ("epsClipC (dual clip) applies to policyLoss: ppo only (gspo clips the "
                      "sequence ratio)")
EPS_CLIP_APPLIES = ("epsClip and epsClipHigh apply to policyLoss " + " or ".join(CLIPPED_LOSSES)
                    + " only (cispo clips its weight with cispoEpsHigh and cispoEpsLow; sapo "
                    "and gpg clip nothing; a custom loss takes its settings in lossArgs)")
CISPO_ONLY = "cispoEpsHigh and cispoEpsLow apply to policyLoss: cispo only"
SAPO_ONLY = "sapoTauPos and sapoTauNeg apply to policyLoss: sapo only"
LOSS_FUNCTION_CUSTOM_ONLY = ("lossFunction is required by policyLoss custom, and only used by "
                             "it")
LOSS_ARGS_CUSTOM_ONLY = ("lossArgs applies to policyLoss: custom only (the keyword arguments "
                         "of lossFunction)")
GAMMA_APPLIES = ("gamma applies to advantageEstimator " + " or ".join(DISCOUNTED_ESTIMATORS)
                 + " only (the discount of their token returns)")
GAE_LAMBDA_APPLIES = "gaeLambda applies to advantageEstimator: ppo only (GAE's lambda)"
OVERLONG_PENALTY_APPLIES = ("overlongPenalty applies only with overlongBuffer (DAPO overlong "
                            "shaping is off without it)")
MIN_LR_APPLIES = "minLrRatio applies only when lrDecayStyle decays (linear or cosine)"
ENGINE_OLD_NO_IS = ("oldLogprobs: engine cannot go with tisCap or importanceMask: their "
                    "weight is pi_old / pi_rollout, which is 1 when pi_old is the engines' "
                    "log-probs (use oldLogprobs: trainer)")


class ImportanceMaskSpec(ApiModel):
    """Masked importance sampling (docs/algorithms.md): drop the policy loss of tokens (or
    whole responses) whose ratio pi_old / pi_rollout leaves [low, high]."""

    level: Literal["token", "sequence"] = Field(
        "token", description="token: each token by its own ratio; sequence: a response by its "
        "geometric-mean ratio, all its tokens kept or dropped together.")
    low: float = Field(0.5, gt=0, le=1, description="Lower edge of the band (<= 1).")
    high: float = Field(2.0, ge=1, le=1000, description="Upper edge of the band (>= 1).")


class AlgorithmSpec(ApiModel):
    """The RL algorithm; docs/algorithms.md has each option's formula and paper."""

    RULES = (
        Rule("!has(self.epsClipHigh) || self.epsClipHigh >= self.epsClip",
             lambda a: a.eps_clip_high is None or a.eps_clip_high >= a.eps_clip,
             "epsClipHigh must be at least epsClip", "epsClipHigh",
             detail=lambda a: f"epsClip = {a.eps_clip}"),
        Rule("self.klPenalty != 'reward' || self.advantageEstimator in "
             f"{list(TOKEN_LEVEL_ESTIMATORS)}",
             lambda a: a.kl_penalty != "reward" or a.advantage_estimator in TOKEN_LEVEL_ESTIMATORS,
             "klPenalty: reward needs a token-level advantageEstimator ("
             + " or ".join(TOKEN_LEVEL_ESTIMATORS) + ")", "klPenalty"),
        Rule("(self.advantageEstimator == 'on_policy_distillation') == has(self.teacherPath)",
             lambda a: ((a.advantage_estimator == "on_policy_distillation")
                        == (a.teacher_path is not None)),
             "teacherPath is required by advantageEstimator on_policy_distillation, and "
             "only used by it", "teacherPath"),
        Rule("(self.policyLoss == 'custom') == has(self.lossFunction)",
             lambda a: (a.policy_loss == "custom") == (a.loss_function is not None),
             LOSS_FUNCTION_CUSTOM_ONLY, "lossFunction",
             detail=lambda a: f"policyLoss = {a.policy_loss}"),
        Rule("size(self.lossArgs) == 0 || self.policyLoss == 'custom'",
             lambda a: not a.loss_args or a.policy_loss == "custom", LOSS_ARGS_CUSTOM_ONLY,
             "lossArgs", detail=lambda a: f"policyLoss = {a.policy_loss}"),
        Rule("self.klPenalty != 'reward' || self.klCoef > 0.0",
             lambda a: a.kl_penalty != "reward" or a.kl_coef > 0, KL_REWARD_NEEDS_COEF,
             "klPenalty"),
        Rule("self.klCoef > 0.0 || self.klLossType == 'low_var_kl'",
             lambda a: a.kl_coef > 0 or a.kl_loss_type == "low_var_kl", KL_TYPE_NEEDS_COEF,
             "klLossType"),
        Rule("!has(self.epsClipC) || self.policyLoss == 'ppo'",
             lambda a: a.eps_clip_c is None or a.policy_loss == "ppo", DUAL_CLIP_PPO_ONLY,
             "epsClipC"),
        Rule(f"self.epsClip == 0.2 || self.policyLoss in {list(CLIPPED_LOSSES)}",
             lambda a: a.eps_clip == 0.2 or a.policy_loss in CLIPPED_LOSSES,
             EPS_CLIP_APPLIES, "epsClip", detail=lambda a: f"policyLoss = {a.policy_loss}"),
        Rule(f"!has(self.epsClipHigh) || self.policyLoss in {list(CLIPPED_LOSSES)}",
             lambda a: a.eps_clip_high is None or a.policy_loss in CLIPPED_LOSSES,
             EPS_CLIP_APPLIES, "epsClipHigh",
             detail=lambda a: f"policyLoss = {a.policy_loss}"),
        Rule("self.cispoEpsHigh == 0.28 || self.policyLoss == 'cispo'",
             lambda a: a.cispo_eps_high == 0.28 or a.policy_loss == "cispo",
             CISPO_ONLY, "cispoEpsHigh", detail=lambda a: f"policyLoss = {a.policy_loss}"),
        Rule("!has(self.cispoEpsLow) || self.policyLoss == 'cispo'",
             lambda a: a.cispo_eps_low is None or a.policy_loss == "cispo",
             CISPO_ONLY, "cispoEpsLow", detail=lambda a: f"policyLoss = {a.policy_loss}"),
        Rule("self.sapoTauPos == 1.0 || self.policyLoss == 'sapo'",
             lambda a: a.sapo_tau_pos == 1.0 or a.policy_loss == "sapo",
             SAPO_ONLY, "sapoTauPos", detail=lambda a: f"policyLoss = {a.policy_loss}"),
        Rule("self.sapoTauNeg == 1.05 || self.policyLoss == 'sapo'",
             lambda a: a.sapo_tau_neg == 1.05 or a.policy_loss == "sapo",
             SAPO_ONLY, "sapoTauNeg", detail=lambda a: f"policyLoss = {a.policy_loss}"),
        Rule(f"self.gamma == 1.0 || self.advantageEstimator in {list(DISCOUNTED_ESTIMATORS)}",
             lambda a: a.gamma == 1.0 or a.advantage_estimator in DISCOUNTED_ESTIMATORS,
             GAMMA_APPLIES, "gamma"),
        Rule("self.gaeLambda == 0.95 || self.advantageEstimator == 'ppo'",
             lambda a: a.gae_lambda == 0.95 or a.advantage_estimator == "ppo",
             GAE_LAMBDA_APPLIES, "gaeLambda"),
        Rule("self.overlongPenalty == 1.0 || has(self.overlongBuffer)",
             lambda a: a.overlong_penalty == 1.0 or a.overlong_buffer is not None,
             OVERLONG_PENALTY_APPLIES, "overlongPenalty"),
        Rule("self.minLrRatio == 0.0 || self.lrDecayStyle != 'constant'",
             lambda a: a.min_lr_ratio == 0.0 or a.lr_decay_style != "constant",
             MIN_LR_APPLIES, "minLrRatio"),
        Rule("self.oldLogprobs == 'trainer' || (!has(self.tisCap) && "
             "!has(self.importanceMask))",
             lambda a: (a.old_logprobs == "trainer"
                        or (a.tis_cap is None and a.importance_mask is None)),
             ENGINE_OLD_NO_IS, "oldLogprobs"),
    )
    model_config = {"json_schema_extra": rules_schema(RULES)}

    advantage_estimator: AdvantageEstimator = Field(
        "grpo", description="grpo, dr_grpo (no std division), rloo (leave-one-out baseline), "
        "reinforce_plus_plus (token returns, batch-whitened), reinforce_plus_plus_baseline "
        "(group mean subtracted first), ppo (GAE with the value model of the critic section), "
        "on_policy_distillation (per token: the teacher's log-prob minus the student's).")
    teacher_path: str | None = Field(
        None, min_length=1, max_length=MAX_STR, description="on_policy_distillation: the "
        "teacher, an HF causal LM directory sharing the model's tokenizer (on the model's "
        "storage); its log-probs of the student's samples are the training signal.")
    policy_loss: PolicyLoss = Field(
        "ppo", description="ppo: the clipped per-token ratio; gspo: the clipped sequence "
        "ratio (geometric mean of a response's token ratios; use small clip ranges, e.g. "
        "epsClip 3e-4, epsClipHigh 4e-4); cispo: REINFORCE weighted by the clipped ratio "
        "under stop-gradient, no token dropped (cispoEpsHigh, cispoEpsLow); sapo: a soft "
        "sigmoid gate of the ratio instead of the clip (sapoTauPos, sapoTauNeg); gpg: the "
        "plain policy gradient -A * log-prob, no ratio and no clip; custom: the job's own "
        "per-token term, lossFunction (docs/algorithms.md, \"Your own loss\").")
    loss_function: str | None = Field(
        None, max_length=MAX_STR, pattern=IMPORT_PATH_PATTERN,
        description="policyLoss custom: `module:function`, `fn(inp, **lossArgs) -> (loss, "
        "metrics)`, the per-token policy loss [B, T] from inp's logp (with gradient), old_logp "
        "(pi_old), rollout_logp, ref_logp, advantages, mask and entropy; kuberl keeps the "
        "importance weights, the KL and entropy terms and the aggregation. Imported by every "
        "training rank (in a cluster: from spec.code or the image) and called once on a "
        "synthetic batch before the job starts.")
    loss_args: LossArgs = Field(
        default_factory=dict, max_length=MAX_LOSS_ARGS,
        description="policyLoss custom: numbers passed to lossFunction as keyword arguments.")
    loss_aggregation: LossAggregation = Field(
        "token-mean", description="How token losses become the loss: token-mean, "
        "seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm (Dr.GRPO: divided "
        "by sequences * data.maxResponseLen).")
    lr: float = Field(1e-6, gt=0, le=1, description="Learning rate.")
    lr_warmup_steps: int = Field(
        0, ge=0, le=10_000_000, description="Optimizer steps of linear LR warmup, from "
        "lr/lrWarmupSteps up to lr.")
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="LR after warmup: constant, or decayed (linear or cosine) to "
        "lr * minLrRatio at the run's last optimizer step.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final LR as a fraction of lr "
                                "when lrDecayStyle decays (linear or cosine only).")
    eps_clip: float = Field(0.2, gt=0, le=10, description="PPO clip range (lower side; "
                            "policyLoss ppo or gspo only).")
    eps_clip_high: float | None = Field(None, gt=0, le=10, description="Upper clip range "
                                        "(clip-higher); = epsClip (policyLoss ppo or gspo "
                                        "only).")
    eps_clip_c: float | None = Field(None, gt=1, le=100, description="Dual-clip constant "
                                     "(policyLoss ppo): for negative advantages the loss is "
                                     "also capped at -A * epsClipC; unset: off.")
    cispo_eps_high: float = Field(
        0.28, gt=0, le=100, description="cispo: the importance weight is at most "
        "1 + cispoEpsHigh (policyLoss cispo only).")
    cispo_eps_low: float | None = Field(
        None, gt=0, le=1, description="cispo: the importance weight is at least "
        "1 - cispoEpsLow; unset: no lower bound, as in MiniMax-M1 (policyLoss cispo only).")
    sapo_tau_pos: float = Field(
        1.0, gt=0, le=100, description="sapo: the gate's temperature for tokens with a "
        "positive advantage; larger fades their gradient faster as the ratio leaves 1 "
        "(policyLoss sapo only).")
    sapo_tau_neg: float = Field(
        1.05, gt=0, le=100, description="sapo: the gate's temperature for tokens with a "
        "zero or negative advantage (policyLoss sapo only).")
    tis_cap: float | None = Field(
        None, gt=0, le=100, description="Truncated importance sampling: weight each token's "
        "policy loss by min(pi_old / pi_rollout, tisCap), correcting for the engines' own "
        "log-probs differing from the trainer's; unset: off.")
    importance_mask: ImportanceMaskSpec | None = Field(
        None, description="Masked importance sampling: tokens (or responses) whose ratio "
        "pi_old / pi_rollout leaves [low, high] leave the policy loss; with tisCap, the "
        "tokens kept are also weighted; unset: off.")
    old_logprobs: OldLogprobs = Field(
        "trainer", description="Whose log-probs of the sampled tokens are pi_old (the PPO "
        "ratio's denominator): trainer (its own forward pass before the rollout's first "
        "optimizer step; none needed with one step per rollout) or engine (the engines' "
        "from sampling: that forward pass is skipped; not with tisCap, importanceMask or "
        "mode: async).")
    kl_coef: float = Field(0.0, ge=0, le=100, description="Weight of the KL term; 0: off.")
    kl_loss_type: KlType = Field(
        "low_var_kl", description="Estimator of the KL term (k1, k2, k3, low_var_kl); only "
        "with klCoef > 0.")
    kl_penalty: KlPenalty = Field(
        "loss", description="Where klCoef applies: loss (a KL(policy || reference) term in "
        "the loss) or reward (a per-token penalty in the rewards; token-level estimators, "
        "klCoef > 0).")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of token-level returns "
                         "(reinforce_plus_plus, ppo only).")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE's lambda (ppo only): 1 is "
                              "the Monte-Carlo return, 0 the one-step TD error.")
    entropy_coef: float = Field(0.0, ge=0, le=100)
    sft_coef: float = Field(0.0, ge=0, le=100, description="Weight of an SFT (NLL) term on "
                            "data.sft's demonstrations, added to every optimizer step (mixed "
                            "RL + SFT training); 0: off.")
    temperature: float = Field(1.0, gt=0, le=100, description="Sampling temperature.")
    drop_constant_groups: bool = Field(
        False, description="Leave out of the loss the prompt groups whose rewards are all "
        "equal (they carry no GRPO signal but dilute the token mean).")
    dynamic_sampling_rounds: int = Field(
        0, ge=0, le=100, description="DAPO dynamic sampling: up to this many extra rounds of "
        "prompts per step to replace groups whose rewards are all equal; groups still equal "
        "after the last round leave the loss. 0: off.")
    routing_replay: RoutingReplay = Field(
        "none", description="Mixture-of-experts models only: which experts each token goes to "
        "in the trainer's passes. none: the router's own top-k; training: the top-k of the "
        "trainer's old-log-prob pass, replayed in its training passes; rollout: the top-k "
        "the engine routed the token to while sampling (reference engine; SGLang 0.5.6 "
        "cannot return it). The router still gets gradients through the replayed experts' "
        "weights.")
    router_aux_loss_coef: float | None = Field(
        None, ge=0, le=100, description="Mixture-of-experts models only: the weight of the "
        "router's load-balancing loss (the model's own, e.g. Switch-style for Qwen3-MoE); "
        "unset: the model config's router_aux_loss_coef; 0: off.")
    overlong_buffer: int | None = Field(
        None, ge=1, le=1048576, description="DAPO overlong shaping: over the last this many "
        "tokens of data.maxResponseLen the reward ramps down by up to overlongPenalty; "
        "unset: off.")
    overlong_penalty: float = Field(1.0, ge=0, le=100, description="The overlong shaping's "
                                    "penalty at data.maxResponseLen (with overlongBuffer "
                                    "only).")

