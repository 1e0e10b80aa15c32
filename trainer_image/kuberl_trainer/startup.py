"""A run's start-up: the part that needs no torch (HeadStart), and where the time went: one
line before the first step, so a person waiting on a slow start (a 70B model's engines
loading, a busy Ray cluster) sees which part it is.

    start-up 8.7 s: checks 0.6, ray 2.5, placement 1.2, engines ready 3.5, trainers ready 0.8,
    first weights 0.2

Each phase is the seconds from the end of the one before it to its own end, counted from the
process's start (the interpreter and imports are in the first phase). The parts of a start-up
overlap (the training workers start while the engines load), so a phase holds what was still
left of it when the phase before ended, not all of its own work.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import secrets
import threading
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import ray
from ray._private.authentication.authentication_utils import is_token_auth_enabled
from ray.exceptions import AuthenticationError

from kuberl_api.spec import RLJobSpec
from kuberl_trainer import ray_auth
from kuberl_trainer.engines.actors import EngineGroup
from kuberl_trainer.engines.reward_engines import RewardEngines
from kuberl_trainer.placement import layout, local_resources
from kuberl_wire.protocol import ENGINE_API_KEY_ENV

if TYPE_CHECKING:
    from kuberl_trainer.options import Options


def process_start_time() -> float:
    """When this process started (epoch seconds): its age from /proc (the machine's uptime
    less the process's start tick, both to 10 ms; /proc/stat's boot time is whole seconds),
    taken from now. Now itself where there is no /proc."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class StartupClock:
    def __init__(self, began: float | None = None) -> None:
        self.began = process_start_time() if began is None else began
        self.last = self.began
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        """`phase` ends now."""
        now = time.time()
        self.phases.append((phase, max(0.0, now - self.last)))
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.began

    def line(self) -> str:
        parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in self.phases)
        return f"start-up {self.total:.1f} s: {parts}"


class HeadStart:
    """The part of a run's start-up that needs neither torch nor transformers: Ray, and the
    engines' actors launching their servers (engine_actors.py imports no torch). `kuberl
    run` begins it while a thread imports the training loop's modules (`preload`): Ray's
    processes start and the engines load while this process imports torch, which cost ~2 s
    of every 2-core start-up done one after the other. `Session.start` does the rest."""

    def __init__(self, clock: StartupClock, engines: EngineGroup,
                 rewards: RewardEngines | None = None) -> None:
        self.clock, self.engines, self.rewards = clock, engines, rewards

    @classmethod
    def begin(cls, spec: RLJobSpec, opts: Options, preload: str | None = None) -> HeadStart:
        clock = StartupClock()
        clock.mark("checks")  # (the process's start, its imports, preflight)
        importer = _Importer(preload) if preload else None
        _quiet_ray()
        _start_ray(spec, opts)
        clock.mark("ray")
        try:
            if opts.address and not opts.in_cluster:
                opts.one_machine = _only_this_machine()
            if opts.log_dir is not None:
                opts.log_dir.mkdir(parents=True, exist_ok=True)
            lay = layout(spec)
            engines = EngineGroup(spec, lay, seed=opts.seed,
                                  one_machine=opts.one_machine, log_dir=opts.log_dir)
            try:  # (the reward model's engines load beside the policy's)
                rewards = (RewardEngines(spec, lay, seed=opts.seed,
                                         one_machine=opts.one_machine, log_dir=opts.log_dir)
                           if spec.reward.model is not None else None)
            except BaseException:
                engines.stop()
                raise
        except BaseException:
            ray.shutdown()
            raise
        head = cls(clock, engines, rewards)
        if importer is not None:
            try:
                importer.join()
            except BaseException:
                head.close()
                raise
        return head

    def close(self) -> None:
        """Stop the engines and Ray (a run that failed before its Session took them over):
        an engine server outlives its actor unless stopped."""
        try:
            try:
                self.engines.stop()
            finally:
                if self.rewards is not None:
                    self.rewards.stop()
        finally:
            ray.shutdown()


