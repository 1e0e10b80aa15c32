"""RL math, pure torch: advantages, KL estimators, policy losses, group filters.

No ray, network or file I/O here (import-linter enforces it); every function maps tensors to
tensors so it can be tested against hand-computed values.
"""

from kuberl_trainer.algos import advantages, filters, kl
from kuberl_trainer.algos.custom_loss import LossInputs  # what a job's own loss receives

__all__ = ["LossInputs", "advantages", "filters", "kl"]
