"""Training backends behind one interface: `fsdp` (HF transformers + torch DDP/FSDP2) today,
`megatron` (megatron-core) in issue 6. See ``base.py`` and docs/trainer-contracts.md."""

from kuberl_trainer.backends.base import Backend, TrainBatch, make_backend

__all__ = ["Backend", "TrainBatch", "make_backend"]
