"""One arm of bench/lora_memory_check.py, run in a process of its own (so its peak memory is
its own): the engine's stand-in allocations, the real FSDPBackend on random weights built on the
device, the train steps, the weight sync into the stand-in's weights, and for LoRA the adapter
saved as a PEFT directory and the checks on the base and the adapter. Returns a JSON-able dict;
running out of GPU memory is a result (``oom_at``: the phase), not a crash."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from gpu_common import random_batch  # bench/ is on sys.path (sets the packages' paths too)

GIB = float(1 << 30)
BUCKET_BYTES = 512 << 20  # session.BUCKET_BYTES: the sync's bucket size
CHUNK = 1 << 26           # elements per fingerprint reduction (bounds its temporaries)


class EngineStandIn:
    """What a colocated SGLang engine keeps resident on the GPU, as plain allocations of the
    same size: its weights (``numel`` in ``dtype``; the sync writes into them) and a KV-cache
    reservation of ``kv_bytes``. ``resume``/``release`` stand for SGLang's
    /resume_memory_occupation and /release_memory_occupation."""

    def __init__(self, numel: int, kv_bytes: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.numel, self.kv_bytes, self.dtype, self.device = numel, kv_bytes, dtype, device
        self.weights: torch.Tensor | None = None
        self.kv: torch.Tensor | None = None

    def resume(self, what: str) -> None:
        if what == "weights" and self.weights is None:
            self.weights = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        if what == "kv" and self.kv is None:
            self.kv = torch.empty(self.kv_bytes, dtype=torch.uint8, device=self.device)

    def release(self) -> None:
        self.weights = self.kv = None
        empty_cache(self.device)

    @property
    def resident(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weights, self.kv)
                   if t is not None)


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def patch_loader(device: torch.device) -> None:
    """The backend's loader (fsdp_models.load_model, also imported by fsdp.py) builds the
    model from config.json directly on ``device``, random weights in float32, instead of
    reading a checkpoint on the host: the same model, attention and mode otherwise."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import kuberl_trainer.backends.fsdp as fsdp
    import kuberl_trainer.backends.fsdp_models as fsdp_models
    from kuberl_trainer.backends.fused_kernels import NONE, apply_fused_kernels
    from kuberl_trainer.backends.varlen_attention import register_hf_attention

    def load(path: str, *, trainable: bool, auto_class: Any = AutoModelForCausalLM,
             fused_kernels: str = NONE, **kwargs: Any) -> Any:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device(device):
            model = auto_class.from_config(config, dtype=torch.float32,
                                           attn_implementation=register_hf_attention(),
                                           **kwargs)
        apply_fused_kernels(model, fused_kernels)
        model.train(False)
        if not trainable:
            model.requires_grad_(False)
        return model

    for module in (fsdp_models, fsdp):
        setattr(module, "load_model", load)  # noqa: B010 (a module attribute, not typed)


def model_numel(model_dir: Path) -> int:
    """The weights a sync sends (tied weights once): the model's parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_dir, local_files_only=True))
    return sum(p.numel() for p in model.parameters())


def make_spec(args: argparse.Namespace, lora: bool, handoff: bool, model_dir: Path) -> Any:
    """One optimizer step per rollout of ``rows``, a micro-batch a row, no KL term (no
    reference model in either mode), the arm's training.offload and training.lora."""
    from kuberl_api.spec import RLJobSpec

    gpus = args.device == "cuda"
    place = {"gpusPerNode": 1} if gpus else {"nodes": 1, "gpusPerNode": 0}
    extra = {"lora": {"rank": args.rank}} if lora else {}
    return RLJobSpec.model_validate({
        "model": {"path": str(model_dir)},
        "data": {"prompts": "/unused.jsonl", "rolloutBatchSize": args.rows,
                 "nSamplesPerPrompt": 1},
        "training": {"backend": "fsdp", "microBatchSize": 1, **place,
                     "offload": {"optimizer": handoff, "weights": handoff}, **extra},
        "rollout": {} if gpus else {"engine": "reference"},
        "algorithm": {"lr": args.lr, "klCoef": 0.0},
    })


def fingerprint(model: torch.nn.Module) -> list[tuple[int, float]]:
    """Per frozen tensor: the sum of its bit patterns (int64) and of its values (float64).
    Any changed element changes the first, short of exactly compensating changes."""
    prints: list[tuple[int, float]] = []
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                continue
            flat = p.detach().reshape(-1)
            bits = flat.view({4: torch.int32, 2: torch.int16}[flat.element_size()])
            bit_sum, value_sum = 0, 0.0
            for start in range(0, flat.numel(), CHUNK):  # (bounded temporaries)
                bit_sum += int(bits[start:start + CHUNK].sum(dtype=torch.int64))
                value_sum += float(flat[start:start + CHUNK].sum(dtype=torch.float64))
            prints.append((bit_sum, value_sum))
    return prints


