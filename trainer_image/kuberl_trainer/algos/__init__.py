"""RL math, pure torch: advantages, KL estimators, policy losses, group filters.

No ray, network or file I/O here (import-linter enforces it); every function maps tensors to
tensors so it can be tested against hand-computed values.
"""

from kuberl_trainer.algos import advantages, filters, kl

__all__ = ["advantages", "filters", "kl"]
