"""The training-backend interface (docs/trainer-contracts.md) and the batch it trains on.

A backend owns one rank's copy (or shard) of the policy, its optimizer and the frozen
reference model. The loop never touches tensors of the model directly: it asks a backend for
log-probs, hands it batches to train on, pulls its weights in HF-named buckets for weight
sync, and tells it where to save and load.

Token alignment (one convention across the trainer): every ``[B, T]`` tensor is indexed by
position in ``input_ids``, and the value at position ``t`` is about token ``input_ids[:, t]``
(its log-prob, advantage, loss weight). Position 0 has no preceding context, so nothing is
predicted there and its log-prob is 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass
class TrainBatch:
    """One rollout's samples, right-padded to a common width ``T``.

    Attributes (all ``[B, T]``, aligned to ``input_ids`` positions, see the module docstring):
        input_ids: long, prompt + response tokens, then padding.
        attention_mask: 1 on real tokens, 0 on padding.
        loss_mask: 1 on response tokens (the ones the policy is trained on), else 0.
        advantages: float, per-token advantage (0 off the loss mask).
        rollout_logprobs: float, log-probs the engines reported while sampling (the
            train-inference gap's metrics and importance corrections; the PPO ratio's
            denominator only with ``algorithm.oldLogprobs: engine``).
        old_logprobs: float, log-probs under the policy that is being updated, taken before
            the first optimizer step of this rollout (the PPO ratio's denominator). None when
            the rollout feeds exactly one optimizer step: the policy being trained is then
            still the one that would compute them, so the training forward's own log-probs,
            detached, are the same numbers without a second forward pass. None also with
            ``oldLogprobs: engine``, which skips that forward pass (``trainer_old_logprobs``).
        ref_logprobs: float, log-probs under the frozen reference model, or None when the
            job has no KL term (``algorithm.klCoef == 0``).
        values: float, the value model's estimates at rollout time (PPO; the value loss
            clips around them), else None.
        returns: float, GAE's return targets for the value model (PPO), else None.
        routes: long ``[B, T, layers, top_k]``, a mixture-of-experts model's experts to
            replay for each token (``kuberl_wire.moe_routes``; ``NO_ROUTE`` rows keep the
            router's own choice): the engine's with ``algorithm.routingReplay: rollout``,
            the trainer's old-log-prob pass's with ``training``; else None.
    """

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    advantages: Tensor
    rollout_logprobs: Tensor
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    values: Tensor | None = None
    returns: Tensor | None = None
    routes: Tensor | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {shape}")
        if self.routes is not None and (self.routes.dim() != 4
                                        or tuple(self.routes.shape[:2]) != shape):
            raise ValueError(f"TrainBatch.routes has shape {tuple(self.routes.shape)}; it must "
                             f"be [B, T, layers, top_k] with [B, T] = {shape}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name != "routes" and value is not None and tuple(value.shape) != shape:
                raise ValueError(f"TrainBatch.{field.name} has shape {tuple(value.shape)}; "
                                 f"every field must match input_ids {shape}")

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def map(self, fn: _TensorFn) -> TrainBatch:
        """A new batch with ``fn`` applied to every tensor field (None stays None)."""
        changes = {f.name: fn(getattr(self, f.name)) for f in dataclasses.fields(self)
                   if getattr(self, f.name) is not None}
        return dataclasses.replace(self, **changes)

    def slice(self, start: int, end: int) -> TrainBatch:
        """Samples ``start:end`` (views, no copy)."""
        return self.map(lambda t: t[start:end])

    def select(self, rows: Sequence[int] | Tensor) -> TrainBatch:
        """The samples at ``rows``, in that order (a copy). An index tensor already on the
        batch's device is used as it is (no transfer, so no host sync on a GPU)."""
        index = rows if isinstance(rows, Tensor) else torch.tensor(list(rows), dtype=torch.long)
        return self.map(lambda t: t.index_select(0, index.to(t.device)))

    def to(self, device: str | torch.device) -> TrainBatch:
        """The batch on ``device``. To a GPU from the host through pinned memory, without
        waiting: a copy from ordinary host memory waits for the GPU's queue to drain (a host
        sync per field, five a step)."""
        target = torch.device(device)
        if target.type != "cuda":
            return self.map(lambda t: t.to(target))
        return self.map(lambda t: t.pin_memory().to(target, non_blocking=True)
                        if t.device.type == "cpu" else t.to(target))

    def chunks(self, size: int) -> Iterator[TrainBatch]:
        """Consecutive batches of ``size`` samples (the last one may be shorter)."""
        if size < 1:
            raise ValueError(f"chunk size must be >= 1, got {size}")
        for start in range(0, len(self), size):
            yield self.slice(start, min(start + size, len(self)))

    def split(self, parts: int) -> list[TrainBatch]:
        """``parts`` equal contiguous shards, one per data-parallel rank.

        Equal sizes are required, not just convenient: every rank must run the same number
        of forward/backward passes and optimizer steps, or the gradient all-reduce of the
        rank with more work waits forever for the others.
        """
        if parts < 1 or len(self) % parts:
            raise ValueError(f"a batch of {len(self)} samples does not split evenly into "
                             f"{parts} data-parallel shards")
        size = len(self) // parts
        return [self.slice(i * size, (i + 1) * size) for i in range(parts)]


def trainer_old_logprobs(batch: TrainBatch, logp: Tensor, fresh: bool) -> Tensor | None:
    """The trainer's own log-probs of the sampling policy for a micro-batch's rows: the
    batch's ``old_logprobs`` when the backend computed them, else, in the rollout's first
    optimizer step (``fresh``), its training forward's ``logp`` detached (the policy has not
    moved yet); else None (``oldLogprobs: engine``, later steps: the trainer has none, and
    the train-inference gap is not measured there)."""
    if batch.old_logprobs is not None:
        return batch.old_logprobs
    return logp.detach() if fresh else None


def sft_step_parts(batch: TrainBatch, sft: TrainBatch | None, share: int, global_batch: int,
                   ranks: str) -> list[TrainBatch | None]:
    """Check that a rank's shard of one rollout makes whole optimizer steps of ``share``
    samples (its part of every global batch) and cut ``sft``'s demonstrations into one equal
    part per step (None each without demonstrations). ``ranks`` names what the global batch
    is divided by, for the error message."""
    if len(batch) == 0 or len(batch) % share:
        raise ValueError(f"this rank got {len(batch)} samples, not a positive multiple of its "
                         f"share of the global batch ({share} = globalBatchSize {global_batch} "
                         f"/ {ranks})")
    steps = len(batch) // share
    sft_parts: list[TrainBatch | None] = [None] * steps
    if sft is not None:
        if len(sft) % steps:
            raise ValueError(f"{len(sft)} demonstrations on this rank do not split into its "
                             f"{steps} optimizer steps")
        sft_parts = list(sft.chunks(len(sft) // steps))
    return sft_parts


class _TensorFn(Protocol):
    def __call__(self, t: Tensor, /) -> Tensor: ...


@runtime_checkable
class Backend(Protocol):
    """What the loop needs from a training backend; one instance per training rank.

    Constructed as ``Backend(spec, *, rank, world_size, device)``; when ``world_size > 1``
    the caller has already initialised torch.distributed's default process group.
    Methods marked *collective* must be called on every rank, in the same order.
    """

    def logprobs(self, batch: TrainBatch) -> Tensor:
        """``[B, T]`` current-policy log-probs of each token given the tokens before it,
        logits divided by ``algorithm.temperature``; 0 off the loss mask and at position 0.
        Returned on CPU."""
        ...

    def ref_logprobs(self, batch: TrainBatch) -> Tensor | None:
        """As ``logprobs`` under the frozen reference model; None when klCoef == 0."""
        ...

    def train_step(self, batch: TrainBatch, sft: TrainBatch | None = None) -> dict[str, float]:
        """Collective. Train on this rank's shard of a rollout: one optimizer step per
        global batch (micro-batches, gradient accumulation, clipping, AdamW, LR schedule),
        each with its part of ``sft``'s demonstrations in an NLL term (``algorithm.sftCoef``).
        Returns metrics averaged over the shard."""
        ...

    def data_parallel_coords(self) -> tuple[int, int, bool]:
        """``(data-parallel rank, data-parallel size, reports)``: the driver gives this rank
        shard ``rank`` of ``size`` of every batch, and reads log-probs and metrics from the
        ranks that report (one per data-parallel rank)."""
        ...

    def named_tensor_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None,
                             ) -> Iterator[list[tuple[str, Tensor]]]:
        """The full weights as weight sync sends them: ``(HF name, tensor)`` lists of at
        most ``bucket_bytes`` each (a single larger tensor gets a bucket of its own), in
        ``dtype`` (the engines', ``engine_command.engine_dtype``; None: the backend's own).
        Each tensor once, under the names HF saves: a tied ``lm_head.weight`` is left out,
        since engines tie it to the embedding on load (SGLang skips the name)."""
        ...

    def offload(self, *, optimizer: bool, weights: bool) -> int:
        """Free this rank's GPU memory for colocated engines (placement: colocate): the
        optimizer's state and/or the weights to host memory, gradients dropped. Returns the
        bytes freed (0 on CPU). Several calls add up; `onload` undoes them all, and must come
        before anything else is asked of the backend."""
        ...

    def onload(self, kinds: Collection[str] | None = None) -> None:
        """Bring back what `offload` freed: all of it, or only `kinds` ("weights",
        "optimizer"; a no-op when nothing is off)."""
        ...

    def save(self, dir: str | Path) -> None:
        """Collective. Write model (an HF directory), optimizer, scheduler and RNG state."""
        ...

    def load(self, dir: str | Path) -> None:
        """Collective. Restore what ``save`` wrote into this (freshly built) backend."""
        ...
