"""The model section: the policy's starting checkpoint, and the PVC (Storage) that holds it."""

from __future__ import annotations

from pydantic import Field, model_validator

from kuberl_api.base import ApiModel, cel, cel_rules, check
from kuberl_api.spec.common import MAX_STR, PVC_NAME_PATTERN, RESERVED_PATHS


class Storage(ApiModel):
    """A PersistentVolumeClaim mounted into every pod of the job at `mountPath`."""

    model_config = {
        "json_schema_extra": cel_rules(
            cel("self.mountPath.startsWith('/')", "mountPath must be an absolute path",
                ".mountPath"),
            cel(f"!(self.mountPath in {list(RESERVED_PATHS)})",
                f"mountPath may not be one of {', '.join(RESERVED_PATHS)} (used by kuberl)",
                ".mountPath"),
        )
    }

    pvc: str = Field(min_length=1, max_length=253, pattern=PVC_NAME_PATTERN,
                     description="Name of a PersistentVolumeClaim in the RLJob's namespace.")
    mount_path: str = Field(min_length=1, max_length=MAX_STR,
                            description="Where the claim is mounted in the pods.")
    sub_path: str | None = Field(None, max_length=MAX_STR,
                                 description="Mount only this sub-directory of the claim.")
    read_only: bool = Field(True, description="Mount read-only.")

    @model_validator(mode="after")
    def _absolute(self) -> Storage:
        check(self.mount_path.startswith("/"), "mountPath", self.mount_path,
              "mountPath must be an absolute path")
        check(self.mount_path not in RESERVED_PATHS, "mountPath", self.mount_path,
              f"mountPath may not be one of {', '.join(RESERVED_PATHS)} (used by kuberl)")
        return self


class ModelSpec(ApiModel):
    """The policy's starting point: a Hugging Face checkpoint directory."""

    model_config = {
        "json_schema_extra": cel_rules(
            cel("!has(self.storage) || self.path.startsWith(self.storage.mountPath)",
                "path must lie under storage.mountPath when a PVC holds the model", ".path"),
        )
    }

    path: str = Field(min_length=1, max_length=MAX_STR,
                      description="HF checkpoint directory (config.json + safetensors).")
    tokenizer: str | None = Field(None, max_length=MAX_STR,
                                  description="Tokenizer directory; defaults to `path`.")
    storage: Storage | None = Field(None, description="PVC that holds the model.")

    @model_validator(mode="after")
    def _under_mount(self) -> ModelSpec:
        if self.storage is not None:
            check(self.path.startswith(self.storage.mount_path), "path", self.path,
                  f"path must lie under storage.mountPath ({self.storage.mount_path}) "
                  "when a PVC holds the model")
        return self
