"""Bad RLJob manifests are refused with messages naming the field — by the pydantic model (what
`kuberl` and the operator use) and by the generated CRD's schema and the rules' CEL in its
ValidatingAdmissionPolicy (what `kubectl apply` uses). Each case is checked against both, so
the two can't drift apart."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic.alias_generators import to_camel

from kuberl_api import InvalidRLJob, parse
from kuberl_api.spec import (
    MAX_GLOBAL_BATCH,
    MAX_GPUS_PER_ENGINE,
    MAX_GPUS_PER_NODE,
    MAX_MICRO_BATCH,
    MAX_NODES,
    MAX_PARALLEL,
    MAX_ROLLOUT_BATCH,
    MAX_ROLLOUT_GPUS,
    MAX_SAMPLES_PER_PROMPT,
)
from kuberl_operator.crd import validated_schema
from tests.crd_admission import admit

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = validated_schema()


def base() -> dict[str, Any]:
    """A short valid manifest: the defaults fill the rest (1 node x 8 GPUs, colocated)."""
    return {
        "apiVersion": "kuberl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "math-grpo", "namespace": "team-a"},
        "spec": {"model": {"path": "/models/qwen"}, "data": {"prompts": "/data/train.jsonl"}},
    }


def disagg(**rollout: Any) -> Callable[[dict[str, Any]], None]:
    def edit(s: dict[str, Any]) -> None:
        s["placement"] = "disaggregated"
        s["rollout"] = rollout
    return edit


def set_(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Edit for spec at a dotted path, creating intermediate maps."""
    def edit(spec: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = spec
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return edit


def both(*edits: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def edit(spec: dict[str, Any]) -> None:
        for e in edits:
            e(spec)
    return edit


def ppo(*edits: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    """`edits` on a PPO job (the critic section applies to it only)."""
    return both(set_("algorithm.advantageEstimator", "ppo"), *edits)


# A job's own policy loss (algorithm.policyLoss: custom).
CUSTOM_LOSS = both(set_("algorithm.policyLoss", "custom"),
                   set_("algorithm.lossFunction", "my_losses:ppo_clip"))

# Training and rollout on CPU (a job without a GPU pod).
ON_CPU = both(set_("training", {"backend": "fsdp", "gpusPerNode": 0}),
              set_("rollout.engine", "reference"))


def eval_mode(*edits: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    """`edits` on a job of mode eval (one eval set, no prompts: it trains nothing)."""
    def edit(spec: dict[str, Any]) -> None:
        spec["mode"] = "eval"
        spec["data"] = {"evalSets": [{"name": "a", "path": "/data/a.jsonl",
                                      "nSamplesPerPrompt": 4, "passK": [1, 4]}]}
        for e in edits:
            e(spec)
    return edit


def drop(path: str) -> Callable[[dict[str, Any]], None]:
    """Edit for spec: remove the field at a dotted path."""
    def edit(spec: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = spec
        for p in parents:
            node = node[p]
        del node[leaf]
    return edit


def remote_reward(url: str = "http://rm:8000/score", **settings: Any
                  ) -> Callable[[dict[str, Any]], None]:
    """Edit for spec: reward.type remote at `url`, with `settings`."""
    return set_("reward", {"type": "remote", "url": url, **settings})


def pool(*tolerations: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return set_("training.nodePool", {"tolerations": list(tolerations)})


# (id, edit of spec, field path both validators must name, words the message must contain)
BAD_SPECS: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    ("unknown-field", set_("bogus", 1), "spec.bogus", ""),
    ("misspelt-nested", set_("training.gpuPerNode", 8), "spec.training.gpuPerNode", ""),
    ("tp-zero", set_("training.parallelism.tp", 0), "spec.training.parallelism.tp", ""),
    ("placement-enum", set_("placement", "hybrid"), "spec.placement", "colocate"),
    ("router-enum", set_("rollout.router", "nginx"), "spec.rollout.router", "sglang"),
    ("backend-enum", set_("training.backend", "deepspeed"), "spec.training.backend", "fsdp"),
    ("estimator-enum", set_("algorithm.advantageEstimator", "a2c"),
     "spec.algorithm.advantageEstimator", "grpo"),
    ("custom-reward-without-function", set_("reward.type", "custom"), "spec.reward.function",
     "required"),
    ("function-without-custom", set_("reward.function", "my.rewards:score"),
     "spec.reward.function", "custom"),
    ("function-not-import-path", both(set_("reward.type", "custom"),
                                      set_("reward.function", "rewards.py")),
     "spec.reward.function", ""),
    ("batch-without-custom", set_("reward.batch", True), "spec.reward.batch",
     "applies only to type custom"),
    ("remote-reward-without-url", set_("reward.type", "remote"), "spec.reward.url", "required"),
    ("url-without-remote", set_("reward.url", "http://rm:8000/score"), "spec.reward.url",
     "allowed only then"),
    ("url-not-http", remote_reward(url="ftp://rm/score"), "spec.reward.url", ""),
    ("url-without-host", remote_reward(url="http:///score"), "spec.reward.url", ""),
    ("url-with-a-space", remote_reward(url="http://rm:8000/my score"), "spec.reward.url", ""),
    *((f"{to_camel(f)}-without-remote", set_(f"reward.{to_camel(f)}", v),
       f"spec.reward.{to_camel(f)}", "applies only to type remote")
      for f, v in (("timeout_seconds", 30), ("max_retries", 0), ("batch_size", 8),
                   ("max_concurrent_requests", 2), ("on_error", "fail"))),
    ("timeout-zero", remote_reward(timeoutSeconds=0), "spec.reward.timeoutSeconds", ""),
    ("retries-negative", remote_reward(maxRetries=-1), "spec.reward.maxRetries", ""),
    ("reward-batch-size-zero", remote_reward(batchSize=0), "spec.reward.batchSize", ""),
    ("no-request-in-flight", remote_reward(maxConcurrentRequests=0),
     "spec.reward.maxConcurrentRequests", ""),
    ("reward-on-error-enum", remote_reward(onError="zero"), "spec.reward.onError", "drop"),
    ("metadata-keys-for-a-per-sample-function",
     both(set_("reward", {"type": "custom", "function": "my_rewards:score"}),
          set_("data.metadataKeys", ["level"])), "spec.data.metadataKeys", "reward.batch"),
    ("rollout-function-args-without-function", set_("rollout.functionArgs", {"tools": "calc"}),
     "spec.rollout.functionArgs", "only with function"),
    ("environment-args-without-class", set_("environment.args", {"level": "2"}),
     "spec.environment.args", "only with class"),
    ("rollout-function-and-environment", both(set_("rollout.function", "agent:run"),
                                              set_("environment.class", "envs:Calculator")),
     "spec.environment.class", "set one"),
    ("environment-args-seed", both(set_("environment.class", "envs:Calculator"),
                                   set_("environment.args", {"seed": "3"})),
     "spec.environment.args", "may not name seed"),
    ("environment-image-without-class", set_("environment.image", "envs:1"),
     "spec.environment.image", "image needs class"),
    *((f"environment-{field}-without-image", set_(f"environment.{field}", value),
       f"spec.environment.{field}", "applies only with image")
      for field, value in (("replicas", 2), ("timeoutSeconds", 30),
                           ("resources", {"cpu": "1"}), ("nodePool", {}),
                           ("env", {"LEVEL": "2"}))),
    ("environment-env-name", both(set_("environment.class", "envs:Calculator"),
                                  set_("environment.image", "envs:1"),
                                  set_("environment.env", {"1LEVEL": "2"})),
     "spec.environment.env", "C identifiers"),
    ("environment-replicas-zero", both(set_("environment.class", "envs:Calculator"),
                                       set_("environment.image", "envs:1"),
                                       set_("environment.replicas", 0)),
     "spec.environment.replicas", ""),
    *((f"code-{case}", both(set_("rollout.function", "agent:run"), set_("code", code)),
       f"spec.code.{field}", words)
      for case, code, field, words in (
          ("two-sources", {"configMap": "agent", "pvc": "agent"}, "pvc", "set one"),
          ("sub-path-without-pvc", {"configMap": "agent", "subPath": "src"}, "subPath",
           "only with pvc"),
          ("sub-path-absolute", {"pvc": "agent", "subPath": "/src"}, "subPath", "relative"),
          ("sub-path-up", {"pvc": "agent", "subPath": "src/../../etc"}, "subPath", "'..'"),
          ("configmap-name", {"configMap": "My_Agent"}, "configMap", ""),
          ("pvc-name", {"pvc": "-agent"}, "pvc", ""))),
    ("code-without-user-code", set_("code", {"configMap": "agent"}), "spec.code",
     "only the job's own functions import"),
    ("code-for-an-environment-image", both(
        set_("environment", {"class": "envs:Calculator", "image": "envs:1"}),
        set_("code", {"pvc": "agent"})), "spec.code", "an image serves its own class"),
    ("max-turns-without-agent", set_("rollout.maxTurns", 4), "spec.rollout.maxTurns",
     "needs rollout.function or environment.class"),
    ("on-error-drop-without-episodes", set_("environment.onError", "drop"),
     "spec.environment.onError", "no episode to drop"),
    ("on-error-enum", both(set_("environment.class", "envs:Calculator"),
                           set_("environment.onError", "retry")),
     "spec.environment.onError", "drop"),
    ("environment-reward-without-episodes", set_("reward.type", "environment"),
     "spec.reward.type", "needs environment.class"),
    ("metadata-keys-without-episodes", set_("data.metadataKeys", ["level"]),
     "spec.data.metadataKeys", "only they see"),
    ("rows-without-function", both(set_("environment.class", "envs:Calculator"),
                                   set_("rollout.maxRowsPerSample", 2)),
     "spec.rollout.maxRowsPerSample", "needs rollout.function"),
    ("rows-with-a-token-level-estimator", both(
        set_("rollout.function", "agent:run"), set_("rollout.maxRowsPerSample", 2),
        set_("algorithm.advantageEstimator", "reinforce_plus_plus")),
     "spec.rollout.maxRowsPerSample", "grpo, dr_grpo or rloo"),
    ("rows-over-the-limit", both(set_("rollout.function", "agent:run"),
                                 set_("rollout.maxRowsPerSample", 65)),
     "spec.rollout.maxRowsPerSample", ""),
    ("rollout-function-not-import-path", set_("rollout.function", "agent.py"),
     "spec.rollout.function", ""),
    ("sft-coef-needs-data", set_("algorithm.sftCoef", 0.1), "spec.data.sft", "needs data.sft"),
    ("sft-data-needs-coef", set_("data.sft", {"path": "/data/sft.jsonl"}), "spec.data.sft",
     "only with"),
    ("sft-batch-split", both(set_("algorithm.sftCoef", 0.1),
                             set_("data.sft", {"path": "/data/sft.jsonl", "batchSize": 3}),
                             set_("training.gpusPerNode", 2)),
     "spec.data.sft.batchSize", "split evenly"),
    ("distillation-needs-teacher", set_("algorithm.advantageEstimator",
                                        "on_policy_distillation"),
     "spec.algorithm.teacherPath", "required"),
    ("teacher-without-distillation", set_("algorithm.teacherPath", "/models/big"),
     "spec.algorithm.teacherPath", "only used"),
    ("critic-placement-enum", set_("critic.placement", "colocate"), "spec.critic.placement",
     "dedicated"),
    ("critic-nodes-when-shared", ppo(set_("critic.nodes", 2)), "spec.critic.nodes",
     "dedicated only"),
    ("critic-image-when-shared", ppo(set_("critic.image", "critic:1")), "spec.critic.image",
     "dedicated only"),
    ("critic-gpus-per-node-when-shared", ppo(set_("critic.gpusPerNode", 4)),
     "spec.critic.gpusPerNode", "dedicated only"),
    ("critic-resources-when-shared", ppo(set_("critic.resources", {"memory": "64Gi"})),
     "spec.critic.resources", "dedicated only"),
    ("critic-without-ppo", set_("critic.lr", 1e-4), "spec.critic", "ppo only"),
    ("dedicated-critic-without-ppo", set_("critic.placement", "dedicated"), "spec.critic",
     "ppo only"),
    ("value-clip-negative", ppo(set_("critic.valueClip", -0.1)), "spec.critic.valueClip", ""),
    ("critic-lr-zero", set_("critic.lr", 0), "spec.critic.lr", ""),
    ("gae-lambda-above-one", set_("algorithm.gaeLambda", 1.01), "spec.algorithm.gaeLambda", ""),
    ("dedicated-critic-batch-split", both(set_("algorithm.advantageEstimator", "ppo"),
                                          set_("critic.placement", "dedicated"),
                                          set_("critic.gpusPerNode", 0),
                                          set_("critic.nodes", 3)),
     "spec.critic.nodes", "critic workers"),
    ("policy-loss-enum", set_("algorithm.policyLoss", "trpo"), "spec.algorithm.policyLoss",
     "gspo"),
    ("aggregation-enum", set_("algorithm.lossAggregation", "seq-sum"),
     "spec.algorithm.lossAggregation", "seq-mean-token-mean"),
    ("kl-in-reward-needs-token-level", both(set_("algorithm.klPenalty", "reward"),
                                            set_("algorithm.klCoef", 0.01)),
     "spec.algorithm.klPenalty", "token-level"),
    ("kl-in-reward-needs-coef", both(set_("algorithm.advantageEstimator", "reinforce_plus_plus"),
                                     set_("algorithm.klPenalty", "reward")),
     "spec.algorithm.klPenalty", "needs klCoef > 0"),
    ("kl-type-without-kl", set_("algorithm.klLossType", "k2"), "spec.algorithm.klLossType",
     "only with klCoef > 0"),
    ("dual-clip-with-gspo", both(set_("algorithm.policyLoss", "gspo"),
                                 set_("algorithm.epsClipC", 3)),
     "spec.algorithm.epsClipC", "policyLoss: ppo only"),
    ("eps-clip-with-gpg", both(set_("algorithm.policyLoss", "gpg"),
                               set_("algorithm.epsClip", 0.1)),
     "spec.algorithm.epsClip", "ppo or gspo only"),
    ("eps-clip-high-with-sapo", both(set_("algorithm.policyLoss", "sapo"),
                                     set_("algorithm.epsClipHigh", 0.28)),
     "spec.algorithm.epsClipHigh", "sapo and gpg clip nothing"),
    ("eps-clip-high-with-cispo", both(set_("algorithm.policyLoss", "cispo"),
                                      set_("algorithm.epsClipHigh", 0.28)),
     "spec.algorithm.epsClipHigh", "cispoEpsHigh"),
    ("dual-clip-with-cispo", both(set_("algorithm.policyLoss", "cispo"),
                                  set_("algorithm.epsClipC", 3)),
     "spec.algorithm.epsClipC", "policyLoss: ppo only"),
    ("cispo-eps-high-with-ppo", set_("algorithm.cispoEpsHigh", 5), "spec.algorithm.cispoEpsHigh",
     "policyLoss: cispo only"),
    ("cispo-eps-low-with-gspo", both(set_("algorithm.policyLoss", "gspo"),
                                     set_("algorithm.cispoEpsLow", 0.2)),
     "spec.algorithm.cispoEpsLow", "policyLoss: cispo only"),
    ("cispo-eps-low-above-one", both(set_("algorithm.policyLoss", "cispo"),
                                     set_("algorithm.cispoEpsLow", 1.5)),
     "spec.algorithm.cispoEpsLow", ""),
    ("sapo-tau-pos-with-ppo", set_("algorithm.sapoTauPos", 2), "spec.algorithm.sapoTauPos",
     "policyLoss: sapo only"),
    ("sapo-tau-neg-with-gpg", both(set_("algorithm.policyLoss", "gpg"),
                                   set_("algorithm.sapoTauNeg", 2)),
     "spec.algorithm.sapoTauNeg", "policyLoss: sapo only"),
    ("sapo-tau-zero", both(set_("algorithm.policyLoss", "sapo"),
                           set_("algorithm.sapoTauPos", 0)),
     "spec.algorithm.sapoTauPos", ""),
    ("custom-loss-without-function", set_("algorithm.policyLoss", "custom"),
     "spec.algorithm.lossFunction", "required by policyLoss custom"),
    ("loss-function-without-custom", set_("algorithm.lossFunction", "my_losses:ppo"),
     "spec.algorithm.lossFunction", "only used by it"),
    ("loss-function-not-an-import-path", both(CUSTOM_LOSS,
                                              set_("algorithm.lossFunction", "my_losses.ppo")),
     "spec.algorithm.lossFunction", ""),
    ("loss-args-without-custom", set_("algorithm.lossArgs", {"eps": 0.2}),
     "spec.algorithm.lossArgs", "policyLoss: custom only"),
    ("loss-args-not-a-number", both(CUSTOM_LOSS, set_("algorithm.lossArgs", {"eps": "0.2"})),
     "spec.algorithm.lossArgs", ""),
    ("loss-args-a-boolean", both(CUSTOM_LOSS, set_("algorithm.lossArgs", {"on": True})),
     "spec.algorithm.lossArgs", ""),
    ("eps-clip-with-custom", both(CUSTOM_LOSS, set_("algorithm.epsClip", 0.1)),
     "spec.algorithm.epsClip", "a custom loss takes its settings in lossArgs"),
    ("eps-clip-high-with-custom", both(CUSTOM_LOSS, set_("algorithm.epsClipHigh", 0.28)),
     "spec.algorithm.epsClipHigh", "lossArgs"),
    ("dual-clip-with-custom", both(CUSTOM_LOSS, set_("algorithm.epsClipC", 3)),
     "spec.algorithm.epsClipC", "policyLoss: ppo only"),
    ("cispo-eps-high-with-custom", both(CUSTOM_LOSS, set_("algorithm.cispoEpsHigh", 5)),
     "spec.algorithm.cispoEpsHigh", "policyLoss: cispo only"),
    ("sapo-tau-neg-with-custom", both(CUSTOM_LOSS, set_("algorithm.sapoTauNeg", 2)),
     "spec.algorithm.sapoTauNeg", "policyLoss: sapo only"),
    ("gamma-without-discounted-returns", set_("algorithm.gamma", 0.99), "spec.algorithm.gamma",
     "reinforce_plus_plus or ppo only"),
    ("gae-lambda-without-ppo", both(set_("algorithm.advantageEstimator", "reinforce_plus_plus"),
                                    set_("algorithm.gaeLambda", 0.9)),
     "spec.algorithm.gaeLambda", "ppo only"),
    ("overlong-penalty-without-buffer", set_("algorithm.overlongPenalty", 0.5),
     "spec.algorithm.overlongPenalty", "only with overlongBuffer"),
    ("min-lr-ratio-with-constant-lr", set_("algorithm.minLrRatio", 0.1),
     "spec.algorithm.minLrRatio", "lrDecayStyle decays"),
    ("tis-cap-zero", set_("algorithm.tisCap", 0), "spec.algorithm.tisCap", ""),
    ("importance-mask-band-without-one", set_("algorithm.importanceMask", {"low": 1.5}),
     "spec.algorithm.importanceMask.low", ""),
    ("importance-mask-level", set_("algorithm.importanceMask", {"level": "geometric"}),
     "spec.algorithm.importanceMask.level", ""),
    ("gamma-above-one", set_("algorithm.gamma", 1.5), "spec.algorithm.gamma", ""),
    ("overlong-buffer-above-budget", both(set_("data.maxResponseLen", 64),
                                          set_("algorithm.overlongBuffer", 65)),
     "spec.algorithm.overlongBuffer", "maxResponseLen"),
    ("rloo-needs-two-samples", both(set_("algorithm.advantageEstimator", "rloo"),
                                    set_("data.nSamplesPerPrompt", 1)),
     "spec.data.nSamplesPerPrompt", "rloo"),
    ("dynamic-sampling-rounds-negative", set_("algorithm.dynamicSamplingRounds", -1),
     "spec.algorithm.dynamicSamplingRounds", ""),
    ("clip-high-below-clip", set_("algorithm.epsClipHigh", 0.1), "spec.algorithm.epsClipHigh",
     "epsClip"),
    ("lr-zero", set_("algorithm.lr", 0), "spec.algorithm.lr", ""),
    ("tp-not-dividing-gpus", set_("training.parallelism", {"tp": 3}),
     "spec.training.parallelism", "divide"),
    ("cp-not-supported", set_("training.parallelism.cp", 2), "spec.training.parallelism.cp",
     "not supported yet"),
    ("ep-not-dividing-gpus", set_("training.parallelism.ep", 3),
     "spec.training.parallelism.ep", "ep * etp * pp must divide"),
    ("ep-times-etp-not-dividing-gpus", set_("training.parallelism", {"ep": 2, "etp": 3}),
     "spec.training.parallelism.ep", "ep * etp * pp must divide"),
    ("ep-with-fsdp", both(set_("training.backend", "fsdp"), set_("training.parallelism.ep", 2)),
     "spec.training.parallelism.ep", "needs backend megatron"),
    ("etp-with-fsdp", both(set_("training.backend", "fsdp"),
                           set_("training.parallelism.etp", 1)),
     "spec.training.parallelism.etp", "backend megatron only"),
    ("rollout-replay-on-sglang", set_("algorithm.routingReplay", "rollout"),
     "spec.algorithm.routingReplay", "return_routed_experts"),
    ("rollout-replay-behind-sglang-router",
     both(set_("algorithm.routingReplay", "rollout"), set_("rollout.engine", "reference"),
          set_("rollout.router", "sglang")),
     "spec.rollout.router", "does not pass"),
    ("async-colocated", set_("mode", "async"), "spec.mode", "placement: disaggregated"),
    ("engine-old-logprobs-with-tis", both(set_("algorithm.oldLogprobs", "engine"),
                                          set_("algorithm.tisCap", 2.0)),
     "spec.algorithm.oldLogprobs", "pi_old / pi_rollout"),
    ("engine-old-logprobs-with-importance-mask",
     both(set_("algorithm.oldLogprobs", "engine"), set_("algorithm.importanceMask", {})),
     "spec.algorithm.oldLogprobs", "pi_old / pi_rollout"),
    ("engine-old-logprobs-async", both(disagg(gpus=8), set_("mode", "async"),
                                       set_("algorithm.oldLogprobs", "engine")),
     "spec.algorithm.oldLogprobs", "proximal policy"),
    ("old-logprobs-unknown", set_("algorithm.oldLogprobs", "reference"),
     "spec.algorithm.oldLogprobs", ""),
    ("engine-restarts-colocated", set_("rollout.maxEngineRestarts", 2),
     "spec.rollout.maxEngineRestarts", "placement: disaggregated"),
    ("engine-restarts-negative", both(disagg(gpus=8), set_("rollout.maxEngineRestarts", -1)),
     "spec.rollout.maxEngineRestarts", ""),
    ("health-probe-colocated", set_("rollout.healthProbe", {"periodSeconds": 2}),
     "spec.rollout.healthProbe", "only where engines are replaced"),
    ("health-probe-without-restarts",
     both(disagg(gpus=8), set_("rollout.maxEngineRestarts", 0),
          set_("rollout.healthProbe", {"timeoutSeconds": 3})),
     "spec.rollout.healthProbe", "only where engines are replaced"),
    ("async-staleness-zero", both(disagg(gpus=8), set_("mode", "async"),
                                  set_("async.maxStaleness", 0)),
     "spec.async.maxStaleness", ""),
    ("async-settings-in-sync-mode", both(disagg(gpus=8), set_("async.maxStaleness", 4)),
     "spec.async", "mode: async only"),
    ("partial-rollout-in-sync-mode", both(disagg(gpus=8), set_("async.partialRollout", True)),
     "spec.async", "mode: async only"),
    ("correction-off-in-sync-mode",
     both(disagg(gpus=8), set_("async.offPolicyCorrection", "none")),
     "spec.async", "mode: async only"),
    ("correction-off-beside-tis", both(disagg(gpus=8), set_("mode", "async"),
                                       set_("async.offPolicyCorrection", "none"),
                                       set_("algorithm.tisCap", 2.0)),
     "spec.async.offPolicyCorrection", "no effect while algorithm.tisCap"),
    ("correction-off-beside-mask", both(disagg(gpus=8), set_("mode", "async"),
                                        set_("async.offPolicyCorrection", "none"),
                                        set_("algorithm.importanceMask", {})),
     "spec.async.offPolicyCorrection", "no effect while algorithm.tisCap"),
    ("correction-unknown", both(disagg(gpus=8), set_("mode", "async"),
                                set_("async.offPolicyCorrection", "decoupled")),
     "spec.async.offPolicyCorrection", ""),
    ("megatron-on-cpu", both(set_("training.backend", "megatron"),
                             set_("training.gpusPerNode", 0)),
     "spec.training.gpusPerNode", "backend megatron trains on GPUs"),
    ("fsdp-with-tp", both(set_("training.backend", "fsdp"), set_("training.parallelism.tp", 2)),
     "spec.training.parallelism", "fsdp"),
    ("tp-wider-than-node", both(set_("training.nodes", 2), set_("training.parallelism.tp", 16)),
     "spec.training.parallelism.tp", "one node"),
    ("disaggregated-without-rollout-gpus", disagg(), "spec.rollout.gpus", "required"),
    ("rollout-gpus-not-multiple-of-engine", disagg(gpus=6, gpusPerEngine=4), "spec.rollout.gpus",
     "gpusPerEngine"),
    # 12-GPU engines on 8-GPU nodes: neither share a node evenly nor fill whole nodes
    ("engine-straddles-nodes", disagg(gpus=24, gpusPerEngine=12), "spec.rollout.gpusPerEngine",
     "whole nodes"),
    # 3 of 8 GPUs per engine: two fit a node, eight engines would need four nodes, not three
    ("engines-do-not-tile-a-node", disagg(gpus=24, gpusPerEngine=3),
     "spec.rollout.gpusPerEngine", "divide rollout.gpusPerNode"),
    ("cpu-engine-straddles-pods", disagg(gpus=0, gpusPerEngine=3, gpusPerNode=2,
                                         engine="reference"),
     "spec.rollout.gpusPerEngine", "multiple"),
    ("rollout-partial-nodes", disagg(gpus=12, gpusPerEngine=2), "spec.rollout.gpus",
     "whole nodes"),
    ("colocate-gpu-mismatch", set_("rollout.gpus", 4), "spec.rollout.gpus", "equal"),
    ("colocate-engine-not-tiling", set_("rollout.gpusPerEngine", 3),
     "spec.rollout.gpusPerEngine", "divide"),
    ("colocate-with-rollout-pool", set_("rollout.nodePool", {"nodeSelector": {"pool": "x"}}),
     "spec.rollout.nodePool", "training.nodePool"),
    ("colocate-with-rollout-image", set_("rollout.image", "rollout:1"), "spec.rollout.image",
     "disaggregated only"),
    ("colocate-with-rollout-resources", set_("rollout.resources", {"memory": "64Gi"}),
     "spec.rollout.resources", "disaggregated only"),
    ("colocate-with-rollout-gpus-per-node", set_("rollout.gpusPerNode", 4),
     "spec.rollout.gpusPerNode", "disaggregated only"),
    ("engines-with-rollout-gpus", set_("rollout.engines", 2), "spec.rollout.engines",
     "only when rollout runs on CPU"),
    ("disaggregated-engines-with-gpus", disagg(gpus=8, engines=2), "spec.rollout.engines",
     "only when rollout runs on CPU"),
    ("sglang-on-cpu", set_("training", {"backend": "fsdp", "gpusPerNode": 0}),
     "spec.rollout.engine", "needs GPUs"),
    ("disaggregated-sglang-on-cpu", disagg(gpus=0, engines=2), "spec.rollout.engine",
     "needs GPUs"),
    ("engine-arg-with-dashes", set_("rollout.engineArgs", {"--mem-fraction-static": "0.8"}),
     "spec.rollout.engineArgs", "without the leading '--'"),
    ("engine-arg-kuberl-sets", set_("rollout.engineArgs", {"tp-size": "2"}),
     "spec.rollout.engineArgs", "rollout.gpusPerEngine"),
    ("engine-arg-model-path", set_("rollout.engineArgs", {"model-path": "/models/other"}),
     "spec.rollout.engineArgs", "model.path"),
    ("engine-arg-seed", both(ON_CPU, set_("rollout.engineArgs", {"seed": "1"})),
     "spec.rollout.engineArgs", "seed"),
    ("reference-engine-unknown-flag", both(ON_CPU, set_("rollout.engineArgs",
                                                        {"enable-memory-saver": ""})),
     "spec.rollout.engineArgs", "reference engine"),
    ("engine-arg-nccl-port", set_("rollout.engineArgs", {"nccl-port": "29500"}),
     "spec.rollout.engineArgs", "nccl-port"),
    ("engine-arg-nnodes", set_("rollout.engineArgs", {"nnodes": "2"}),
     "spec.rollout.engineArgs", "gpusPerNode"),
    ("engine-arg-dist-init-addr", set_("rollout.engineArgs", {"dist-init-addr": "a:1"}),
     "spec.rollout.engineArgs", "Ray nodes"),
    ("engine-arg-mem-fraction", set_("rollout.engineArgs", {"mem-fraction-static": "0.8"}),
     "spec.rollout.engineArgs", "kuberl sets it from rollout.memoryFraction"),
    ("colocated-sglang-without-memory-saver",
     set_("rollout.engineArgs", {"enable-memory-saver": "false"}), "spec.rollout.engineArgs",
     "need enable-memory-saver to release their GPU memory"),
    ("offload-when-disaggregated", both(disagg(gpus=8), set_("training.offload",
                                                             {"optimizer": False})),
     "spec.training.offload", "placement: colocate only"),
    ("engine-arg-dp-size", set_("rollout.engineArgs", {"dp-size": "2"}),
     "spec.rollout.engineArgs", "tensor parallel ranks"),
    ("engine-list-arg-skip-tokenizer", set_("rollout.engineListArgs",
                                            {"skip-tokenizer-init": ["x"]}),
     "spec.rollout.engineListArgs", "detokenize"),
    ("engine-list-arg-kuberl-sets", set_("rollout.engineListArgs", {"node-rank": ["1"]}),
     "spec.rollout.engineListArgs", "engineListArgs may not set"),
    ("engine-list-arg-bad-name", set_("rollout.engineListArgs", {"Cuda_Graph_Bs": ["1"]}),
     "spec.rollout.engineListArgs", "engineListArgs keys are flag names"),
    ("engine-list-arg-empty", set_("rollout.engineListArgs", {"cuda-graph-bs": []}),
     "spec.rollout.engineListArgs", ""),
    ("engine-arg-in-both-maps", both(set_("rollout.engineArgs", {"cuda-graph-bs": "1"}),
                                     set_("rollout.engineListArgs", {"cuda-graph-bs": ["2"]})),
     "spec.rollout.engineListArgs", "not in both"),
    ("reference-engine-list-args", both(ON_CPU, set_("rollout.engineListArgs",
                                                     {"cuda-graph-bs": ["1"]})),
     "spec.rollout.engineListArgs", "no list flags"),
    ("pass-k-above-samples", both(
        set_("data.evalSets", [{"name": "a", "path": "/d/a.jsonl", "nSamplesPerPrompt": 4,
                                "passK": [1, 8]}]), set_("schedule.evalInterval", 10)),
     "spec.data.evalSets[0].passK", "nSamplesPerPrompt = 4"),
    ("pass-k-repeated", both(
        set_("data.evalSets", [{"name": "a", "path": "/d/a.jsonl", "nSamplesPerPrompt": 4,
                                "passK": [2, 2]}]), set_("schedule.evalInterval", 10)),
     "spec.data.evalSets[0].passK", "distinct"),
    ("pass-threshold-without-pass-k", both(
        set_("data.evalSets", [{"name": "a", "path": "/d/a.jsonl", "passThreshold": 0.5}]),
        set_("schedule.evalInterval", 10)),
     "spec.data.evalSets[0].passThreshold", "only with passK"),
    ("training-without-prompts", drop("data.prompts"), "spec.data.prompts", "required"),
    ("eval-mode-without-sets", eval_mode(set_("data.evalSets", [])), "spec.data.evalSets",
     "at least one eval set"),
    ("eval-mode-with-prompts", eval_mode(set_("data.prompts", "/data/train.jsonl")),
     "spec.data.prompts", "mode eval trains nothing"),
    ("eval-mode-with-eval-interval", eval_mode(set_("schedule.evalInterval", 5)),
     "spec.schedule.evalInterval", "mode eval trains nothing"),
    ("eval-mode-with-save-interval", eval_mode(set_("schedule.saveInterval", 5)),
     "spec.schedule.saveInterval", "mode eval trains nothing"),
    ("eval-mode-with-sft", eval_mode(set_("data.sft", {"path": "/data/sft.jsonl"})),
     "spec.data.sft", "mode eval trains nothing"),
    ("eval-interval-without-sets", set_("schedule.evalInterval", 10),
     "spec.schedule.evalInterval", "needs data.evalSets"),
    ("eval-sets-without-interval", set_("data.evalSets", [{"name": "a", "path": "/data/a.jsonl"}]),
     "spec.data.evalSets", "evaluated only every"),
    ("global-batch-not-dividing", set_("training.globalBatchSize", 100),
     "spec.training.globalBatchSize", "divide"),
    ("micro-batch-not-splitting", set_("training.microBatchSize", 3),
     "spec.training.microBatchSize", "data-parallel"),
    ("token-budget-under-the-longest-sample",
     both(set_("data.maxPromptLen", 512), set_("training.maxTokensPerMicroBatch", 1535)),
     "spec.training.maxTokensPerMicroBatch", "maxPromptLen + data.maxResponseLen"),
    ("liger-with-megatron", set_("training.fusedKernels", "liger"),
     "spec.training.fusedKernels", "applies to backend fsdp on GPUs"),
    ("liger-on-cpu", both(set_("training", {"backend": "fsdp", "gpusPerNode": 0}),
                          set_("training.fusedKernels", "liger")),
     "spec.training.fusedKernels", "applies to backend fsdp on GPUs"),
    ("fused-kernels-unknown", set_("training.fusedKernels", "te"),
     "spec.training.fusedKernels", ""),
    ("queue-name-not-a-label-value", set_("scheduling.queueName", "Team_A"),
     "spec.scheduling.queueName", ""),
    ("priority-class-not-a-name", set_("scheduling.priorityClassName", "Gold!"),
     "spec.scheduling.priorityClassName", ""),
    ("grace-period-too-short-to-save", set_("scheduling.terminationGracePeriodSeconds", 5),
     "spec.scheduling.terminationGracePeriodSeconds", ""),
    ("model-outside-mount", set_("model.storage", {"pvc": "models", "mountPath": "/mnt/m"}),
     "spec.model.path", "mountPath"),
    ("storage-without-mount", set_("model.storage", {"pvc": "models"}),
     "spec.model.storage.mountPath", ""),
    ("reserved-mount", both(set_("model.path", "/dev/shm/m"),
                            set_("model.storage", {"pvc": "m", "mountPath": "/dev/shm"})),
     "spec.model.storage.mountPath", "used by kuberl"),
    ("prompts-outside-data-mount", set_("data.storage", {"pvc": "d", "mountPath": "/mnt/d"}),
     "spec.data.prompts", "mountPath"),
    # Every other path a job reads lies under its section's PVC, as model.path and
    # data.prompts must: a typo is refused at apply (issue 36).
    ("eval-set-outside-data-mount",
     both(set_("data", {"prompts": "/mnt/d/p.jsonl", "storage": {"pvc": "d", "mountPath": "/mnt/d"},
                        "evalSets": [{"name": "a", "path": "/mnt/d/a.jsonl"},
                                     {"name": "b", "path": "/mnt/dta/b.jsonl"}]}),
          set_("schedule.evalInterval", 10)),
     "spec.data.evalSets", "storage.mountPath = /mnt/d"),
    ("sft-outside-data-mount",
     both(set_("data", {"prompts": "/mnt/d/p.jsonl", "storage": {"pvc": "d", "mountPath": "/mnt/d"},
                        "sft": {"path": "/data/sft.jsonl"}}),
          set_("algorithm.sftCoef", 0.1)),
     "spec.data.sft.path", "mountPath"),
    ("tokenizer-outside-model-mount",
     set_("model", {"path": "/mnt/m/q", "tokenizer": "/mnt/n/tok",
                    "storage": {"pvc": "m", "mountPath": "/mnt/m"}}),
     "spec.model.tokenizer", "mountPath"),
    ("teacher-outside-model-mount",
     both(set_("model", {"path": "/mnt/m/q", "storage": {"pvc": "m", "mountPath": "/mnt/m"}}),
          set_("algorithm", {"advantageEstimator": "on_policy_distillation",
                             "teacherPath": "/models/big"})),
     "spec.algorithm.teacherPath", "model.storage.mountPath = /mnt/m"),
    ("critic-model-outside-model-mount",
     both(set_("model", {"path": "/mnt/m/q", "storage": {"pvc": "m", "mountPath": "/mnt/m"}}),
          ppo(set_("critic.modelPath", "/mnt/mm/value"))),
     "spec.critic.modelPath", "mountPath"),
    ("model-and-data-same-mount",
     both(set_("model", {"path": "/mnt/x/m", "storage": {"pvc": "a", "mountPath": "/mnt/x"}}),
          set_("data", {"prompts": "/mnt/x/p.jsonl",
                        "storage": {"pvc": "b", "mountPath": "/mnt/x"}})),
     "spec.data.storage.mountPath", "different"),
    ("checkpoint-on-model-mount",
     both(set_("model", {"path": "/mnt/x/m", "storage": {"pvc": "a", "mountPath": "/mnt/x"}}),
          set_("checkpoint.path", "/mnt/x")),
     "spec.checkpoint.path", "differ"),
    ("relative-mount", set_("model.storage", {"pvc": "models", "mountPath": "mnt"}),
     "spec.model.storage.mountPath", "absolute"),
    ("relative-checkpoint", set_("checkpoint.path", "ckpt"), "spec.checkpoint.path", "absolute"),
    ("bad-quantity", set_("training.resources.memory", "lots"),
     "spec.training.resources.memory", ""),
    ("bad-pvc-name", set_("checkpoint.pvc", "My_PVC"), "spec.checkpoint.pvc", ""),
    ("negative-backoff", set_("backoffLimit", -1), "spec.backoffLimit", ""),
    ("heartbeat-too-short", set_("heartbeatTimeoutSeconds", 5), "spec.heartbeatTimeoutSeconds",
     ""),
    ("zero-batch", set_("data.rolloutBatchSize", 0), "spec.data.rolloutBatchSize", ""),
    ("toleration-operator", set_("training.nodePool", {"tolerations": [{"operator": "Maybe"}]}),
     "spec.training.nodePool.tolerations[0].operator", "Exists"),
    ("toleration-exists-with-value", pool({"key": "gpu", "operator": "Exists", "value": "a"}),
     "spec.training.nodePool.tolerations[0].value", "operator Exists"),
    ("toleration-equal-without-key", pool({"value": "a", "effect": "NoSchedule"}),
     "spec.training.nodePool.tolerations[0].key", "needs a key"),
    ("toleration-seconds-without-no-execute",
     pool({"key": "gpu", "operator": "Exists"},
          {"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 60}),
     "spec.training.nodePool.tolerations[1].tolerationSeconds", "NoExecute"),
    ("privileged-port", set_("network.weightSyncPort", 80), "spec.network.weightSyncPort", ""),
    ("rdma-without-resource", set_("network.rdma", {"count": 1}), "spec.network.rdma.resource",
     ""),
    ("gpus-per-node-too-many", set_("training.gpusPerNode", 32), "spec.training.gpusPerNode",
     ""),
    ("env-name-with-equals", set_("network.env", {"NCCL_DEBUG=INFO": "1"}), "spec.network.env",
     "C identifiers"),
    ("env-name-leading-digit", set_("network.env", {"1NCCL": "1"}), "spec.network.env",
     "C identifiers"),
    ("network-env-on-cpu-job", both(ON_CPU, set_("network.env", {"NCCL_DEBUG": "INFO"})),
     "spec.network.env", "GPU pods"),
    ("nccl-ifname-on-cpu-job", both(ON_CPU, set_("network.ncclSocketIfname", "eth0")),
     "spec.network.ncclSocketIfname", "GPU pods"),
    ("host-network-on-cpu-job", both(ON_CPU, set_("network.hostNetwork", True)),
     "spec.network.hostNetwork", "GPU pods"),
    ("rdma-on-cpu-job", both(ON_CPU, set_("network.rdma", {"resource": "rdma/ib"})),
     "spec.network.rdma", "GPU pods"),
    ("weight-sync-port-on-cpu-job", both(ON_CPU, set_("network.weightSyncPort", 31000)),
     "spec.network.weightSyncPort", "GPU pods"),
]

# A divisor of a cross-field rule at 0, below its minimum: only the field's own minimum is
# reported. (The policy runs only on objects the CRD's schema accepted. Where the rules are a
# CRD's, the API server still runs them after such a schema error, so each rule that divides by
# it passes rather than fail to evaluate, "division by zero evaluating rule": common._outside.)
# (id, edit of spec, the field, another field a CEL rule rightly names too, or "")
ZERO_DIVISORS: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    ("tp-zero", set_("training.parallelism.tp", 0), "spec.training.parallelism.tp", ""),
    ("pp-zero", set_("training.parallelism.pp", 0), "spec.training.parallelism.pp", ""),
    ("cp-zero", set_("training.parallelism.cp", 0), "spec.training.parallelism.cp", ""),
    ("zero-batch", set_("data.rolloutBatchSize", 0), "spec.data.rolloutBatchSize", ""),
    ("zero-samples", set_("data.nSamplesPerPrompt", 0), "spec.data.nSamplesPerPrompt", ""),
    ("global-batch-zero", set_("training.globalBatchSize", 0), "spec.training.globalBatchSize",
     ""),
    ("micro-batch-zero", set_("training.microBatchSize", 0), "spec.training.microBatchSize",
     ""),
    ("token-budget-zero", set_("training.maxTokensPerMicroBatch", 0),
     "spec.training.maxTokensPerMicroBatch", ""),
    ("engine-zero", set_("rollout.gpusPerEngine", 0), "spec.rollout.gpusPerEngine", ""),
    ("disaggregated-engine-zero", disagg(gpus=8, gpusPerEngine=0),
     "spec.rollout.gpusPerEngine", ""),
    # gpusPerNode is the tiling rule's divisor: only its minimum is reported
    ("rollout-node-zero", disagg(gpus=16, gpusPerNode=0), "spec.rollout.gpusPerNode", ""),
]


# An operand of a cross-field rule far outside its range: the field's own bound is all that is
# reported. (Where the rules are a CRD's, the server runs them after a violated maximum too, and
# multiplies int64s: unguarded, nodes: 2**62 added "integer overflow evaluating rule" (nodes *
# gpusPerNode). Each rule that multiplies, divides or takes a modulus passes while an operand is
# out of range.)
# (id, edit of spec, the field, another field a comparison rule rightly names too, or "",
#  the bound as the server words it: "... in body should be <bound>")
HUGE = 2**62
LE, GE = "less than or equal to", "greater than or equal to"
OVERFLOWS: list[tuple[str, Callable[[dict[str, Any]], None], str, str, str]] = [
    ("nodes-huge", set_("training.nodes", HUGE), "spec.training.nodes", "",
     f"{LE} {MAX_NODES}"),
    ("nodes-huge-negative", set_("training.nodes", -HUGE), "spec.training.nodes", "", f"{GE} 1"),
    ("gpus-per-node-huge", set_("training", {"nodes": 2, "gpusPerNode": HUGE}),
     "spec.training.gpusPerNode", "", f"{LE} {MAX_GPUS_PER_NODE}"),
    # tp (1) no longer fits on a node of fewer than 0 GPUs: that rule compares, and says so
    ("gpus-per-node-huge-negative", set_("training", {"nodes": 3, "gpusPerNode": -HUGE}),
     "spec.training.gpusPerNode", "spec.training.parallelism.tp", f"{GE} 0"),
    ("tp-huge", set_("training.parallelism", {"tp": HUGE, "pp": 2}),
     "spec.training.parallelism.tp", "", f"{LE} {MAX_PARALLEL}"),
    ("pp-huge", set_("training.parallelism", {"pp": HUGE, "tp": 2}),
     "spec.training.parallelism.pp", "", f"{LE} {MAX_PARALLEL}"),
    ("cp-huge", set_("training.parallelism", {"cp": HUGE, "pp": 2}),
     "spec.training.parallelism.cp", "", f"{LE} {MAX_PARALLEL}"),
    ("micro-batch-huge", set_("training.microBatchSize", HUGE), "spec.training.microBatchSize",
     "", f"{LE} {MAX_MICRO_BATCH}"),
    ("global-batch-huge", set_("training.globalBatchSize", HUGE),
     "spec.training.globalBatchSize", "", f"{LE} {MAX_GLOBAL_BATCH}"),
    ("rollout-batch-huge", set_("data.rolloutBatchSize", HUGE), "spec.data.rolloutBatchSize",
     "", f"{LE} {MAX_ROLLOUT_BATCH}"),
    ("samples-huge", set_("data.nSamplesPerPrompt", HUGE), "spec.data.nSamplesPerPrompt", "",
     f"{LE} {MAX_SAMPLES_PER_PROMPT}"),
    ("engine-huge", set_("rollout.gpusPerEngine", HUGE), "spec.rollout.gpusPerEngine", "",
     f"{LE} {MAX_GPUS_PER_ENGINE}"),
    ("disaggregated-gpus-huge", disagg(gpus=HUGE + 2), "spec.rollout.gpus", "",
     f"{LE} {MAX_ROLLOUT_GPUS}"),
    # the tiling rule divides by gpusPerNode: only its minimum is reported
    ("rollout-node-huge-negative", disagg(gpus=16, gpusPerNode=-HUGE),
     "spec.rollout.gpusPerNode", "", f"{GE} 1"),
]


def _manifest(edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    obj = base()
    edit(obj["spec"])
    return obj


def _names(problem: str, field: str) -> bool:
    """The problem line is about `field`: it starts with the path, or names the missing leaf
    under its parent (jsonschema reports required fields at the parent)."""
    parent, _, leaf = field.rpartition(".")
    leaf = leaf.split("[")[0]
    return problem.startswith(field) or (problem.startswith(parent + ":") and leaf in problem)


@pytest.mark.parametrize(("case", "edit", "field", "words"), BAD_SPECS,
                         ids=[c[0] for c in BAD_SPECS])
def test_model_refuses_with_field_path(case: str, edit: Any, field: str, words: str) -> None:
    with pytest.raises(InvalidRLJob) as info:
        parse(_manifest(edit))
    problems = info.value.problems
    assert any(_names(p, field) for p in problems), problems
    if words:
        assert any(words in p for p in problems if _names(p, field)), problems
    assert any("got" in p or "is required" in p or "not a known field" in p for p in problems)


# What SGLang's own parser would refuse at start: only the model knows SGLang's flags (a table
# made from the pinned release's parser, kuberl_api/engine_flags.py), so `kuberl validate`,
# `kuberl run` and the operator (Accepted=False) refuse these; the CRD admits them.
SGLANG_REFUSES: list[tuple[str, dict[str, Any], str, str]] = [
    ("misspelt", {"engineArgs": {"mem-fraction-statik": "0.7"}}, "spec.rollout.engineArgs",
     "SGLang 0.5.6 has no flag --mem-fraction-statik; did you mean mem-fraction-static?"),
    ("switch-with-a-value", {"engineArgs": {"enable-memory-saver": "yes"}},
     "spec.rollout.engineArgs", "--enable-memory-saver is a switch"),
    ("not-a-number", {"engineArgs": {"schedule-conservativeness": "70%"}},
     "spec.rollout.engineArgs", "--schedule-conservativeness takes a number, not '70%'"),
    ("not-an-integer", {"engineArgs": {"context-length": "8k"}}, "spec.rollout.engineArgs",
     "--context-length takes an integer"),
    ("not-a-choice", {"engineArgs": {"attention-backend": "flash"}},
     "spec.rollout.engineArgs", "--attention-backend takes one of: "),
    ("value-flag-given-true", {"engineArgs": {"chunked-prefill-size": "true"}},
     "spec.rollout.engineArgs", "'true', 'false' and '' are for switches"),
    ("list-of-a-single-value-flag", {"engineListArgs": {"context-length": ["1", "2"]}},
     "spec.rollout.engineListArgs", "--context-length takes a single value"),
    ("list-with-a-bad-item", {"engineListArgs": {"cuda-graph-bs": ["1", "two"]}},
     "spec.rollout.engineListArgs", "--cuda-graph-bs takes an integer, not 'two'"),
]


@pytest.mark.parametrize("engine", ["sglang", "reference"])
@pytest.mark.parametrize("fraction", [0, 1, 1.5, -0.2, "0.5x"])
def test_memory_fraction_outside_zero_one_is_refused(engine: str, fraction: Any) -> None:
    edit = both(disagg(gpus=8, memoryFraction=fraction), set_("rollout.engine", engine))
    problems = _problems(edit)
    assert any(p.startswith("spec.rollout.memoryFraction") for p in problems), problems
    assert any("memoryFraction" in p for p in admit(SCHEMA, _manifest(edit)))  # kubectl too
    ok = both(disagg(gpus=8, memoryFraction=0.85), set_("rollout.engine", engine))
    assert not _problems(ok) and not admit(SCHEMA, _manifest(ok))


def test_memory_fraction_defaults_to_what_colocated_engines_on_gpus_need() -> None:
    colocated = parse(_manifest(lambda m: None)).spec
    assert colocated.placement == "colocate" and colocated.engine_memory_fraction == 0.7
    assert parse(_manifest(disagg(gpus=8))).spec.engine_memory_fraction is None
    assert parse(_manifest(ON_CPU)).spec.engine_memory_fraction is None
    assert parse(_manifest(set_("rollout.memoryFraction", 0.5))).spec.engine_memory_fraction \
        == 0.5


@pytest.mark.parametrize(("case", "rollout", "field", "words"), SGLANG_REFUSES,
                         ids=[c[0] for c in SGLANG_REFUSES])
def test_flags_sglang_would_refuse_are_refused_by_the_model(case: str, rollout: dict[str, Any],
                                                            field: str, words: str) -> None:
    edit = disagg(gpus=8, **rollout)
    with pytest.raises(InvalidRLJob) as info:
        parse(_manifest(edit))
    assert any(_names(p, field) and words in p for p in info.value.problems), \
        info.value.problems
    assert not admit(SCHEMA, _manifest(edit))  # beyond what a CRD schema can say
    reference = both(disagg(gpus=8, **rollout), set_("rollout.engine", "reference"))
    assert not any(words in p for p in _problems(reference))  # its own flags, its own rules


def _problems(edit: Callable[[dict[str, Any]], None]) -> list[str]:
    try:
        parse(_manifest(edit))
    except InvalidRLJob as exc:
        return list(exc.problems)
    return []


def test_sglang_flags_as_users_write_them_pass() -> None:
    parse(_manifest(disagg(gpus=8, engineArgs={
        "schedule-conservativeness": "0.8", "enable-memory-saver": "",
        "disable-radix-cache": "false",
        "context-length": "32768", "attention-backend": "fa3", "log-level": "warning",
        "json-model-override-args": '{"rope_scaling": null}', "cuda-graph-max-bs": "64"},
        engineListArgs={"cuda-graph-bs": ["1", "2", "4"]})))


@pytest.mark.parametrize(("case", "edit", "field", "words"), BAD_SPECS,
                         ids=[c[0] for c in BAD_SPECS])
def test_crd_refuses_with_field_path(case: str, edit: Any, field: str, words: str) -> None:
    problems = admit(SCHEMA, _manifest(edit))
    assert any(_names(p, field) for p in problems), problems


@pytest.mark.parametrize(("case", "edit", "field", "also"), ZERO_DIVISORS,
                         ids=[c[0] for c in ZERO_DIVISORS])
def test_zero_divisor_reports_only_its_minimum(case: str, edit: Any, field: str,
                                               also: str) -> None:
    with pytest.raises(InvalidRLJob) as info:  # not a ZeroDivisionError from a Python twin
        parse(_manifest(edit))
    assert all(_names(p, field) for p in info.value.problems), info.value.problems
    problems = admit(SCHEMA, _manifest(edit))  # raises where a CEL rule fails to evaluate
    assert any(_names(p, field) for p in problems), problems
    assert all(_names(p, field) or (also and _names(p, also)) for p in problems), problems


def _arithmetic_messages(schema: dict[str, Any]) -> set[str]:
    """The messages of the CEL rules in `schema` that multiply, divide or take a modulus."""
    out = {r["message"] for r in schema.get("x-kubernetes-validations", [])
           if re.search(r"[*/%]", re.sub(r"'[^']*'", "", r["rule"]))}
    for sub in (schema.get("properties") or {}).values():
        out |= _arithmetic_messages(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            out |= _arithmetic_messages(schema[key])
    return out


ARITHMETIC_MESSAGES = _arithmetic_messages(SCHEMA)


@pytest.mark.parametrize(("case", "edit", "field", "also", "bound"), OVERFLOWS,
                         ids=[c[0] for c in OVERFLOWS])
def test_huge_operand_reports_only_its_bound(case: str, edit: Any, field: str, also: str,
                                             bound: str) -> None:
    # exactly at the field (a rule on the parent, naming the leaf in its message, won't do)
    def at(p: str) -> bool:
        return p.startswith(f"{field}:") or (bool(also) and p.startswith(f"{also}:"))

    with pytest.raises(InvalidRLJob) as info:
        parse(_manifest(edit))
    assert [p for p in info.value.problems if at(p)] == info.value.problems, info.value.problems
    upper, limit = bound.startswith(LE), bound.split()[-1]
    words = f"must be {'<=' if upper else '>='} {limit} "  # pydantic's
    assert any(words in p for p in info.value.problems), info.value.problems
    problems = admit(SCHEMA, _manifest(edit))  # raises where a CEL rule fails to evaluate
    assert problems and all(at(p) for p in problems), problems
    assert not [p for p in problems if p.partition(": ")[2] in ARITHMETIC_MESSAGES], problems
    words = f"{'maximum' if upper else 'minimum'} of {limit}"  # jsonschema's
    assert any(p.startswith(f"{field}:") and words in p for p in problems), problems


# Every operand of the arithmetic rules at its maximum (parallelism at 1, so dataParallel is the
# whole GPU count, and at its maximum), colocated and disaggregated: the rules evaluate (no
# int64 overflow), whatever they then say about such a spec.
AT_MAXIMUM: dict[str, Any] = {
    "data": {"prompts": "/data/p.jsonl", "rolloutBatchSize": MAX_ROLLOUT_BATCH,
             "nSamplesPerPrompt": MAX_SAMPLES_PER_PROMPT},
    "training": {"nodes": MAX_NODES, "gpusPerNode": MAX_GPUS_PER_NODE,
                 "microBatchSize": MAX_MICRO_BATCH},
    "rollout": {"gpusPerEngine": MAX_GPUS_PER_ENGINE},
}


@pytest.mark.parametrize("parallel", [1, MAX_PARALLEL])
@pytest.mark.parametrize("global_batch", [None, MAX_GLOBAL_BATCH])
@pytest.mark.parametrize("edit", [set_("rollout.gpus", MAX_NODES * MAX_GPUS_PER_NODE),
                                  disagg(gpus=MAX_ROLLOUT_GPUS, gpusPerEngine=MAX_GPUS_PER_ENGINE,
                                         gpusPerNode=MAX_GPUS_PER_NODE)],
                         ids=["colocate", "disaggregated"])
def test_rules_evaluate_with_every_operand_at_its_maximum(parallel: int,
                                                          global_batch: int | None,
                                                          edit: Any) -> None:
    obj = base()
    for section, values in copy.deepcopy(AT_MAXIMUM).items():
        obj["spec"].setdefault(section, {}).update(values)
    obj["spec"]["training"]["parallelism"] = {"tp": parallel, "pp": parallel, "cp": parallel}
    if global_batch is not None:
        obj["spec"]["training"]["globalBatchSize"] = global_batch
    edit(obj["spec"])
    problems = admit(SCHEMA, obj)  # raises where a CEL rule fails to evaluate
    assert not [p for p in problems if "maximum" in p or "minimum" in p], problems


# Near misses of the rules above, which both validators accept.
GOOD_SPECS: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("colocated-keeps-its-optimizer-on-the-gpu", set_("training.offload", {"optimizer": False})),
    ("engine-over-two-nodes", disagg(gpus=32, gpusPerEngine=16)),
    ("engines-behind-the-router", both(disagg(gpus=8), set_("rollout.router", "sglang"))),
    ("engines-share-a-small-pod", disagg(gpus=6, gpusPerEngine=3)),
    ("cpu-engine-over-two-pods", disagg(gpus=0, gpusPerEngine=4, gpusPerNode=2,
                                        engine="reference")),
    # the engine-per-node rules are about rollout pods: colocated engines fit a training node
    ("colocated-engine-spans-a-training-node",
     both(set_("training.gpusPerNode", 16), set_("rollout.gpus", 16),
          set_("rollout.gpusPerEngine", 16))),
    ("critic-written-at-its-defaults-without-ppo", set_("critic", {"lr": 1e-5,
                                                                   "placement": "shared"})),
    ("dedicated-critic-pool-with-ppo", ppo(set_("critic", {
        "placement": "dedicated", "nodes": 2, "gpusPerNode": 4, "image": "critic:1",
        "resources": {"memory": "64Gi"}, "nodePool": {"nodeSelector": {"pool": "a"}}}))),
    ("value-clip-off", ppo(set_("critic.valueClip", 0))),
    ("liger-on-fsdp-gpus", both(set_("training.backend", "fsdp"),
                                set_("training.fusedKernels", "liger"))),
    ("token-budget-of-exactly-the-longest-sample",
     both(set_("data.maxPromptLen", 512), set_("training.maxTokensPerMicroBatch", 1536))),
    ("kl-settings-with-kl", both(set_("algorithm.advantageEstimator", "reinforce_plus_plus"),
                                 set_("algorithm.klCoef", 0.01),
                                 set_("algorithm.klPenalty", "reward"),
                                 set_("algorithm.klLossType", "k1"),
                                 set_("algorithm.gamma", 0.99))),
    ("ppo-gae", ppo(set_("algorithm.gamma", 0.99), set_("algorithm.gaeLambda", 1.0),
                    set_("algorithm.epsClipC", 3))),
    ("cispo-with-its-bounds", both(set_("algorithm.policyLoss", "cispo"),
                                   set_("algorithm.cispoEpsHigh", 5),
                                   set_("algorithm.cispoEpsLow", 1),
                                   set_("algorithm.tisCap", 2))),
    ("sapo-with-its-temperatures", both(set_("algorithm.policyLoss", "sapo"),
                                        set_("algorithm.sapoTauPos", 2),
                                        set_("algorithm.sapoTauNeg", 3),
                                        set_("algorithm.lossAggregation", "seq-mean-token-mean"))),
    ("gpg-with-defaults-written-out", both(set_("algorithm.policyLoss", "gpg"),
                                           set_("algorithm.advantageEstimator", "dr_grpo"),
                                           set_("algorithm.dropConstantGroups", True),
                                           set_("algorithm.epsClip", 0.2),
                                           set_("algorithm.sapoTauPos", 1.0),
                                           set_("algorithm.cispoEpsHigh", 0.28))),
    ("custom-loss-with-its-args-and-kuberls-terms", both(
        CUSTOM_LOSS, set_("algorithm.lossArgs", {"eps_low": 0.2, "eps_high": 1, "big": 1e30}),
        set_("algorithm.tisCap", 2), set_("algorithm.klCoef", 0.01),
        set_("algorithm.entropyCoef", 0.001), set_("algorithm.epsClip", 0.2),
        set_("algorithm.cispoEpsHigh", 0.28))),
    ("code-for-a-loss-function", both(CUSTOM_LOSS, set_("code", {"configMap": "my-losses"}))),
    ("gspo-keeps-its-clip", both(set_("algorithm.policyLoss", "gspo"),
                                 set_("algorithm.epsClip", 3e-4),
                                 set_("algorithm.epsClipHigh", 4e-4))),
    ("decaying-lr", both(set_("algorithm.lrDecayStyle", "cosine"),
                         set_("algorithm.minLrRatio", 0.1))),
    ("overlong-shaping", both(set_("algorithm.overlongBuffer", 64),
                              set_("algorithm.overlongPenalty", 0.5))),
    ("eval-sets-and-interval", both(set_("data.evalSets", [{"name": "a", "path": "/d/a.jsonl"}]),
                                    set_("schedule.evalInterval", 10))),
    ("every-path-under-its-mount", both(
        set_("model", {"path": "/mnt/m/q", "tokenizer": "/mnt/m/tok",
                       "storage": {"pvc": "m", "mountPath": "/mnt/m"}}),
        set_("data", {"prompts": "/mnt/d/p.jsonl", "storage": {"pvc": "d", "mountPath": "/mnt/d"},
                      "evalSets": [{"name": "a", "path": "/mnt/d/a.jsonl"}],
                      "sft": {"path": "/mnt/d/sft.jsonl"}}),
        set_("schedule.evalInterval", 10), set_("algorithm.sftCoef", 0.1),
        set_("algorithm", {"advantageEstimator": "on_policy_distillation",
                           "teacherPath": "/mnt/m/big", "sftCoef": 0.1}))),
    ("paths-anywhere-without-a-pvc", both(  # local `kuberl run`: relative paths
        set_("model", {"path": "out/m", "tokenizer": "out/tok"}),
        set_("data", {"prompts": "out/p.jsonl", "evalSets": [{"name": "a", "path": "e.jsonl"}]}),
        set_("schedule.evalInterval", 10),
        set_("algorithm", {"advantageEstimator": "on_policy_distillation",
                           "teacherPath": "../teacher"}))),
    ("engine-old-logprobs-over-several-optimizer-steps", both(
        set_("algorithm.oldLogprobs", "engine"), set_("training.globalBatchSize", 64))),
    ("cpu-rollout-engines", both(ON_CPU, set_("rollout.engines", 2),
                                 set_("rollout.engineArgs", {"dtype": "bfloat16"}))),
    ("sglang-engine-args", both(set_("rollout.memoryFraction", 0.8), set_(
        "rollout.engineArgs", {"schedule-conservativeness": "0.8",
                               "chunked-prefill-size": "4096"}))),
    ("sglang-engine-switches-and-lists", both(
        set_("rollout.engineArgs", {"enable-memory-saver": "true", "skip-server-warmup": "true"}),
        set_("rollout.engineListArgs", {"cuda-graph-bs": ["1", "2", "4"]}))),
    ("network-on-a-cpu-job-with-a-gpu-critic",
     both(ON_CPU, ppo(set_("critic", {"placement": "dedicated", "gpusPerNode": 1})),
          set_("network.env", {"NCCL_DEBUG": "INFO"}))),
    ("network-with-gpu-rollout-only",
     both(set_("training", {"backend": "fsdp", "gpusPerNode": 0}),
          disagg(gpus=8, gpusPerEngine=2), set_("network.hostNetwork", True))),
    ("an-agent-with-everything-issue-35-adds", both(
        set_("rollout.function", "agent:run"), set_("rollout.maxRowsPerSample", 4),
        set_("algorithm.advantageEstimator", "rloo"), set_("environment.onError", "drop"),
        set_("reward.type", "environment"), set_("data.metadataKeys", ["level", "tools"]))),
    ("an-environment-drops-and-rewards", both(
        set_("environment.class", "envs:Calculator"), set_("environment.onError", "drop"),
        set_("reward.type", "environment"), set_("data.metadataKeys", ["level"]))),
    ("environment-service-with-everything", set_("environment", {
        "class": "envs:Calculator", "image": "registry.example/envs:1", "args": {"level": "2"},
        "replicas": 4, "timeoutSeconds": 120, "resources": {"cpu": "2", "memory": "4Gi"},
        "nodePool": {"nodeSelector": {"pool": "cpu"}}, "env": {"LEVEL": "2"}})),
    ("code-from-a-configmap", both(set_("rollout.function", "my_agent:run"),
                                   set_("code", {"configMap": "my-agent.v2"}))),
    ("code-from-a-pvc-directory", both(set_("environment.class", "envs:Calculator"),
                                       set_("code", {"pvc": "code", "subPath": "v1..2/./src"}))),
    ("code-for-a-reward-function", both(set_("reward", {"type": "custom",
                                                        "function": "my_rewards:score"}),
                                        set_("code", {"pvc": "code"}))),
    ("eval-mode", eval_mode()),
    ("a-reward-service-with-everything", both(
        remote_reward(url="https://judge.team-a.svc:8443/v1/score?model=b", timeoutSeconds=300,
                      maxRetries=0, batchSize=64, maxConcurrentRequests=16, onError="drop"),
        set_("data.metadataKeys", ["level"]))),
    ("a-reward-service-in-eval-mode", eval_mode(remote_reward())),
    # One storage at one mountPath, named by several sections, is mounted once.
    ("a-reward-model-on-the-policys-pvc", both(
        set_("model", {"path": "/mnt/m/q", "storage": {"pvc": "m", "mountPath": "/mnt/m"}}),
        set_("reward", {"type": "model", "model": {
            "path": "/mnt/m/rm", "storage": {"pvc": "m", "mountPath": "/mnt/m"}}}))),
    # A served reward model's GPU pods are GPU pods: the network section applies to them.
    ("network-for-a-reward-models-gpus-alone", both(
        ON_CPU, set_("reward", {"type": "model", "model": {"path": "/rm", "gpusPerReplica": 2}}),
        set_("network", {"ncclSocketIfname": "eth0"}))),
    ("model-and-data-on-one-pvc", both(
        set_("model", {"path": "/mnt/x/m", "storage": {"pvc": "a", "mountPath": "/mnt/x",
                                                       "subPath": "s", "readOnly": False}}),
        set_("data", {"prompts": "/mnt/x/p.jsonl", "storage": {
            "pvc": "a", "mountPath": "/mnt/x", "subPath": "s", "readOnly": False}}))),
    ("a-batch-function-sees-metadata", both(
        set_("reward", {"type": "custom", "function": "judge:grade", "batch": True}),
        set_("data.metadataKeys", ["level", "rubric"]))),
    ("eval-mode-on-cpu-with-an-environment", eval_mode(
        ON_CPU, set_("environment.class", "envs:Calculator"), set_("reward.type", "environment"))),
    ("pass-k-up-to-the-samples", both(
        set_("data.evalSets", [{"name": "a", "path": "/d/a.jsonl", "nSamplesPerPrompt": 8,
                                "passK": [1, 4, 8], "passThreshold": 0.5}]),
        set_("schedule.evalInterval", 10))),
    ("tolerations-kubernetes-accepts", pool(
        {"operator": "Exists"}, {"key": "gpu", "operator": "Exists", "value": ""},
        {"key": "gpu", "value": "a", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": 300})),
]


@pytest.mark.parametrize(("case", "edit"), GOOD_SPECS, ids=[c[0] for c in GOOD_SPECS])
def test_near_misses_are_valid_for_both(case: str, edit: Any) -> None:
    parse(_manifest(edit))
    assert admit(SCHEMA, _manifest(edit)) == []


def test_at_least_twenty_distinct_bad_manifests() -> None:
    assert len({c[2] for c in BAD_SPECS}) >= 20


@pytest.mark.parametrize("name", ["a" * 41, "Math-GRPO", "1job", "job_1"])
def test_bad_names_refused_by_both(name: str) -> None:
    obj = base()
    obj["metadata"]["name"] = name
    with pytest.raises(InvalidRLJob, match=r"metadata\.name"):
        parse(obj)
    # a root rule: the API server reports it at the object, and the message names the field
    assert any(": metadata.name must" in p for p in admit(SCHEMA, obj))


def test_wrong_kind_and_version_named() -> None:
    obj = base() | {"apiVersion": "kuberl.dev/v1", "kind": "Job"}
    with pytest.raises(InvalidRLJob) as info:
        parse(obj)
    text = str(info.value)
    assert "apiVersion: must be kuberl.dev/v1alpha1" in text and "kind: must be RLJob" in text


def test_short_manifest_gets_sensible_defaults() -> None:
    job = parse(base())
    spec = job.spec
    assert (spec.training.nodes, spec.training.gpus_per_node) == (1, 8)
    assert spec.placement == "colocate" and spec.rollout_gpus == 8 and spec.num_engines == 8
    assert spec.global_batch_size == 32 * 8
    assert spec.training.data_parallel == 8
    assert admit(SCHEMA, base()) == []


def test_model_and_crd_defaults_agree() -> None:
    """The API server's defaults (from the CRD) equal the model's, so what `kubectl get -o yaml`
    shows is what the trainer runs."""
    from tests.crd_admission import apply_defaults

    server_side = apply_defaults(SCHEMA, copy.deepcopy(base()))["spec"]
    model_side = parse(base()).spec.model_dump(by_alias=True, exclude_none=True)
    assert server_side == model_side


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_valid_for_both(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    parse(obj)
    assert admit(SCHEMA, obj) == []


def _running(obj: dict[str, Any], phase: str) -> dict[str, Any]:
    return obj | {"status": {"phase": phase}}


@pytest.mark.parametrize("section, edit", [
    ("model", set_("model.path", "/models/other")),
    ("training", set_("training.nodes", 2)),
    ("algorithm", set_("algorithm.lr", 1e-5)),
    ("data", set_("data.rolloutBatchSize", 64)),
    ("scheduling", set_("scheduling.queueName", "other-team")),
])
def test_immutable_once_running(section: str, edit: Any) -> None:
    old = _running(base(), "Running")
    new = _running(_manifest(edit), "Running")
    problems = admit(SCHEMA, new, old)
    assert problems and problems[0].startswith(f"spec.{section}"), problems
    assert "immutable" in problems[0]
    # before the job starts, the same edit is fine
    assert admit(SCHEMA, _running(_manifest(edit), "Pending"), _running(base(), "Pending")) == []


def test_code_is_immutable_once_running() -> None:
    """A running job's pods mounted the code it started with: another source would apply only
    to a restart."""
    def job(name: str) -> dict[str, Any]:
        return _manifest(both(set_("rollout.function", "my_agent:run"),
                              set_("code", {"configMap": name})))
    problems = admit(SCHEMA, _running(job("agent-2"), "Running"), _running(job("agent-1"),
                                                                            "Running"))
    assert problems and problems[0].startswith("spec.code") and "immutable" in problems[0]


@pytest.mark.parametrize("edit", [set_("suspend", True), set_("backoffLimit", 5),
                                  set_("activeDeadlineSeconds", 3600),
                                  set_("ttlSecondsAfterFinished", 60)])
def test_operational_fields_stay_mutable(edit: Any) -> None:
    assert admit(SCHEMA, _running(_manifest(edit), "Running"), _running(base(), "Running")) == []


def test_kueue_queue_label_on_the_rljob_is_refused_for_the_field() -> None:
    """The RLJob's labels are copied onto the RayJob: Kueue's queue label there would queue it
    without the suspend that makes Kueue admit it as a gang."""
    manifest = base()
    manifest["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    with pytest.raises(InvalidRLJob) as err:
        parse(manifest)
    assert "spec.scheduling.queueName" in str(err.value)
    assert "metadata.labels.kueue.x-k8s.io/queue-name" in str(err.value)
