"""The network section: NCCL's interface and environment, host networking, RDMA devices and
the weight-sync port of the job's GPU pods."""

from __future__ import annotations

from pydantic import Field

from kuberl_api.base import ApiModel, rules_schema
from kuberl_api.spec.common import LABEL_KEY_PATTERN, env_name_rules


class RdmaSpec(ApiModel):
    resource: str = Field(min_length=1, max_length=253, pattern=LABEL_KEY_PATTERN,
                          description="Device-plugin resource, e.g. rdma/rdma_shared_device_a.")
    count: int = Field(1, ge=1, le=64)


ENV_RULES = env_name_rules("network.env", " (e.g. NCCL_DEBUG)")


class NetworkSpec(ApiModel):
    FIELD_RULES = {"env": ENV_RULES}

    nccl_socket_ifname: str | None = Field(
        None, max_length=253, description="NCCL_SOCKET_IFNAME, e.g. eth0 or ^lo,docker.")
    host_network: bool = Field(False, description="Run GPU pods on the host network.")
    rdma: RdmaSpec | None = None
    weight_sync_port: int = Field(29600, ge=1024, le=65535,
                                  description="Port of the trainer-to-engines NCCL group.")
    env: dict[str, str] = Field(
        default_factory=dict, max_length=64,
        description="Extra NCCL_* (or other) variables for GPU pods.",
        json_schema_extra=rules_schema(ENV_RULES))

    def variables(self) -> dict[str, str]:
        """The environment of GPU processes: `env`, then the typed fields, which win over a
        same-named free-form entry (the typed field is the documented way; silently
        preferring `env` would make `ncclSocketIfname` a no-op). The operator renders them
        into the GPU pods; `kuberl run` gives them to its local Ray's workers."""
        values = dict(self.env)
        if self.nccl_socket_ifname:
            values["NCCL_SOCKET_IFNAME"] = self.nccl_socket_ifname
        return values
