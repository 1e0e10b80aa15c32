"""The `fsdp` backend: a Hugging Face causal LM trained with plain torch data parallelism.

How the policy is replicated across the ``world_size`` training ranks:

- one rank: the bare HF module (on GPU with bf16 autocast over fp32 weights);
- several ranks on GPU: FSDP2 ``fully_shard`` per decoder layer and at the root, bf16
  compute, fp32 gradient reduction and fp32 master weights/optimizer state sharded across
  ranks — the memory profile that lets a model larger than one GPU's share train at all;
- several ranks on CPU: DDP over gloo. FSDP's collectives (all-gather / reduce-scatter of
  flat shards) are built and tested for NCCL; on CPU models are small anyway, and DDP's
  all-reduce is the simplest correct choice.

Micro-batches are packed (``backends/micro_batches.py``): each forward pass runs whole
samples concatenated into one row, no padding, up to ``training.maxTokensPerMicroBatch``
tokens; the HF models are loaded with the ``kuberl_varlen`` attention
(``backends/varlen_attention.py``), which keeps attention inside each sample.

The reference model (only when ``algorithm.klCoef > 0``) is built exactly like the policy,
minus the optimizer, so at step 0 policy and reference give bitwise-equal log-probs (KL 0).
With ``training.lora`` (``backends/lora.py``) the policy is the HF model under a PEFT adapter,
only the adapter trains, and the reference is the same model with the adapter off.

Both models are kept in ``eval()`` mode throughout: no dropout, so ``logprobs`` and the
training forward agree and the PPO ratio starts at exactly 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from transformers import PreTrainedModel

from kuberl_api.spec import LoraSpec, RLJobSpec
from kuberl_trainer.algos.objective import Objective
from kuberl_trainer.backends.base import TrainBatch, sft_step_parts, trainer_old_logprobs
from kuberl_trainer.backends.fsdp_models import (
    Mode,
    build_model,
    load_model,
    parallel_mode,
    place,
    rank_batch_size,
    resolve_device,
)
from kuberl_trainer.backends.fsdp_weights import FSDPWeights
from kuberl_trainer.backends.micro_batches import MicroBatch, micro_batches
from kuberl_trainer.backends.moe_routing import AUX_LOSS, MoeRouting
from kuberl_trainer.backends.offload import Offloads, optimizer_state, release_cached
from kuberl_trainer.backends.optim import (
    OptimConfig,
    build_optimizer,
    build_scheduler,
    clip_gradients,
    optim_config,
)
from kuberl_trainer.backends.packing import next_token_targets, to_rows
from kuberl_trainer.backends.step_metrics import StepMetrics
from kuberl_trainer.backends.tokens import response_mask
from kuberl_trainer.backends.vocab_logprobs import token_logprobs_and_entropy
from kuberl_wire.moe_routes import NO_ROUTE, moe_shape

if TYPE_CHECKING:
    pass

LOG = logging.getLogger("kuberl.backend.fsdp")



class FSDPBackend(FSDPWeights):
    """One training rank of the fsdp backend (see the module docstring for the layout)."""

    def __init__(self, spec: RLJobSpec, *, rank: int, world_size: int, device: str,
                 optim: OptimConfig | None = None) -> None:
        self.spec, self.algo = spec, spec.algorithm
        self.objective = self._make_objective()
        self.rank, self.world_size = rank, world_size
        self.device = resolve_device(device)
        self.mode: Mode = parallel_mode(world_size, self.device)
        self.micro_batch_size = spec.training.micro_batch_size
        # (rows: a sample's rows, rollout.maxRowsPerSample, train in the same optimizer step)
        self.rank_batch_size = rank_batch_size(spec.global_batch_size, world_size,
                                               self.micro_batch_size
                                               ) * spec.rollout.max_rows_per_sample
        # `module` is the HF model itself (HF state_dict names, save_pretrained), or with LoRA
        # the PEFT model around it; `model` is what the training forward runs through (the
        # DDP wrapper, when there is one).
        self.lora = self._lora_spec()
        self.module: nn.Module = self._build_trainable()
        self.moe = self._moe_routing()
        self._moe_stats: dict[str, Tensor] = {}  # the last forward's (replay mismatch)
        self._aux: Tensor | None = None  # the last training forward's router aux loss
        self.model = self._wrap(self.module)
        self.ref = self._build_reference()
        config = optim or optim_config(spec)
        self.optimizer = build_optimizer(self._trainable_params(), self._lr(), config)
        self.scheduler = build_scheduler(self.optimizer, config)
        self._offloads = Offloads()  # what `offload` freed (colocated handoff)

    # What a subclass (the PPO value model, backends/value.py) builds differently.

    def _lora_spec(self) -> LoraSpec | None:
        """The adapter the policy trains (None: all its weights)."""
        return self.spec.training.lora

    def _build_trainable(self) -> nn.Module:
        kernels = self.spec.training.fused_kernels
        if self.lora is None:
            return build_model(self.spec.model.path, self.device, self.mode, trainable=True,
                               fused_kernels=kernels)
        from kuberl_trainer.backends.lora import add_adapter

        # wrapped before it is placed: FSDP2 shards each adapter with its decoder layer
        model = add_adapter(load_model(self.spec.model.path, trainable=True,
                                       fused_kernels=kernels), self.lora)
        return place(model, self.device, self.mode)

    def _moe_routing(self) -> MoeRouting | None:
        """A mixture-of-experts policy's routing (replay, aux loss); None for a dense one."""
        config = getattr(self.module, "config", None)
        settings = {} if config is None else config.to_dict()
        return MoeRouting(self.module, settings, self.algo) if moe_shape(settings) else None

    def _trainable_params(self) -> list[nn.Parameter]:
        """What the optimizer steps: every weight, or only the adapter's."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def _build_reference(self) -> PreTrainedModel | None:
        """The frozen model: the teacher in on-policy distillation, else the policy's starting
        point, when a KL term needs it."""
        kernels = self.spec.training.fused_kernels
        if self.algo.teacher_path is not None:
            return build_model(self.algo.teacher_path, self.device, self.mode, trainable=False,
                               fused_kernels=kernels)
        if self.algo.kl_coef <= 0 or self.lora is not None:
            return None  # (LoRA: the reference is the policy with its adapter off)
        return build_model(self.spec.model.path, self.device, self.mode, trainable=False,
                           fused_kernels=kernels)

    def _lr(self) -> float:
        return self.algo.lr

    def _make_objective(self) -> Objective:
        return Objective.from_spec(self.spec)

    # -- log-probs ---------------------------------------------------------------------------

    def logprobs(self, batch: TrainBatch) -> Tensor:
        """``[B, T]`` float32 on CPU; see ``Backend.logprobs``. Collective under FSDP2."""
        return self._logprobs(self.module, batch).cpu()

    def ref_logprobs(self, batch: TrainBatch) -> Tensor | None:
        ref = self._reference_logprobs(batch)
        return None if ref is None else ref.cpu()

    def _reference_logprobs(self, batch: TrainBatch) -> Tensor | None:
        """The reference model's log-probs (the teacher's, or the starting policy's), on the
        device; None without one. With LoRA the starting policy is the base: the policy's own
        model with the adapter off."""
        if self.ref is not None:
            return self._logprobs(self.ref, batch)
        if self.lora is None or self.algo.kl_coef <= 0:
            return None
        with self._peft.disable_adapter():
            return self._logprobs(self.module, batch)

    @torch.no_grad()
    def _logprobs(self, model: nn.Module, batch: TrainBatch) -> Tensor:
        """``[B, T]`` on the device, in micro-batches. Runs the unwrapped module: no DDP
        hooks (nothing to synchronise without gradients)."""
        return self._per_token(batch, lambda mb: self._token_values(model, mb)[0])

    def _per_token(self, batch: TrainBatch, fn: Callable[[MicroBatch], Tensor]) -> Tensor:
        """``fn`` (a ``[b, t]`` value per token of a micro-batch's rows) over the whole batch:
        ``[B, T]`` on the device, 0 off the response."""
        batch = batch.to(self.device)
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        for mb in self._micros(batch):
            values = fn(mb) * response_mask(mb.batch.loss_mask)
            out[mb.rows, :values.shape[1]] = values
        return out

    def _micros(self, batch: TrainBatch, *, sft: bool = False) -> list[MicroBatch]:
        """``batch`` packed into micro-batches (``backends/micro_batches.py``). Under FSDP2
        every forward is a collective, so each rank runs as many as the busiest rank."""
        return micro_batches(batch, micro_batch_size=self.micro_batch_size,
                             max_tokens=self.spec.training.max_tokens_per_micro_batch,
                             agree=self._busiest if self.mode == "fsdp2" else None, sft=sft)

    def _busiest(self, count: int) -> int:
        """The largest of the ranks' ``count`` (collective)."""
        total = torch.tensor(count, device=self.device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return int(total.item())

    def _forward(self, model: nn.Module, mb: MicroBatch) -> Tensor:
        """The model's per-position output over ``mb``'s packed row: ``[N, ...]`` (logits,
        or the value head's scores). Attention keeps to each sequence
        (``varlen_attention``); positions restart at 0 with each one, so RoPE sees every
        sequence as if it were alone."""
        p = mb.packed
        routing = self.moe if model is self.module or model is self.model else None
        extra = {} if routing is None else routing.forward_kwargs(
            training=torch.is_grad_enabled())
        self._moe_stats = {}
        with self._autocast(), (contextlib.nullcontext() if routing is None
                                else routing.forward(mb.batch, self._moe_stats)):
            out = model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False,
                        cu_seq_lens_q=p.cu_seqlens, cu_seq_lens_k=p.cu_seqlens,
                        max_length_q=p.max_seqlen, max_length_k=p.max_seqlen, **extra)
        self._aux = getattr(out, "aux_loss", None) if extra else None
        logits: Tensor = out.logits[0]
        return logits

    def _token_values(self, model: nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor]:
        """``(log-probs, entropy)`` ``[b, t]`` of ``mb``'s tokens under the temperature-scaled
        policy, aligned to input_ids (``vocab_logprobs``: no float32 copy of the logits)."""
        targets, valid = next_token_targets(mb.packed)
        logp, entropy = token_logprobs_and_entropy(self._forward(model, mb), targets,
                                                   temperature=self.algo.temperature)
        width = mb.batch.input_ids.shape[1]
        return (to_rows(logp, valid, mb.packed, width),
                to_rows(entropy, valid, mb.packed, width))

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        # FSDP2 casts through its MixedPrecisionPolicy; a single GPU gets the same bf16
        # compute from autocast; CPU stays float32 (bf16 matmuls on CPU are slow and lossy).
        if self.mode == "single" and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- training ----------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, sft: TrainBatch | None = None) -> dict[str, float]:
        """Collective. ``batch`` is this rank's shard of one rollout (``B`` samples).

        It is cut into ``B / rank_batch_size`` optimizer steps (``rank_batch_size =
        globalBatchSize / world_size``), each accumulated over micro-batches of
        ``microBatchSize``. ``sft`` (this rank's share of the step's demonstrations, with
        ``algorithm.sftCoef``) is cut into as many equal parts, one per optimizer step.
        Returned metrics are token-weighted means over the shard, plus the mean grad norm and
        the last learning rate of its optimizer steps, and ``old_logprobs_recomputed`` (1 when
        the trainer ran a forward pass of its own for pi_old, else 0).
        """
        sft_parts = sft_step_parts(batch, sft, self.rank_batch_size,
                                   self.spec.global_batch_size, f"{self.world_size} ranks")
        # Old and reference log-probs of the whole shard, before the first step moves the policy.
        batch, prepared = self._prepare(batch.to(self.device))
        metrics = StepMetrics()
        for i, (step_batch, sft_part) in enumerate(zip(batch.chunks(self.rank_batch_size),
                                                       sft_parts, strict=True)):
            if sft_part is not None:
                sft_part = sft_part.to(self.device)
            self._optimizer_step(step_batch, metrics, sft_part, fresh=i == 0)
        return metrics.summary() | prepared | self._adapter_metrics()

    def _adapter_metrics(self) -> dict[str, float]:
        """LoRA's per-step metrics (collective under FSDP2): the adapter's size and norm."""
        if self.lora is None:
            return {}
        from kuberl_trainer.backends.lora import lora_metrics

        return lora_metrics(self.module, sharded=self.mode == "fsdp2")

    def _prepare(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        """The tensors the loss needs that the caller may leave out, and the step's metric
        ``old_logprobs_recomputed``: 1 when this computed the old log-probs (a forward pass
        over the whole shard), else 0."""
        batch = self._with_reference(batch)
        recompute = self._needs_old(batch)
        if self._records_routes(batch):  # (routingReplay training: the pass records them)
            old, routes = self._logprobs_and_routes(batch)
            batch = dataclasses.replace(batch, routes=routes,
                                        old_logprobs=old if recompute else batch.old_logprobs)
        elif recompute:
            batch = dataclasses.replace(batch, old_logprobs=self._logprobs(self.module, batch))
        return batch, {"old_logprobs_recomputed": float(recompute)}

    def _records_routes(self, batch: TrainBatch) -> bool:
        """routingReplay training, and a rollout that feeds several optimizer steps: every
        step after the first replays the experts of the policy from before the first (with
        one step, the training forward's own routes are those)."""
        return (self.moe is not None and self.moe.records and batch.routes is None
                and len(batch) > self.rank_batch_size)

    @torch.no_grad()
    def _logprobs_and_routes(self, batch: TrainBatch) -> tuple[Tensor, Tensor]:
        """The policy's log-probs ``[B, T]`` and the experts its routers chose for every
        token, ``[B, T, layers, top_k]`` (``NO_ROUTE`` on padding), in one pass."""
        moe = self.moe
        assert moe is not None
        routes = torch.full((*batch.input_ids.shape, moe.shape.layers, moe.control.top_k),
                            NO_ROUTE, dtype=torch.long, device=self.device)

        def recorded(mb: MicroBatch) -> Tensor:
            logp = self._token_values(self.module, mb)[0]
            routes[mb.rows, :logp.shape[1]] = moe.recorded_rows(mb.batch)
            return logp

        return self._per_token(batch, recorded), routes

    def _needs_old(self, batch: TrainBatch) -> bool:
        """Old log-probs are computed when the caller left them out but the shard feeds
        several optimizer steps: every step after the first must see the policy from before
        the first. With one step the training forward's own log-probs serve (see
        TrainBatch); with ``oldLogprobs: engine`` the engines' do, and the pass is skipped."""
        return (batch.old_logprobs is None and len(batch) > self.rank_batch_size
                and self.objective.old_logprobs == "trainer")

    def _with_reference(self, batch: TrainBatch) -> TrainBatch:
        """Fill in reference log-probs when the KL term needs them and the caller did not."""
        if batch.ref_logprobs is not None:
            return batch
        ref = self._reference_logprobs(batch)
        return batch if ref is None else dataclasses.replace(batch, ref_logprobs=ref)

    def _optimizer_step(self, batch: TrainBatch, metrics: StepMetrics,
                        sft: TrainBatch | None = None, *, fresh: bool = True) -> None:
        """One optimizer step over ``batch`` (this rank's part of one global batch); ``fresh``:
        the rollout's first, whose forward still sees the policy that sampled it.

        The loss is aggregated over the *whole global batch* (``algos.objective``): each
        micro-batch backpropagates its partial sum divided by the units (tokens or sequences)
        of all ranks' micro-batches together, times world_size, which DDP/FSDP's gradient
        averaging divides back out. The update is then independent of how the batch is cut
        into micro-batches and ranks.
        """
        units = self._global_sum(self.objective.units(response_mask(batch.loss_mask)))
        aux_on = self.moe is not None and self.moe.aux_coef > 0
        all_tokens = (self._global_sum(float(response_mask(batch.loss_mask).sum()))
                      if aux_on else 0.0)
        micros = self._micros(batch)
        if sft is not None:  # the SFT term: a token-mean NLL over all ranks' demonstrations
            sft_tokens = self._global_sum(float(response_mask(sft.loss_mask).sum()))
            micros += self._micros(sft, sft=True)
        self.optimizer.zero_grad(set_to_none=True)
        with self._training_forward():
            for i, mb in enumerate(micros):
                with self._grad_sync(i == len(micros) - 1):
                    if mb.sft:
                        nll, tokens = self._sft_nll(mb)
                        loss = nll * (self.algo.sft_coef * self.world_size / sft_tokens)
                        metrics.add_micro(tokens=tokens, loss=loss.detach() / self.world_size,
                                          sft_nll=nll.detach())
                    else:
                        partial, stats, tokens = self._micro_loss(mb, fresh)
                        loss = partial * (self.world_size / units)
                        if aux_on and self._aux is not None and all_tokens > 0:
                            loss = loss + self._aux_term(tokens, all_tokens)
                        metrics.add_micro(tokens=tokens, loss=loss.detach() / self.world_size,
                                          stats=stats)
                    torch.autograd.backward(loss)
        grad_norm = clip_gradients(self._trainable_params())
        lr = float(self.optimizer.param_groups[0]["lr"])
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:  # the same on every rank: the norm is computed from all-reduced gradients
            LOG.warning("non-finite gradient norm %s: skipping this optimizer step", grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        metrics.add_step(grad_norm, lr)

    def _aux_term(self, tokens: Tensor, all_tokens: float) -> Tensor:
        """The router's load-balancing loss of the last forward, weighted by the micro-batch's
        share of the global batch's response tokens (times world_size, which the gradient
        averaging divides back out): the step's loss gains ``coef`` x its token-weighted
        mean."""
        assert self.moe is not None and self._aux is not None
        return self._aux * (self.moe.aux_coef * self.world_size * tokens / all_tokens)

    def _training_forward(self) -> contextlib.AbstractContextManager[Any]:
        """Around a step's training forwards: the adapter's dropout on (``lora.dropout``);
        everything else stays in eval mode (see the module docstring)."""
        if self.lora is None or self.lora.dropout == 0:
            return contextlib.nullcontext()
        from kuberl_trainer.backends.lora import dropout_on

        return dropout_on(self.module)

    def _micro_loss(self, mb: MicroBatch, fresh: bool
                    ) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """``(partial loss sum, token-mean stats, response tokens)`` for one micro-batch, the
        last two as device scalars; the objective (policy loss, TIS, KL, entropy,
        aggregation) is ``algos.objective``'s. ``fresh``: the rollout's first optimizer
        step, where this forward's log-probs are the trainer's pi_old."""
        logp, entropy = self._token_values(self.model, mb)    # [b, t] each
        b = mb.batch
        mask = response_mask(b.loss_mask)                     # [b, t]
        old = trainer_old_logprobs(b, logp, fresh)
        if not self.objective.needs_entropy_grad:
            entropy = entropy.detach()  # a metric only: its backward term is skipped
        partial, stats = self.objective.partial_loss(
            logp, old, b.advantages, mask, entropy=entropy, rollout_logp=b.rollout_logprobs,
            ref_logp=b.ref_logprobs)
        stats = stats | self._moe_stats
        if self._aux is not None:
            stats[AUX_LOSS] = self._aux.detach().float()
        return partial, stats, mask.sum()

    def _sft_nll(self, mb: MicroBatch) -> tuple[Tensor, Tensor]:
        """``(sum of -log p over the target tokens, their count)`` for one micro-batch of
        demonstrations (temperature-scaled logits, like everything the policy is trained on)."""
        logp, _ = self._token_values(self.model, mb)
        mask = response_mask(mb.batch.loss_mask)
        nll = -torch.where(mask.bool(), logp, torch.zeros_like(logp)).sum()
        return nll, mask.sum()

    def _global_sum(self, value: float) -> float:
        """``value`` summed over the ranks (>= 1): the denominators of the step's losses."""
        count = torch.tensor(value, dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(count)
        return max(float(count.item()), 1.0)

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """DDP: all-reduce gradients only on the last micro-batch of a step. FSDP2 keeps
        reduce-scattering every micro-batch: its gradients stay sharded, which is the point
        of sharding; skipping the sync would hold full-size gradients instead."""
        if self.mode == "ddp" and not last:
            assert isinstance(self.model, DistributedDataParallel)
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _wrap(self, module: nn.Module) -> nn.Module:
        if self.mode != "ddp":
            return module  # single: bare; fsdp2: sharded in place by build_model
        # broadcast_buffers=False: HF models' buffers (rotary tables) are constants, and the
        # broadcast would make every forward, even a no-grad one, a collective.
        return DistributedDataParallel(module, broadcast_buffers=False)

    def data_parallel_coords(self) -> tuple[int, int, bool]:
        """Every rank is a data-parallel rank of its own (no model parallelism)."""
        return self.rank, self.world_size, True

    # -- colocated memory handoff ------------------------------------------------------------

    def offload(self, *, optimizer: bool, weights: bool) -> int:
        """Free this rank's GPU memory for colocated engines: the optimizer's state and/or the
        weights (the trainable model's, the reference model's, and their buffers), kept in
        host memory; gradients are dropped (the next step sets them anew). Returns the bytes
        freed; nothing on CPU. Undone by `onload`, and before anything that needs them."""
        for param in self.module.parameters():
            param.grad = None  # the next step's zero_grad(set_to_none=True) would drop them
        freed = 0
        if optimizer:
            freed += self._offloads.offload("optimizer", optimizer_state(self.optimizer))
        if weights:
            freed += self._offloads.offload("weights", [
                t for model in (self.module, self.ref) if model is not None
                for t in (*model.parameters(), *model.buffers())])
        release_cached()  # what the gradients and the sync's buckets held, too
        return freed

    def onload(self, kinds: Collection[str] | None = None) -> None:
        """What `offload` freed, back on the GPU: all of it, or only `kinds` (a no-op when
        nothing is off)."""
        self._offloads.onload(kinds)
