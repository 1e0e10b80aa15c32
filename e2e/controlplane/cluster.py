"""The cluster: its state directory, clients, and the boot sequence that starts the components
(one module each, in this package) in order."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import apiserver, controller_manager, etcd, kuberay, kueue, kwok, scheduler
from .api import Api
from .base import ClusterError, Component, http_ok, wait
from .boot import Boot
from .pki import make_pki
from .procs import free_ports, niceness, pid_alive, pid_runs, set_pdeathsig
from .versions import Binaries, binaries, binaries_for, build, default_state_dir

# The startup order; `stop` stops them in reverse (clients first, etcd last).
ORDER: tuple[Component, ...] = (
    etcd.COMPONENT, apiserver.COMPONENT, controller_manager.COMPONENT, scheduler.COMPONENT,
    kwok.COMPONENT, kuberay.COMPONENT, kueue.COMPONENT)
COMPONENTS = tuple(c.name for c in ORDER)
# Started by every cluster (Kueue only on request).
BASE = tuple(c for c in ORDER if c is not kueue.COMPONENT)
LINKED_TOOLS = ("kubectl", "helm", "kwok", "etcd", "kube-apiserver", "kube-controller-manager",
                "kube-scheduler", "kuberay-operator")


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
        return kwok.add_nodes(self.api(), pool, count, start_index, wait)

    # ---- lifecycle

    @classmethod
    def start(cls, state_dir: str | Path | None = None, *,
              nodes: Mapping[str, int] | None = None, build_missing: bool = True,
              crds: Sequence[str | Path] = (), kueue: bool = False, timeout: float = 300,
              die_with_parent: bool = True,
              log: Callable[[str], None] | None = None) -> Cluster:
        """Start a fresh cluster in `state_dir` (default: the cache's run/ dir).

        Whatever a previous cluster left in `state_dir` is stopped and removed first. With
        `die_with_parent` the components get SIGTERM when the calling process dies, so a killed
        pytest run leaves nothing behind (the CLI's `up` turns it off: it must outlive `up`).
        `crds` are more CRD files or directories (e.g. the repo's crds/) to install before the
        controller-manager starts, so that its garbage collector watches them from the start.
        `kueue` also starts Kueue (its CRDs go in with the others; see `start_kueue`).
        `log` is a callable taking progress lines (default: silent).
        """
        say = log or (lambda _msg: None)
        state = (Path(state_dir) if state_dir is not None else default_state_dir()).resolve()
        counts = {**kwok.DEFAULT_NODES, **(nodes or {})}
        unknown = set(counts) - set(kwok.POOLS)
        if unknown:
            raise ClusterError(f"unknown node pools {sorted(unknown)}; known: "
                               f"{sorted(kwok.POOLS)}")
        bins = _ensure_built(build_missing, say)
        cls._fresh_state_dir(state)
        names = [port for c in BASE for port in c.ports]
        ports = dict(zip(names, free_ports(len(names)), strict=True))
        cluster = cls(state_dir=state, ports=ports, pids={}, pgid=0, versions=dict(bins.versions))
        boot = Boot(cluster, bins, time.monotonic() + timeout, die_with_parent, say)
        try:
            cluster._boot(boot, counts, _crd_files(crds), kueue)
        except BaseException:
            say(f"start failed; logs in {cluster.log_dir}")
            cluster._write_state()
            cluster.stop(remove_state=False)
            raise
        return cluster

    @classmethod
    def _fresh_state_dir(cls, state: Path) -> None:
        with contextlib.suppress(ClusterError):
            cls.attach(state).stop()
        if state.exists():
            shutil.rmtree(state)
        for sub in ("pki", "logs", "bin", "etcd"):
            (state / sub).mkdir(parents=True, exist_ok=True)
        state.chmod(0o700)

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
        return {name: pid_runs(pid, str(bins.path(name))) for name, pid in self.pids.items()}

    def stop(self, *, remove_state: bool = True, grace: float = 10) -> None:
        """Stop every component, clients first and etcd last (SIGTERM, then SIGKILL after
        `grace` s each); remove the state dir. In that order the whole cluster stops in about
        a second and a half; signalled all at once, kube-apiserver outlives etcd and hangs in
        its graceful shutdown until killed."""
        alive = {n: self.pids[n] for n, ok in self.running().items() if ok}
        for name in reversed(COMPONENTS):
            if name in alive:
                self._stop_pid(alive[name], grace)
        for proc in self._procs.values():
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
        self._procs.clear()
        if remove_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def _stop_pid(self, pid: int, grace: float) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while pid_alive(pid) and time.monotonic() < deadline:
            for proc in self._procs.values():
                proc.poll()  # reap our children, or they stay "alive" as zombies
            time.sleep(0.05)
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    # ---- Kueue (optional)

    def start_kueue(self, *, timeout: float = 180, die_with_parent: bool = True,
                    log: Callable[[str], None] | None = None) -> None:
        """Start Kueue on this running cluster (a no-op if it runs): its CRDs, ClusterRole,
        ServiceAccount, manager and webhooks (see kueue.py). CRDs installed now, after the
        controller-manager started, are garbage-collected only after its next discovery resync
        (up to 30 s): a Workload outlives its deleted RayJob that long. `Cluster.start(kueue=
        True)` installs them before, as `up --kueue` does."""
        if self.running().get("kueue"):
            return
        bins = _ensure_built(True, log or (lambda _msg: None))
        boot = Boot(self, bins, time.monotonic() + timeout, die_with_parent,
                    log or (lambda _msg: None))
        self._add_ports(kueue.COMPONENT)
        kueue.install_crds(boot)
        kueue.prepare(boot)
        kueue.start(boot)
        boot.mark("kueue")
        self._write_state()

    def stop_kueue(self) -> None:
        """Stop Kueue and remove its webhook configurations (which would refuse every RayJob
        with Kueue gone); its CRDs and objects stay."""
        kueue.unregister_webhooks(self)
        if self.running().get("kueue"):
            self._stop_pid(self.pids["kueue"], 10)
        self.pids.pop("kueue", None)
        self._procs.pop("kueue", None)
        self._write_state()

    # ---- boot sequence

    def _spawn(self, name: str, argv: list[str], die_with_parent: bool,
               env: Mapping[str, str] | None = None) -> None:
        logf = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        nice = niceness()
        prefix = ["nice", "-n", str(nice)] if nice else []
        # Join the cluster's process group if we started it; an attached cluster's group may
        # belong to another session, which setpgid refuses.
        group = self.pgid if self._procs else 0
        proc = subprocess.Popen(
            prefix + argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            cwd=self.state_dir, env={**os.environ, **(env or {})}, process_group=group,
            preexec_fn=set_pdeathsig if die_with_parent else None)
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
        wait(f"{name}: {what}", timeout, ok, check=lambda: self._check_alive(name))

    def _write_state(self) -> None:
        state = {"ports": self.ports, "pids": self.pids, "pgid": self.pgid,
                 "versions": self.versions, "timings": self.timings,
                 "kubeconfig": str(self.kubeconfig), "server": self.server}
        tmp = self.state_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_dir / "state.json")

    def _boot(self, boot: Boot, counts: Mapping[str, int], extra_crds: Sequence[Path],
              with_kueue: bool) -> None:
        t_start = time.monotonic()
        make_pki(self.state_dir / "pki")
        for tool in LINKED_TOOLS:
            (self.bin_dir / tool).symlink_to(boot.bins.path(tool))
        boot.mark("pki")
        etcd.start(boot)
        boot.mark("etcd")
        apiserver.start(boot)
        boot.mark("kube-apiserver")
        scheduler.spawn(boot)
        kwok.spawn(boot)
        # CRDs (KubeRay's, Kueue's, any given) before the controller-manager: its garbage
        # collector watches the resources that discovery shows at its start, and picks up later
        # ones only on its 30 s discovery resync (until then, deleting a custom resource leaves
        # its dependents behind for up to 30 s).
        kueue_crds = boot.bins.kueue_crds if with_kueue else []
        self._install_crds(boot, [*boot.bins.kuberay_crds, *kueue_crds, *extra_crds])
        boot.mark("crds")
        controller_manager.spawn(boot)
        kuberay.prepare(boot)
        api = self.api()
        names = [n for pool, count in counts.items()
                 for n in kwok.create_nodes(api, pool, range(count))]
        scheduler.wait(boot)
        kwok.wait_ready(boot, names)
        controller_manager.wait(boot)
        boot.mark("controller-manager, scheduler, kwok nodes")
        kuberay.start(boot)
        boot.mark("kuberay")
        if with_kueue:
            self._add_ports(kueue.COMPONENT)
            kueue.prepare(boot)
            kueue.start(boot)
            boot.mark("kueue")
        self.timings["total"] = round(time.monotonic() - t_start, 2)
        self._write_state()

    def _add_ports(self, component: Component) -> None:
        self.ports.update(zip(component.ports, free_ports(len(component.ports)), strict=True))

    def _install_crds(self, boot: Boot, files: Sequence[Path]) -> None:
        boot.apply(*files)
        self.kubectl("wait", "--for=condition=Established", f"--timeout={int(boot.left())}s",
                     "crd", "--all", timeout=boot.left())

    # ---- reporting

    def describe(self) -> str:
        running = self.running()
        health = {c.name: c.health(self.ports) for c in ORDER
                  if c.health is not None and all(p in self.ports for p in c.ports)}
        lines = [f"state dir: {self.state_dir}", f"kubeconfig: {self.kubeconfig}",
                 "versions: " + ", ".join(f"{k}={v}" for k, v in sorted(self.versions.items())),
                 "", f"{'component':<26}{'pid':>8}  {'state':<8}{'health':<8}endpoint"]
        for name in COMPONENTS:
            if name == "kueue" and name not in self.pids:
                continue  # optional, not started
            pid = self.pids.get(name)
            up = running.get(name, False)
            healthy = "-"
            if up and name in health:
                healthy = "ok" if (self.api().readyz() if name == "kube-apiserver"
                                   else http_ok(health[name])) else "FAIL"
            lines.append(f"{name:<26}{pid or '-':>8}  {'running' if up else 'down':<8}"
                         f"{healthy:<8}{health.get(name, '')}")
        if running.get("kube-apiserver"):
            with contextlib.suppress(Exception):
                lines += self._describe_nodes()
        return "\n".join(lines)

    def _describe_nodes(self) -> list[str]:
        nodes = self.api().get("/api/v1/nodes")["items"]
        lines = ["", f"{'node':<20}{'pool':<10}{'ready':<7}{'gpu':>4}  taints"]
        for n in nodes:
            taints = ",".join(f"{t['key']}={t.get('value', '')}:{t['effect']}"
                              for t in n["spec"].get("taints", []))
            gpu = n["status"].get("allocatable", {}).get("nvidia.com/gpu", "0")
            lines.append(f"{n['metadata']['name']:<20}"
                         f"{n['metadata']['labels'].get('pool', '-'):<10}"
                         f"{kwok.node_ready(n)!s:<7}{gpu:>4}  {taints or '-'}")
        return lines


def _ensure_built(build_missing: bool, say: Callable[[str], None]) -> Binaries:
    bins = binaries()
    if bins.missing():
        if not build_missing:
            raise ClusterError(f"not built: {bins.missing()}; run e2e/build.sh first")
        say(f"building {bins.missing()} (once per version; see e2e/README.md)")
        build()
    return binaries()


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
