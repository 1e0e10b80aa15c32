#!/usr/bin/env python3
"""A local Kubernetes control plane for kuberl's end-to-end tests (envtest + kind, from parts).

Runs, all on 127.0.0.1 with free ports, from binaries that ``e2e/build.sh`` builds once per
version into ``${XDG_CACHE_HOME:-~/.cache}/kuberl/e2e/``:

- etcd; kube-apiserver (RBAC + Node authorization, service-account issuer, default admission);
  kube-controller-manager (service-account credentials, token controller, garbage collector);
  kube-scheduler;
- kwok, the fake kubelet, with its stock stages (node-initialize, node-heartbeat-with-lease,
  pod-ready, pod-complete, pod-delete): scheduled pods become Running and Ready;
- fake nodes in three pools (see ``POOLS``): ``pool=train`` and ``pool=rollout`` with 8
  ``nvidia.com/gpu`` each, tainted, and an untainted ``pool=cpu`` for Ray heads;
- the KubeRay operator (webhooks off), as a ServiceAccount bound to KubeRay's own ClusterRole,
  after its CRDs.

Command line (stdlib only: any python3 >= 3.11 runs it)::

    python e2e/cluster.py build           # e2e/build.sh: the binaries, once per version
    python e2e/cluster.py up              # start; prints `export KUBECONFIG=... PATH=...`
    python e2e/cluster.py status          # what runs, on which ports, node pools
    python e2e/cluster.py down            # stop everything and remove the state dir

From Python (a session-scoped pytest fixture)::

    from e2e.cluster import Cluster       # or put e2e/ on sys.path
    cluster = Cluster.start(tmp_path_factory.mktemp("k8s"))
    try:
        yield cluster                     # cluster.kubeconfig, cluster.kubectl("get", "nodes")
    finally:
        cluster.stop()
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VERSIONS_FILE = HERE / "versions.env"
BUILD_SCRIPT = HERE / "build.sh"

CLUSTER_NAME = "kuberl-e2e"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service: first address of SERVICE_CIDR
POD_CIDR = "10.244.0.0/16"  # kwok hands pod IPs out of it (nothing routes them: fake pods)
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
KUBERAY_NAMESPACE = "kuberay-system"
KUBERAY_SA = "kuberay-operator"

# The fake node pools. Labels and taints follow the examples/ RLJobs: the training pool is picked
# by the GPU-feature-discovery label nvidia.com/gpu.product, the rollout pool by pool=rollout,
# and both GPU pools carry the usual nvidia.com/gpu taint; the rollout pool is also kept for
# inference by dedicated=rollout. Ray heads (no GPU) go to the untainted cpu pool.
GPU_LABELS = {
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.count": "8",
    "nvidia.com/gpu.memory": "81559",
    "node.kubernetes.io/instance-type": "p5.48xlarge",
}
GPU_CAPACITY = {
    "cpu": "192",
    "memory": "2000Gi",
    "pods": "110",
    "ephemeral-storage": "7Ti",
    "nvidia.com/gpu": "8",
    "rdma/rdma_shared_device_a": "1k",
}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@dataclass(frozen=True)
class Pool:
    name: str
    labels: Mapping[str, str]
    taints: Sequence[Mapping[str, str]]
    capacity: Mapping[str, str]


POOLS: dict[str, Pool] = {
    "train": Pool("train", {"pool": "train", **GPU_LABELS}, [GPU_TAINT], GPU_CAPACITY),
    "rollout": Pool(
        "rollout",
        {"pool": "rollout", **GPU_LABELS},
        [{"key": "dedicated", "value": "rollout", "effect": "NoSchedule"}, GPU_TAINT],
        GPU_CAPACITY,
    ),
    "cpu": Pool(
        "cpu",
        {"pool": "cpu", "node.kubernetes.io/instance-type": "m7i.16xlarge"},
        [],
        {"cpu": "64", "memory": "256Gi", "pods": "110", "ephemeral-storage": "1Ti"},
    ),
}
DEFAULT_NODES = {"train": 2, "rollout": 2, "cpu": 1}

# The startup order; `down` stops them in reverse.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok",
              "kuberay-operator")


class ClusterError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------
# Versions and binaries


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip().strip("'\"")
    return out


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

    def _dir(self, component: str, key: str) -> Path:
        return self.root / f"{component}-{self.versions[key]}"

    @property
    def dirs(self) -> dict[str, Path]:
        return {
            "etcd": self._dir("etcd", "ETCD_VERSION"),
            "kubernetes": self._dir("kubernetes", "KUBERNETES_VERSION"),
            "kwok": self._dir("kwok", "KWOK_VERSION"),
            "kuberay": self._dir("kuberay", "KUBERAY_VERSION"),
            "helm": self._dir("helm", "HELM_VERSION"),
            "prometheus": self._dir("prometheus", "PROMETHEUS_DEB_VERSION"),
        }

    def missing(self) -> list[str]:
        return [c for c, d in self.dirs.items() if not d.is_dir()]

    def path(self, name: str) -> Path:
        d = self.dirs
        return {
            "etcd": d["etcd"] / "etcd",
            "kube-apiserver": d["kubernetes"] / "kube-apiserver",
            "kube-controller-manager": d["kubernetes"] / "kube-controller-manager",
            "kube-scheduler": d["kubernetes"] / "kube-scheduler",
            "kubectl": d["kubernetes"] / "kubectl",
            "kwok": d["kwok"] / "kwok",
            "kuberay-operator": d["kuberay"] / "kuberay-operator",
            "helm": d["helm"] / "helm",
            "prometheus": d["prometheus"] / "prometheus",
        }[name]

    @property
    def kwok_stages(self) -> Path:
        return self.dirs["kwok"] / "stages"

    @property
    def kuberay_crds(self) -> list[Path]:
        return sorted((self.dirs["kuberay"] / "crds").glob("*.yaml"))

    @property
    def kuberay_role(self) -> Path:
        return self.dirs["kuberay"] / "rbac" / "role.yaml"


def binaries() -> Binaries:
    return Binaries(cache_root(), read_versions())


def build(components: Sequence[str] = (), *, quiet: bool = False) -> None:
    """Run e2e/build.sh for what is missing (a no-op when all of it is cached)."""
    bins = binaries()
    todo = list(components) or bins.missing()
    if not todo:
        return
    env = {**os.environ, "KUBERL_E2E_CACHE": str(bins.root)}
    subprocess.run(["bash", str(BUILD_SCRIPT), *todo], check=True, env=env,
                   stdout=subprocess.DEVNULL if quiet else None)


# --------------------------------------------------------------------------------------------
# Certificates (openssl CLI: present wherever Python is, unlike the `cryptography` package)


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"openssl {' '.join(args[:2])} failed: {proc.stderr.strip()}")


def _ec_cert(pki: Path, name: str, subject: str, usage: str, sans: str | None = None, *,
             ca: str = "ca") -> None:
    args = ["req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "3650",
            "-subj", subject, "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-addext", "basicConstraints=critical,CA:FALSE",
            "-addext", "keyUsage=critical,digitalSignature,keyEncipherment",
            "-addext", f"extendedKeyUsage={usage}"]
    if sans:
        args += ["-addext", f"subjectAltName={sans}"]
    _openssl(*args, cwd=pki)


def make_pki(pki: Path) -> None:
    """CA, apiserver serving cert, client certs (admin in system:masters; the controller-manager
    and scheduler as their built-in RBAC users), the service-account signing key pair, and the
    front-proxy CA and client cert of the aggregation layer."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
             "-subj", f"/CN={CLUSTER_NAME}-ca",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,digitalSignature,keyCertSign,cRLSign", cwd=pki)
    sans = ",".join(["IP:127.0.0.1", "IP:::1", f"IP:{SERVICE_IP}", "DNS:localhost",
                     "DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
                     "DNS:kubernetes.default.svc.cluster.local"])
    _ec_cert(pki, "apiserver", "/CN=kube-apiserver", "serverAuth", sans)
    _ec_cert(pki, "admin", "/O=system:masters/CN=kuberl-e2e-admin", "clientAuth")
    _ec_cert(pki, "controller-manager", "/CN=system:kube-controller-manager", "clientAuth")
    _ec_cert(pki, "scheduler", "/CN=system:kube-scheduler", "clientAuth")
    # The aggregation layer's front proxy: its own CA and the apiserver's client cert.
    _openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", "front-proxy-ca.key", "-out", "front-proxy-ca.crt",
             "-days", "3650", "-subj", f"/CN={CLUSTER_NAME}-front-proxy-ca",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,digitalSignature,keyCertSign,cRLSign", cwd=pki)
    _ec_cert(pki, "front-proxy-client", "/CN=front-proxy-client", "clientAuth",
             ca="front-proxy-ca")
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
             "-out", "sa.key", cwd=pki)
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    for key in pki.glob("*.key"):
        key.chmod(0o600)


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, server: str, ca: Path, user: str, *,
                     cert: Path | None = None, key: Path | None = None,
                     token: str | None = None) -> None:
    """A self-contained kubeconfig (certificates embedded, so it can be copied anywhere)."""
    if token is not None:
        creds = f"    token: {token}\n"
    else:
        assert cert is not None and key is not None
        creds = (f"    client-certificate-data: {_b64(cert)}\n"
                 f"    client-key-data: {_b64(key)}\n")
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: {CLUSTER_NAME}\n  cluster:\n    server: {server}\n"
        f"    certificate-authority-data: {_b64(ca)}\n"
        f"users:\n- name: {user}\n  user:\n{creds}"
        f"contexts:\n- name: {CLUSTER_NAME}\n  context:\n    cluster: {CLUSTER_NAME}\n"
        f"    user: {user}\n    namespace: default\n"
        f"current-context: {CLUSTER_NAME}\n")
    path.chmod(0o600)


