"""What a backend's train_step reports: token-weighted means of the micro-batches' statistics,
the mean loss and grad norm, and the last learning rate of its optimizer steps."""

from __future__ import annotations


class StepMetrics:
    """Token-weighted means of micro-batch stats (extremes, ``*_max``/``*_min``, stay
    extremes); the mean loss, the mean grad norm and the last lr of the optimizer steps."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.extremes: dict[str, float] = {}
        self.tokens = 0
        self.loss = 0.0
        self.sft_nll, self.sft_tokens = 0.0, 0
        self.grad_norms: list[float] = []
        self.lr = 0.0

    def add_tokens(self, stats: dict[str, float], tokens: int) -> None:
        for key, value in stats.items():
            if key.endswith("_max"):
                self.extremes[key] = max(self.extremes.get(key, value), value)
            elif key.endswith("_min"):
                self.extremes[key] = min(self.extremes.get(key, value), value)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value * tokens
        self.tokens += tokens

    def add_loss(self, part: float) -> None:
        self.loss += part

    def add_sft(self, nll_sum: float, tokens: int) -> None:
        self.sft_nll += nll_sum
        self.sft_tokens += tokens

    def add_step(self, grad_norm: float, lr: float) -> None:
        self.grad_norms.append(grad_norm)
        self.lr = lr

    def summary(self) -> dict[str, float]:
        out = {k: v / max(self.tokens, 1) for k, v in self.sums.items()}
        out.update(self.extremes)
        steps = max(len(self.grad_norms), 1)
        out["loss"] = self.loss / steps  # each step's loss is the sum of its micro parts
        if self.sft_tokens:
            out["sft_nll"] = self.sft_nll / self.sft_tokens
        out["grad_norm"] = sum(self.grad_norms) / steps
        out["lr"] = self.lr
        out["optimizer_steps"] = float(len(self.grad_norms))
        out["response_tokens"] = float(self.tokens)
        return out
