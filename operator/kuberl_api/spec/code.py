"""The code section: the user's own Python modules (rollout.function, environment.class,
reward.function on the head; algorithm.lossFunction in every training rank) mounted into every
Ray pod of the job at CODE_DIR and put on its PYTHONPATH,
from a ConfigMap or a directory of a PVC: the Kubernetes-native alternative to an image built
on kuberl's trainer image (docs/agents.md, "Your code in a cluster")."""

from __future__ import annotations

from pydantic import Field

from kuberl_api.base import ApiModel, Rule, rules_schema
from kuberl_api.spec.common import CODE_DIR, DNS_SUBDOMAIN_PATTERN, MAX_STR

CODE_ONE_SOURCE = (f"configMap and pvc are two sources of the same directory ({CODE_DIR}): "
                   "set one")
SUB_PATH_NEEDS_PVC = "subPath applies only with pvc"
SUB_PATH_RELATIVE = ("subPath must be a relative path inside the claim: not starting with '/', "
                     "no '..' part (Kubernetes refuses the pods otherwise)")


def _sub_path_ok(path: str | None) -> bool:
    return path is None or (not path.startswith("/") and ".." not in path.split("/"))


class CodeSpec(ApiModel):
    """Where the job's own modules come from in a cluster. `kuberl run` ignores it (with a
    notice) and imports them from the current directory and PYTHONPATH, as without it."""

    RULES = (
        Rule("!has(self.configMap) || !has(self.pvc)",
             lambda c: c.config_map is None or c.pvc is None, CODE_ONE_SOURCE, "pvc"),
        Rule("!has(self.subPath) || has(self.pvc)",
             lambda c: c.sub_path is None or c.pvc is not None, SUB_PATH_NEEDS_PVC, "subPath"),
        Rule("!has(self.subPath) || (!self.subPath.startsWith('/') && "
             "!self.subPath.matches('(^|/)[.][.](/|$)'))",
             lambda c: _sub_path_ok(c.sub_path), SUB_PATH_RELATIVE, "subPath"),
    )
    model_config = {"json_schema_extra": rules_schema(RULES)}

    config_map: str | None = Field(
        None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN,
        description=f"A ConfigMap in the RLJob's namespace whose keys are files (e.g. "
        f"my_agent.py), mounted read-only at {CODE_DIR}: flat modules only (a key cannot "
        "hold a '/'), 1 MiB in all. Build it with `kubectl create configmap NAME "
        "--from-file=my_agent.py`. The operator waits for it (Accepted=False) before "
        "creating the RayJob.")
    pvc: str | None = Field(
        None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN,
        description=f"A PersistentVolumeClaim in the RLJob's namespace (ReadOnlyMany or "
        f"ReadWriteMany: every Ray pod mounts it) whose directory subPath is mounted "
        f"read-only at {CODE_DIR}: packages, or code too big for a ConfigMap.")
    sub_path: str | None = Field(
        None, min_length=1, max_length=MAX_STR,
        description="The directory of the claim to mount (pvc only), relative; default its "
        "root.")

    @property
    def source(self) -> str | None:
        """What is mounted, for messages: `ConfigMap NAME`, `PVC NAME[/SUBPATH]`, or None."""
        if self.config_map:
            return f"ConfigMap {self.config_map}"
        if self.pvc:
            return f"PVC {self.pvc}" + (f" (subPath {self.sub_path})" if self.sub_path else "")
        return None
