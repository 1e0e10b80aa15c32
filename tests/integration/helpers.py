"""Test helpers: the operator subprocess, and playing kubectl, KubeRay and the trainer against
the API emulator.

A subprocess, not kopf in the test's loop: it is exactly what the Deployment runs (flags,
metrics server, liveness endpoint, login), and it can be SIGKILLed at any point, which is how
the restart-safety tests crash it. Timers are made short by flags.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import yaml

from tests.integration.emulator import Emulator, get, objects

NS = "default"
RLJOBS = "kuberl.dev/v1alpha1/rljobs"
RAYJOBS = "ray.io/v1/rayjobs"
RAYCLUSTERS = "ray.io/v1/rayclusters"
MERGE = {"Content-Type": "application/merge-patch+json"}
RESYNC = 0.5
HEAD_GRACE = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def eventually(predicate: Callable[[], Any], timeout: float = 10.0,
                     what: str | Callable[[], Any] = "") -> Any:
    """The predicate's first truthy result (it may return an awaitable), polled until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            detail = what() if callable(what) else what
            raise AssertionError(f"not within {timeout}s: {detail or predicate}")
        await asyncio.sleep(0.05)


class Operator:
    """The operator process. `start()` waits until it watches RLJobs and RayJobs; `kill()` is
    SIGKILL."""

    def __init__(self, emu: Emulator, tmp: Path, extra: list[str]) -> None:
        self.emu = emu
        self.tmp = tmp
        self.extra = extra
        self.proc: asyncio.subprocess.Process | None = None
        self.metrics_port = _free_port()
        self.health_port = _free_port()
        self.log = tmp / "operator.log"
        self.kubeconfig = tmp / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emu",
            "clusters": [{"name": "emu", "cluster": {"server": str(emu.url).rstrip("/")}}],
            "users": [{"name": "emu", "user": {}}],
            "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu"}}],
        }))

    async def start(self) -> None:
        before = self._watches()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1"}
        args = [sys.executable, "-m", "kuberl_operator", "-n", NS, "--no-scanning", "-v",
                "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port),
                "--health-port", str(self.health_port), "--resync-seconds", str(RESYNC),
                "--head-lost-grace-seconds", str(HEAD_GRACE), "--error-backoff-seconds", "0.2",
                *self.extra]
        with self.log.open("a") as log:
            log.write(f"\n===== start {' '.join(args[1:])}\n")
            self.proc = await asyncio.create_subprocess_exec(
                *args, env=env, stdout=log, stderr=asyncio.subprocess.STDOUT)

        def watching() -> bool:
            return all(n > b for n, b in zip(self._watches(), before, strict=True))
        try:
            await eventually(lambda: watching() or self._died(), timeout=20,
                             what="the operator watches RLJobs and RayJobs")
        except AssertionError as exc:
            # Killed, not left behind: the fixture that failed here never stops it, and it would
            # keep on retrying the closed emulator. Its log says how far it got.
            await self.kill()
            raise AssertionError(f"{exc}; the operator's log:\n{self.output()}") from None
        assert not self._died(), self.output()

    def _watches(self) -> tuple[int, int]:
        """Watch requests so far, of RLJobs and of RayJobs (a new operator makes one of each:
        then it hears of every change to either)."""
        watches = [r.resource for r in self.emu[kmock.action.WATCH]]
        return (sum(1 for r in watches if r == kmock.resource(RLJOBS)),
                sum(1 for r in watches if r == kmock.resource(RAYJOBS)))

    def _died(self) -> bool:
        return self.proc is not None and self.proc.returncode is not None

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                await self.kill()

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    async def metrics(self) -> str:
        async with aiohttp.ClientSession() as s, s.get(
                f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
            return await r.text()

    async def reconciles(self) -> float:
        """Passes that ended well so far (kuberl_operator_reconcile_total{result="success"})."""
        for line in (await self.metrics()).splitlines():
            if line.startswith('kuberl_operator_reconcile_total{result="success"}'):
                return float(line.split()[-1])
        return 0.0

    async def health(self) -> int:
        async with aiohttp.ClientSession() as s, s.get(
                f"http://127.0.0.1:{self.health_port}/healthz") as r:
            return r.status


# ---------------------------------------------------------------------------- API helpers

def manifest(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"path": "/models/qwen"}, "data": {"prompts": "/data/t.jsonl"},
                     **spec}}


