"""The data section: the prompts, their batch sizes and lengths, held-out eval sets and SFT
demonstrations."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from kuberl_api.base import ApiModel, Rule, rules_schema
from kuberl_api.spec.common import (
    MAX_ITEMS,
    MAX_ROLLOUT_BATCH,
    MAX_SAMPLES_PER_PROMPT,
    MAX_STR,
    under,
    under_cel,
)
from kuberl_api.spec.model import Storage

_MOUNT = "self.storage.mountPath"


MAX_PASS_K = 8  # k values per eval set


class EvalSet(ApiModel):
    """A held-out set: its score is the mean reward of `nSamplesPerPrompt` samples per problem
    (`eval_<name>_reward`) and, for each k of `passK`, avg@k, pass@k and maj@k
    (docs/algorithms.md, "Evaluation")."""

    RULES = (
        Rule("self.passK.all(k, k <= self.nSamplesPerPrompt)",
             lambda e: all(k <= e.n_samples_per_prompt for k in e.pass_k),
             "every passK value must be at most nSamplesPerPrompt (pass@k, maj@k and avg@k "
             "are computed from the samples each problem has)", "passK",
             detail=lambda e: f"nSamplesPerPrompt = {e.n_samples_per_prompt}"),
        Rule("self.passK.all(k, self.passK.filter(j, j == k).size() == 1)",
             lambda e: len(set(e.pass_k)) == len(e.pass_k),
             "passK values must be distinct", "passK"),
        Rule("self.passThreshold == 1.0 || size(self.passK) > 0",
             lambda e: e.pass_threshold == 1.0 or bool(e.pass_k),
             "passThreshold applies only with passK (it decides which samples pass@k counts)",
             "passThreshold"),
    )
    model_config = {"json_schema_extra": rules_schema(RULES)}

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9_]*[a-z0-9])?$")
    path: str = Field(min_length=1, max_length=MAX_STR, description="JSONL or Parquet file.")
    n_samples_per_prompt: int = Field(1, ge=1, le=1024, description="Samples per problem: 1 "
                                      "is greedy, more sample at algorithm.temperature; the "
                                      "set's score is their mean reward.")
    pass_k: list[Annotated[int, Field(ge=1, le=1024)]] = Field(
        default_factory=list, max_length=MAX_PASS_K,
        description="The k values to report avg@k, pass@k (unbiased, from all "
        "nSamplesPerPrompt samples) and maj@k for; each at most nSamplesPerPrompt.")
    pass_threshold: float = Field(
        1.0, ge=-1e9, le=1e9, description="A sample passes (pass@k) when its reward is at "
        "least this; 1.0 suits the built-in 0/1 rewards.")


class SftData(ApiModel):
    """Demonstrations for the SFT (NLL) term (algorithm.sftCoef): prompt and target response,
    under the data section's inputKey and labelKey."""

    path: str = Field(min_length=1, max_length=MAX_STR,
                      description="JSONL or Parquet file, as seen from the head pod.")
    batch_size: int = Field(16, ge=1, le=MAX_ROLLOUT_BATCH,
                            description="Demonstrations per step, split evenly over the step's "
                            "optimizer steps and data-parallel ranks.")


def _outside_mount(d: DataSpec) -> list[str]:
    """The eval sets' paths outside the data PVC's mount (Python's twin of the CEL's `all`)."""
    mount = d.storage.mount_path if d.storage else ""
    return [e.path for e in d.eval_sets if not under(e.path, mount)]


class DataSpec(ApiModel):
    """Where prompts come from and how many are generated per step."""

    RULES = (
        Rule(f"!has(self.storage) || !has(self.prompts) || {under_cel('self.prompts', _MOUNT)}",
             lambda d: (d.storage is None or d.prompts is None
                        or under(d.prompts, d.storage.mount_path)),
             "prompts must lie under storage.mountPath when a PVC holds the data", "prompts",
             detail=lambda d: f"storage.mountPath = {d.storage.mount_path}"),
        # The other files the head reads from the data PVC: a typo is refused at apply, not
        # found at the first evaluation or SFT step, after a cluster was provisioned.
        Rule(f"!has(self.storage) || self.evalSets.all(e, {under_cel('e.path', _MOUNT)})",
             lambda d: d.storage is None or not _outside_mount(d),
             "evalSets[].path must lie under storage.mountPath when a PVC holds the data",
             "evalSets", value=lambda d: _outside_mount(d),
             detail=lambda d: f"storage.mountPath = {d.storage.mount_path}"),
        Rule(f"!has(self.storage) || !has(self.sft) || {under_cel('self.sft.path', _MOUNT)}",
             lambda d: (d.storage is None or d.sft is None
                        or under(d.sft.path, d.storage.mount_path)),
             "sft.path must lie under storage.mountPath when a PVC holds the data", "sft.path",
             detail=lambda d: f"storage.mountPath = {d.storage.mount_path}"),
    )
    model_config = {"json_schema_extra": rules_schema(RULES)}

    prompts: str | None = Field(
        None, min_length=1, max_length=MAX_STR, description="Prompt file (JSONL or Parquet) "
        "as seen from the head pod. Required to train; mode eval reads none.")
    input_key: str = Field("prompt", min_length=1, max_length=253)
    label_key: str = Field("label", min_length=1, max_length=253)
    metadata_keys: list[Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        default_factory=list, max_length=MAX_ITEMS,
        description="Columns of the prompt file (and of data.evalSets) copied into each "
        "sample's metadata, which a rollout.function reads as ctx.sample.metadata, an "
        "environment.class's reset as sample.metadata, and a reward service (reward.type "
        "remote) or batch reward function (reward.batch) as each item's metadata; a row "
        "without one of them is an error naming the file, the row and the key. Only with "
        "one of those.")
    rollout_batch_size: int = Field(32, ge=1, le=MAX_ROLLOUT_BATCH,
                                    description="Prompts per step.")
    n_samples_per_prompt: int = Field(8, ge=1, le=MAX_SAMPLES_PER_PROMPT,
                                      description="Responses per prompt.")
    max_prompt_len: int = Field(1024, ge=1, le=1048576, description="Tokens.")
    max_response_len: int = Field(1024, ge=1, le=1048576, description="Tokens.")
    storage: Storage | None = Field(None, description="PVC that holds the data.")
    eval_sets: list[EvalSet] = Field(default_factory=list, max_length=16,
                                     description="Held-out sets, evaluated every "
                                     "schedule.evalInterval steps (both or neither), or once "
                                     "by mode eval.")
    sft: SftData | None = Field(None, description="Demonstrations for algorithm.sftCoef's "
                                "NLL term, trained on beside every RL step.")
