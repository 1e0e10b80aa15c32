"""One run's parts and their lifetime: Ray, engines, training workers, data, checkpoints.

`run.py` decides what happens on errors and signals; this module builds and tears down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from transformers import AutoTokenizer

from kuberl_api import RLJob
from kuberl_trainer import async_loop, checkpoint as ckpt
from kuberl_trainer.actors import TrainGroup
from kuberl_trainer.critic import CriticGroup
from kuberl_trainer.engines.actors import EngineGroup
from kuberl_trainer.engines.client import EngineClient, EngineError
from kuberl_trainer.engines.fleet import Fleet, dead_after
from kuberl_trainer.engines.metrics import EngineMetrics
from kuberl_trainer.engines.router import Router
from kuberl_trainer.loop import Parts, train
from kuberl_trainer.memory_handoff import MemoryHandoff, Ranks
from kuberl_trainer.metrics_log import MetricsLog
from kuberl_trainer.placement import layout
from kuberl_trainer.preflight import Checked
from kuberl_trainer.progress import Progress
from kuberl_trainer.rollout.manager import DataPosition, RolloutManager
from kuberl_trainer.rollout.prompts import PromptSource
from kuberl_trainer.startup import HeadStart
from kuberl_trainer.stopping import GracefulStop

if TYPE_CHECKING:
    from kuberl_trainer.reporter import StatusReporter
    from kuberl_trainer.run import Options

LOG = logging.getLogger("kuberl.run")
ENGINE_START_TIMEOUT_S = 600.0
LOG_TAIL_LINES = 20  # of a dead engine's log, with the error that names it
# Weight-sync bucket: each costs a round trip and the engine's per-bucket work, so fewer is
# faster (1.5B over NCCL on H200s: 0.107 s a sync in 64 MB buckets, 0.024 s in 512 MB;
# colocated 1 GB: 74 ms, 30 ms; bench/RESULTS.md). A sync holds up to three buckets on the
# trainer's GPU (two colocated, in the engines' dtype) and one receive buffer on the engine's,
# slime's default size for that buffer.
BUCKET_BYTES = 512 << 20
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its exceptions' headers


class Session:
    def __init__(self, job: RLJob, opts: Options, checked: Checked) -> None:
        self.job, self.spec, self.opts, self.checked = job, job.spec, opts, checked
        self.engines: EngineGroup | None = None
        self.trainers: TrainGroup | None = None
        self.critic: CriticGroup | None = None
        self.memory: MemoryHandoff
        self.sft_source: PromptSource | None = None
        self.rollout: RolloutManager | None = None
        self.router: Router | None = None
        self.step = 0
        self.weight_version = 0
        self.aio = asyncio.new_event_loop()  # one loop for the run: the HTTP session lives on it
        self.status: StatusReporter | None = None
        if opts.in_cluster:  # (the kubernetes client: imported only where it reports)
            from kuberl_trainer.reporter import StatusReporter

            self.status = StatusReporter.in_cluster()

    # ------------------------------------------------------------------ lifetime
    def start(self, head: HeadStart | None = None) -> None:
        """The rest of the start-up after `head` (Ray, the engines' actors: begun, on `kuberl
        run`, while this module was being imported; begun here when None): the training
        workers, the engines ready, the first weights. Each phase is marked on the head's
        clock, and one line on stdout at the end says where the start-up went."""
        head = head or HeadStart.begin(self.spec, self.opts)
        clock, logs, local = head.clock, self.opts.log_dir, self.opts.one_machine
        self.engines = head.engines
        lay = layout(self.spec)
        # The training workers' processes import while the engines load; they build their
        # models in `setup` (colocated, only once the engines made room).
        self.trainers = TrainGroup(self.spec, lay, one_machine=local, log_dir=logs)
        self.critic = (CriticGroup(self.spec, lay, self.trainers, one_machine=local,
                                   log_dir=logs)
                       if self.spec.has_critic else None)
        clock.mark("placement")
        self.client = EngineClient(self.engines.urls)
        self.fleet = Fleet(self.engines, self.client, budget=self.spec.engine_restart_budget,
                           start_timeout_s=ENGINE_START_TIMEOUT_S)
        self.fleet.announce = self._announce_replacement
        self.memory = MemoryHandoff(self.client, self.aio, [], self.spec.trainer_offload)
        if self.memory.on:  # colocated: the engines start alone, then make room (see there)
            self._wait_for_engines()
            clock.mark("engines ready")
            self.memory.release_engines()
            self._setup_ranks()
            clock.mark("trainers ready")
        else:  # (disaggregated: the trainers build their models while the engines load)
            self._setup_ranks()
            clock.mark("trainers ready")
            self._wait_for_engines()
            clock.mark("engines ready")
        self.memory.ranks = self._colocated_ranks()
        if self.spec.rollout.router == "sglang":  # (generation only: after the engines)
            self.router = Router(self.client, log=None if logs is None else logs / "router.log")
            self.aio.run_until_complete(self.router.start())
            self.client.router_url = self.router.url
            self.fleet.router = self.router
        d = self.spec.data
        self.source = PromptSource(d.prompts, d.input_key, d.label_key, seed=self.opts.seed)
        self.sft_source = (PromptSource(d.sft.path, d.input_key, d.label_key,
                                        seed=self.opts.seed) if d.sft else None)
        resumed = self._resume()
        if resumed:
            clock.mark("checkpoint loaded")
        self._first_sync(resumed)
        clock.mark("first weights")
        print(clock.line(), flush=True)

    def _setup_ranks(self) -> None:
        assert self.trainers is not None
        self.trainers.setup()
        if self.critic is not None:
            self.critic.setup()

    def _wait_for_engines(self) -> None:
        assert self.engines is not None
        self.aio.run_until_complete(self.client.wait_healthy(
            timeout_s=ENGINE_START_TIMEOUT_S, exited=self.engines.dead))

    def _first_sync(self, resumed: bool) -> None:
        """The engines start from the base model and, colocated, released even that: they
        get the trainers' weights (a resumed job's, or the base model's), then their cache.
        A new disaggregated job's engines hold the trainers' weights already: they get the
        first bucket only, which checks the weight-update group on the real network before
        the first rollout, rather than after it (an unreachable engine, a wrong interface:
        the run fails here, naming the engine)."""
        assert self.trainers is not None and self.engines is not None
        if not (self.memory.on or resumed):
            seconds = self.trainers.push_weights(self.engines.urls, self.weight_version,
                                                 1 << 26, max_buckets=1)
            LOG.info("weight sync checked: one bucket to %d engines in %.2f s",
                     len(self.engines.urls), seconds)
            return
        self.memory.trained()  # (megatron's fp32 master weights exist from the start)
        self.memory.before_sync()
        self.trainers.push_weights(self.engines.urls, self.weight_version, 1 << 26)
        self.memory.to_engines()
        self.memory.step_metrics()  # (start-up's moves are not the first step's)

    def _resume(self) -> bool:
        found = ckpt.latest(self.opts.checkpoint_dir)
        if found is None:
            return False
        step, path = found
        assert self.trainers is not None and self.engines is not None
        self.trainers.load(str(path))
        if self.critic is not None:
            self.critic.load(str(path))
        state = ckpt.TrainerState.read(path)
        self.source.load_state_dict(state.data)
        if self.sft_source is not None and state.sft_data:
            self.sft_source.load_state_dict(state.sft_data)
        self.step, self.weight_version = state.step, state.weight_version
        LOG.info("resumed from %s (step %d)", path, step)
        return True

    def train(self, progress: Progress, stop: GracefulStop | None = None) -> None:
        assert self.trainers is not None and self.engines is not None
        tokenizer = AutoTokenizer.from_pretrained(self.checked.tokenizer_path)
        memory = self.memory
        self.rollout = RolloutManager(self.spec, self.source, self.client, tokenizer,
                                      self.checked.reward_fn, seed=self.opts.seed,
                                      ref_logprobs=self.trainers.ref_logprobs,
                                      values=self.critic.values if self.critic else None,
                                      sft_source=self.sft_source, sampled=memory.to_trainers)
        parts = Parts(
            aio=self.aio,
            rollout=self.rollout,
            train=self.trainers, engines=self.engines, critic=self.critic,
            log=MetricsLog(self.opts.output_dir, prometheus_port=self.opts.prometheus_port,
                           tensorboard_dir=self.opts.tensorboard,
                           wandb_project=self.opts.wandb_project, run_name=self.job.name),
            checkpointer=self, reporter=_Watchers(progress, self),
            bucket_bytes=BUCKET_BYTES, eval_interval=self.spec.schedule.eval_interval,
            memory=memory,
            fleet=self.fleet, stop=stop or GracefulStop())
        # (the engines' own metrics beside the loop's: their ports are unknown to the chart)
        parts.log.serve_also(EngineMetrics(self.client.live))
        progress.bar.n = self.step
        stop_watching = self.fleet.watch(self.spec.rollout.health_probe, self.aio)
        try:
            total, a = self.spec.schedule.num_rollouts, self.spec.async_
            self.weight_version = (
                async_loop.train(parts, self.step, total, self.weight_version,
                                 max_staleness=a.max_staleness,
                                 partial_rollout=a.partial_rollout)
                if self.spec.mode == "async" else
                train(parts, self.step, total, self.weight_version))
            self.step = self.spec.schedule.num_rollouts
            self.save_now()
        finally:
            stop_watching()
            parts.log.close()
            progress.close()

    def _colocated_ranks(self) -> list[Ranks]:
        """The rank groups on the engines' GPUs: the trainers, and a shared critic."""
        assert self.trainers is not None
        shared = self.critic is not None and self.spec.critic.placement == "shared"
        return [self.trainers, *([self.critic] if shared and self.critic else [])]

    # ------------------------------------------------------------ checkpoints
    def due(self, step: int) -> bool:
        self.step = step  # the loop calls this once per finished step
        every = self.spec.schedule.save_interval
        return every is not None and step % every == 0

    def save(self, step: int, weight_version: int, position: DataPosition | None = None
             ) -> str:
        assert self.trainers is not None
        self.weight_version = weight_version
        # Where the prompts stood before step `step`'s rollout: mode async has drawn them
        # already, and a checkpoint holds no rollout (a resumed run generates it again).
        drawn = position or (self.rollout.position_at(step) if self.rollout is not None
                             else None)  # (None: no step has begun; the sources as loaded)
        state = ckpt.TrainerState(
            step=step, weight_version=weight_version,
            data=drawn.data if drawn else self.source.state_dict(),
            sft_data=(drawn.sft_data if drawn else
                      self.sft_source.state_dict() if self.sft_source else {}))
        path = ckpt.save(self.opts.checkpoint_dir, step, state, self._write_models,
                         keep=self.spec.checkpoint.keep)
        return str(path)

    def _write_models(self, path: str) -> None:
        assert self.trainers is not None
        self.trainers.save(path)
        if self.critic is not None:
            self.critic.save(path)  # into path/critic/

    def save_now(self) -> None:
        if self.trainers is not None and self.step > 0:
            latest = ckpt.latest(self.opts.checkpoint_dir)
            if latest is None or latest[0] < self.step:
                self._room_to_save()
                self.save(self.step, self.weight_version)

    def save_and_report(self) -> None:
        """Save as the job stops (SIGTERM), and tell the RLJob where: the operator's Preempted
        condition and the next attempt read it."""
        self.save_now()
        latest = ckpt.latest(self.opts.checkpoint_dir)
        if self.status is None or latest is None:
            return
        try:
            self.status.report(step=self.step, total_steps=self.spec.schedule.num_rollouts,
                               reward_mean=None, checkpoint=(latest[0], str(latest[1])))
        except Exception as exc:  # best effort: the checkpoint is on disk either way
            LOG.warning("could not report the checkpoint to the RLJob status: %s", exc)

    def _room_to_save(self) -> None:
        """Colocated, the engines hold their pool between steps and a save brings the
        trainers' whole state back: at the end of a run (done, interrupted) the engines
        release it first; they generate no more."""
        if self.memory.on:
            try:
                self.memory.release_engines()
            except Exception as exc:  # (an engine gone: its memory is free anyway)
                LOG.warning("engines did not release their memory before the save: %s", exc)

    def _announce_replacement(self, message: str) -> None:
        """In a cluster, an Event on the RLJob (best effort: it never stops training)."""
        if self.status is None:
            return
        try:
            self.status.event("EngineReplaced", message)
        except (OSError, KeyError, ValueError) as exc:
            LOG.warning("could not post the EngineReplaced Event on the RLJob: %s", exc)

    # ------------------------------------------------------------------ errors
    def explain(self, exc: BaseException) -> str:
        """The error line for `exc`: which engine died, with the end of its log, or the error
        itself; on a local run, where the actors' logs are."""
        dead = self._dead_engines(exc)
        if dead:
            codes = ", ".join(f"{url} exited with code {c}" for url, c in dead.items())
            return ANSI.sub("", f"engine died: {codes} ({exc})") + "".join(
                self._engine_log(url) for url in dead)
        if isinstance(exc, EngineError):  # alive but failing: its log says why
            return ANSI.sub("", str(exc)) + self._engine_log(exc.url)
        logs = self.opts.log_dir
        return ANSI.sub("", f"{type(exc).__name__}: {exc}") + (
            f"\n(the engines' and training workers' logs: {logs}/)" if logs is not None
            else "")

    def _dead_engines(self, exc: BaseException) -> dict[str, int]:
        """Engines whose server exited, with the code (fleet.dead_after)."""
        if self.engines is None:
            return {}
        try:
            return dead_after(self.engines, exc)
        except Exception:  # explaining an error must not raise another (a dead actor)
            return {}

    def _engine_log(self, url: str) -> str:
        """The last lines of the log of the engine at `url`, naming the file (on a local run;
        in a cluster its output is in its pod's log: nothing)."""
        path = self.engines.log_of(url) if self.engines is not None else None
        if path is None:  # in a cluster: the lines its actor kept (EngineServer.log_tail)
            lines = self._actor_log_tail(url)
            return "".join([f"\nlast lines of the engine at {url}:\n",
                            *(f"  {line}\n" for line in lines)]).rstrip("\n") if lines else ""
        if not path.exists():
            return ""
        return f"\nlast lines of {path} ({url}):\n" + "\n".join(
            f"  {line}" for line in tail(path, LOG_TAIL_LINES))

    def _actor_log_tail(self, url: str) -> list[str]:
        if self.engines is None or url not in self.engines.urls:
            return []
        try:  # explaining an error must not raise another (a dead actor)
            return [str(line) for line in ray.get(
                self.engines.actor_of(url).log_tail.remote(LOG_TAIL_LINES), timeout=10)]
        except Exception:
            return []

    def close(self) -> None:
        try:
            if self.router is not None:
                self.router.stop()
            if hasattr(self, "client"):
                self.aio.run_until_complete(self.client.close())
            if self.engines is not None:
                self.engines.stop()
        finally:
            self.aio.close()
            if ray.is_initialized():
                ray.shutdown()


def tail(path: Path, lines: int, max_bytes: int = 64 << 10) -> list[str]:
    """The last `lines` lines of a text file that may be long (read from its end)."""
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
        return f.read().decode(errors="replace").splitlines()[-lines:]


class _Watchers:
    """What happens after each step besides metrics: the progress line and, in a cluster, the
    RLJob status heartbeat (best effort: a failed report never stops training)."""

    def __init__(self, progress: Progress, session: Session) -> None:
        self.progress, self.session = progress, session

    def step(self, step: int, metrics: dict[str, Any], checkpoint: tuple[int, str] | None
             ) -> None:
        self.progress.step(metrics)
        reporter = self.session.status
        if reporter is None:
            return
        try:
            reporter.report(step=step + 1, total_steps=self.session.spec.schedule.num_rollouts,
                            reward_mean=metrics.get("reward_mean"), checkpoint=checkpoint,
                            engine_restarts=int(metrics.get("engine_restarts_total", 0)))
        except OSError as exc:
            LOG.warning("could not report progress to the RLJob status: %s", exc)
