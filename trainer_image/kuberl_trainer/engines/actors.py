"""The engine actors: each runs one engine HTTP server (SGLang, or the reference engine) as a
child process on its pod and reports the URL; the group starts, restarts and stops them.

No torch here: an engine actor's own start-up is on every run's critical path (the engines
must be up before the first step), and it only launches a process (ray_actors).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import IO, Any

import ray

from kuberl_api import spec_from_driver
from kuberl_api.spec import RLJobSpec
from kuberl_trainer.engines.client import engine_api_key
from kuberl_trainer.engines.command import (
    api_key_config,
    engine_command,
    reward_engine_command,
)
from kuberl_trainer.placement import Layout, colocated_engine_devices, cpu_sharing
from kuberl_trainer.ray_actors import (
    distinct_free_ports,
    log_to_file,
    node_ip,
    placed,
    torch_threads,
)
from kuberl_wire.protocol import ENGINE_SECRET_ENV

ENGINE_LOG_TAIL_LINES = 200  # kept by an engine actor (EngineServer.log_tail)
REDACTED = b"<engine API key>"  # what the server's output shows in place of the key
# Where SGLang's --config file with the key is written: memory (tmpfs), not disk, when the
# machine has it (Linux pods and hosts do)
SECRETS_DIR = "/dev/shm"


def write_api_key_config(api_key: str) -> Path:
    """SGLang's --config file holding the engines' API key: mode 0600 in a fresh 0700
    directory (mkdtemp), on SECRETS_DIR when there is one. The caller removes its directory."""
    where = SECRETS_DIR if os.access(SECRETS_DIR, os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="kuberl-engine-", dir=where)) / "api-key.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(api_key_config(api_key))
    return path


class EngineServer:
    """Runs one engine HTTP server as a child process of this actor (on the actor's pod): the
    whole engine, or node `node_rank` of an engine spanning `spec.engine_nodes` nodes.
    `log_file`: where the actor's and the server's output go (see log_to_file). `role`:
    "rollout" (the policy's engines) or "reward" (a replica of the served reward model,
    reward.model: its own command line, one node, its GPUs Ray's)."""

    def __init__(self, spec_json: str, index: int, seed: int, sharing: int = 1,
                 log_file: str | None = None, node_rank: int = 0,
                 role: str = "rollout") -> None:
        part = f" node {node_rank}" if node_rank else ""
        what = "reward model" if role == "reward" else "engine"
        log_to_file(log_file, f"{what} {index}{part}")
        self.spec = spec_from_driver(spec_json)
        self.index, self.seed, self.sharing, self.node_rank = index, seed, sharing, node_rank
        self.role = role
        self.name = f"{what} {index}{part}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.tail: deque[str] = deque(maxlen=ENGINE_LOG_TAIL_LINES)
        # The engines' API key, from this actor's environment as every part of the job reads
        # it (engines/client.py); SGLang logs its ServerArgs, key included, at start, so the
        # server's output is forwarded with the key replaced (_forward).
        self.api_key = engine_api_key()
        self._config: Path | None = None  # SGLang's --config file with the key

    def start(self, model_path: str, dist_init_addr: str = "",
              secret: str = "") -> tuple[str, str]:
        """Start the server; returns (its URL, the engine's dist-init address). Node rank 0
        of a multi-node engine picks that address (a free port on its node); the others are
        given it. `secret`: the key the reference engine's nodes authenticate each other with
        (shared by one engine's parts, passed in the environment, never on a command line)."""
        port, nccl_port, dist_port = distinct_free_ports(3)
        if self.spec.engine_nodes > 1 and self.node_rank == 0:
            dist_init_addr = f"{node_ip()}:{dist_port}"
        self._drop_config()
        if self.api_key and self._engine == "sglang":
            self._config = write_api_key_config(self.api_key)
        cmd = self._command(model_path, port, nccl_port, dist_init_addr)
        env = dict(os.environ)  # the reference engine reads the key from it
        if secret:
            env[ENGINE_SECRET_ENV] = secret
        if (self.role == "rollout" and self.spec.placement == "colocate"
                and self.spec.rollout_gpus):
            devices = colocated_engine_devices(self.index, self.spec.rollout.gpus_per_engine,
                                               self.spec.training.gpus_per_node)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
        device = cmd[cmd.index("--device") + 1] if "--device" in cmd else "its GPUs"
        print(f"{self.name} ({self._engine}) on {device} "
              f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
              f"{' '.join(cmd)}", flush=True)
        # The server's output goes through this actor to its stdout (its log file, or the
        # pod's log), keeping the last lines for log_tail: a server that dies in a cluster is
        # explained by them too, where the driver cannot read the pod's log.
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env)
        threading.Thread(target=self._forward, args=(self.proc.stdout,), daemon=True,
                         name=f"engine-{self.index}-{self.node_rank}-output").start()
        self.url = f"http://{node_ip()}:{port}"
        return self.url, dist_init_addr

    @property
    def _engine(self) -> str:
        """sglang or reference: the kind of engine this actor runs."""
        model = self.spec.reward.model
        if self.role == "reward" and model is not None:
            return model.engine
        return self.spec.rollout.engine

    def _command(self, model_path: str, port: int, nccl_port: int,
                 dist_init_addr: str = "") -> list[str]:
        if self.role == "reward":
            return reward_engine_command(self.spec, port=port, nccl_port=nccl_port,
                                         seed=self.seed,
                                         torch_threads=torch_threads(self.sharing),
                                         config_file=str(self._config or ""))
        return engine_command(self.spec, model_path=model_path, port=port, nccl_port=nccl_port,
                              seed=self.seed, torch_threads=torch_threads(self.sharing),
                              node_rank=self.node_rank, dist_init_addr=dist_init_addr,
                              config_file=str(self._config or ""))

    def _drop_config(self) -> None:
        if self._config is not None:
            shutil.rmtree(self._config.parent, ignore_errors=True)
            self._config = None

    def _forward(self, pipe: IO[bytes] | None) -> None:
        if pipe is None:
            return
        key = self.api_key.encode()
        for line in iter(pipe.readline, b""):
            if key and key in line:
                line = line.replace(key, REDACTED)
            view = memoryview(line)
            while view:
                view = view[os.write(1, view):]
            self.tail.append(line.decode(errors="replace").rstrip("\r\n"))

    def log_tail(self, lines: int = ENGINE_LOG_TAIL_LINES) -> list[str]:
        """The last `lines` lines the server wrote (stdout and stderr)."""
        return list(self.tail)[-lines:]

    def poll(self) -> int | None:
        """The child's exit code, or None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after grace_s (at once with 0: a hung server would not
        handle the SIGTERM anyway)."""
        if self.proc is not None and self.proc.poll() is None:
            if grace_s > 0:
                self.proc.terminate()
            else:
                self.proc.kill()
            try:
                self.proc.wait(timeout=grace_s or 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._drop_config()



class EngineGroup:
    """The engine actors and their servers' URLs (node rank 0's, for an engine spanning
    nodes: the one that serves HTTP). `log_dir`: where each engine's output goes
    (engine-<index>.log, engine-<index>-node-<rank>.log for the other nodes of one), read back
    by `log_tail` to explain an engine's death."""

    def __init__(self, spec: RLJobSpec, layout: Layout, seed: int, *,
                 one_machine: bool = False, log_dir: Path | None = None) -> None:
        self._spec_json = spec.model_dump_json(by_alias=True)
        self._model_path, self._seed, self._nodes = spec.model.path, seed, layout.engine_nodes
        nodes = layout.engine_nodes
        # Bundle e * nodes + r holds node r of engine e: PACK puts an engine's nodes side by
        # side, and a bundle as large as a node takes a node of its own.
        self._opts = placed(layout.engine_actor, layout.engines * nodes, "engine")
        self._sharing = cpu_sharing(spec, layout, layout.engines * nodes, one_machine)
        self.logs: list[list[Path | None]] = [
            [None if log_dir is None else log_dir / _engine_log_name(e, r) for r in range(nodes)]
            for e in range(layout.engines)]
        self.parts: list[list[Any]] = [[self._actor(e, r) for r in range(nodes)]
                                       for e in range(layout.engines)]
        secrets_ = [secrets.token_hex(16) if nodes > 1 else "" for _ in self.parts]
        heads: list[tuple[str, str]] = ray.get([
            parts[0].start.remote(spec.model.path, "", key)
            for parts, key in zip(self.parts, secrets_, strict=True)])
        # The other nodes join node rank 0's TP group at the address it picked.
        ray.get([part.start.remote(spec.model.path, addr, key)
                 for parts, (_, addr), key in zip(self.parts, heads, secrets_, strict=True)
                 for part in parts[1:]])
        self.urls: list[str] = [url for url, _ in heads]
        self._failed_part: dict[str, int] = {}  # engine URL -> the node first seen dead

    def _actor(self, e: int, r: int) -> Any:
        """The actor of node `r` of engine `e`, in its own placement bundle."""
        log = self.logs[e][r]
        return ray.remote(EngineServer).options(**self._opts[e * self._nodes + r]).remote(
            self._spec_json, e, self._seed + e, self._sharing,
            None if log is None else str(log.resolve()), r)

    def restart(self, url: str) -> str:
        """Start the engine serving `url` again in its place (the same actors, or new ones in
        the same placement bundles where an actor died with its pod); returns its new URL.
        It serves the base model until the next weight sync."""
        e = self.urls.index(url)
        for r, part in enumerate(self.parts[e]):
            try:  # dead or hung: nothing to shut down gracefully
                ray.get(part.stop.remote(0), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.kill(part)  # (its bundle is free again once it is gone)
                self.parts[e][r] = self._actor(e, r)
        key = secrets.token_hex(16) if self._nodes > 1 else ""
        head = self.parts[e][0]
        new, addr = ray.get(head.start.remote(self._model_path, "", key))
        ray.get([part.start.remote(self._model_path, addr, key) for part in self.parts[e][1:]])
        self.urls[e] = new
        self._failed_part.pop(url, None)
        return str(new)

    def kill(self, url: str) -> None:
        """Kill every server process of the engine serving `url` (hung: no grace); `restart`
        starts it again."""
        e = self.urls.index(url)
        for part in self.parts[e]:
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.get(part.stop.remote(0), timeout=60)

    def dead(self) -> dict[str, int]:
        """Engines a server process of which exited (any node's), with the exit code."""
        polls = [p.poll.remote() for parts in self.parts for p in parts]  # all at once
        codes: list[Any] = [server_exit_code(ref) for ref in polls]
        nodes = len(self.parts[0])
        out: dict[str, int] = {}
        for e, url in enumerate(self.urls):
            for rank, code in enumerate(codes[e * nodes:(e + 1) * nodes]):
                if code is not None:
                    out[url] = code
                    self._failed_part.setdefault(url, rank)
                    break
        return out

    def actor_of(self, url: str) -> Any:
        """The actor whose output explains the engine at `url`: the node whose server exited
        first, else node rank 0."""
        e = self.urls.index(url)
        return self.parts[e][self._failed_part.get(url, 0)]

    def log_of(self, url: str) -> Path | None:
        """The log file explaining the engine serving `url` (as actor_of; None in a cluster:
        pod logs)."""
        if url not in self.urls:
            return None
        e = self.urls.index(url)
        return self.logs[e][self._failed_part.get(url, 0)]

    def stop(self) -> None:
        ray.get([p.stop.remote() for parts in self.parts for p in parts])


def server_exit_code(poll: Any) -> int | None:
    """The exit code an engine actor's `poll` returned for its server; -1 when the actor
    itself is gone (its pod was lost, say)."""
    try:
        code: int | None = ray.get(poll, timeout=30)
        return code
    except ray.exceptions.RayActorError:
        return -1


def _engine_log_name(index: int, node_rank: int) -> str:
    return f"engine-{index}.log" if node_rank == 0 else f"engine-{index}-node-{node_rank}.log"

