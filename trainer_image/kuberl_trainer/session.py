"""One run's parts and their lifetime: Ray, engines, training workers, data, checkpoints.

`run.py` decides what happens on errors and signals; this module builds and tears down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import ray
from transformers import AutoTokenizer

from kuberl_api import RLJob
from kuberl_trainer import checkpoint as ckpt
from kuberl_trainer.actors import TrainGroup
from kuberl_trainer.critic import CriticGroup
from kuberl_trainer.engines.actors import EngineGroup
from kuberl_trainer.engines.client import EngineClient, engine_api_key
from kuberl_trainer.engines.fleet import Fleet
from kuberl_trainer.engines.metrics import EngineMetrics
from kuberl_trainer.engines.reward_engines import RewardEngines
from kuberl_trainer.engines.router import Router
from kuberl_trainer.loops import async_loop, sync_loop
from kuberl_trainer.loops.parts import Parts
from kuberl_trainer.memory_handoff import MemoryHandoff, Ranks
from kuberl_trainer.placement import layout
from kuberl_trainer.preflight import Checked
from kuberl_trainer.report.heartbeat import ENGINE_START_S
from kuberl_trainer.report.metrics_log import DROPPED, MetricsLog
from kuberl_trainer.report.progress import Progress
from kuberl_trainer.rollout.evaluation import evaluator, scores_of
from kuberl_trainer.rollout.grading import Grader
from kuberl_trainer.rollout.manager import DataPosition, RolloutManager
from kuberl_trainer.rollout.prompts import PromptSource
from kuberl_trainer.rollout.reward_client import RemoteScorer
from kuberl_trainer.rollout.rewards.model_io import chat_render
from kuberl_trainer.startup import HeadStart
from kuberl_trainer.stopping import GracefulStop
from kuberl_trainer.weight_sync.adapter import ADAPTERS_DIR, adapter_name

if TYPE_CHECKING:
    from kuberl_api.status import TrainerPhase
    from kuberl_trainer.options import Options
    from kuberl_trainer.report.heartbeat import StartupHeartbeat
    from kuberl_trainer.report.status import StatusReporter

LOG = logging.getLogger("kuberl.run")
ENGINE_START_TIMEOUT_S = ENGINE_START_S  # (the start-up heartbeat's EnginesStarting allows it)
# Weight-sync bucket: each costs a round trip and the engine's per-bucket work, so fewer is
# faster (1.5B over NCCL on H200s: 0.107 s a sync in 64 MB buckets, 0.024 s in 512 MB;
# colocated 1 GB: 74 ms, 30 ms; bench/RESULTS.md). A sync holds up to three buckets on the
# trainer's GPU (two colocated, in the engines' dtype) and one receive buffer on the engine's,
# slime's default size for that buffer.
BUCKET_BYTES = 512 << 20


class Session:
    def __init__(self, job: RLJob, opts: Options, checked: Checked,
                 beat: StartupHeartbeat | None = None) -> None:
        self.job, self.spec, self.opts, self.checked = job, job.spec, opts, checked
        self.engines: EngineGroup | None = None
        self.reward_engines: RewardEngines | None = None  # reward.model's
        self.trainers: TrainGroup | None = None
        self.critic: CriticGroup | None = None
        self.memory: MemoryHandoff
        self.sft_source: PromptSource | None = None
        self.rollout: RolloutManager | None = None
        self.router: Router | None = None
        self.ckpt = ckpt.Checkpointer(opts.checkpoint_dir, job.spec.schedule.save_interval,
                                      job.spec.checkpoint.keep, self._position)
        self.aio = asyncio.new_event_loop()  # one loop for the run: the HTTP session lives on it
        self.status: StatusReporter | None = None
        # The start-up heartbeat (in a cluster; run.py starts it): the phase the start-up is
        # in, until the first step reports.
        self.beat = beat
        if beat is not None and beat.reporter is not None:
            self.status = beat.reporter
        elif opts.in_cluster:  # (the kubernetes client: imported only where it reports)
            from kuberl_trainer.report.status import StatusReporter

            self.status = StatusReporter.in_cluster()

    # ------------------------------------------------------------------ lifetime
    def start(self, head: HeadStart | None = None) -> None:
        """The rest of the start-up after `head` (Ray, the engines' actors: begun, on `kuberl
        run`, while this module was being imported; begun here when None): the training
        workers, the engines ready, the first weights. Each phase is marked on the head's
        clock, and one line on stdout at the end says where the start-up went."""
        head = head or HeadStart.begin(self.spec, self.opts)
        clock, logs, local = head.clock, self.opts.log_dir, self.opts.one_machine
        self.engines, self.reward_engines = head.engines, head.rewards
        lay = layout(self.spec)
        self._phase("Placing")
        # The training workers' processes import while the engines load; they build their
        # models in `setup` (colocated, only once the engines made room).
        self.trainers = TrainGroup(self.spec, lay, one_machine=local, log_dir=logs)
        self.critic = (CriticGroup(self.spec, lay, self.trainers, one_machine=local,
                                   log_dir=logs)
                       if self.spec.has_critic else None)
        self.ckpt.models = [self.trainers, *([self.critic] if self.critic else [])]
        clock.mark("placement")
        self.client = EngineClient(self.engines.urls)
        self.fleet = Fleet(self.engines, self.client, budget=self.spec.engine_restart_budget,
                           start_timeout_s=ENGINE_START_TIMEOUT_S)
        self.fleet.announce = self._announce_replacement
        # (sync: adapter: the engines keep the base weights; only their cache moves)
        self.memory = MemoryHandoff(self.client, self.aio, [], self.spec.trainer_offload,
                                    keep_weights=self.spec.adapter_sync)
        if self.memory.on:  # colocated: the engines start alone, then make room (see there)
            self._phase("EnginesStarting")
            self._wait_for_engines()
            clock.mark("engines ready")
            self.memory.release_engines()
            self._phase("Loading")
            self._setup_ranks()
            clock.mark("trainers ready")
        else:  # (disaggregated: the trainers build their models while the engines load)
            self._phase("Loading")
            self._setup_ranks()
            clock.mark("trainers ready")
            self._phase("EnginesStarting")
            self._wait_for_engines()
            clock.mark("engines ready")
        self.memory.ranks = self._colocated_ranks()
        if self.spec.rollout.router == "sglang":  # (generation only: after the engines)
            self.router = Router(self.client, log=None if logs is None else logs / "router.log")
            self.aio.run_until_complete(self.router.start())
            self.client.router_url = self.router.url
            self.fleet.router = self.router
        d = self.spec.data
        assert d.prompts is not None  # (required to train: job_rules.py)
        self.source = PromptSource(d.prompts, d.input_key, d.label_key, seed=self.opts.seed,
                                   metadata_keys=d.metadata_keys)
        self.sft_source = (PromptSource(d.sft.path, d.input_key, d.label_key,
                                        seed=self.opts.seed) if d.sft else None)
        self._phase("Loading")  # (the checkpoint, if any)
        resumed = self._resume()
        if resumed:
            clock.mark("checkpoint loaded")
        self._phase("FirstStep")  # until the first step reports (_Watchers.step)
        self._first_sync(resumed)
        clock.mark("first weights")
        print(clock.line(), flush=True)

    def _phase(self, phase: TrainerPhase) -> None:
        if self.beat is not None:
            self.beat.enter(phase)

    def _setup_ranks(self) -> None:
        assert self.trainers is not None
        self.trainers.setup()
        if self.spec.adapter_sync:  # (weight_sync/adapter.py)
            self.trainers.set_adapter_root(self.ckpt.root / ADAPTERS_DIR)
            self.trainers.published = lambda version: self.client.use_adapter(
                adapter_name(version), version)
        if self.critic is not None:
            self.critic.setup()

    def _wait_for_engines(self) -> None:
        """Until the policy's engines, and the reward model's (reward.model), answer
        /health."""
        assert self.engines is not None
        self.aio.run_until_complete(self.client.wait_healthy(
            timeout_s=ENGINE_START_TIMEOUT_S, exited=self.engines.dead))
        if self.reward_engines is not None:
            rewards = EngineClient(self.reward_engines.urls)
            try:
                self.aio.run_until_complete(rewards.wait_healthy(
                    timeout_s=ENGINE_START_TIMEOUT_S, exited=self.reward_engines.dead))
            finally:
                self.aio.run_until_complete(rewards.close())

    def _first_sync(self, resumed: bool) -> None:
        """The engines start from the base model and, colocated, released even that: they
        get the trainers' weights (a resumed job's, or the base model's), then their cache.
        A new disaggregated job's engines hold the trainers' weights already: they get the
        first bucket only, which checks the weight-update group on the real network before
        the first rollout, rather than after it (an unreachable engine, a wrong interface:
        the run fails here, naming the engine)."""
        assert self.trainers is not None and self.engines is not None
        if not (self.memory.on or resumed or self.spec.adapter_sync):
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
        resumed = self.ckpt.resume()
        if resumed is None:
            return False
        state, path = resumed
        self.source.load_state_dict(state.data)
        if self.sft_source is not None and state.sft_data:
            self.sft_source.load_state_dict(state.sft_data)
        LOG.info("resumed from %s (step %d)", path, state.step)
        return True

    def _grader(self) -> Grader:
        """The job's reward as the grading stage: the function preflight imported, the
        reward service's client, or the served reward model's (its replicas, its tokenizer's
        chat template, the engines' API key)."""
        model = None
        r = self.spec.reward
        if self.reward_engines is not None and r.model is not None:
            render = chat_render(AutoTokenizer.from_pretrained(r.model.tokenizer_path))
            model = RemoteScorer.for_model(r, self.reward_engines.urls, render,
                                           engine_api_key())
        return Grader.of(r, self.checked.reward_fn, model)

    def train(self, progress: Progress, stop: GracefulStop | None = None) -> None:
        assert self.trainers is not None and self.engines is not None
        tokenizer = AutoTokenizer.from_pretrained(self.checked.tokenizer_path)
        memory = self.memory
        self.rollout = RolloutManager(self.spec, self.source, self.client, tokenizer,
                                      self._grader(), seed=self.opts.seed,
                                      ref_logprobs=self.trainers.ref_logprobs,
                                      values=self.critic.values if self.critic else None,
                                      sft_source=self.sft_source, sampled=memory.to_trainers,
                                      rollout_function=self.checked.rollout_function,
                                      environment_class=self.checked.environment_class)
        log = MetricsLog(self.opts.output_dir, first_step=self.step,
                         prometheus_port=self.opts.prometheus_port,
                         tensorboard_dir=self.opts.tensorboard,
                         wandb_project=self.opts.wandb_project, run_name=self.job.name)
        if log.dropped:  # (a run killed after its last checkpoint had written them)
            print(f"{log.path.name}: {log.dropped} rows of step {self.step} and later, which "
                  f"this run trains again, moved to {DROPPED}", flush=True)
        parts = Parts(
            aio=self.aio,
            rollout=self.rollout,
            train=self.trainers, engines=self.engines, critic=self.critic,
            log=log,
            checkpointer=self.ckpt, reporter=_Watchers(progress, self),
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
                                 partial_rollout=a.partial_rollout,
                                 run_ahead=a.run_ahead)
                if self.spec.mode == "async" else
                sync_loop.train(parts, self.step, total, self.weight_version))
            self.step = self.spec.schedule.num_rollouts
            self.save_now()
        finally:
            stop_watching()
            parts.log.close()
            progress.close()

    def evaluate_only(self, head: HeadStart | None = None) -> dict[str, Any]:
        """mode eval: the engines serve model.path, the eval sets are scored once (as a
        training run scores them: rollout/evaluation.py), one row goes to metrics.jsonl and
        the scores to the RLJob status; no training rank starts. Returns the row."""
        head = head or HeadStart.begin(self.spec, self.opts)
        self.engines, self.reward_engines = head.engines, head.rewards
        self._phase("EnginesStarting")
        self.client = EngineClient(self.engines.urls)
        self._wait_for_engines()
        head.clock.mark("engines ready")
        if self.spec.rollout.router == "sglang":
            logs = self.opts.log_dir
            self.router = Router(self.client, log=None if logs is None else logs / "router.log")
            self.aio.run_until_complete(self.router.start())
            self.client.router_url = self.router.url
        print(head.clock.line(), flush=True)
        self._phase("Evaluating")
        tokenizer = AutoTokenizer.from_pretrained(self.checked.tokenizer_path)
        scoring = evaluator(self.spec, self.client, tokenizer, self._grader(),
                            seed=self.opts.seed,
                            rollout_function=self.checked.rollout_function,
                            environment_class=self.checked.environment_class)
        seconds = time.perf_counter()
        scores = self.aio.run_until_complete(scoring.evaluate())
        step = ckpt.model_step(self.spec.model.path)
        record: dict[str, Any] = {"step": step, **scores,
                                  "time_eval_s": time.perf_counter() - seconds}
        # (appended: the rows of a training run in the same output directory stay)
        log = MetricsLog(self.opts.output_dir, first_step=None,
                         prometheus_port=self.opts.prometheus_port,
                         tensorboard_dir=self.opts.tensorboard,
                         wandb_project=self.opts.wandb_project, run_name=self.job.name)
        try:
            log.write(record)
        finally:
            log.close()
        if self.beat is not None:
            self.beat.stop()
            self.beat = None
        if self.status is not None:
            try:
                self.status.report(step=step, total_steps=step, reward_mean=None,
                                   evals=scores_of(self.spec.data.eval_sets, record),
                                   phase="Evaluating")
            except OSError as exc:
                LOG.warning("could not report the scores to the RLJob status: %s", exc)
        for key in sorted(scores):
            print(f"{key} {scores[key]:.6g}", flush=True)
        return record

    def _colocated_ranks(self) -> list[Ranks]:
        """The rank groups on the engines' GPUs: the trainers, and a shared critic."""
        assert self.trainers is not None
        shared = self.critic is not None and self.spec.critic.placement == "shared"
        return [self.trainers, *([self.critic] if shared and self.critic else [])]

    # ------------------------------------------------------------ checkpoints
    @property
    def step(self) -> int:
        """Training steps finished (as the checkpointer last heard)."""
        return self.ckpt.step

    @step.setter
    def step(self, step: int) -> None:
        self.ckpt.step = step

    @property
    def weight_version(self) -> int:
        """The engines' weight version (as the checkpointer last heard)."""
        return self.ckpt.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.ckpt.weight_version = version

    def _position(self, step: int) -> DataPosition:
        """Where the prompts stood before step `step`'s rollout (mode async has drawn them
        already); the sources as they stand when no step has begun."""
        if self.rollout is not None:
            return self.rollout.position_at(step)
        return DataPosition(self.source.state_dict(),
                            self.sft_source.state_dict() if self.sft_source else {})

    def save_now(self) -> None:
        """Save the steps trained since the last checkpoint (the run ends or is stopped)."""
        if self.trainers is not None and self.ckpt.unsaved():
            self._room_to_save()
            self.ckpt.save(self.step, self.weight_version)

    def save_and_report(self) -> None:
        """Save as the job stops (SIGTERM), and tell the RLJob where: the operator's Preempted
        condition and the next attempt read it."""
        self.save_now()
        latest = ckpt.latest(self.ckpt.root)
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

    def close(self) -> None:
        try:
            if self.router is not None:
                self.router.stop()
            if hasattr(self, "client"):
                self.aio.run_until_complete(self.client.close())
            if self.engines is not None:
                self.engines.stop()
        finally:
            try:
                if self.reward_engines is not None:
                    self.reward_engines.stop()
            finally:
                self.aio.close()
            if ray.is_initialized():
                ray.shutdown()


class _Watchers:
    """What happens after each step besides metrics: the progress line and, in a cluster, the
    RLJob status heartbeat (best effort: a failed report never stops training)."""

    def __init__(self, progress: Progress, session: Session) -> None:
        self.progress, self.session = progress, session

    def step(self, step: int, metrics: dict[str, Any], checkpoint: tuple[int, str] | None
             ) -> None:
        self.progress.step(metrics)
        if self.session.beat is not None:  # a step is the heartbeat from now on
            self.session.beat.stop()
            self.session.beat = None
        reporter = self.session.status
        if reporter is None:
            return
        try:
            reporter.report(step=step + 1, total_steps=self.session.spec.schedule.num_rollouts,
                            reward_mean=metrics.get("reward_mean"), checkpoint=checkpoint,
                            engine_restarts=int(metrics.get("engine_restarts_total", 0)),
                            evals=scores_of(self.session.spec.data.eval_sets, metrics))
        except OSError as exc:
            LOG.warning("could not report progress to the RLJob status: %s", exc)