def sync(backend: Any, engine: EngineStandIn) -> tuple[float, int, dict[str, tuple[int, int]]]:
    """The colocated sync's copies, timed: each bucket of the backend's export (training dtype;
    LoRA: merged) cast and flattened by the trainer (``flatten_to``), then copied into the
    engine's weights (the engine's side of the CUDA IPC handle). Returns (seconds, bytes,
    {name: (offset, numel)} in the engine's weights)."""
    from kuberl_trainer.weight_sync.colocated import flatten_to

    assert engine.weights is not None, "the engine's weights must be resumed before a sync"
    where: dict[str, tuple[int, int]] = {}
    at = 0
    synchronize(engine.device)
    started = time.perf_counter()
    for bucket in backend.named_tensor_buckets(BUCKET_BYTES, None):
        flat, _ = flatten_to(bucket, engine.dtype)
        values = flat.view(engine.dtype)
        engine.weights[at:at + values.numel()].copy_(values)
        for name, tensor in bucket:
            where[name] = (at, tensor.numel())
            at += tensor.numel()
        del flat, values
    synchronize(engine.device)
    seconds = time.perf_counter() - started
    assert at == engine.numel, f"the sync sent {at} elements, the engine holds {engine.numel}"
    return seconds, at * engine.weights.element_size(), where


def merged_changed(backend: Any, engine: EngineStandIn,
                   where: dict[str, tuple[int, int]]) -> int:
    """Elements of LoRA's targeted weights that the engine received different from the base
    (in the engine's dtype): 0 means the adapter never reached the engine."""
    from kuberl_trainer.backends.lora import hf_entries

    assert engine.weights is not None
    changed = 0
    with torch.no_grad():
        for entry in hf_entries(backend._peft):
            if entry.layer is None:
                continue
            at, numel = where[entry.name]
            sent = engine.weights[at:at + numel]
            changed += int((sent != entry.value.reshape(-1).to(engine.dtype)).sum())
    return changed


def save_adapter_dir(backend: Any, out: Path) -> tuple[float, int]:
    """The adapter gathered and written as a PEFT directory (as the backend's checkpoint
    writes ``adapter/``): (seconds, bytes on disk)."""
    from kuberl_trainer.backends.fsdp_models import full_tensor
    from kuberl_trainer.backends.lora import save_adapter

    synchronize(backend.device)
    started = time.perf_counter()
    state = {name: full_tensor(p, None).cpu()
             for name, p in backend.module.named_parameters() if p.requires_grad}
    save_adapter(backend._peft, out, state)
    seconds = time.perf_counter() - started
    return seconds, sum(f.stat().st_size for f in out.rglob("*") if f.is_file())


def lora_b_max(backend: Any) -> float:
    """The largest |entry| of the adapter's B matrices (zero at the start: PEFT's init)."""
    from kuberl_trainer.backends.fsdp_models import full_tensor

    return max(float(full_tensor(p, None).abs().max())
               for name, p in backend.module.named_parameters() if ".lora_B." in name)


