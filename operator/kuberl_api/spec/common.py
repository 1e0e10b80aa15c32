"""What the RLJob spec's sections share: Kubernetes' own patterns, the bounds that keep CEL
cost estimates finite and CEL arithmetic from overflowing, the images and GPU counts the
sections default to, and the helpers that write a rule's CEL (and its Python twin's parts)."""

from __future__ import annotations

import re

from kuberl_api.base import ApiModel, Rule, key_rule

# Kubernetes' own quantity grammar (resource.Quantity), so "500m", "64Gi" and "1e3" pass here
# exactly when the API server would accept them.
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
LABEL_KEY_PATTERN = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
IMPORT_PATH_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
PVC_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
# A DNS-1123 subdomain (the names of ConfigMaps and PersistentVolumeClaims): dot-separated
# labels of lowercase letters, digits and '-', each starting and ending alphanumeric.
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"

# Bounds keep CEL cost estimates finite (the API server refuses rules over unbounded lists).
MAX_STR = 1024
MAX_ITEMS = 64

# Where spec.code's modules are mounted in every Ray pod (and put first on PYTHONPATH).
CODE_DIR = "/opt/kuberl/code"
# Mount points kuberl itself uses in every pod (config, shared memory for NCCL, user code).
RESERVED_PATHS = ("/etc/kuberl", "/dev/shm", CODE_DIR)



def under_cel(path: str, mount: str) -> str:
    """CEL: the path `path` lies under the mount point `mount` (both CEL string expressions):
    the mount itself or below it, so /mnt/dta is not under /mnt/d (a plain prefix would be)."""
    return (f"({path} == {mount} || {path}.startsWith({mount}.endsWith('/') ? {mount} : "
            f"{mount} + '/'))")


def under(path: str, mount: str) -> bool:
    """Python's twin of `under_cel`."""
    return path == mount or path.startswith(mount if mount.endswith("/") else mount + "/")


# Upper bounds of the integers that CEL rules multiply, divide or take a modulus of: far above
# any real job, and low enough that no product in a rule can overflow CEL's int64 (the largest,
# microBatchSize * dataParallel, is at most 65536 * (4096 * 16) = 2**32).
MAX_NODES = 4096
MAX_GPUS_PER_NODE = 16
MAX_PARALLEL = 1024  # tp, pp, cp (and ep)
MAX_MICRO_BATCH = 65536
MAX_MICRO_BATCH_TOKENS = 16777216
MAX_GLOBAL_BATCH = 16777216
MAX_ROLLOUT_BATCH = 65536
MAX_SAMPLES_PER_PROMPT = 1024
MAX_ROLLOUT_GPUS = 65536
MAX_GPUS_PER_ENGINE = 64
MAX_ENGINE_RESTARTS = 1000


# A CEL rule that multiplies, divides or takes a modulus first passes when one of its operands
# lies outside its schema range, so that it evaluates on any value its field's type allows.
# kuberl's ValidatingAdmissionPolicy (kuberl_operator/policy.py) runs the rules only on objects
# the CRD's schema accepted, but as a CRD's `x-kubernetes-validations` (as kuberl shipped them
# before; bench/crd_validation_cost.py's rules-in-crd) the API server still runs them after such
# a schema error (a minimum or a maximum; only a wrong type, a missing field, an enum or a
# length stops them), and an unguarded rule would add "division by zero" or "integer overflow
# evaluating rule", or a cross-field message worked out from the refused value, to the field's
# own minimum or maximum error. The Python twins never see such values (pydantic runs a model
# validator only once every field is valid).


def _outside(path: str, low: int, high: int, *, optional: bool = False) -> str:
    """CEL: the integer at `path` lies outside [low, high] (an unset optional one does not)."""
    test = f"{path} < {low} || {path} > {high}"
    return f"(has({path}) && ({test}))" if optional else test


def _gpus_outside(training: str) -> str:
    """CEL: nodes or gpusPerNode of the training section at `training` is out of range."""
    return (f"{_outside(f'{training}.nodes', 1, MAX_NODES)} || "
            f"{_outside(f'{training}.gpusPerNode', 0, MAX_GPUS_PER_NODE)}")


def _mp_outside(training: str) -> str:
    """CEL: tp, pp or cp of the training section at `training` is out of range."""
    return " || ".join(_outside(f"{training}.parallelism.{p}", 1, MAX_PARALLEL)
                       for p in ("tp", "pp", "cp"))


def _at_defaults(path: str, model: type[ApiModel]) -> str:
    """CEL: the section at `path` holds only `model`'s defaults. The API server fills in every
    default before the rules run, so an untouched section reads as exactly these values."""
    return "(" + " && ".join(_at_default(path, model, name)
                             for name in model.model_fields) + ")"


def _at_default(path: str, model: type[ApiModel], name: str) -> str:
    """CEL: field `name` of `model`'s section at `path` holds its default."""
    info = model.model_fields[name]
    field = f"{path}.{info.alias or name}"
    default = info.get_default(call_default_factory=True)
    if default is None:
        return f"!has({field})"
    if isinstance(default, ApiModel):
        return _at_defaults(field, type(default))
    if isinstance(default, (dict, list)):
        if default:
            raise ValueError(f"{field}: only empty map or list defaults are supported")
        return f"size({field}) == 0"
    if isinstance(default, bool):
        return f"{field} == {str(default).lower()}"
    if isinstance(default, str):
        return f"{field} == '{default}'"
    return f"{field} == {default!r}"  # int or float: repr keeps a float a double (1.0, not 1)


def _is_default(section: ApiModel, name: str) -> bool:
    """Python's twin of `_at_default`."""
    info = type(section).model_fields[name]
    return bool(getattr(section, name) == info.get_default(call_default_factory=True))


DEFAULT_TRAINER_IMAGE = "ghcr.io/kuberl/trainer:0.1.0"
DEFAULT_ROLLOUT_IMAGE = "ghcr.io/kuberl/rollout:0.1.0"
DEFAULT_GPUS_PER_NODE = 8


def env_name_rules(field: str, example: str = "") -> tuple[Rule, ...]:
    """The rule for an env map's keys (`field`: its path in messages): Kubernetes refuses a pod
    whose env names are not C identifiers, so the pods would never be created."""
    return (key_rule(f"self.all(k, k.matches('{ENV_NAME_PATTERN}'))",
                     lambda name: re.fullmatch(ENV_NAME_PATTERN, name) is not None,
                     f"{field} names must be C identifiers: letters, digits and '_', not "
                     f"starting with a digit{example}"),)