# --------------------------------------------------------------------------------------------
# Processes


def terminate(proc: subprocess.Popen[bytes], grace: float = 10) -> None:
    """SIGTERM a child we started, SIGKILL it after `grace` s; wait for it either way."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held together while picked, so no duplicates)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _niceness() -> int:
    return int(os.environ.get("KUBERL_E2E_NICE", "19"))


def _set_pdeathsig() -> None:
    """In the child: die (SIGTERM) when the parent that started the cluster dies."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) is not running.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def _pid_runs(pid: int, binary: str) -> bool:
    """The pid is alive and still runs `binary` (not a recycled pid)."""
    if not _pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    # argv[0] is the path it was started with; compare names, so that a cache dir given
    # differently (a symlink, another XDG_CACHE_HOME) still finds it.
    return bool(cmdline) and Path(cmdline[0].decode(errors="replace")).name == Path(binary).name


# --------------------------------------------------------------------------------------------
# A minimal API client (admin client certificate); kubectl is used for YAML files.


class Api:
    def __init__(self, server: str, ca: Path, cert: Path, key: Path) -> None:
        self.server = server
        self._ctx = ssl.create_default_context(cafile=str(ca))
        self._ctx.load_cert_chain(str(cert), str(key))

    def request(self, method: str, path: str, body: Any = None, *,
                content_type: str = "application/json", timeout: float = 10.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method,
                                     headers={"Content-Type": content_type,
                                              "Accept": "application/json"})
        with urllib.request.urlopen(req, context=self._ctx, timeout=timeout) as resp:
            raw = resp.read()
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode()

    def get(self, path: str) -> Any:
        """The object, or None for a 404."""
        try:
            return self.request("GET", path)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def create(self, path: str, obj: Mapping[str, Any]) -> Any:
        """POST; an object that already exists is left as it is."""
        try:
            return self.request("POST", path, obj)
        except urllib.error.HTTPError as e:
            if e.code == 409:
                return None
            raise ClusterError(f"POST {path}: {e.code} {e.read().decode(errors='replace')}") from e

    def readyz(self) -> bool:
        try:
            return bool(self.request("GET", "/readyz", timeout=3) == "ok")
        except (OSError, urllib.error.URLError, ssl.SSLError):
            return False


