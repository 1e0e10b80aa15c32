"""Which backend a job trains with: the one place that names the backends, so the interface
(base.py) imports none of them and each imports only what it builds on."""

from __future__ import annotations

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.backends.base import Backend


def preload_backend(spec: RLJobSpec) -> None:
    """Import what building ``spec``'s backend takes, without building it: a rank's actor does
    this as it starts, while the engines load, so that its build (after the engines are up,
    colocated) is only the build (the imports were 3 s of the tiny job's 2-core start-up).
    Imports touch no GPU. The megatron backend is left to ``make_backend``: Transformer
    Engine's import may open a CUDA context, which must wait until colocated engines have
    sized their memory pool from the free memory."""
    if spec.training.backend == "fsdp":
        from kuberl_trainer.backends.fsdp_models import preload

        preload(spec.model.path)
        if spec.training.lora is not None:
            import kuberl_trainer.backends.lora  # noqa: F401  (PEFT's import)


def make_backend(spec: RLJobSpec, rank: int, world_size: int, device: str) -> Backend:
    """The backend ``spec.training.backend`` names, built for this rank."""
    kind = spec.training.backend
    if kind == "fsdp":
        # Imported here: transformers is slow to import and only the chosen backend needs it.
        from kuberl_trainer.backends.fsdp import FSDPBackend

        return FSDPBackend(spec, rank=rank, world_size=world_size, device=device)
    if kind == "megatron":
        # Imported here: megatron-core is only installed where the backend runs (GPU images).
        from kuberl_trainer.backends.megatron.backend import MegatronBackend

        return MegatronBackend(spec, rank=rank, world_size=world_size, device=device)
    raise ValueError(f"unknown training.backend {kind!r}; expected 'fsdp' or 'megatron'")
