"""spec.code in the Ray pods: the user's modules (a ConfigMap's files, or a directory of a PVC)
mounted read-only at CODE_DIR in the head and every worker group, and CODE_DIR put first on the
Ray container's PYTHONPATH, so the driver and every Ray worker process import them.

Why every Ray pod, not only the head that imports them: the training ranks import
algorithm.lossFunction themselves (on the train pods), and Ray unpickles what it ships between
processes on whichever pod a task or actor lands (as the images install the whole
distribution for that reason); a mount costs nothing where it is not read. Not the pods of
environment.image: its class lives in its own image (a rule refuses code that only such a
class would read).

Why PYTHONPATH and not a path the trainer inserts itself: `ray start`, the job's driver and
the Ray workers all inherit the container's environment, so one variable reaches every Python
process on the pod with no code of kuberl's in between."""

from __future__ import annotations

from typing import Any

from kuberl_api.spec import CODE_DIR, CodeSpec

VOLUME_CODE = "code"
ENV_PYTHONPATH = "PYTHONPATH"


def code_volume(code: CodeSpec) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The volume and the Ray container's mount of spec.code, or None without a source."""
    mount: dict[str, Any] = {"name": VOLUME_CODE, "mountPath": CODE_DIR, "readOnly": True}
    if code.config_map is not None:
        return {"name": VOLUME_CODE, "configMap": {"name": code.config_map}}, mount
    if code.pvc is not None:
        if code.sub_path:
            mount["subPath"] = code.sub_path
        claim = {"claimName": code.pvc, "readOnly": True}
        return {"name": VOLUME_CODE, "persistentVolumeClaim": claim}, mount
    return None


def with_code_path(env: list[dict[str, Any]], code: CodeSpec) -> list[dict[str, Any]]:
    """`env` with CODE_DIR first on PYTHONPATH: prepended to the PYTHONPATH entry `env`
    already has (network.env's, on GPU pods), whose paths come after it, else a new entry.

    An image's own ENV PYTHONPATH cannot be kept: Kubernetes expands $(VAR) only from the
    container's earlier env entries, never from the image's, and a pod's entry replaces the
    image's. kuberl's images set none (their packages are installed in site-packages, which
    PYTHONPATH does not replace); an image that relies on one repeats it in network.env (GPU
    pods) or installs its packages instead (docs/agents.md)."""
    if code.source is None:
        return env
    for i, entry in enumerate(env):
        if entry["name"] == ENV_PYTHONPATH and entry.get("value"):
            return [*env[:i], {"name": ENV_PYTHONPATH, "value": f"{CODE_DIR}:{entry['value']}"},
                    *env[i + 1:]]
    return [*env, {"name": ENV_PYTHONPATH, "value": CODE_DIR}]