def _http_ok(url: str, timeout: float = 3.0) -> bool:
    """GET url is 2xx (TLS not verified: for the components' self-signed health endpoints)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=timeout) as resp:
            return bool(200 <= resp.status < 300)
    except (OSError, urllib.error.URLError, ssl.SSLError):
        return False


# --------------------------------------------------------------------------------------------
# Node manifests


def node_manifest(pool: Pool, index: int) -> dict[str, Any]:
    name = f"kwok-{pool.name}-{index}"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_NODE_ANNOTATION[0]: KWOK_NODE_ANNOTATION[1]},
            "labels": {
                "type": "kwok",
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/os": "linux",
                "kubernetes.io/hostname": name,
                "topology.kubernetes.io/zone": "local-a",
                **pool.labels,
            },
        },
        "spec": {"taints": [dict(t) for t in pool.taints]},
        "status": {
            "capacity": dict(pool.capacity),
            "allocatable": dict(pool.capacity),
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": name}],
        },
    }


def _node_ready(node: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in node.get("status", {}).get("conditions", []))


# --------------------------------------------------------------------------------------------
# The cluster


@dataclass
class Cluster:
    """A running local control plane; `Cluster.start` makes one, `Cluster.attach` finds one."""

    state_dir: Path
    ports: dict[str, int]
    pids: dict[str, int]
    pgid: int
    versions: dict[str, str]
    timings: dict[str, float] = field(default_factory=dict)
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    # ---- paths and clients

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (system:masters)."""
        return self.state_dir / "admin.kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    @property
    def bin_dir(self) -> Path:
        """Links to kubectl, helm, kwok, etcd, ... of the pinned versions."""
        return self.state_dir / "bin"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def kubectl_path(self) -> Path:
        return binaries_for(self.versions).path("kubectl")

    @property
    def helm_path(self) -> Path:
        return binaries_for(self.versions).path("helm")

    @property
    def env(self) -> dict[str, str]:
        """Environment for tools run against this cluster (KUBECONFIG, PATH with bin_dir)."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig),
                "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}

    def api(self) -> Api:
        pki = self.state_dir / "pki"
        return Api(self.server, pki / "ca.crt", pki / "admin.crt", pki / "admin.key")

    def kubectl(self, *args: str, input: str | bytes | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run kubectl against the cluster as admin; stdout/stderr captured as text."""
        if isinstance(input, bytes):
            input = input.decode()
        proc = subprocess.run([str(self.kubectl_path), f"--kubeconfig={self.kubeconfig}", *args],
                              input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}): "
                               f"{proc.stderr.strip()}")
        return proc

    def add_nodes(self, pool: str, count: int, *, start_index: int | None = None,
                  wait: float = 60) -> list[str]:
        """Create `count` more kwok nodes in `pool` and wait until they are Ready."""
        api = self.api()
        if start_index is None:
            existing = api.get(f"/api/v1/nodes?labelSelector=pool%3D{pool}") or {"items": []}
            start_index = len(existing["items"])
        names = []
        for i in range(start_index, start_index + count):
            manifest = node_manifest(POOLS[pool], i)
            api.create("/api/v1/nodes", manifest)
            names.append(manifest["metadata"]["name"])
        _wait(f"nodes {names} Ready", wait,
              lambda: all(_node_ready(api.get(f"/api/v1/nodes/{n}") or {}) for n in names))
        return names

    # ---- lifecycle

    @classmethod
    def start(cls, state_dir: str | Path | None = None, *,
              nodes: Mapping[str, int] | None = None, build_missing: bool = True,
              crds: Sequence[str | Path] = (), timeout: float = 300,
              die_with_parent: bool = True,
              log: Callable[[str], None] | None = None) -> Cluster:
        """Start a fresh cluster in `state_dir` (default: the cache's run/ dir).

        Whatever a previous cluster left in `state_dir` is stopped and removed first. With
        `die_with_parent` the components get SIGTERM when the calling process dies, so a killed
        pytest run leaves nothing behind (the CLI's `up` turns it off: it must outlive `up`).
        `crds` are more CRD files or directories (e.g. the repo's crds/) to install before the
        controller-manager starts, so that its garbage collector watches them from the start.
        `log` is a callable taking progress lines (default: silent).
        """
        say = log or (lambda _msg: None)
        state = Path(state_dir) if state_dir is not None else default_state_dir()
        state = state.resolve()
        counts = {**DEFAULT_NODES, **(nodes or {})}
        unknown = set(counts) - set(POOLS)
        if unknown:
            raise ClusterError(f"unknown node pools {sorted(unknown)}; known: {sorted(POOLS)}")

        bins = binaries()
        if bins.missing():
            if not build_missing:
                raise ClusterError(f"not built: {bins.missing()}; run e2e/build.sh first")
            say(f"building {bins.missing()} (once per version; see e2e/README.md)")
            build()

        with contextlib.suppress(ClusterError):
            cls.attach(state).stop()
        if state.exists():
            shutil.rmtree(state)
        for sub in ("pki", "logs", "bin", "etcd"):
            (state / sub).mkdir(parents=True, exist_ok=True)
        state.chmod(0o700)

        names = ["etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok",
                 "kuberay-metrics", "kuberay-probe"]
        ports = dict(zip(names, free_ports(len(names)), strict=True))
        cluster = cls(state_dir=state, ports=ports, pids={}, pgid=0, versions=dict(bins.versions))
        try:
            cluster._boot(bins, counts, _crd_files(crds), timeout, die_with_parent, say)
        except BaseException:
            say(f"start failed; logs in {cluster.log_dir}")
            cluster._write_state()
            cluster.stop(remove_state=False)
            raise
        return cluster

    @classmethod
    def attach(cls, state_dir: str | Path | None = None) -> Cluster:
        """The cluster that `up` (or `start`) left running in `state_dir`."""
        state = Path(state_dir) if state_dir is not None else default_state_dir()
        f = state / "state.json"
        if not f.exists():
            raise ClusterError(f"no cluster in {state} (no state.json)")
        d = json.loads(f.read_text())
        return cls(state_dir=state.resolve(), ports=d["ports"], pids=d["pids"], pgid=d["pgid"],
                   versions=d["versions"], timings=d.get("timings", {}))

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @contextlib.contextmanager
    def paused(self, name: str) -> Iterator[None]:
        """Freeze one component (SIGSTOP) for the block, then let it go on (SIGCONT).

        The e2e tests pause the KubeRay operator to play the Ray dashboard's part: fake pods run
        no Ray, so KubeRay would overwrite any RayJob status a test writes (and fail the job 30 s
        after its submitter finishes). Frozen, it keeps its watches' state and catches up after."""
        if not self.running().get(name):
            raise ClusterError(f"{name} is not running")
        pid = self.pids[name]
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def running(self) -> dict[str, bool]:
        bins = binaries_for(self.versions)
        return {name: _pid_runs(pid, str(bins.path(name))) for name, pid in self.pids.items()}

    def stop(self, *, remove_state: bool = True, grace: float = 10) -> None:
        """Stop every component, clients first and etcd last (SIGTERM, then SIGKILL after
        `grace` s each); remove the state dir. In that order the whole cluster stops in about
        a second and a half; signalled all at once, kube-apiserver outlives etcd and hangs in
        its graceful shutdown until killed."""
        alive = {n: self.pids[n] for n, ok in self.running().items() if ok}
        for name in reversed(COMPONENTS):
            pid = alive.get(name)
            if pid is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while _pid_alive(pid) and time.monotonic() < deadline:
                for proc in self._procs.values():
                    proc.poll()  # reap our children, or they stay "alive" as zombies
                time.sleep(0.05)
            if _pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self._procs.values():
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
        self._procs.clear()
        if remove_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    # ---- boot sequence

    def _spawn(self, name: str, argv: list[str], die_with_parent: bool,
               env: Mapping[str, str] | None = None) -> None:
        logf = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        nice = _niceness()
        prefix = ["nice", "-n", str(nice)] if nice else []
        proc = subprocess.Popen(
            prefix + argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            cwd=self.state_dir, env={**os.environ, **(env or {})},
            process_group=self.pgid or 0,
            preexec_fn=_set_pdeathsig if die_with_parent else None)
        logf.close()
        if not self.pgid:
            self.pgid = proc.pid
        self._procs[name] = proc
        self.pids[name] = proc.pid
        self._write_state()

    def _check_alive(self, name: str) -> None:
        proc = self._procs.get(name)
        if proc is not None and proc.poll() is not None:
            lines = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
            tail = "\n".join(line[:400] for line in lines[-15:])
            raise ClusterError(f"{name} exited with {proc.returncode}; its log ends:\n{tail}")

    def _wait_for(self, name: str, what: str, timeout: float, ok: Callable[[], Any]) -> None:
        _wait(f"{name}: {what}", timeout, ok, check=lambda: self._check_alive(name))

    def _write_state(self) -> None:
        state = {"ports": self.ports, "pids": self.pids, "pgid": self.pgid,
                 "versions": self.versions, "timings": self.timings,
                 "kubeconfig": str(self.kubeconfig), "server": self.server}
        tmp = self.state_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_dir / "state.json")

    def _boot(self, bins: Binaries, counts: Mapping[str, int], extra_crds: Sequence[Path],
              timeout: float,
              die_with_parent: bool, say: Callable[[str], None]) -> None:
        t_start = time.monotonic()
        deadline = t_start + timeout
        s, p = self.state_dir, self.ports
        pki = s / "pki"

        def left() -> float:
            return max(1.0, deadline - time.monotonic())

        def b(name: str) -> str:
            return str(bins.path(name))

        def mark(stage: str, t0: float) -> float:
            now = time.monotonic()
            self.timings[stage] = round(now - t0, 2)
            say(f"{stage}: {now - t0:.1f}s")
            return now

        t = time.monotonic()
        make_pki(pki)
        for tool in ("kubectl", "helm", "kwok", "etcd", "kube-apiserver",
                     "kube-controller-manager", "kube-scheduler", "kuberay-operator"):
            (self.bin_dir / tool).symlink_to(bins.path(tool))
        t = mark("pki", t)

        # etcd
        etcd_url = f"http://127.0.0.1:{p['etcd']}"
        peer_url = f"http://127.0.0.1:{p['etcd-peer']}"
        self._spawn("etcd", [
            b("etcd"), f"--name={CLUSTER_NAME}", f"--data-dir={s / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={CLUSTER_NAME}={peer_url}", "--initial-cluster-state=new",
            "--unsafe-no-fsync=true", "--log-level=warn"], die_with_parent)
        self._wait_for("etcd", "/health", left(), lambda: _http_ok(f"{etcd_url}/health"))
        t = mark("etcd", t)

        # kube-apiserver
        self._spawn("kube-apiserver", [
            b("kube-apiserver"), "--advertise-address=127.0.0.1", "--bind-address=127.0.0.1",
            f"--secure-port={p['apiserver']}", f"--etcd-servers={etcd_url}",
            f"--cert-dir={pki}", f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--enable-admission-plugins=NodeRestriction",  # on top of the default set
            f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            # 1.37's endpoint reconciler refuses a loopback advertise address: no endpoints
            # for the `kubernetes` Service (nothing in this cluster runs code that would use it).
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true", "--profiling=false", "--v=1"], die_with_parent)
        api = self.api()
        self._wait_for("kube-apiserver", "/readyz", left(), api.readyz)
        write_kubeconfig(self.kubeconfig, self.server, pki / "ca.crt", "kuberl-e2e-admin",
                         cert=pki / "admin.crt", key=pki / "admin.key")
        for who in ("controller-manager", "scheduler"):
            write_kubeconfig(s / f"{who}.kubeconfig", self.server, pki / "ca.crt",
                             f"system:kube-{who}", cert=pki / f"{who}.crt", key=pki / f"{who}.key")
        t = mark("kube-apiserver", t)

        # kube-scheduler and kwok (with the stock stages, managing the nodes annotated as fake)
        sched_cfg = s / "scheduler.kubeconfig"
        self._spawn("kube-scheduler", [
            b("kube-scheduler"), f"--kubeconfig={sched_cfg}",
            f"--authentication-kubeconfig={sched_cfg}", f"--authorization-kubeconfig={sched_cfg}",
            "--bind-address=127.0.0.1", f"--secure-port={p['scheduler']}",
            f"--cert-dir={pki / 'scheduler-serving'}",
            "--leader-elect=false", "--profiling=false", "--v=1"], die_with_parent)
        stages = bins.kwok_stages
        stage_files = [stages / "node/fast/node-initialize.yaml",
                       stages / "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
                       stages / "pod/fast/pod-ready.yaml", stages / "pod/fast/pod-complete.yaml",
                       stages / "pod/fast/pod-delete.yaml"]
        self._spawn("kwok", [
            b("kwok"), f"--kubeconfig={self.kubeconfig}",
            *[f"--config={f}" for f in stage_files],
            "--manage-nodes-with-annotation-selector="
            f"{KWOK_NODE_ANNOTATION[0]}={KWOK_NODE_ANNOTATION[1]}",
            "--node-lease-duration-seconds=40", f"--cidr={POD_CIDR}", "--node-ip=127.0.0.1",
            f"--server-address=127.0.0.1:{p['kwok']}"], die_with_parent)

        # CRDs (KubeRay's and any given) before the controller-manager: its garbage collector
        # watches the resources that discovery shows at its start, and picks up later ones only
        # on its 30 s discovery resync (until then, deleting a custom resource leaves its
        # dependents behind for up to 30 s).
        crd_files = [*bins.kuberay_crds, *extra_crds]
        self.kubectl("apply", "--server-side", "--force-conflicts",
                     *[f"--filename={c}" for c in crd_files], timeout=left())
        self.kubectl("wait", "--for=condition=Established", f"--timeout={int(left())}s",
                     "crd", "--all", timeout=left())
        t = mark("crds", t)

        kcm_cfg = s / "controller-manager.kubeconfig"
        self._spawn("kube-controller-manager", [
            b("kube-controller-manager"), f"--kubeconfig={kcm_cfg}",
            f"--authentication-kubeconfig={kcm_cfg}", f"--authorization-kubeconfig={kcm_cfg}",
            "--bind-address=127.0.0.1", f"--secure-port={p['controller-manager']}",
            f"--cert-dir={pki / 'controller-manager-serving'}",
            "--leader-elect=false", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", f"--cluster-name={CLUSTER_NAME}",
            "--profiling=false", "--v=1"], die_with_parent)

        # The KubeRay operator runs as a ServiceAccount bound to its own ClusterRole, and
        # authenticates with a legacy token Secret (filled by the controller-manager's token
        # controller once it runs; unlike a TokenRequest token, it doesn't expire).
        self.kubectl("apply", "--server-side", f"--filename={bins.kuberay_role}", timeout=left())
        ns = KUBERAY_NAMESPACE
        api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                          "metadata": {"name": ns}})
        api.create(f"/api/v1/namespaces/{ns}/serviceaccounts",
                   {"apiVersion": "v1", "kind": "ServiceAccount",
                    "metadata": {"name": KUBERAY_SA, "namespace": ns}})
        api.create("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "kuberay-operator"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "kuberay-operator"},
            "subjects": [{"kind": "ServiceAccount", "name": KUBERAY_SA, "namespace": ns}]})
        api.create(f"/api/v1/namespaces/{ns}/secrets", {
            "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
            "metadata": {"name": f"{KUBERAY_SA}-token", "namespace": ns,
                         "annotations": {"kubernetes.io/service-account.name": KUBERAY_SA}}})

        # Nodes (kwok makes them Ready meanwhile)
        names = []
        for pool, count in counts.items():
            for i in range(count):
                manifest = node_manifest(POOLS[pool], i)
                api.create("/api/v1/nodes", manifest)
                names.append(manifest["metadata"]["name"])

        self._wait_for("kube-scheduler", "/healthz", left(),
                       lambda: _http_ok(f"https://127.0.0.1:{p['scheduler']}/healthz"))
        self._wait_for("kwok", f"{len(names)} nodes Ready", left(),
                       lambda: all(_node_ready(api.get(f"/api/v1/nodes/{n}") or {})
                                   for n in names))
        self._wait_for("kube-controller-manager", "/healthz", left(),
                       lambda: _http_ok(f"https://127.0.0.1:{p['controller-manager']}/healthz"))
        # The service-account controller made `default` (pods can't be admitted without it).
        self._wait_for("kube-controller-manager", "ServiceAccount default/default", left(),
                       lambda: api.get("/api/v1/namespaces/default/serviceaccounts/default"))
        t = mark("controller-manager, scheduler, kwok nodes", t)

        # The KubeRay operator
        secret_path = f"/api/v1/namespaces/{ns}/secrets/{KUBERAY_SA}-token"
        self._wait_for("kube-controller-manager", "the kuberay-operator token", left(),
                       lambda: (api.get(secret_path) or {}).get("data", {}).get("token"))
        token = base64.b64decode(api.get(secret_path)["data"]["token"]).decode()
        kuberay_cfg = s / "kuberay-operator.kubeconfig"
        write_kubeconfig(kuberay_cfg, self.server, pki / "ca.crt",
                         f"system:serviceaccount:{ns}:{KUBERAY_SA}", token=token)
        self._spawn("kuberay-operator", [
            b("kuberay-operator"), f"--metrics-addr=127.0.0.1:{p['kuberay-metrics']}",
            f"--health-probe-bind-address=127.0.0.1:{p['kuberay-probe']}",
            "--enable-leader-election=false", "--log-stdout-encoder=console"],
            die_with_parent, env={"KUBECONFIG": str(kuberay_cfg)})
        self._wait_for("kuberay-operator", "/readyz", left(),
                       lambda: _http_ok(f"http://127.0.0.1:{p['kuberay-probe']}/readyz"))
        t = mark("kuberay", t)
        self.timings["total"] = round(time.monotonic() - t_start, 2)
        self._write_state()

    # ---- reporting

    def describe(self) -> str:
        running = self.running()
        health = {
            "etcd": f"http://127.0.0.1:{self.ports['etcd']}/health",
            "kube-apiserver": f"{self.server}/livez",
            "kube-controller-manager": f"https://127.0.0.1:{self.ports['controller-manager']}/healthz",
            "kube-scheduler": f"https://127.0.0.1:{self.ports['scheduler']}/healthz",
            "kwok": f"http://127.0.0.1:{self.ports['kwok']}/healthz",
            "kuberay-operator": f"http://127.0.0.1:{self.ports['kuberay-probe']}/readyz",
        }
        lines = [f"state dir: {self.state_dir}", f"kubeconfig: {self.kubeconfig}",
                 "versions: " + ", ".join(f"{k}={v}" for k, v in sorted(self.versions.items())),
                 "", f"{'component':<26}{'pid':>8}  {'state':<8}{'health':<8}endpoint"]
        for name in COMPONENTS:
            pid = self.pids.get(name)
            up = running.get(name, False)
            healthy = "-"
            if up and name in health:
                healthy = "ok" if (self.api().readyz() if name == "kube-apiserver"
                                   else _http_ok(health[name])) else "FAIL"
            lines.append(f"{name:<26}{pid or '-':>8}  {'running' if up else 'down':<8}"
                         f"{healthy:<8}{health.get(name, '')}")
        if running.get("kube-apiserver"):
            with contextlib.suppress(Exception):
                nodes = self.api().get("/api/v1/nodes")["items"]
                lines += ["", f"{'node':<20}{'pool':<10}{'ready':<7}{'gpu':>4}  taints"]
                for n in nodes:
                    taints = ",".join(f"{t['key']}={t.get('value', '')}:{t['effect']}"
                                      for t in n["spec"].get("taints", []))
                    gpu = n["status"].get("allocatable", {}).get("nvidia.com/gpu", "0")
                    lines.append(f"{n['metadata']['name']:<20}"
                                 f"{n['metadata']['labels'].get('pool', '-'):<10}"
                                 f"{_node_ready(n)!s:<7}{gpu:>4}  {taints or '-'}")
        return "\n".join(lines)


