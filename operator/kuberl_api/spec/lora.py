"""training.lora: post-train a low-rank adapter instead of every weight (docs/lora.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kuberl_api.base import ApiModel, Rule, rules_schema
from kuberl_api.spec.common import MAX_ITEMS, MAX_STR

MAX_LORA_RANK = 1024
ModuleName = Annotated[str, Field(min_length=1, max_length=MAX_STR)]


# Modules SGLang 0.5.6 serves no adapter on ("Not supported yet", its LoRA loading)
ENGINE_UNSERVED_MODULES = ("lm_head", "embed_tokens")
ADAPTER_UNSERVED_MODULES = ("sync adapter: SGLang serves no adapter on lm_head or embed_tokens; "
                            "leave them out of targetModules or use sync merged")


class LoraSpec(ApiModel):
    """A LoRA adapter on the policy (backend fsdp): only the adapter trains; the reference
    model is the base with the adapter off; the engines receive the merged weights, or the
    adapter itself (sync: adapter)."""

    RULES = (
        Rule("self.sync != 'adapter' || !has(self.targetModules) || "
             f"self.targetModules.all(m, !(m in {list(ENGINE_UNSERVED_MODULES)}))",
             lambda lora: lora.sync != "adapter" or not set(lora.target_modules or ())
             & set(ENGINE_UNSERVED_MODULES), ADAPTER_UNSERVED_MODULES, "targetModules"),
    )
    model_config = {"json_schema_extra": rules_schema(RULES)}

    rank: int = Field(ge=1, le=MAX_LORA_RANK, description="The adapter's rank r.")
    alpha: float | None = Field(
        None, gt=0, le=1e6, description="LoRA's alpha: the update is scaled by alpha / rank; "
        "default: 2 * rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input in "
                           "the training forward passes (never in log-prob passes).")
    target_modules: list[ModuleName] | None = Field(
        None, min_length=1, max_length=MAX_ITEMS, description="The modules the adapter wraps, "
        "as PEFT matches them (a name or a suffix of one, e.g. q_proj); default: every linear "
        "layer of the decoder, not the LM head. A name matching nothing is refused at start.")
    path: str | None = Field(
        None, min_length=1, max_length=MAX_STR, description="Start from this PEFT adapter "
        "directory (adapter_config.json + adapter_model.safetensors) instead of a fresh "
        "adapter; its rank, alpha and target modules must be these.")
    sync: Literal["merged", "adapter"] = Field(
        "merged", description="How the engines get the adapter: merged (W + alpha/rank * B A "
        "into the full weights, sent as a full-weight sync each step), or adapter (each "
        "step's adapter written as a PEFT directory under checkpoint.path and loaded by the "
        "engines through SGLang's /load_lora_adapter under a versioned name, which every "
        "request names; the engines keep the base weights and serve LoRA).")

    @property
    def lora_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank
