"""A job's own policy loss (``algorithm.policyLoss: custom``): the per-token policy term of the
objective, written by the user as ``fn(inp, **lossArgs) -> (loss, metrics)``.

The function replaces only that term (``pg`` in ``algos.objective``'s formula); kuberl keeps
the rest around it: the TIS and masked-IS weights, the KL and entropy terms and the loss
aggregation, so that a batch cut into micro-batches and data-parallel ranks trains exactly
as the whole (as long as each row's loss depends on that row alone: a micro-batch holds whole
responses, never the whole batch).

The contract (docs/algorithms.md, "Your own loss"):

- ``inp`` is a ``LossInputs``: ``[B, T]`` tensors of one micro-batch, every one 0 off the
  mask (padding holds no garbage to guard against), only ``logp`` with a gradient.
- ``loss``: a float tensor ``[B, T]``, the per-token policy loss (kuberl keeps its values on
  the mask only; the gradient must reach ``inp.logp``).
- ``metrics``: a mapping of names (letters, digits, ``_``) to scalars (0-d or one-element
  tensors, or Python numbers), reported as ``loss_<name>``: a token-mean over the micro-batch
  is what kuberl combines exactly (weighted by the micro-batches' and ranks' response tokens),
  and a name ending in ``_max`` or ``_min`` is combined as an extreme.

``check`` calls the function once on a small synthetic batch before anything trains
(preflight.py), so a broken function fails the job at once with what was wrong.

A function needs no kuberl import: it reads ``inp``'s attributes, so anything with them
(a ``types.SimpleNamespace`` in the user's own tests) works as well.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kuberl_trainer.user_code import import_object

METRIC_PREFIX = "loss_"
METRIC_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's per-token inputs of a custom loss, all ``[B, T]`` and 0 off ``mask``.

    Attributes:
        logp: the policy's log-probs of the sampled tokens, with gradient (the one input the
            loss must depend on).
        old_logp: pi_old, the policy that sampled the rows, as kuberl's own losses see it:
            the trainer's log-probs of the sampling policy (``oldLogprobs: trainer``; with one
            optimizer step per rollout, its training forward's own, detached) or the engines'
            (``oldLogprobs: engine``, where it equals ``rollout_logp``).
        rollout_logp: the engines' log-probs from sampling.
        ref_logp: the reference model's (or, with on-policy distillation, the teacher's), when
            the job has one (``klCoef > 0`` or ``teacherPath``); else None.
        advantages: the per-token advantages.
        mask: 1.0 on the response tokens the loss counts, else 0.0.
        entropy: the policy's per-token entropy, detached (a statistic to weigh tokens by;
            an entropy bonus is ``entropyCoef``'s).
    """

    logp: Tensor
    old_logp: Tensor
    rollout_logp: Tensor
    ref_logp: Tensor | None
    advantages: Tensor
    mask: Tensor
    entropy: Tensor

    @classmethod
    def of(cls, *, logp: Tensor, old_logp: Tensor, rollout_logp: Tensor,
           ref_logp: Tensor | None, advantages: Tensor, mask: Tensor,
           entropy: Tensor) -> LossInputs:
        """The inputs with padding set to 0 (a select: a NaN there neither passes nor gets a
        gradient) and everything but ``logp`` detached."""
        on = mask.bool()

        def clean(x: Tensor) -> Tensor:
            return torch.where(on, x, torch.zeros_like(x))

        return cls(logp=clean(logp), old_logp=clean(old_logp.detach()),
                   rollout_logp=clean(rollout_logp.detach()),
                   ref_logp=None if ref_logp is None else clean(ref_logp.detach()),
                   advantages=clean(advantages.detach()), mask=on.to(logp.dtype),
                   entropy=clean(entropy.detach()))


class LossFunctionError(ValueError):
    """A loss function that cannot load or broke its contract; the message says which and
    how."""


