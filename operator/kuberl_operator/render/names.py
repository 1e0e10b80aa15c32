"""Every name, label and selector the operator gives its children, in one place.

Length budget: RLJob names are at most 40 characters (a CRD rule), KubeRay refuses RayJob names
over 47 and builds more names from them (RayCluster "<rayjob>-<5 chars>", pods
"<cluster>-<group>-worker-<5>"), so the longest suffix we add to an RLJob name is 7 characters
("-r" + two digits of attempt, or a fixed word). `tests/unit/test_names.py` checks every name
for the longest valid RLJob name.
"""

from __future__ import annotations

from typing import Final

from kuberl_api.rljob import MAX_NAME_LENGTH

MAX_RAYJOB_NAME: Final = 47  # KubeRay's MaxRayJobNameLength
MAX_ATTEMPTS: Final = 100  # backoffLimit <= 99, so attempts fit in two digits

# Label keys the operator owns; users' labels never override them (applied last).
LABEL_JOB: Final = "kuberl.dev/rljob"
LABEL_ATTEMPT: Final = "kuberl.dev/attempt"
LABEL_COMPONENT: Final = "kuberl.dev/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
MANAGER: Final = "kuberl-operator"

# Ray custom resources that pin actors to their group's pods.
RESOURCE_TRAIN: Final = "kuberl_train"
RESOURCE_ROLLOUT: Final = "kuberl_rollout"

GROUP_TRAIN: Final = "train"
GROUP_ROLLOUT: Final = "rollout"


def rayjob(job: str, attempt: int) -> str:
    """RayJob of the given attempt (0 = first run, n = n-th restart from checkpoint)."""
    if not 0 <= attempt < MAX_ATTEMPTS:
        raise ValueError(f"attempt {attempt} out of range 0..{MAX_ATTEMPTS - 1}")
    return f"{job}-r{attempt}"


def configmap(job: str) -> str:
    return f"{job}-config"


def service_account(job: str) -> str:
    return f"{job}-head"


def role(job: str) -> str:
    return f"{job}-status"


def role_binding(job: str) -> str:
    return f"{job}-status"


def labels(job: str, component: str | None = None, attempt: int | None = None) -> dict[str, str]:
    """Labels on every child; `selector(job)` matches all of them."""
    out = {
        LABEL_NAME: "kuberl",
        LABEL_INSTANCE: job,
        LABEL_MANAGED_BY: MANAGER,
        LABEL_JOB: job,
    }
    if component:
        out[LABEL_COMPONENT] = component
    if attempt is not None:
        out[LABEL_ATTEMPT] = str(attempt)
    return out


def selector(job: str) -> dict[str, str]:
    return {LABEL_JOB: job}


def longest_job_name() -> str:
    """The longest RLJob name the CRD admits, for length tests."""
    return "a" * MAX_NAME_LENGTH