def url(resource: str, name: str | None = None, sub: str | None = None) -> str:
    group_version, plural = resource.rsplit("/", 1)
    root = "/api" if group_version == "v1" else "/apis"
    out = f"{root}/{group_version}/namespaces/{NS}/{plural}"
    return out + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


async def create(emu: Emulator, resource: str, body: Mapping[str, Any]) -> dict[str, Any]:
    resp = await emu.post(url(resource), json=dict(body))
    assert resp.status in (200, 201), await resp.text()
    created: dict[str, Any] = await resp.json()
    return created


async def patch(emu: Emulator, resource: str, name: str, body: Mapping[str, Any],
                sub: str | None = None) -> None:
    resp = await emu.patch(url(resource, name, sub), json=dict(body), headers=MERGE)
    assert resp.status == 200, await resp.text()


async def delete(emu: Emulator, resource: str, name: str) -> None:
    resp = await emu.delete(url(resource, name))
    assert resp.status == 200, await resp.text()


def rljob(emu: Emulator, name: str) -> dict[str, Any] | None:
    return get(emu, RLJOBS, NS, name)


def status(emu: Emulator, name: str) -> dict[str, Any]:
    st: dict[str, Any] = (rljob(emu, name) or {}).get("status") or {}
    return st


def history(emu: Emulator, name: str) -> list[dict[str, Any]]:
    """Every stored version of the RLJob, oldest first; kept after it is deleted."""
    key = (kmock.resource(RLJOBS), NS, name)
    if key not in emu.objects:
        return []
    return [v.raw for v in emu.objects[key].history if v is not None]


def phases(emu: Emulator, name: str) -> list[str]:
    """The phases the RLJob went through, in order (a phase repeats when its status was
    patched again): a phase that lasted too short to be polled still shows here."""
    return [p for v in history(emu, name) if (p := (v.get("status") or {}).get("phase"))]


def condition(emu: Emulator, name: str, type_: str) -> dict[str, Any]:
    return next((c for c in status(emu, name).get("conditions") or [] if c["type"] == type_),
                {})


async def wait_phase(emu: Emulator, name: str, phase: str, timeout: float = 10) -> dict[str, Any]:
    st: dict[str, Any] = await eventually(
        lambda: status(emu, name).get("phase") == phase and status(emu, name),
        timeout=timeout, what=f"{name} phase {phase} (now {status(emu, name).get('phase')})")
    return st


def events(emu: Emulator, name: str) -> list[dict[str, Any]]:
    return [e for e in objects(emu, "v1/events", NS)
            if (e.get("involvedObject") or {}).get("name") == name]


def rayjobs(emu: Emulator) -> list[str]:
    return sorted(o["metadata"]["name"] for o in objects(emu, RAYJOBS, NS))


def now_iso(offset: float = 0) -> str:
    t = time.time() + offset
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


async def kuberay(emu: Emulator, rayjob: str, job_status: str, deployment: str,
                  cluster: str | None = None, started: float | None = None) -> None:
    """Play KubeRay: set a RayJob's status (and its RayCluster's, when named)."""
    st: dict[str, Any] = {"jobStatus": job_status, "jobDeploymentStatus": deployment}
    if cluster:
        st["rayClusterName"] = cluster
    if started is not None:
        st["rayJobInfo"] = {"startTime": now_iso(started)}
    await patch(emu, RAYJOBS, rayjob, {"status": st}, "status")


async def make_cluster(emu: Emulator, name: str, head_ready: bool = True,
                       since: float = 0) -> None:
    body = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": name, "namespace": NS}}
    if get(emu, RAYCLUSTERS, NS, name) is None:
        await create(emu, RAYCLUSTERS, body)
    await set_head(emu, name, head_ready, since)


async def set_head(emu: Emulator, name: str, ready: bool, since: float = 0) -> None:
    cond = {"type": "HeadPodReady", "status": "True" if ready else "False",
            "reason": "HeadPodRunningAndReady" if ready else "HeadPodNotFound",
            "lastTransitionTime": now_iso(since)}
    await patch(emu, RAYCLUSTERS, name, {"status": {
        "conditions": [cond], "readyWorkerReplicas": 1, "desiredWorkerReplicas": 1}}, "status")


async def heartbeat(emu: Emulator, name: str, offset: float = 0, step: int = 1) -> None:
    """Play the trainer: report progress."""
    await patch(emu, RLJOBS, name, {"status": {"progress": {
        "step": step, "totalSteps": 100, "lastHeartbeatTime": now_iso(offset)}}}, "status")
