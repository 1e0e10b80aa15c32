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

# Re-exported: the renderers' view of the trainer contract (defined in the API package).
from kuberl_api.runtime import (
    CONFIG_DIR as CONFIG_DIR,
    CONFIG_KEY as CONFIG_KEY,
    CONFIG_PATH as CONFIG_PATH,
    ENGINE_API_KEY_SECRET_KEY as ENGINE_API_KEY_SECRET_KEY,
    ENV_ATTEMPT as ENV_ATTEMPT,
    ENV_ENGINE_API_KEY as ENV_ENGINE_API_KEY,
    ENV_JOB_NAME as ENV_JOB_NAME,
    ENV_JOB_NAMESPACE as ENV_JOB_NAMESPACE,
    RESOURCE_CRITIC as RESOURCE_CRITIC,
    RESOURCE_REWARD as RESOURCE_REWARD,
    RESOURCE_ROLLOUT as RESOURCE_ROLLOUT,
    RESOURCE_TRAIN as RESOURCE_TRAIN,
)
from kuberl_env import protocol as environment_protocol

MAX_RAYJOB_NAME: Final = 47  # KubeRay's MaxRayJobNameLength
MAX_ATTEMPTS: Final = 100  # backoffLimit <= 99, so attempts fit in two digits

# Label keys the operator owns; users' labels never override them (applied last).
LABEL_JOB: Final = "kuberl.dev/rljob"
LABEL_ATTEMPT: Final = "kuberl.dev/attempt"
LABEL_COMPONENT: Final = "kuberl.dev/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
# On pod templates only: which Ray group a pod belongs to (head, train, rollout, critic, reward).
# One-pod-per-node anti-affinity selects on job + group; KubeRay's own `ray.io/group` is not
# unique across jobs.
LABEL_GROUP: Final = "kuberl.dev/group"
MANAGER: Final = "kuberl-operator"
OWNED_LABEL_KEYS: Final = (LABEL_NAME, LABEL_INSTANCE, LABEL_MANAGED_BY, LABEL_JOB,
                           LABEL_COMPONENT, LABEL_ATTEMPT, LABEL_GROUP)

# Values of LABEL_COMPONENT.
COMPONENT_RBAC: Final = "rbac"
COMPONENT_CONFIG: Final = "config"
COMPONENT_RAYJOB: Final = "rayjob"
COMPONENT_HEAD: Final = "ray-head"
COMPONENT_WORKER: Final = "ray-worker"
COMPONENT_ENVIRONMENT: Final = "environment"
COMPONENT_ENGINE_KEY: Final = "engine-key"
COMPONENT_SUBMITTER: Final = "ray-submitter"
COMPONENT_NETWORK: Final = "network"


GROUP_HEAD: Final = "head"
GROUP_TRAIN: Final = "train"
GROUP_ROLLOUT: Final = "rollout"
GROUP_CRITIC: Final = "critic"
GROUP_REWARD: Final = "reward"  # the engines of a reward model the job serves (reward.model)

# Named container port of the trainer-to-engines weight-update group (IANA_SVC_NAME, <= 15).
PORT_WEIGHT_SYNC: Final = "weight-sync"


def rayjob(job: str, attempt: int) -> str:
    """RayJob of the given attempt (0 = first run, n = n-th restart from checkpoint)."""
    if not 0 <= attempt < MAX_ATTEMPTS:
        raise ValueError(f"attempt {attempt} out of range 0..{MAX_ATTEMPTS - 1}")
    return f"{job}-r{attempt}"


def job_of_rayjob(rayjob_name: str) -> str | None:
    """The RLJob whose attempt a RayJob of this name is (None: not a name `rayjob` makes)."""
    job, sep, attempt = rayjob_name.rpartition("-r")
    if not sep or not job or not attempt.isdigit() or int(attempt) >= MAX_ATTEMPTS:
        return None
    return job if rayjob(job, int(attempt)) == rayjob_name else None


def configmap(job: str) -> str:
    return f"{job}-config"


def engine_key_secret(job: str, attempt: int) -> str:
    """The Secret holding the engines' API key of one attempt (a new key per attempt)."""
    return f"{rayjob(job, attempt)}-engine-key"


def service_account(job: str) -> str:
    return f"{job}-head"


def role(job: str) -> str:
    return f"{job}-status"


def role_binding(job: str) -> str:
    return f"{job}-status"


def environment(job: str) -> str:
    """The environment service's Deployment and headless Service (environment.image)."""
    return f"{job}-env"


def network_policy(job: str) -> str:
    """The job's NetworkPolicy (one per RLJob, every attempt's pods)."""
    return f"{job}-netpol"


def environment_url(job: str) -> str:
    """What the head calls the environment service: the headless Service's name, which
    resolves to every ready replica (in the head's own namespace)."""
    return f"http://{environment(job)}:{environment_protocol.DEFAULT_PORT}"


def environment_selector(job: str) -> dict[str, str]:
    """The environment pods of one RLJob (the Deployment's selector: never changes)."""
    return {LABEL_JOB: job, LABEL_COMPONENT: COMPONENT_ENVIRONMENT}


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


def merged_labels(owned: dict[str, str], user: dict[str, str]) -> dict[str, str]:
    """The user's labels (the RLJob's metadata.labels) added to `owned`, which always win.

    Owned keys come first in their fixed order, the user's follow sorted by key, so the output
    does not depend on the order the user wrote them in."""
    extra = {k: user[k] for k in sorted(user) if k not in owned and k not in OWNED_LABEL_KEYS}
    return {**owned, **extra}


def pod_labels(job: str, group: str, attempt: int) -> dict[str, str]:
    """Labels on the pods of one Ray group (head, train, rollout, critic or reward)."""
    component = COMPONENT_HEAD if group == GROUP_HEAD else COMPONENT_WORKER
    return {**labels(job, component, attempt), LABEL_GROUP: group}


def submitter_labels(job: str) -> dict[str, str]:
    """Labels on the pod KubeRay's submitter Job runs (`ray job submit` to the head's
    dashboard): the job's label, so the NetworkPolicy lets it in. No attempt label: the
    observer reads an attempt's pods for why its *Ray* pods do not come up."""
    return labels(job, COMPONENT_SUBMITTER)


def selector(job: str) -> dict[str, str]:
    """Every child of one RLJob, and every pod it runs: the Ray pods (KubeRay keeps a template's
    labels), the environment's and the submitter's. The operator's keys can't be set from the
    RLJob's own labels (merged_labels), so no other job's pod carries this one's value."""
    return {LABEL_JOB: job}


def longest_job_name() -> str:
    """The longest RLJob name the CRD admits, for length tests."""
    return "a" * MAX_NAME_LENGTH
