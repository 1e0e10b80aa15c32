"""Fused kernels for the fsdp backend's HF models (`training.fusedKernels`).

``liger``: Liger Kernel's Triton RoPE, RMSNorm and SwiGLU in place of the model family's eager
PyTorch ops, each of which reads and writes the activations once more per op (bench/RESULTS.md:
1.15-1.20x the train step at the Qwen2.5-1.5B shape on an H200, 10 GiB less peak memory). Not
Liger's cross-entropy kernels: the trainer's log-probs come from its own chunked kernel
(`vocab_logprobs`), never from HF's loss. Liger patches the family's modeling module as well as
the instance (its RoPE is a module-level function), so every model of that family the process
builds afterwards runs it too: the policy and its reference are both patched anyway. Triton
runs on GPUs only; the spec refuses liger for CPU training, and the trainer image installs the
package (the ``kernels`` extra).
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel

NONE, LIGER = "none", "liger"
LIGER_OPS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
             "fused_linear_cross_entropy": False}


def apply_fused_kernels(model: PreTrainedModel, kind: str) -> None:
    """Patch ``model`` (before it is wrapped or sharded) with ``kind``'s kernels; "none" leaves
    it as loaded. Raises, naming the field, when the kernels cannot be applied: a model that
    silently ran without them would not be what the spec asked for."""
    if kind == NONE:
        return
    if kind != LIGER:
        raise ValueError(f"training.fusedKernels: unknown kernels {kind!r} (none or liger)")
    table, apply = _liger()
    model_type = getattr(model.config, "model_type", None)
    if model_type not in table:
        raise ValueError(f"training.fusedKernels: Liger Kernel has no kernels for model_type "
                         f"{model_type!r} (it has: {', '.join(sorted(table))}); set "
                         "fusedKernels: none")
    apply(model=model, **LIGER_OPS)


def _liger() -> tuple[dict[str, Any], Any]:
    try:
        from liger_kernel.transformers.monkey_patch import (
            MODEL_TYPE_TO_APPLY_LIGER_FN,
            _apply_liger_kernel_to_instance,
        )
    except ImportError as exc:
        raise RuntimeError(
            "training.fusedKernels: liger needs the liger-kernel package, which kuberl's "
            f"trainer image installs (pip install 'kuberl[kernels]'): {exc}") from exc
    return MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance
