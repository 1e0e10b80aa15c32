"""What the GPU benchmarks share: real model shapes with random weights, an RLJob spec around
a model directory, and synthetic RL batches of variable length.

Nothing here touches a GPU at import; the scripts that import it run on the GPU machines.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
for sub in ("operator", "trainer_image", "rollout_image", "wire"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab (the HF configs' values)
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936),
    "qwen2.5-3b": (2048, 36, 16, 2, 11008, 151936),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064),
    # Not a real model: the scripts' CPU dry runs (every code path in seconds, no GPU).
    "tiny": (64, 2, 4, 2, 128, 512),
}
UNTIED = {"qwen2.5-7b"}  # its own output layer, as the real checkpoint has
# Parameters of the shapes users extrapolate to (Qwen2.5-7B / -32B model cards), for
# seconds-per-sync estimates from a measured bandwidth.
EXTRAPOLATE = {"qwen2.5-7b": 7.62e9, "qwen2.5-32b": 32.8e9}
# Dense bf16 peak of the cards here (NVIDIA datasheets, SXM): the MFU denominator.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


def family_configs(common: dict[str, Any]) -> dict[str, Any]:
    """One small HF config per family the megatron backend converts, each exercising what sets
    it apart: Qwen2 (QKV bias, tied embeddings), Qwen3 (q/k norm, head_dim 64, not
    hidden / heads), Llama 3 (untied)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {
        "qwen2-tied": Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**common, head_dim=64, tie_word_embeddings=False),
        "llama3": LlamaConfig(**common, tie_word_embeddings=False),
    }


def build_tokenizer(vocab_size: int) -> Any:
    """The tiny job's character vocabulary (pad, eos, digits, '+', '=') padded with filler
    tokens to the model's real vocabulary size, so every id a random model samples decodes."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kuberl_trainer.tiny.tokenizer import VOCAB

    vocab = dict(VOCAB)
    vocab.update({f"<x{i}>": i for i in range(len(VOCAB), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   padding_side="left")


def build_model(out: Path, shape: str) -> Path:
    """A random-weight Qwen2 of ``shape`` in bf16 at ``out/model`` (with a tokenizer) and the
    tiny addition prompts at ``out/data/train.jsonl``; kept when already there."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from kuberl_trainer.tiny.data import split, write_jsonl

    model_dir = out / "model"
    if (model_dir / "config.json").exists():
        return model_dir
    train, _ = split(seed=0, n_eval=500)
    write_jsonl(out / "data" / "train.jsonl", (p.record() for p in train))
    hidden, layers, heads, kv, inter, vocab = SHAPES[shape]
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                      tie_word_embeddings=shape not in UNTIED, max_position_embeddings=4096,
                      torch_dtype="bfloat16", eos_token_id=1, pad_token_id=0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # (3B: minutes on CPU)
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    build_tokenizer(vocab).save_pretrained(str(model_dir))
    del model
    if torch.cuda.is_available():  # the driver keeps no GPU memory from the build
        torch.cuda.empty_cache()
    return model_dir


def make_spec(model_dir: Path | str, *, backend: str, samples: int, micro_batch: int,
              tp: int = 1, pp: int = 1, gpus: int = 1, lr: float = 1e-6,
              max_tokens: int | None = None, fused_kernels: str = "none",
              **algorithm: Any) -> Any:
    """An RLJobSpec whose one rollout of ``samples`` is one optimizer step; ``max_tokens``:
    training.maxTokensPerMicroBatch (the data's length limits shrink to fit it);
    ``fused_kernels``: training.fusedKernels."""
    from kuberl_api.spec import RLJobSpec

    budget = {} if max_tokens is None else {"maxTokensPerMicroBatch": max_tokens}
    lengths = {} if max_tokens is None else {"maxPromptLen": max_tokens // 2,
                                             "maxResponseLen": max_tokens // 2}
    return RLJobSpec.model_validate({
        "model": {"path": str(model_dir)},
        "data": {"prompts": "/unused.jsonl", "rolloutBatchSize": samples,
                 "nSamplesPerPrompt": 1, **lengths},
        "training": {"backend": backend, "gpusPerNode": gpus, "microBatchSize": micro_batch,
                     "parallelism": {"tp": tp, "pp": pp}, "fusedKernels": fused_kernels,
                     **budget},
        "algorithm": {"lr": lr, **algorithm},
    })


def random_batch(samples: int, prompt: int, response: tuple[int, int], vocab: int,
                 seed: int = 0) -> Any:
    """A TrainBatch of ``samples`` sequences: a ``prompt``-token prompt and a response of a
    length drawn uniformly from ``response`` (inclusive), right-padded; advantages +-1."""
    from kuberl_trainer.backends.base import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    lo, hi = response
    lengths = torch.randint(lo, hi + 1, (samples,), generator=gen) + prompt
    width = int(lengths.max())
    ids = torch.randint(2, vocab, (samples, width), generator=gen)
    positions = torch.arange(width)[None]
    attention = (positions < lengths[:, None]).long()
    loss_mask = ((positions >= prompt) & (attention > 0)).float()
    ids = ids * attention
    adv = torch.where(torch.rand(samples, generator=gen) < 0.5, 1.0, -1.0)[:, None] * loss_mask
    return TrainBatch(input_ids=ids, attention_mask=attention, loss_mask=loss_mask,
                      advantages=adv, rollout_logprobs=torch.zeros(samples, width))


def card() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def peak_flops() -> float:
    name = card()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), float("nan"))


