"""Versions (e2e/versions.env) and where e2e/build.sh caches each component's binaries."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

E2E = Path(__file__).resolve().parent.parent
VERSIONS_FILE = E2E / "versions.env"
BUILD_SCRIPT = E2E / "build.sh"

# Cache directory name -> the versions.env key of its version.
BUILDS = {
    "etcd": "ETCD_VERSION",
    "kubernetes": "KUBERNETES_VERSION",
    "kwok": "KWOK_VERSION",
    "kuberay": "KUBERAY_VERSION",
    "kueue": "KUEUE_VERSION",
    "helm": "HELM_VERSION",
    "prometheus": "PROMETHEUS_DEB_VERSION",
}
# Binary -> the cache directory that holds it.
BINARIES = {
    "etcd": "etcd",
    "kube-apiserver": "kubernetes",
    "kube-controller-manager": "kubernetes",
    "kube-scheduler": "kubernetes",
    "kubectl": "kubernetes",
    "kwok": "kwok",
    "kuberay-operator": "kuberay",
    "kueue": "kueue",
    "helm": "helm",
    "prometheus": "prometheus",
}


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """versions.env, with KUBERAY_VERSION set to the KubeRay this run uses (see kuberay_pick)."""
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip().strip("'\"")
    out["KUBERAY_VERSION"] = kuberay_pick(out, os.environ.get(KUBERAY_PICK, ""))
    return out


# KUBERL_E2E_KUBERAY=newest (or an exact version) runs the local cluster on that KubeRay rather
# than the oldest supported one; e2e/build.sh reads the same variable.
KUBERAY_PICK = "KUBERL_E2E_KUBERAY"


def kuberay_pick(versions: Mapping[str, str], pick: str) -> str:
    if pick == "newest":
        return versions["KUBERAY_NEWEST_VERSION"]
    return pick or versions["KUBERAY_VERSION"]


def cache_root() -> Path:
    if os.environ.get("KUBERL_E2E_CACHE"):
        return Path(os.environ["KUBERL_E2E_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kuberl" / "e2e"


def default_state_dir() -> Path:
    return cache_root() / "run"


@dataclass(frozen=True)
class Binaries:
    """Where e2e/build.sh put each component of these versions."""

    root: Path
    versions: Mapping[str, str]

    @property
    def dirs(self) -> dict[str, Path]:
        # A state.json from before a component existed lacks its version: that one is absent.
        return {c: self.root / f"{c}-{self.versions[k]}" for c, k in BUILDS.items()
                if k in self.versions}

    def missing(self) -> list[str]:
        return [c for c in BUILDS if c not in self.dirs or not self.dirs[c].is_dir()]

    def path(self, name: str) -> Path:
        return self.dirs[BINARIES[name]] / name

    @property
    def kwok_stages(self) -> Path:
        return self.dirs["kwok"] / "stages"

    @property
    def kuberay_crds(self) -> list[Path]:
        return sorted((self.dirs["kuberay"] / "crds").glob("*.yaml"))

    @property
    def kuberay_role(self) -> Path:
        return self.dirs["kuberay"] / "rbac" / "role.yaml"

    @property
    def kueue_crds(self) -> list[Path]:
        return sorted((self.dirs["kueue"] / "crds").glob("*.yaml"))

    @property
    def kueue_rbac(self) -> list[Path]:
        return sorted((self.dirs["kueue"] / "rbac").glob("*.yaml"))

    @property
    def kueue_webhooks(self) -> Path:
        return self.dirs["kueue"] / "webhook" / "manifests.yaml"


def binaries() -> Binaries:
    return Binaries(cache_root(), read_versions())


def binaries_for(versions: Mapping[str, str]) -> Binaries:
    return Binaries(cache_root(), versions)


def build(components: Sequence[str] = (), *, quiet: bool = False) -> None:
    """Run e2e/build.sh for what is missing (a no-op when all of it is cached)."""
    bins = binaries()
    todo = list(components) or bins.missing()
    if not todo:
        return
    env = {**os.environ, "KUBERL_E2E_CACHE": str(bins.root)}
    subprocess.run(["bash", str(BUILD_SCRIPT), *todo], check=True, env=env,
                   stdout=subprocess.DEVNULL if quiet else None)