def _crd_files(paths: Sequence[str | Path]) -> list[Path]:
    out: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser().resolve()
        if path.is_dir():
            out += sorted(path.glob("*.yaml")) + sorted(path.glob("*.yml"))
        elif path.is_file():
            out.append(path)
        else:
            raise ClusterError(f"no CRD file or directory {path}")
    return out


def binaries_for(versions: Mapping[str, str]) -> Binaries:
    return Binaries(cache_root(), versions)


def _wait(what: str, timeout: float, ok: Callable[[], Any],
          check: Callable[[], None] | None = None, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        try:
            if ok():
                return
        except (OSError, urllib.error.URLError, ssl.SSLError, ValueError, KeyError, TypeError):
            pass
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# --------------------------------------------------------------------------------------------
# Command line


def _exports(c: Cluster) -> str:
    return f"export KUBECONFIG={c.kubeconfig}\nexport PATH={c.bin_dir}:$PATH"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e/cluster.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_build = sub.add_parser("build", help="build the binaries that are missing (e2e/build.sh)")
    p_build.add_argument("components", nargs="*")
    p_up = sub.add_parser("up", help="start a cluster (replacing one left in the state dir)")
    p_down = sub.add_parser("down", help="stop the cluster and remove its state dir")
    p_status = sub.add_parser("status", help="what runs, ports, health, nodes")
    p_env = sub.add_parser("env", help="print the export lines for a running cluster")
    for p in (p_up, p_down, p_status, p_env):
        p.add_argument("--state-dir", type=Path, default=None,
                       help=f"default: {default_state_dir()}")
    for pool, n in DEFAULT_NODES.items():
        p_up.add_argument(f"--{pool}-nodes", type=int, default=n, help=f"default {n}")
    p_up.add_argument("--crds", type=Path, action="append", default=[], metavar="PATH",
                      help="more CRD files or directories to install (repeatable), e.g. crds/")
    p_up.add_argument("--timeout", type=float, default=300)
    p_up.add_argument("--no-build", action="store_true", help="fail instead of building")
    p_down.add_argument("--keep-state", action="store_true", help="keep logs and data")
    args = parser.parse_args(argv)

    def say(msg: str) -> None:
        print(f"[cluster.py] {msg}", file=sys.stderr, flush=True)

    if args.cmd == "build":
        build(args.components)
        return 0
    if args.cmd == "up":
        counts = {pool: getattr(args, f"{pool}_nodes") for pool in DEFAULT_NODES}
        c = Cluster.start(args.state_dir, nodes=counts, build_missing=not args.no_build,
                          crds=args.crds,
                          timeout=args.timeout, die_with_parent=False, log=say)
        say(f"up in {c.timings['total']:.1f}s; logs in {c.log_dir}")
        print(_exports(c))
        return 0
    try:
        c = Cluster.attach(args.state_dir)
    except ClusterError as e:
        say(str(e))
        return 0 if args.cmd == "down" else 1
    if args.cmd == "down":
        c.stop(remove_state=not args.keep_state)
        say("down")
    elif args.cmd == "status":
        print(c.describe())
        return 0 if all(c.running().values()) else 1
    elif args.cmd == "env":
        print(_exports(c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
