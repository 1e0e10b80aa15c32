"""What a backend's train_step reports: token-weighted means of the micro-batches' statistics,
the mean loss and grad norm, and the last learning rate of its optimizer steps.

Micro-batches report device scalars (``add_micro``); ``summary`` reads all of them back in one
transfer. A host read per micro-batch would be a device sync each, and on a GPU every sync
stalls the launch queue while the step is still running."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

# What ``summary`` reports beside the token-means of the micro-batches' stats.
PER_STEP = frozenset({"loss", "sft_nll", "grad_norm", "lr", "optimizer_steps",
                      "response_tokens", "lora_trainable_params", "lora_adapter_norm"})


def combine_ranks(results: Sequence[dict[str, float]]) -> dict[str, float]:
    """One dict from the data-parallel ranks' summaries (the same keys each). The ranks hold
    equal numbers of samples but not of tokens, so a token-mean is weighted by each rank's
    ``response_tokens``; extremes (``*_max``, ``*_min``) stay extremes; the rest (``PER_STEP``,
    or everything when no rank has response tokens) is the ranks' mean."""
    weights = [r.get("response_tokens", 0.0) for r in results]
    total = sum(weights)
    out = {}
    for key in results[0]:
        values = [r[key] for r in results]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        elif key in PER_STEP or total <= 0:
            out[key] = sum(values) / len(values)
        else:
            out[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / total
    return out


@dataclass
class _Micro:
    tokens: Tensor
    loss: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)
    sft_nll: Tensor | None = None

    def scalars(self) -> list[Tensor]:
        extra = [] if self.sft_nll is None else [self.sft_nll]
        return [self.tokens, self.loss, *extra, *self.stats.values()]


class StepMetrics:
    """Token-weighted means of micro-batch stats (extremes, ``*_max``/``*_min``, stay
    extremes); the mean loss, the mean grad norm and the last lr of the optimizer steps.

    A stat's mean is over the tokens of the micro-batches that report it: one only some
    report (the train-inference gap with ``oldLogprobs: engine``, measurable in the rollout's
    first optimizer step only) is their mean, not diluted by the others' tokens. Extremes come
    from the micro-batches with response tokens (one without has none to report: its
    placeholder must not win), or from the first micro-batch when none has any."""

    def __init__(self) -> None:
        self.micros: list[_Micro] = []
        self.grad_norms: list[float] = []
        self.lr = 0.0

    def add_micro(self, *, tokens: Tensor, loss: Tensor, stats: dict[str, Tensor] | None = None,
                  sft_nll: Tensor | None = None) -> None:
        """One micro-batch: its response tokens, its part of the step's loss, and either the
        objective's token-mean ``stats`` or (an SFT micro-batch) its summed ``sft_nll``."""
        self.micros.append(_Micro(tokens, loss, stats or {}, sft_nll))

    def add_step(self, grad_norm: float, lr: float) -> None:
        self.grad_norms.append(grad_norm)
        self.lr = lr

    def summary(self) -> dict[str, float]:
        sums: dict[str, float] = {}
        weights: dict[str, int] = {}
        extremes: dict[str, float] = {}
        placeholders: set[str] = set()  # extremes only micro-batches without tokens reported
        tokens = sft_tokens = 0
        loss = sft_nll = 0.0
        for micro, values in zip(self.micros, self._read_back(), strict=True):
            count, part, *rest = values
            loss += part
            if micro.sft_nll is not None:
                sft_nll += rest[0]
                sft_tokens += int(count)
                continue
            tokens += int(count)
            for key, value in zip(micro.stats, rest, strict=True):
                if key.endswith(("_max", "_min")):
                    if count > 0 and key in placeholders:  # a real value replaces it
                        extremes[key] = value
                        placeholders.discard(key)
                    elif key not in extremes:
                        extremes[key] = value
                        if count == 0:
                            placeholders.add(key)
                    elif count > 0:
                        pick = max if key.endswith("_max") else min
                        extremes[key] = pick(extremes[key], value)
                else:
                    sums[key] = sums.get(key, 0.0) + value * count
                    weights[key] = weights.get(key, 0) + int(count)
        out = {k: v / max(weights[k], 1) for k, v in sums.items()}
        out.update(extremes)
        steps = max(len(self.grad_norms), 1)
        out["loss"] = loss / steps  # each step's loss is the sum of its micro parts
        if sft_tokens:
            out["sft_nll"] = sft_nll / sft_tokens
        out["grad_norm"] = sum(self.grad_norms) / steps
        out["lr"] = self.lr
        out["optimizer_steps"] = float(len(self.grad_norms))
        out["response_tokens"] = float(tokens)
        return out

    def _read_back(self) -> list[list[float]]:
        """Every micro-batch's scalars as floats, in one device-to-host transfer."""
        scalars = [s for micro in self.micros for s in micro.scalars()]
        if not scalars:
            return []
        flat = iter(torch.stack([s.detach().to(torch.float64).reshape(())
                                 for s in scalars]).tolist())
        return [[next(flat) for _ in micro.scalars()] for micro in self.micros]