@dataclass(frozen=True)
class CustomLoss:
    """``algorithm.lossFunction`` imported, with its ``lossArgs``."""

    path: str
    fn: Callable[..., Any]
    args: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str, args: Mapping[str, float] | None = None) -> CustomLoss:
        """Import ``module:function`` (raises ``user_code.UserCodeError``, naming it)."""
        return cls(path, import_object(path, "loss function"), dict(args or {}))

    def __call__(self, inp: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        """``(per-token loss [B, T], metrics)``: the function's result, its shape and
        metrics checked (nothing here reads a value back: on a GPU that would be a sync per
        micro-batch), the metrics as detached float32 device scalars named
        ``loss_<name>``."""
        out = self.fn(inp, **self.args)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise LossFunctionError(f"{self.name} must return (loss, metrics), got "
                                    f"{_kind(out)}")
        loss, metrics = out
        if not isinstance(loss, Tensor) or not loss.is_floating_point():
            raise LossFunctionError(f"{self.name} returned a loss that is {_kind(loss)}, "
                                    f"not a float tensor [B, T]")
        if loss.shape != inp.mask.shape:
            raise LossFunctionError(f"{self.name} returned a loss of shape "
                                    f"{list(loss.shape)}; the per-token loss must be [B, T] = "
                                    f"{list(inp.mask.shape)}, like inp.logp")
        if not isinstance(metrics, Mapping):
            raise LossFunctionError(f"{self.name} returned metrics that are {_kind(metrics)}, "
                                    "not a dict of names to scalars")
        return loss, {METRIC_PREFIX + self._metric_name(k): self._scalar(k, v, loss.device)
                      for k, v in metrics.items()}

    @property
    def name(self) -> str:
        return f"loss function {self.path!r}"

    def _metric_name(self, key: object) -> str:
        if not isinstance(key, str) or not METRIC_NAME.match(key):
            raise LossFunctionError(f"{self.name} returned a metric named {key!r}: names are "
                                    "letters, digits and '_', not starting with a digit")
        return key

    def _scalar(self, key: str, value: object, device: torch.device) -> Tensor:
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise LossFunctionError(f"{self.name} returned metric {key!r} of shape "
                                        f"{list(value.shape)}: a metric is a scalar (e.g. a "
                                        "token-mean over inp.mask)")
            return value.detach().reshape(()).to(device=device, dtype=torch.float32)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return torch.tensor(float(value), dtype=torch.float32, device=device)
        raise LossFunctionError(f"{self.name} returned metric {key!r} as {_kind(value)}: a "
                                "metric is a scalar tensor or a number")


def _kind(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


# The synthetic batch `check` calls a function on: a few rows of unequal lengths (one all
# padding), ratios within 1 +- RATIO_SPREAD of pi_old (inside any clip range a loss would
# use), advantages of both signs.
CHECK_ROWS, CHECK_WIDTH, RATIO_SPREAD = 4, 6, 0.05


def synthetic_inputs(*, with_ref: bool, seed: int = 0) -> tuple[LossInputs, Tensor]:
    """``(inputs, logp leaf)``: a small batch as a backend would pass it, on CPU."""
    gen = torch.Generator().manual_seed(seed)
    shape = (CHECK_ROWS, CHECK_WIDTH)
    lengths = torch.tensor([CHECK_WIDTH, CHECK_WIDTH - 2, 1, 0])  # the last: all padding
    mask = (torch.arange(CHECK_WIDTH)[None, :] < lengths[:, None]).float()

    def noise() -> Tensor:
        return (torch.rand(shape, generator=gen) * 2 - 1) * RATIO_SPREAD

    logp = (-0.1 - 2 * torch.rand(shape, generator=gen)).requires_grad_()
    old = logp.detach() + noise()
    inputs = LossInputs.of(
        logp=logp, old_logp=old, rollout_logp=old + noise(),
        ref_logp=old + noise() if with_ref else None,
        advantages=torch.randn(shape, generator=gen), mask=mask,
        entropy=torch.rand(shape, generator=gen) * 2)
    return inputs, logp


def check(loss: CustomLoss, *, with_ref: bool) -> None:
    """Call ``loss`` once on ``synthetic_inputs`` and raise ``LossFunctionError`` if it
    raises, returns the wrong shape, a value that is not finite (on the mask), a metric that
    is not a finite scalar, or a loss no gradient of ``inp.logp`` flows from."""
    inp, logp = synthetic_inputs(with_ref=with_ref)
    where = (f"(called on a synthetic batch: {CHECK_ROWS} rows x {CHECK_WIDTH} tokens, ratios "
             f"within 1 +- {RATIO_SPREAD}, ref_logp {'given' if with_ref else 'None'})")
    try:
        per_token, metrics = loss(inp)
    except LossFunctionError as exc:
        raise LossFunctionError(f"{exc} {where}") from None
    except Exception as exc:  # the user's code: whatever it raises
        raise LossFunctionError(f"{loss.name} raised {type(exc).__name__}: {exc} "
                                f"{where}") from exc
    on = inp.mask.bool()
    if not bool(torch.isfinite(per_token.detach()[on]).all()):
        raise LossFunctionError(f"{loss.name} returned a loss that is not finite on "
                                f"response tokens {where}")
    for key, value in metrics.items():
        if not math.isfinite(float(value)):
            raise LossFunctionError(f"{loss.name} returned metric "
                                    f"{key.removeprefix(METRIC_PREFIX)!r} = {float(value)} "
                                    f"{where}")
    total = torch.where(on, per_token, torch.zeros_like(per_token)).sum()
    grad = (torch.autograd.grad(total, logp, allow_unused=True)[0]
            if total.requires_grad else None)
    if grad is None:
        raise LossFunctionError(f"{loss.name}: no gradient reaches inp.logp (the loss is "
                                f"detached from it) {where}")
    if not bool(grad[on].ne(0).any()):
        raise LossFunctionError(f"{loss.name}: no gradient reaches inp.logp (it is 0 on "
                                f"every response token) {where}")
    if not bool(torch.isfinite(grad[on]).all()):
        raise LossFunctionError(f"{loss.name}: the gradient of inp.logp is not finite "
                                f"{where}")