def train_flops(params: int, layers: int, hidden: int, lengths: list[int]) -> float:
    """Model FLOPs of one forward+backward over sequences of ``lengths`` (PaLM's MFU
    convention: 6 per parameter per token, plus causal attention's 6 * layers * hidden * s
    per token, i.e. 12 * layers * hidden * s^2 / 2 per sequence of length s)."""
    tokens = sum(lengths)
    return 6.0 * params * tokens + 6.0 * layers * hidden * sum(s * s for s in lengths)


def gpu_memory_used_gib() -> list[float]:
    """Memory in use on each GPU as nvidia-smi shows it (what other processes see), GiB."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                          "nounits"], capture_output=True, text=True, check=True).stdout
    return [int(x) / 1024 for x in out.split()]


# Where a profiled step's GPU time goes, by kernel name (first match wins). Liger's Triton
# kernels keep their Python names (_rms_norm_forward_kernel, _swiglu_..., _triton_rope);
# torch.compile's (the trainer's chunked log-prob kernel) start with triton_.
KERNEL_CATEGORIES = (
    ("attention", r"flash|fmha|attention|sdpa"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|wgmma"),
    ("liger", r"^_(rms_norm|swiglu|triton_rope|rope|layer_norm)"),
    ("compiled (triton_)", r"^triton_"),
    ("optimizer & foreach", r"adam|multi_tensor|foreach"),
    ("copies & casts", r"copy|cast|memcpy|memset|fill"),
    ("nccl", r"nccl"),
)


def kernel_breakdown(prof: Any, wall_s: float) -> str:
    """A table of one profiled step's GPU time by KERNEL_CATEGORIES ("other": the rest,
    mostly elementwise and reductions), in ms and % of the step's wall time, and the time
    no kernel ran (the GPU waiting for the host)."""
    import re

    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        kind = next((k for k, pattern in KERNEL_CATEGORIES if re.search(pattern, name)),
                    "other")
        totals[kind] = totals.get(kind, 0.0) + event.self_device_time_total / 1e3  # us -> ms
    wall = wall_s * 1e3
    busy = sum(totals.values())
    lines = ["| kernels | ms | % of step |", "|---|---|---|"]
    for kind, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {ms:.1f} | {100 * ms / wall:.1f} |")
    lines.append(f"| GPU idle (step - kernels) | {max(wall - busy, 0.0):.1f} | "
                 f"{100 * max(wall - busy, 0.0) / wall:.1f} |")
    lines.append(f"| step (wall) | {wall:.1f} | 100 |")
    return "\n".join(lines)


def profiled(step: Any, title: str) -> None:
    """Run ``step()`` once under torch.profiler and print kernel_breakdown."""
    import time

    from torch.profiler import ProfilerActivity, profile

    def sync() -> None:
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync()
        start = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - start
    print(f"\n--- where the GPU time goes: {title} (one step, under the profiler)\n"
          f"{kernel_breakdown(prof, wall)}", flush=True)


def train_and_measure(backend: Any, batch: Any, steps: int = 3) -> tuple[dict[str, float],
                                                                          list[dict[str, float]]]:
    """``steps`` train steps on ``batch`` (advantages +-1): how far the log-probs of the
    positive and of the negative tokens moved (``logp up (+adv)``, ``logp down (-adv)``: a
    backend that trains moves the first up and the second down), and each step's metrics."""
    before = backend.logprobs(batch)
    metrics = [backend.train_step(batch) for _ in range(steps)]
    moved = backend.logprobs(batch) - before
    adv = batch.advantages
    return {"logp up (+adv)": float((moved * (adv > 0)).sum() / (adv > 0).sum()),
            "logp down (-adv)": float((moved * (adv < 0)).sum() / (adv < 0).sum())}, metrics
