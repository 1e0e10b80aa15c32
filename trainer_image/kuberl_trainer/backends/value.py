"""PPO's value model on the fsdp backend: the policy's transformer with a scalar head.

It is built from an HF causal-LM directory (``critic.modelPath``, default ``model.path``) as
``AutoModelForTokenClassification`` with one label: the same backbone weights, the LM head
dropped and a fresh linear value head (HF initialises it small, so first estimates are near 0).
Everything else - parallel modes, micro-batching, optimizer and LR schedule, checkpoints - is
the fsdp backend's; only the model, the loss and the learning rate differ.

Alignment (see backends/base.py): ``values[:, t]`` estimates the return from generating token
``t`` on, so it is read from the hidden state at ``t - 1`` (the prefix before token ``t``),
exactly where the policy's logits for token ``t`` come from. Position 0 has no prefix: 0.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import AutoModelForTokenClassification, PreTrainedModel

from kuberl_trainer.algos import aggregation, value_loss
from kuberl_trainer.algos.objective import Objective
from kuberl_trainer.backends.base import TrainBatch
from kuberl_trainer.backends.fsdp import FSDPBackend, build_model
from kuberl_trainer.backends.tokens import response_mask

VALUE_HEAD_SEED = 0


class ValueBackend(FSDPBackend):
    """One rank of the value model; the same collectives and layout as ``FSDPBackend``."""

    @property
    def model_path(self) -> str:
        return self.spec.critic.model_path or self.spec.model.path

    def _make_objective(self) -> Objective:
        return Objective(aggregation="token-mean")  # (only its units: the value loss's mean)

    def _build_trainable(self) -> PreTrainedModel:
        # The fresh head's initial weights come from a fixed seed: every rank and every run
        # (a restart from the policy's weights, a test) starts from the same value model,
        # and the global RNG the rest of the run draws from is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(VALUE_HEAD_SEED)
            return build_model(self.model_path, self.device, self.mode, trainable=True,
                               auto_class=AutoModelForTokenClassification, num_labels=1)

    def _build_reference(self) -> PreTrainedModel | None:
        return None

    def _lr(self) -> float:
        return self.spec.critic.lr

    def _prepare(self, batch: TrainBatch) -> TrainBatch:
        if batch.values is None or batch.returns is None:
            raise ValueError("the value model trains on a batch with values and returns")
        return batch

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> Tensor:
        """``[B, T]`` float32 value estimates on CPU, 0 off the response; in micro-batches."""
        return self._per_token(batch, lambda mb: self._values(self.module, mb)).cpu()

    def _values(self, model: nn.Module, mb: TrainBatch) -> Tensor:
        with self._autocast():
            out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                        use_cache=False)
        scores = out.logits[..., 0].float()                  # [b, t]: after token i
        return nn.functional.pad(scores[:, :-1], (1, 0))      # [b, t]: before token t

    def _micro_loss(self, mb: TrainBatch) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        assert mb.values is not None and mb.returns is not None
        mask = response_mask(mb.loss_mask)
        values = self._values(self.model, mb)
        # critic.valueClip 0 turns clipping off (the spec has no "unset": see CriticSpec)
        per_token, stats = value_loss.value_loss(values, mb.values, mb.returns, mask,
                                                 self.spec.critic.value_clip or None)
        partial = aggregation.partial_sum(per_token, mask, "token-mean")
        on = mask.bool()
        n = on.sum().clamp(min=1)
        with torch.no_grad():
            stats["value_loss"] = per_token.detach().sum() / n
            stats["value_mean"] = torch.where(on, values, 0.0).sum() / n
        return partial, stats, on.sum()