class _Importer(threading.Thread):
    """Imports a module in a thread; `join` raises what the import raised. (Imports take
    the interpreter lock while they run Python, but ray.init mostly waits on the processes
    it starts, so the two overlap.)"""

    def __init__(self, module: str) -> None:
        super().__init__(name=f"import {module}", daemon=True)
        self.module = module
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            importlib.import_module(self.module)
        except BaseException as exc:  # handed to the main thread by join
            self.error = exc

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


def _start_ray(spec: RLJobSpec, opts: Options) -> None:
    # Ray's own INFO lines ("Started a local Ray instance", "Connecting to existing Ray
    # cluster") are not for the terminal; its warnings are.
    if opts.address:
        # A Ray started elsewhere: its token (if it has one) comes with this process's
        # environment (ray_auth); without it Ray retries for ~20 s, then says little.
        try:
            ray.init(address=opts.address, log_to_driver=True, logging_level=logging.WARNING)
        except (ConnectionError, AuthenticationError) as exc:
            raise ray_auth.JoinRefused(opts.address, exc) from exc
        return
    # Ray's token authentication on the local Ray: set by `kuberl run` before Ray was
    # imported (ray_auth.enable_for_local_ray; Ray reads it once, at import). A Ray imported
    # without it would start open, so refuse that rather than run without.
    if not is_token_auth_enabled():
        raise RuntimeError(
            "a local Ray must start with token authentication: call "
            "kuberl_trainer.ray_auth.enable_for_local_ray() before Ray is imported")
    # The engines' API key: a new random one per run, in this process's environment only
    # (never on disk, never on a command line), which the local Ray's processes inherit, so
    # the engines check it and every client sends it (engines/client.py). One the caller set
    # is kept; a run joining a Ray (--address) uses its environment's, as the cluster's
    # processes must have the same (the operator's Secret, in a cluster).
    os.environ.setdefault(ENGINE_API_KEY_ENV, secrets.token_urlsafe(32))
    # A local Ray sized to this job's actors (see placement.local_resources). The actors'
    # environment. A local Ray's processes inherit the driver's, so it is set
    # around ray.init rather than given as the job's runtime_env: with one, Ray starts a new
    # worker process for every actor instead of handing it one started ahead, which cost
    # each run about a second of start-up on 2 cores. HF's progress bars would only fill the
    # actors' log files. Address "local": a Ray of its own even where `ray start` left one
    # running, which ray.init would join otherwise (and fail: it refuses the sizes given).
    with environment({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                       **spec.network.variables()}):
        ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2),
                 include_dashboard=False, resources=local_resources(spec), log_to_driver=True,
                 logging_level=logging.WARNING)


def _only_this_machine() -> bool:
    """Whether every live node of the Ray just joined is this machine (a Ray started here
    with `ray start --head`, or a test's): the run then behaves as a local one."""
    here = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    return all(n["NodeManagerAddress"] == here for n in ray.nodes() if n.get("Alive"))


@contextlib.contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """`variables` set in this process's environment for the block, then as they were."""
    before = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _quiet_ray() -> None:
    """Keep what Ray prints on its own about itself off the run's output.

    Its lines forwarded from actors come uncoloured (RAY_COLOR_PREFIX=0: a terminal is not
    always where they land; pod logs keep the escape codes verbatim). Its FutureWarning that
    actors asking for no GPU will one day see every GPU is dropped rather than answered with
    the switch it suggests, RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0: each worker reads that from
    its own environment, so set here it would change what actors see on a local run (whose
    Ray inherits it) but not in a cluster (whose pods' Ray does not), and the two should
    place GPUs alike (placement.colocated_engine_devices describes today's behaviour).
    """
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    warnings.filterwarnings("ignore", message="Tip: In future versions of Ray",
                            category=FutureWarning)