class Memory:
    """Peak-memory readings on the arm's device (None on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def allocated_gib(self) -> float | None:
        return torch.cuda.memory_allocated() / GIB if self.cuda else None

    def peaks(self) -> tuple[float | None, float | None]:
        if not self.cuda:
            return None, None
        return torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB


def pinned_host_bytes(backend: Any) -> int:
    """Host bytes the trainer's offload of optimizer and weights pins (backends/offload.py, as
    FSDPBackend.offload groups them): per kind, one buffer of the kept storages' summed sizes
    (each at a 512-byte boundary), pinned at exactly that size."""
    from kuberl_trainer.backends.offload import Offload, optimizer_state

    weights = [t for model in (backend.module, getattr(backend, "ref", None))
               if model is not None for t in (*model.parameters(), *model.buffers())]
    return (Offload(optimizer_state(backend.optimizer)).host_bytes
            + Offload(weights).host_bytes)


def host_available() -> int:
    """MemAvailable of this host (bytes; a large number where /proc/meminfo is absent)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def run_arm(args: argparse.Namespace, arm: Any) -> dict[str, Any]:
    """The arm's result (see lora_memory_check's table). Running out of GPU memory at any
    phase is recorded as ``oom_at`` with the peaks reached; any other error as ``error``
    (with its phase). With ``args.result`` the result so far is written there after every
    phase, so a process killed from outside (the host's OOM killer) still leaves it."""
    from kuberl_trainer.backends.fsdp import FSDPBackend

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    work = Path(args.work)
    model_dir = work / "model"
    patch_loader(device)
    numel = model_numel(model_dir)
    engine = EngineStandIn(numel, int(args.engine_kv_gib * GIB),
                           torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    memory = Memory(device)
    out: dict[str, Any] = {"arm": args.child, "note": arm.note, "oom_at": None}
    result = getattr(args, "result", None)
    phase = "engine allocation"

    def at(next_phase: str) -> None:
        nonlocal phase
        phase = next_phase
        if result:
            write_json(Path(result), {**out, "error": f"stopped in {phase}"})

    offloads = arm.handoff  # off when the host cannot hold what the offload pins
    try:
        if not arm.handoff:  # resident from the start (the engine starts before the trainer)
            engine.resume("weights")
            engine.resume("kv")
        out["engine_resident_gib"] = engine.resident / GIB
        at("build")
        torch.manual_seed(0)
        backend = FSDPBackend(make_spec(args, arm.lora, arm.handoff, model_dir), rank=0,
                              world_size=1, device=args.device)
        total = sum(p.numel() for p in backend.module.parameters())
        trainable = sum(p.numel() for p in backend.module.parameters() if p.requires_grad)
        out |= {"total_params": total, "trainable_params": trainable,
                "states_gib": (4 * total + 12 * trainable) / GIB,
                "built_gib": memory.allocated_gib()}
        before = fingerprint(backend.module) if arm.lora else None
        batch = random_batch(args.rows, prompt=args.tokens // 2,
                             response=(args.tokens - args.tokens // 2,) * 2,
                             vocab=int(getattr(backend.module.config, "vocab_size")))  # noqa: B009
        for step in range(1, args.steps + 1):
            last = step == args.steps
            if arm.handoff:  # 1: sampling over, the engine releases, the trainer onloads
                engine.release()
                at(f"onload {step}")
                started = time.perf_counter()
                backend.onload()
                out["onload_s"] = time.perf_counter() - started
            at(f"train step {step}")
            out["engine_train_gib"] = engine.resident / GIB
            memory.reset()
            synchronize(device)
            started = time.perf_counter()
            metrics = backend.train_step(batch)
            synchronize(device)
            out["step_s"] = time.perf_counter() - started
            out["peak_alloc_gib"], out["peak_reserved_gib"] = memory.peaks()
            if out["peak_alloc_gib"] is not None:
                out["trainer_peak_gib"] = out["peak_alloc_gib"] - engine.resident / GIB
            out["loss"] = metrics.get("loss")
            offload_s = 0.0
            if offloads and step == 1 and device.type == "cuda":
                out["pinned_host_gib"] = pinned_host_bytes(backend) / GIB
                out["host_available_gib"] = host_available() / GIB
                if out["pinned_host_gib"] > 0.9 * out["host_available_gib"]:
                    offloads = False  # (not run into the host's OOM killer on purpose)
                    out["offload_skipped"] = (
                        f"the offload would pin {out['pinned_host_gib']:.1f} GiB of host "
                        f"memory, {out['host_available_gib']:.1f} GiB available: steps "
                        "continue with the engine released and no offload")
            if offloads:  # 2: the optimizer off; 3: the engine's weights back
                at(f"offload {step}")
                started = time.perf_counter()
                backend.offload(optimizer=True, weights=False)
                offload_s += time.perf_counter() - started
            engine.resume("weights")
            at(f"sync {step}")
            if last:
                memory.reset()
            out["sync_s"], out["sync_bytes"], where = sync(backend, engine)
            if last:
                out["sync_peak_gib"] = memory.peaks()[0]
            if offloads:  # 4: the trainer's weights off, the engine's cache back
                at(f"offload {step}")
                started = time.perf_counter()
                backend.offload(optimizer=False, weights=True)
                offload_s += time.perf_counter() - started
                out["offload_s"] = offload_s
                out["pinned_host_gib_held"] = backend._offloads.pinned_bytes / GIB
                engine.resume("kv")
        if arm.lora:
            at("lora checks")
            out["base_unchanged"] = fingerprint(backend.module) == before
            out["lora_b_max"] = lora_b_max(backend)
            out["merged_changed"] = merged_changed(backend, engine, where)
            out["lora_adapter_norm"] = metrics.get("lora_adapter_norm")
            at("adapter save")
            out["adapter_save_s"], out["adapter_bytes"] = save_adapter_dir(
                backend, work / f"adapter-{args.child}")
    except torch.OutOfMemoryError as error:
        out["oom_at"] = phase
        out["oom_message"] = str(error).split("\n")[0][:300]
        out["peak_alloc_gib"], out["peak_reserved_gib"] = memory.peaks()
    except RuntimeError as error:  # e.g. pinned host memory refused: the phase, not a trace
        out["error"] = f"{phase}: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
    if result:
        write_json(Path(result), out)
    return out


def write_json(path: Path, value: dict[str, Any]) -> None:
    """Whole or not at all (the process may be killed while writing)."""
    part = path.with_suffix(".part")
    part.write_text(json.dumps(value))
    os.replace(part, path)
