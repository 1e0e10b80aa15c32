"""One run's parts and their lifetime: Ray, engines, training workers, data, checkpoints.

`run.py` decides what happens on errors and signals; this module builds and tears down.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

import ray
from transformers import AutoTokenizer

from kuberl_api import RLJob
from kuberl_trainer import checkpoint as ckpt
from kuberl_trainer.actors import EngineGroup, TrainGroup
from kuberl_trainer.critic import CriticGroup
from kuberl_trainer.data import PromptSource
from kuberl_trainer.engine_client import EngineClient, EngineError
from kuberl_trainer.loop import Parts, train
from kuberl_trainer.metrics_log import MetricsLog
from kuberl_trainer.placement import layout, local_resources
from kuberl_trainer.preflight import Checked
from kuberl_trainer.progress import Progress
from kuberl_trainer.reporter import StatusReporter
from kuberl_trainer.rollout import RolloutManager

if TYPE_CHECKING:
    from kuberl_trainer.run import Options

LOG = logging.getLogger("kuberl.run")
ENGINE_START_TIMEOUT_S = 600.0


class Session:
    def __init__(self, job: RLJob, opts: Options, checked: Checked) -> None:
        self.job, self.spec, self.opts, self.checked = job, job.spec, opts, checked
        self.engines: EngineGroup | None = None
        self.trainers: TrainGroup | None = None
        self.critic: CriticGroup | None = None
        self.sft_source: PromptSource | None = None
        self.step = 0
        self.weight_version = 0
        self.aio = asyncio.new_event_loop()  # one loop for the run: the HTTP session lives on it
        self.status: StatusReporter | None = StatusReporter.in_cluster() if opts.in_cluster \
            else None

    # ------------------------------------------------------------------ lifetime
    def start(self) -> None:
        if self.opts.address:
            ray.init(address=self.opts.address, log_to_driver=True)
        else:  # a local Ray sized to this job's actors (see placement.local_resources)
            ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False,
                     resources=local_resources(self.spec), log_to_driver=True,
                     runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
        lay = layout(self.spec)
        local = not self.opts.address
        self.engines = EngineGroup(self.spec, lay, seed=self.opts.seed, one_machine=local)
        self.trainers = TrainGroup(self.spec, lay, one_machine=local)
        self.critic = (CriticGroup(self.spec, lay, self.trainers, one_machine=local)
                       if self.spec.has_critic else None)
        self.client = EngineClient(self.engines.urls)
        self.aio.run_until_complete(self.client.wait_healthy(timeout_s=ENGINE_START_TIMEOUT_S))
        d = self.spec.data
        self.source = PromptSource(d.prompts, d.input_key, d.label_key, seed=self.opts.seed)
        self.sft_source = (PromptSource(d.sft.path, d.input_key, d.label_key,
                                        seed=self.opts.seed) if d.sft else None)
        self._resume()

    def _resume(self) -> None:
        found = ckpt.latest(self.opts.checkpoint_dir)
        if found is None:
            return
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
        # Engines start from the base model: give them the resumed weights before generating.
        self.trainers.push_weights(self.engines.urls, self.weight_version, 1 << 26)
        LOG.info("resumed from %s (step %d)", path, step)

    def train(self, progress: Progress) -> None:
        assert self.trainers is not None and self.engines is not None
        tokenizer = AutoTokenizer.from_pretrained(self.checked.tokenizer_path)
        parts = Parts(
            aio=self.aio,
            rollout=RolloutManager(self.spec, self.source, self.client, tokenizer,
                                   self.checked.reward_fn, seed=self.opts.seed,
                                   ref_logprobs=self.trainers.ref_logprobs,
                                   values=self.critic.values if self.critic else None,
                                   sft_source=self.sft_source),
            train=self.trainers, engines=self.engines, critic=self.critic,
            log=MetricsLog(self.opts.output_dir, prometheus_port=self.opts.prometheus_port,
                           tensorboard_dir=self.opts.tensorboard,
                           wandb_project=self.opts.wandb_project, run_name=self.job.name),
            checkpointer=self, reporter=_Watchers(progress, self),
            bucket_bytes=1 << 26, eval_interval=self.spec.schedule.eval_interval)
        progress.bar.n = self.step
        try:
            self.weight_version = train(parts, self.step, self.spec.schedule.num_rollouts,
                                        self.weight_version)
            self.step = self.spec.schedule.num_rollouts
            self.save_now()
        finally:
            parts.log.close()
            progress.close()

    # ------------------------------------------------------------ checkpoints
    def due(self, step: int) -> bool:
        self.step = step  # the loop calls this once per finished step
        every = self.spec.schedule.save_interval
        return every is not None and step % every == 0

    def save(self, step: int, weight_version: int) -> str:
        assert self.trainers is not None
        self.weight_version = weight_version
        state = ckpt.TrainerState(
            step=step, data=self.source.state_dict(), weight_version=weight_version,
            sft_data=self.sft_source.state_dict() if self.sft_source else {})
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
                self.save(self.step, self.weight_version)

    # ------------------------------------------------------------------ errors
    def explain(self, exc: BaseException) -> str:
        dead = self.engines.dead() if self.engines is not None else {}
        if dead:
            codes = ", ".join(f"{url} exited with code {c}" for url, c in dead.items())
            return f"engine died: {codes} ({exc})"
        if isinstance(exc, EngineError):
            return str(exc)
        return f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        try:
            if hasattr(self, "client"):
                self.aio.run_until_complete(self.client.close())
            if self.engines is not None:
                self.engines.stop()
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
        reporter = self.session.status
        if reporter is None:
            return
        try:
            reporter.report(step=step + 1, total_steps=self.session.spec.schedule.num_rollouts,
                            reward_mean=metrics.get("reward_mean"), checkpoint=checkpoint)
        except OSError as exc:
            LOG.warning("could not report progress to the RLJob status: %s", exc)
