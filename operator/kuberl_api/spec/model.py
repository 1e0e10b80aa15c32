"""The model section: the policy's starting checkpoint, and the PVC (Storage) that holds it."""

from __future__ import annotations

from pydantic import Field

from kuberl_api.base import ApiModel, Rule, rules_schema
from kuberl_api.spec.common import MAX_STR, PVC_NAME_PATTERN, RESERVED_PATHS, under, under_cel

_MOUNT = "self.storage.mountPath"


class Storage(ApiModel):
    """A PersistentVolumeClaim mounted into every pod of the job at `mountPath`."""

    RULES = (
        Rule("self.mountPath.startsWith('/')", lambda s: s.mount_path.startswith("/"),
             "mountPath must be an absolute path", "mountPath"),
        Rule(f"!(self.mountPath in {list(RESERVED_PATHS)})",
             lambda s: s.mount_path not in RESERVED_PATHS,
             f"mountPath may not be one of {', '.join(RESERVED_PATHS)} (used by kuberl)",
             "mountPath"),
    )
    model_config = {"json_schema_extra": rules_schema(RULES)}

    pvc: str = Field(min_length=1, max_length=253, pattern=PVC_NAME_PATTERN,
                     description="Name of a PersistentVolumeClaim in the RLJob's namespace.")
    mount_path: str = Field(min_length=1, max_length=MAX_STR,
                            description="Where the claim is mounted in the pods.")
    sub_path: str | None = Field(None, max_length=MAX_STR,
                                 description="Mount only this sub-directory of the claim.")
    read_only: bool = Field(True, description="Mount read-only.")


def storage_rules(what: str = "the model") -> tuple[Rule, ...]:
    """A checkpoint's path and tokenizer lie under its storage's mountPath when a PVC holds
    it (`what`: the policy's model, a served reward model)."""
    return (
        Rule(f"!has(self.storage) || {under_cel('self.path', _MOUNT)}",
             lambda m: m.storage is None or under(m.path, m.storage.mount_path),
             f"path must lie under storage.mountPath when a PVC holds {what}", "path",
             detail=lambda m: f"storage.mountPath = {m.storage.mount_path}"),
        Rule(f"!has(self.storage) || !has(self.tokenizer) || "
             f"{under_cel('self.tokenizer', _MOUNT)}",
             lambda m: (m.storage is None or m.tokenizer is None
                        or under(m.tokenizer, m.storage.mount_path)),
             f"tokenizer must lie under storage.mountPath when a PVC holds {what}",
             "tokenizer", detail=lambda m: f"storage.mountPath = {m.storage.mount_path}"),
    )


class ModelSpec(ApiModel):
    """The policy's starting point: a Hugging Face checkpoint directory."""

    RULES = storage_rules()
    model_config = {"json_schema_extra": rules_schema(RULES)}

    path: str = Field(min_length=1, max_length=MAX_STR,
                      description="HF checkpoint directory (config.json + safetensors).")
    tokenizer: str | None = Field(None, max_length=MAX_STR,
                                  description="Tokenizer directory; defaults to `path`.")
    storage: Storage | None = Field(None, description="PVC that holds the model.")
