"""The tiny local job's ingredients, made by the project's own code (no model hub, no network).

`python -m kuberl_trainer.tiny build --out DIR` writes 2-digit addition data, a 14-symbol
character tokenizer, and a ~0.66M-parameter Qwen2-config model warm-started by a short SFT, so
that GRPO on one CPU has something to learn and visibly does (DESIGN.md, "a measured reference
point for the tiny local job"). `--variant tool`: the tiny agent's task; `--variant moe`: the
same task on a Qwen3-MoE model (4 experts, top-2). Everything is seeded: the same seed gives the
same files.
"""

from kuberl_trainer.tiny.build import BuildConfig, build

__all__ = ["BuildConfig", "build"]
