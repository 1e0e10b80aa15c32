"""PPO's value model on the fsdp backend: the policy's transformer with a scalar head.

It is built from an HF causal-LM directory (``critic.modelPath``, default ``model.path``) as
``AutoModelForTokenClassification`` with one label: the same backbone weights, the LM head
dropped and a fresh linear value head that starts at zero, so every first estimate is 0 and
PPO's first advantages are the plain returns. (HF's random head, at the model's
initializer_range over unnormalised hidden states, gave estimates of +-1 on the tiny model:
GAE then mixed the head's noise into every advantage, and the policy learnt nothing until the
critic caught up, ~6 steps. A saved value model, e.g. a checkpoint's critic/, keeps its head.)
Everything else - parallel modes, micro-batching, optimizer and LR schedule, checkpoints - is
the fsdp backend's; only the model, the loss and the learning rate differ.

Alignment (see backends/base.py): ``values[:, t]`` estimates the return from generating token
``t`` on, so it is read from the hidden state at ``t - 1`` (the prefix before token ``t``),
exactly where the policy's logits for token ``t`` come from. Position 0 has no prefix: 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoModelForTokenClassification, PreTrainedModel

from kuberl_api.spec import LoraSpec
from kuberl_trainer.algos import aggregation, value_loss
from kuberl_trainer.algos.objective import Objective
from kuberl_trainer.backends.base import TrainBatch
from kuberl_trainer.backends.fsdp import FSDPBackend
from kuberl_trainer.backends.fsdp_models import build_model
from kuberl_trainer.backends.micro_batches import MicroBatch
from kuberl_trainer.backends.moe_routing import MoeRouting
from kuberl_trainer.backends.packing import align_to_tokens, unpack
from kuberl_trainer.backends.tokens import response_mask


class _ValueModel:
    """``AutoModelForTokenClassification`` whose parameters missing from the checkpoint (the
    fresh value head of a causal-LM directory) start at zero."""

    @staticmethod
    def from_pretrained(path: str, **kwargs: Any) -> PreTrainedModel:
        model, info = AutoModelForTokenClassification.from_pretrained(
            path, output_loading_info=True, **kwargs)
        fresh = set(info["missing_keys"])
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in fresh:
                    param.zero_()
        return model  # type: ignore[no-any-return]


class ValueBackend(FSDPBackend):
    """One rank of the value model; the same collectives and layout as ``FSDPBackend``."""

    @property
    def model_path(self) -> str:
        return self.spec.critic.model_path or self.spec.model.path

    def _make_objective(self) -> Objective:
        return Objective(aggregation="token-mean")  # (only its units: the value loss's mean)

    def _build_trainable(self) -> PreTrainedModel:
        # HF draws the fresh head's random init before it is zeroed: the global RNG the rest
        # of the run draws from is left as it was.
        with torch.random.fork_rng(devices=[]):
            return build_model(self.model_path, self.device, self.mode, trainable=True,
                               auto_class=_ValueModel, num_labels=1)

    def _build_reference(self) -> PreTrainedModel | None:
        return None

    def _lora_spec(self) -> LoraSpec | None:
        return None  # training.lora adapts the policy; the value model trains all its weights

    def _moe_routing(self) -> MoeRouting | None:
        # Replay and the aux loss are the policy's (docs/moe.md): an MoE value model routes by
        # itself, with no load-balancing term in the value loss.
        return None

    def _lr(self) -> float:
        return self.spec.critic.lr

    def _prepare(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        if batch.values is None or batch.returns is None:
            raise ValueError("the value model trains on a batch with values and returns")
        return batch, {}

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> Tensor:
        """``[B, T]`` float32 value estimates on CPU, 0 off the response; in micro-batches."""
        return self._per_token(batch, lambda mb: self._values(self.module, mb)).cpu()

    def _values(self, model: nn.Module, mb: MicroBatch) -> Tensor:
        """``[b, t]``: the estimate before token t is the score read after token t - 1 in
        the same sequence (0 at a sequence's start)."""
        scores = self._forward(model, mb)[:, 0].float()       # [N]: after each packed token
        return unpack(align_to_tokens(scores, mb.packed), mb.packed, mb.batch.input_ids.shape[1])

    def _micro_loss(self, mb: MicroBatch, fresh: bool
                    ) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        b = mb.batch
        assert b.values is not None and b.returns is not None
        mask = response_mask(b.loss_mask)
        values = self._values(self.model, mb)
        # critic.valueClip 0 turns clipping off (the spec has no "unset": see CriticSpec)
        per_token, stats = value_loss.value_loss(values, b.values, b.returns, mask,
                                                 self.spec.critic.value_clip or None)
        partial = aggregation.partial_sum(per_token, mask, "token-mean")
        on = mask.bool()
        n = on.sum().clamp(min=1)
        with torch.no_grad():
            stats["value_loss"] = per_token.detach().sum() / n
            stats["value_mean"] = torch.where(on, values, 0.0).sum() / n
        return partial, stats, on.sum()
