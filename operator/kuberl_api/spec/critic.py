"""The critic section: PPO's value model, trained beside the training workers (shared) or on
pods of its own (dedicated)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic.alias_generators import to_camel

from kuberl_api.base import ApiModel, Rule, rules_schema
from kuberl_api.spec.common import (
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_TRAINER_IMAGE,
    MAX_GPUS_PER_NODE,
    MAX_NODES,
    MAX_STR,
    _at_defaults,
    _is_default,
)
from kuberl_api.spec.pods import NodePool, Resources


def _dedicated_only(field: str) -> str:
    return (f"critic.{field} applies to placement: dedicated only (shared critics run on the "
            "training pods)")


def _dedicated_only_rule(name: str, at_default: str) -> Rule:
    """Field `name` of the critic keeps its default unless placement is dedicated; `at_default`
    is CEL's test of that."""
    field = to_camel(name)
    return Rule(f"self.placement == 'dedicated' || {at_default}",
                lambda c: c.placement == "dedicated" or _is_default(c, name),
                _dedicated_only(field), field)


class CriticSpec(ApiModel):
    """The value model PPO trains alongside the policy (advantageEstimator: ppo only)."""

    RULES = tuple(_dedicated_only_rule(name, at_default) for name, at_default in (
        ("nodes", "self.nodes == 1"),
        ("gpus_per_node", f"self.gpusPerNode == {DEFAULT_GPUS_PER_NODE}"),
        ("node_pool", _at_defaults("self.nodePool", NodePool)),
        ("resources", _at_defaults("self.resources", Resources)),
        ("image", f"self.image == '{DEFAULT_TRAINER_IMAGE}'"),
    ))
    model_config = {"json_schema_extra": rules_schema(RULES)}

    model_path: str | None = Field(
        None, min_length=1, max_length=MAX_STR, description="Weights to start the value model "
        "from (an HF causal LM directory; a fresh scalar value head is added); default: "
        "model.path.")
    lr: float = Field(1e-5, gt=0, le=1, description="The value model's learning rate.")
    # 0 rather than unset turns it off: the API server fills in the 0.2 default for an unset
    # field, and the ConfigMap the trainer reads drops None values.
    value_clip: float = Field(
        0.2, ge=0, le=1000, description="PPO value clipping: a value moves at most this far "
        "from its rollout-time estimate per update; 0: off.")
    placement: Literal["shared", "dedicated"] = Field(
        "shared", description="shared: one critic worker beside each training worker, on the "
        "training pods (sharing their GPUs); dedicated: pods of their own (nodes, "
        "gpusPerNode, nodePool, resources, image).")
    image: str = Field(DEFAULT_TRAINER_IMAGE, min_length=1, max_length=MAX_STR,
                       description="Image of the dedicated critic pods.")
    nodes: int = Field(1, ge=1, le=MAX_NODES, description="Dedicated critic pods.")
    gpus_per_node: int = Field(DEFAULT_GPUS_PER_NODE, ge=0, le=MAX_GPUS_PER_NODE,
                               description="GPUs per dedicated critic pod; 0: CPU.")
    node_pool: NodePool = Field(default_factory=NodePool,
                                description="Where the dedicated critic pods run.")
    resources: Resources = Field(default_factory=Resources,
                                 description="CPU and memory per dedicated critic pod.")
