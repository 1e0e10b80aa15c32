"""The `megatron` backend: megatron-core GPT models with tensor, pipeline and data parallelism.

One instance per GPU. The ranks form Megatron's grid (tensor-parallel groups fastest, then
data-parallel, then pipeline stages); the driver sends every rank of a data-parallel group
the same samples (``data_parallel_coords``) and reads results from the ranks that hold the
last pipeline stage's logits with TP rank 0.

- **Weights.** The HF checkpoint is converted to Megatron's fused layout and each rank keeps
  its stage's layers and its TP shard (``megatron/model.py``). Parameters are bf16; the
  distributed optimizer keeps fp32 master weights and Adam moments sharded over the
  data-parallel ranks (ZeRO-1) and clips the global grad norm.
- **Micro-batches** are packed (``backends/micro_batches.py``): sequences concatenated into one
  row with ``cu_seqlens``, no padding computed, up to a token budget each
  (``maxTokensPerMicroBatch``, default ``microBatchSize`` x the step's longest sequence).
  Samples are spread over data-parallel ranks by token count.
- **Loss.** Logits stay split over the vocabulary (TP); log-probs and entropy are reduced over
  the TP group (``backends/vocab_logprobs.py``) and fed to the same ``algos.objective`` as the
  fsdp backend, normalised over the whole global batch, so Megatron sums gradients over
  data-parallel ranks instead of averaging them (``calculate_per_token_loss``).
- **Mixture of experts** (Qwen3-MoE, Qwen2-MoE; ``moe_layout``, ``moe_runtime``): experts
  split over ep ranks (carved out of the data-parallel ranks) and their matrices over etp;
  every rank of an expert-parallel group runs the same number of micro-batches (the token
  all-to-all is collective). Routing replay hooks the routers (``routing_replay``).
- **Weight sync** gathers TP shards into full HF tensors bucket by bucket (``megatron/
  export.py``'s plan), issuing the next bucket's all-gathers before yielding the current one;
  later pipeline stages send theirs to global rank 0, which sends to the engines.
- **Checkpoints**: an HF directory (bf16, servable), each rank's optimizer shard (fp32 master
  weights and Adam moments, so a resumed run is exact; it resumes with the same tp/pp/dp),
  the step count and RNG state.

megatron-core is imported only here and in ``megatron/``, and only when this backend is built.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
from collections.abc import Callable, Collection, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.algos.objective import Objective
from kuberl_trainer.backends.base import TrainBatch, sft_step_parts, trainer_old_logprobs
from kuberl_trainer.backends.hf_files import (
    MODEL_DIR,
    copy_tokenizer,
    read_safetensors_dir,
)
from kuberl_trainer.backends.megatron import hf_layout as L, model as M, moe_runtime as MR
from kuberl_trainer.backends.megatron.bucket_export import BucketExport
from kuberl_trainer.backends.megatron.grad_norm import use_sync_free_grad_norm
from kuberl_trainer.backends.megatron.moe_layout import check_layout as check_moe_layout
from kuberl_trainer.backends.megatron.moe_runtime import idle_micro_batches, record_routes
from kuberl_trainer.backends.micro_batches import MicroBatch, micro_batches
from kuberl_trainer.backends.offload import Offloads, optimizer_state, release_cached
from kuberl_trainer.backends.optim import MAX_GRAD_NORM, LrMultiplier, optim_config
from kuberl_trainer.backends.packing import next_token_targets, to_rows
from kuberl_trainer.backends.rng import rng_state, set_rng_state
from kuberl_trainer.backends.step_metrics import StepMetrics
from kuberl_trainer.backends.tokens import response_mask
from kuberl_trainer.backends.vocab_logprobs import token_logprobs_and_entropy

LOG = logging.getLogger("kuberl.backend.megatron")

STATE_DIR = "megatron"                           # inside a checkpoint
OPTIM_FILE = "optimizer_rank{rank}.pt"  # each rank's optimizer shard (fp32 master weights, Adam)
STEPS_FILE = "steps.json"
RNG_FILE = "rng_rank{rank}.pt"
SEED = 1234


class MegatronBackend(BucketExport):
    """One GPU's rank of the megatron backend (see the module docstring)."""

    def __init__(self, spec: RLJobSpec, *, rank: int, world_size: int, device: str) -> None:
        if not device.startswith("cuda"):
            raise ValueError("training.backend megatron needs GPUs (training.gpusPerNode > 0); "
                             "use backend fsdp to train on CPU")
        try:
            from megatron.core import parallel_state as ps
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        except ImportError as exc:
            raise RuntimeError("training.backend megatron needs megatron-core, which this "
                               "image lacks (pip install 'kuberl[megatron]')") from exc

        self.spec, self.algo = spec, spec.algorithm
        self.objective = Objective.from_spec(spec)
        self.rank, self.world_size = rank, world_size
        _ensure_process_group(rank, world_size)
        p = spec.training.parallelism
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=p.tp,
                                         pipeline_model_parallel_size=p.pp,
                                         context_parallel_size=p.cp,
                                         expert_model_parallel_size=p.ep,
                                         expert_tensor_parallel_size=p.expert_tp)
        elif (ps.get_tensor_model_parallel_world_size(),
              ps.get_pipeline_model_parallel_world_size(),
              ps.get_expert_model_parallel_world_size(),
              ps.get_expert_tensor_parallel_world_size()) != (p.tp, p.pp, p.ep, p.expert_tp):
            raise RuntimeError("this process already holds a different Megatron grid (tp, pp, "
                               "ep, etp); parallel_state.destroy_model_parallel() first")
        self.ps = ps
        self.par = M.Parallel(tp=p.tp, tp_rank=ps.get_tensor_model_parallel_rank(),
                              pp=p.pp, pp_rank=ps.get_pipeline_model_parallel_rank(),
                              ep=p.ep, ep_rank=ps.get_expert_model_parallel_rank(),
                              etp=p.expert_tp, etp_rank=ps.get_expert_tensor_parallel_rank())
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        torch.manual_seed(SEED)
        model_parallel_cuda_manual_seed(SEED)
        self.te = M.has_transformer_engine()
        self.micro_batch_size = spec.training.micro_batch_size
        self.rank_batch_size = spec.global_batch_rows // self.dp_size  # (rows, see fsdp.py)

        self.shape = L.DecoderShape.from_hf_config(M.read_hf_config(spec.model.path))
        self.shape.check_tp(p.tp)
        L.stage_layers(self.shape.num_layers, p.pp, 0)  # raises when pp does not divide
        check_moe_layout(self.shape.experts, p.tp, p.ep, p.etp)
        self.model = self._build_trainable()
        self.replay = (None if self.shape.experts is None
                       else MR.Replay(self.model, self.shape.num_layers))
        self.aux_coef = float(getattr(self.model.config, "moe_aux_loss_coeff", 0.0) or 0.0)
        self._record = False  # the old-log-prob pass records routes (routingReplay training)
        self.ref = self._build_reference()
        self.optimizer = self._build_optimizer()
        o = optim_config(spec)
        self.lr_at = LrMultiplier(o.warmup_steps, o.decay_steps, o.min_lr_ratio, o.decay_style)
        self.steps = 0  # optimizer steps taken (the LR schedule's position)
        self._offloads = Offloads()  # what `offload` freed (colocated handoff)

    # -- construction ------------------------------------------------------------------------

    def _build_trainable(self) -> Any:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        module = self._gpt_from(self.spec.model.path)
        config: Any = module.config
        ddp = DistributedDataParallel(
            config=config, module=module,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                     use_distributed_optimizer=True))
        config.no_sync_func = ddp.no_sync
        # The loss is normalised by the global batch already (see the module docstring):
        # finalise without Megatron's own division by the token count.
        config.finalize_model_grads_func = (
            lambda chunks, num_tokens=None, **kw: finalize_model_grads(chunks, None, **kw))
        return ddp

    def _build_reference(self) -> Any:
        """The frozen model: the teacher (on-policy distillation), else the starting policy
        when a KL term needs it; None otherwise."""
        path = self.algo.teacher_path or (self.spec.model.path if self.algo.kl_coef > 0
                                           else None)
        if path is None:
            return None
        module = self._gpt_from(path)
        module.requires_grad_(False)
        module.eval()
        return module

    def _gpt_from(self, path: str) -> Any:
        """This rank's GPTModel with the weights of the HF checkpoint at ``path``."""
        hf_config = M.read_hf_config(path)
        shape = L.DecoderShape.from_hf_config(hf_config)
        module = M.build_gpt(shape, hf_config, self.par,
                             aux_loss_coef=self.algo.router_aux_loss_coef)
        M.load_hf(module, read_safetensors_dir(Path(path)), shape, self.par)
        return module

    def _build_optimizer(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if use_sync_free_grad_norm():
            LOG.info("no Transformer Engine or Apex: gradient norm by torch._foreach_norm")
        o = optim_config(self.spec)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=self.algo.lr, weight_decay=o.weight_decay,
            adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_eps=o.eps, bf16=True,
            params_dtype=torch.bfloat16, use_distributed_optimizer=True,
            clip_grad=MAX_GRAD_NORM,
            # A constant scale of 1 changes no gradient; it makes Megatron check gradients for
            # inf/NaN and skip that step, as the fsdp backend does.
            loss_scale=1.0), [self.model])
        self.model.config.grad_scale_func = optimizer.scale_loss
        return optimizer

    # -- colocated memory handoff ------------------------------------------------------------

    def offload(self, *, optimizer: bool, weights: bool) -> int:
        """As FSDPBackend.offload. The optimizer's part is the distributed optimizer's fp32
        master shards and Adam moments (12 of the 16-18 bytes a parameter costs); the weights'
        the bf16 parameter buffers of the model and the reference model; the fp32 gradient
        buffers are dropped (zeroed at the next step's start)."""
        freed = self._offloads.offload("grads", [], [
            p.main_grad for p in self.model.parameters()
            if getattr(p, "main_grad", None) is not None])
        if optimizer:
            freed += self._offloads.offload("optimizer", [
                t for inner in self._inner_optimizers()
                for t in (*optimizer_state(inner),
                          *(p for group in inner.param_groups for p in group["params"]))])
        if weights:
            # nn.Module's own methods: Megatron's DDP wrapper shadows `buffers` with its list
            # of parameter-and-gradient buffers.
            freed += self._offloads.offload("weights", [
                t for model in (self.model, self.ref) if model is not None
                for t in (*torch.nn.Module.parameters(model), *torch.nn.Module.buffers(model))])
        release_cached()  # what the sync's buckets held, too
        return freed

    def onload(self, kinds: Collection[str] | None = None) -> None:
        self._offloads.onload(kinds)

    # -- the driver's view -------------------------------------------------------------------

    def data_parallel_coords(self) -> tuple[int, int, bool]:
        """``(data-parallel rank, size, reports)``: which shard of each batch this rank gets,
        and whether its results (log-probs, metrics) are the ones to read."""
        reports = self.par.tp_rank == 0 and self.par.last_stage
        return self.dp_rank, self.dp_size, reports

    # -- micro-batches -----------------------------------------------------------------------

    def _micros(self, batch: TrainBatch, *, sft: bool = False) -> list[MicroBatch]:
        """``batch`` packed into micro-batches (``backends/micro_batches.py``). Data-parallel
        ranks may run different counts of a dense model: nothing in its forward is collective
        across them (the gradients are reduced once, after the last micro-batch). With ep > 1
        the experts' all-to-all is, so every rank runs the busiest one's count."""
        micros = micro_batches(batch, micro_batch_size=self.micro_batch_size,
                               max_tokens=self.spec.training.max_tokens_per_micro_batch,
                               agree=self._busiest if self.par.ep > 1 else None, sft=sft)
        if self.par.ep > 1:  # the experts' all-to-all is collective over the ep group
            micros += idle_micro_batches(micros, self._busiest(len(micros)) - len(micros))
        return micros

    def _busiest(self, count: int) -> int:
        """The largest of the data-parallel ranks' ``count`` (collective)."""
        total = torch.tensor(count, device="cuda")
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.ps.get_data_parallel_group())
        return int(total.item())

    def _run(self, model: Any, micros: list[MicroBatch],
             loss_fn: Callable[[MicroBatch, Tensor], Any], *, forward_only: bool,
             ) -> list[dict[str, Any]]:
        """Megatron's pipeline schedule over ``micros``: each micro-batch's output goes to
        ``loss_fn`` on the last stage. Returns what ``loss_fn`` reported (last stage only)."""
        from megatron.core.packed_seq_params import PackedSeqParams
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data: Iterator[MicroBatch], chunk: Any) -> tuple[Tensor, Any]:
            mb = next(data)
            p = mb.packed
            # Without Transformer Engine, Megatron's RoPE for packed sequences reads the
            # boundaries with .tolist() in every layer; it reads the "padded" boundaries when
            # given, so those get a CPU copy (no device sync per layer) while attention takes
            # the GPU ones. TE's kernels need both on the GPU.
            host = None if self.te else mb.bin.cu_seqlens_cpu
            if self.replay is not None and chunk is self.model:
                replayed = mb.batch.routes if self.algo.routing_replay != "none" else None
                self.replay.set_micro_batch(replayed, mb.batch.attention_mask,
                                            record=self._record)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=p.cu_seqlens,
                                     cu_seqlens_kv=p.cu_seqlens, max_seqlen_q=p.max_seqlen,
                                     max_seqlen_kv=p.max_seqlen, cu_seqlens_q_padded=host,
                                     cu_seqlens_kv_padded=host)
            out = chunk(p.input_ids, p.position_ids, None, packed_seq_params=params)
            return out, partial(loss_fn, mb)

        if not micros:
            return []
        run = get_forward_backward_func()
        stored: list[dict[str, Any]] = run(
            forward_step_func=forward_step, data_iterator=iter(micros), model=[model],
            num_microbatches=len(micros), seq_length=max(m.packed.tokens for m in micros),
            micro_batch_size=1, forward_only=forward_only)
        return stored

    def _token_values(self, mb: MicroBatch, output: Tensor) -> tuple[Tensor, Tensor]:
        """``(log-probs, entropy)`` ``[b, t]`` of ``mb``'s tokens, aligned to input_ids."""
        logits = output[0]                                          # [N, V/tp], bf16
        targets, valid = next_token_targets(mb.packed)
        logp, entropy = token_logprobs_and_entropy(
            logits, targets, vocab_start=self.par.tp_rank * logits.shape[-1],
            group=self.ps.get_tensor_model_parallel_group() if self.par.tp > 1 else None,
            vocab_size=self.shape.vocab, temperature=self.algo.temperature)
        width = mb.batch.input_ids.shape[1]
        mask = response_mask(mb.batch.loss_mask)
        return (to_rows(logp, valid, mb.packed, width) * mask,
                to_rows(entropy, valid, mb.packed, width) * mask)

    # -- log-probs ---------------------------------------------------------------------------

    def logprobs(self, batch: TrainBatch) -> Tensor:
        """Collective. ``[B, T]`` on CPU on the reporting ranks (empty elsewhere)."""
        return self._logprobs(self.model, batch).cpu()

    def ref_logprobs(self, batch: TrainBatch) -> Tensor | None:
        return None if self.ref is None else self._logprobs(self.ref, batch).cpu()

    @torch.no_grad()
    def _logprobs(self, model: Any, batch: TrainBatch) -> Tensor:
        """``[B, T]`` log-probs (last stage; empty elsewhere). With ``self._record``, every
        rank also sets ``self.recorded``: the routes its routers chose, ``[B, T, layers, k]``."""
        micros = self._micros(batch.to("cuda"))

        def report(mb: MicroBatch, output: Tensor) -> tuple[Tensor, Tensor, dict[str, Any]]:
            logp, _ = self._token_values(mb, output)
            zero = torch.zeros((), device=output.device)
            return zero, torch.zeros((), dtype=torch.int, device=output.device), {"logp": logp}

        stored = self._run(model, micros, report, forward_only=True)
        if self._record and self.replay is not None:
            self.recorded = record_routes(self.replay, micros, batch)
        if not self.par.last_stage:
            return torch.empty(0)
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device="cuda")
        for mb, item in zip(micros, stored, strict=True):
            logp = item["logp"]
            out[mb.rows, :logp.shape[1]] = logp
        return out

    # -- training ----------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, sft: TrainBatch | None = None) -> dict[str, float]:
        """Collective. ``batch``: this data-parallel rank's samples of one rollout, a multiple
        of its share of the global batch (one optimizer step per share)."""
        sft_parts = sft_step_parts(batch, sft, self.rank_batch_size,
                                   self.spec.global_batch_size,
                                   f"{self.dp_size} data-parallel ranks")
        # Old and reference log-probs of the whole shard, before the first step moves the policy.
        if self.replay is not None:
            self.replay.reset_counts()
        self._micro_count = 0
        batch, recomputed = self._prepare(batch.to("cuda"))
        metrics = StepMetrics()
        for i, (step_batch, sft_part) in enumerate(zip(batch.chunks(self.rank_batch_size),
                                                       sft_parts, strict=True)):
            if sft_part is not None:
                sft_part = sft_part.to("cuda")
            self._optimizer_step(step_batch, sft_part, metrics, fresh=i == 0)
        return (metrics.summary() | {"old_logprobs_recomputed": float(recomputed)}
                | self._moe_metrics())

    def _prepare(self, batch: TrainBatch) -> tuple[TrainBatch, bool]:
        """Old log-probs when the rollout feeds several optimizer steps (not with
        ``oldLogprobs: engine``), reference log-probs when the KL term needs them and the
        caller left them out (see FSDPBackend); and whether the old ones were computed."""
        if self.ref is not None and batch.ref_logprobs is None:
            ref = self._logprobs(self.ref, batch)
            if self.par.last_stage:
                batch = dataclasses.replace(batch, ref_logprobs=ref)
        recompute = (batch.old_logprobs is None and len(batch) > self.rank_batch_size
                     and self.objective.old_logprobs == "trainer")
        if recompute:
            self._record = self.replay is not None and self.algo.routing_replay == "training"
            try:
                old = self._logprobs(self.model, batch)
            finally:
                self._record = False
            if self.par.last_stage:
                batch = dataclasses.replace(batch, old_logprobs=old)
            if self.replay is not None and self.algo.routing_replay == "training":
                batch = dataclasses.replace(batch, routes=self.recorded.to(batch.input_ids.device))
        return batch, recompute

    def _optimizer_step(self, batch: TrainBatch, sft: TrainBatch | None,
                        metrics: StepMetrics, *, fresh: bool) -> None:
        """One optimizer step; ``fresh``: the rollout's first (its forward's log-probs are
        the trainer's pi_old, see ``trainer_old_logprobs``)."""
        units = self._dp_sum(self.objective.units(response_mask(batch.loss_mask)))
        micros = self._micros(batch)
        sft_tokens = 1.0
        if sft is not None:
            sft_tokens = self._dp_sum(float(response_mask(sft.loss_mask).sum()))
            micros += self._micros(sft, sft=True)

        def loss(mb: MicroBatch, output: Tensor) -> tuple[Tensor, Tensor, dict[str, Any]]:
            # What is reported stays on the GPU, read back once per train_step (StepMetrics):
            # a host read here would stall the schedule once per micro-batch.
            logp, entropy = self._token_values(mb, output)
            mask = response_mask(mb.batch.loss_mask)
            count = mask.sum().to(torch.int)
            if mb.sft:
                nll = -logp.sum()
                value = nll * (self.algo.sft_coef / sft_tokens)
                return value, count, {"sft_nll": nll.detach(), "tokens": count,
                                      "loss": value.detach()}
            b = mb.batch
            old = trainer_old_logprobs(b, logp, fresh)
            if not self.objective.needs_entropy_grad:
                entropy = entropy.detach()
            partial_sum, stats = self.objective.partial_loss(
                logp, old, b.advantages, mask, entropy=entropy, rollout_logp=b.rollout_logprobs,
                ref_logp=b.ref_logprobs)
            value = partial_sum / units
            return value, count, {"stats": stats, "tokens": count, "loss": value.detach()}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.algo.lr * self.lr_at(self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.aux_coef > 0:
            MR.scale_aux_loss(self.model, self.aux_coef,
                              self._dp_sum(float(sum(m.packed.tokens for m in micros))))
        reported = self._run(self.model, micros, loss, forward_only=False)
        self._micro_count += len(micros)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            LOG.warning("non-finite gradients: skipping this optimizer step")
        self.steps += 1
        for item in reported:  # the last pipeline stage's (others report nothing)
            metrics.add_micro(**item)
        metrics.add_step(float(grad_norm) if grad_norm is not None else math.nan, lr)

    def _moe_metrics(self) -> dict[str, float]:
        """``moe_aux_loss`` (with a load-balancing loss) and ``routing_replay_mismatch``
        (with routing replay) of this train_step; collective over the pipeline stages."""
        if self.replay is None:
            return {}
        pp = self.ps.get_pipeline_model_parallel_group() if self.par.pp > 1 else None
        out = {}
        aux = MR.aux_loss_metric(self._micro_count, self.shape.num_layers, pp)
        if aux is not None:
            out["moe_aux_loss"] = aux
        if self.algo.routing_replay != "none":
            mismatch = self.replay.mismatch(pp)
            if mismatch is not None:
                out["routing_replay_mismatch"] = mismatch
        return out

    def _dp_sum(self, value: float) -> float:
        """``value`` summed over the data-parallel ranks (>= 1): the global batch's units."""
        total = torch.tensor(value, dtype=torch.float64, device="cuda")
        if self.dp_size > 1:
            dist.all_reduce(total, group=self.ps.get_data_parallel_group())
        return max(float(total.item()), 1.0)

    # -- weights -----------------------------------------------------------------------------

    def _hf_state(self) -> dict[str, Tensor]:
        """Every HF tensor on CPU (rank 0; empty elsewhere). Collective."""
        state: dict[str, Tensor] = {}
        for bucket in self.named_tensor_buckets(1 << 28):
            if self.rank == 0:
                state.update((n, t.detach().cpu().clone()) for n, t in bucket)
        return state

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, dir: str | Path) -> None:
        """Collective. ``dir/model/`` (HF), ``dir/megatron/`` (optimizer, steps), RNG."""
        path = Path(dir)
        state_dir = path / STATE_DIR
        state_dir.mkdir(parents=True, exist_ok=True)
        hf = self._hf_state()
        if self.rank == 0:
            self._save_hf(path / MODEL_DIR, hf)
            (state_dir / STEPS_FILE).write_text(json.dumps({"optimizer_steps": self.steps}))
        torch.save({"layout": self._layout(), "optimizers": [
            {"state": inner.state_dict(),
             "params": [p.detach().cpu() for g in inner.param_groups for p in g["params"]]}
            for inner in self._inner_optimizers()]},
            state_dir / OPTIM_FILE.format(rank=self.rank))
        torch.save(rng_state(), path / RNG_FILE.format(rank=self.rank))
        dist.barrier()

    def load(self, dir: str | Path) -> None:
        """Collective. Restore weights, optimizer (with its fp32 master weights), schedule
        position and RNG into this freshly built backend."""
        path = Path(dir)
        state_dir = path / STATE_DIR
        M.load_hf(self.model.module, read_safetensors_dir(path / MODEL_DIR), self.shape,
                  self.par)
        saved = torch.load(state_dir / OPTIM_FILE.format(rank=self.rank), map_location="cuda",
                           weights_only=False)
        if saved["layout"] != self._layout():
            raise ValueError(f"checkpoint {path} was saved with (tp, pp, dp[, ep, etp]) = "
                             f"{tuple(saved['layout'])}; this job runs {tuple(self._layout())} "
                             "(the megatron backend resumes with the layout it saved)")
        with torch.no_grad():
            for inner, part in zip(self._inner_optimizers(), saved["optimizers"], strict=True):
                params = [p for g in inner.param_groups for p in g["params"]]
                for p, value in zip(params, part["params"], strict=True):
                    p.copy_(value)
                inner.load_state_dict(part["state"])
        self.steps = int(json.loads((state_dir / STEPS_FILE).read_text())["optimizer_steps"])
        rng = path / RNG_FILE.format(rank=self.rank)
        if rng.exists():
            set_rng_state(torch.load(rng, weights_only=False))
        dist.barrier()

    def _layout(self) -> list[int]:
        experts = [] if self.shape.experts is None else [self.par.ep, self.par.etp]
        return [self.par.tp, self.par.pp, self.dp_size, *experts]

    def _inner_optimizers(self) -> list[Any]:
        """The torch optimizers over this rank's fp32 shards (one per Megatron optimizer).

        Checkpoints save their state and shard parameters rank by rank, as they are:
        megatron-core 0.16's gather-to-rank-0 format fails on bf16 buffers (a shape mismatch
        in get_parameter_state_dp_zero, seen on H100) and its reshardable format does not
        load what it saves."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [o.optimizer for o in chained]

    def _save_hf(self, out: Path, state: dict[str, Tensor]) -> None:
        from huggingface_hub import save_torch_state_dict

        out.mkdir(parents=True, exist_ok=True)
        save_torch_state_dict(state, out)
        # The source's config.json as is: engines then load in the dtype the model came in.
        shutil.copy2(Path(self.spec.model.path) / "config.json", out / "config.json")
        copy_tokenizer(self.spec, out)


def _ensure_process_group(rank: int, world_size: int) -> None:
    """Megatron needs torch.distributed even on one GPU; the driver starts it only for
    several ranks."""
    if dist.is_initialized():
        return
    if world_size != 1:
        raise RuntimeError("torch.distributed must be initialised for several training ranks")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=1)
