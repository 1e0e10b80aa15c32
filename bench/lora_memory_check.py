"""A 7B-shaped LoRA job against full fine-tuning on one GPU, with a colocated engine's memory
resident: does the train step fit, and what do step, sync and memory cost (issue: "a 7B-shaped
LoRA job fits one H200 colocated where full fine-tuning needs the memory handoff").

Three arms, each in a fresh process (its peak memory is its own), on one device:

- ``full``: all weights train, no offload, the engine's memory resident;
- ``full-handoff``: all weights train, the colocated memory handoff as the trainer runs it
  (memory_handoff.py's order each step: engine memory released, trainer onload, train step,
  optimizer offloaded, engine weights back, sync, trainer weights offloaded, engine KV back);
- ``lora``: a rank-16 adapter on every linear layer, no offload, the engine's memory resident.

Each builds the real FSDPBackend from an RLJob spec (klCoef 0: no reference model in either
mode; one optimizer step per rollout) and runs ``--steps`` train steps on one fixed batch, the
last one measured: seconds, peak GPU memory (max_memory_allocated / max_memory_reserved; "the
trainer's peak" is the allocated peak less the engine's resident bytes), then the weight sync
as the colocated path does its copies (named_tensor_buckets in 512 MiB buckets, each cast and
flattened by weight_sync.colocated.flatten_to, then copied into the engine's weights; with LoRA
the merged weights), and for LoRA the time and bytes of the adapter written as a PEFT directory
(backends/lora.save_adapter over the gathered adapter, what a checkpoint's ``adapter/`` holds
and what an adapter-mode sync would write: training.lora.sync has only ``merged`` today).

**The engine is a stand-in.** No SGLang runs here: its resident memory is allocations of the
same size in this process, made before the trainer is built (bf16 weights, the model's bytes,
and a KV-cache reservation of ``--engine-kv-gib``). A real engine also holds CUDA graphs and
its own CUDA context (not counted here). Releasing the stand-in is what the real handoff's
/release_memory_occupation does to the engine's pool.

The weights are random, built directly on the device in float32 as the backend holds them (the
backend's loader, fsdp_models.load_model, is replaced by one building the same model from
config.json on the device instead of reading a checkpoint from disk: 30 GB of file reads per
arm saved); everything else is the real backend.

Checks that must hold (exit 1 otherwise): the LoRA arm fits with the engine resident; its base
weights are bit-for-bit unchanged by training (fingerprints of every frozen tensor); its
adapter trained (some lora_B entry non-zero: B starts at zero); the merged sync differs from
the base (the adapter reaches the engine). Reported, not required: ``full`` runs out of memory
with the engine resident, ``full-handoff`` fits.

Expected at 7B (Qwen2.5-7B shape, untied: 7.616e9 parameters; LoRA r=16 all-linear: 40.4e6):

    single GPU: float32 master weights, bf16 autocast compute, fused AdamW in float32
    full FT states     = 16 B/param (weights 4, grads 4, Adam 8)   = 113.5 GiB
    + bf16 weight casts kept for the backward (autocast)           ~  14.2 GiB
    + activations of one 1024-token micro-batch (bf16, 28 layers)  ~   8-9 GiB
    LoRA states        = 4 B/param base + 16 B/param adapter       =  28.4 + 0.6 GiB
    engine stand-in    = 2 B/param bf16 weights + 20 GiB KV        =  34.2 GiB
    full + engine: 113.5 + 34.2 = 147.7 GiB > an H200's ~139.8 GiB before any activation: OOM
    full alone (handoff): ~136 GiB, at the card's edge; LoRA + engine: ~80-90 GiB

The handoff's host side: the trainer's offload (backends/offload.py) packs each kind's storages
(optimizer state; weights) into one host buffer of their summed sizes and pins exactly that
(cudaHostRegister): weights + Adam, 85 GiB of data, pin ~85 GiB. (It used to pin one
buffer per storage through torch's pinned allocator, which rounds each to a power of two: the
7B MLP matrices, 272 MB in float32, took 512 MiB each, ~162 GiB in all, more than a 128 GiB
host.) The arm computes the figure after step 1 and, when it exceeds 90% of MemAvailable,
records why and goes on without the offload (engine released while training, its weights back
for the sync, no KV) instead of running the host out of memory; after the offloads it records
what the trainer holds pinned.

The GPU command (one H200, repository root, ~3-5 minutes for all arms):

    python3 bench/lora_memory_check.py --shape 7b --out /tmp/lora-memory-7b.json

(``--arms lora`` reruns one arm; ``--rows``/``--tokens`` change the batch; the children inherit
the environment, so PYTORCH_CUDA_ALLOC_CONF applies to them.) The CPU dry run (float32, no
process group: one rank; nothing can run out of memory, the code paths only):

    python3 bench/lora_memory_check.py --device cpu --shape tiny
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_common import SHAPES, UNTIED  # bench/ is on sys.path (sets the packages' too)

GIB = float(1 << 30)
SHAPE_NAMES = {"7b": "qwen2.5-7b", "tiny": "tiny"}
# Per shape: rows x tokens of the fixed batch, the engine's KV reservation (GiB).
DEFAULTS = {"7b": (4, 1024, 20.0), "tiny": (4, 64, 0.01)}


@dataclass(frozen=True)
class Arm:
    lora: bool
    handoff: bool   # engine memory released while training; the trainer offloads
    note: str


ARMS = {
    "full": Arm(False, False, "all weights, no offload, engine resident"),
    "full-handoff": Arm(False, True, "all weights, memory handoff (engine released to train)"),
    "lora": Arm(True, False, "LoRA r16 all-linear, no offload, engine resident"),
}
FULL, HANDOFF, LORA = ARMS


# -- the parent: one child per arm, the table, the checks --------------------------------------

def write_config(shape: str, out: Path) -> Path:
    """config.json of ``shape`` (no weights: the children build them on the device)."""
    from transformers import Qwen2Config

    hidden, layers, heads, kv, inter, vocab = SHAPES[SHAPE_NAMES[shape]]
    Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                tie_word_embeddings=SHAPE_NAMES[shape] not in UNTIED,
                max_position_embeddings=32768, eos_token_id=1,
                pad_token_id=0).save_pretrained(out)
    return out


def run_children(args: argparse.Namespace, work: Path) -> dict[str, dict[str, Any]]:
    results = {}
    for name in args.arms.split(","):
        result = work / f"{name}.json"
        cmd = [sys.executable, __file__, "--child", name, "--work", str(work),
               "--result", str(result), *forwarded(args)]
        started = time.perf_counter()
        proc = subprocess.run(cmd, timeout=args.arm_timeout_s)
        row = (json.loads(result.read_text()) if result.exists()
               else {"arm": name, "error": f"child exited {proc.returncode} with no result"})
        if proc.returncode:
            row["child_rc"] = proc.returncode
        row["arm_wall_s"] = time.perf_counter() - started
        results[name] = row
        print(f"[{name}] {json.dumps(row)}", flush=True)
    return results


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--device", args.device, "--shape", args.shape, "--steps", str(args.steps),
            "--rows", str(args.rows), "--tokens", str(args.tokens), "--lr", str(args.lr),
            "--rank", str(args.rank), "--engine-kv-gib", str(args.engine_kv_gib)]


def checks(results: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """What must hold (the LoRA arm's): all False when the arm is missing or failed."""
    lora = results.get(LORA, {})
    ran = bool(lora) and "error" not in lora and lora.get("oom_at") is None
    return {
        "lora fits beside the engine": ran,
        "lora base unchanged": ran and lora.get("base_unchanged") is True,
        "lora adapter trained (B != 0)": ran and (lora.get("lora_b_max") or 0.0) > 0.0,
        "lora merged sync != base": ran and (lora.get("merged_changed") or 0) > 0,
    }


def expectations(results: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """What the issue expects of full fine-tuning (reported only: a CPU cannot run out of
    memory, and at 7B the handoff arm is at the card's edge)."""
    full, handoff = results.get(FULL, {}), results.get(HANDOFF, {})
    return {"full OOMs beside the engine": full.get("oom_at") is not None,
            "full fits with the handoff": bool(handoff) and "error" not in handoff
            and handoff.get("oom_at") is None}


def gib(value: float) -> str:
    return f"{value:.3g}"


ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("what", "note", str),
    ("fits (engine memory resident while training)", "fits", str),
    ("out of memory at", "oom_at", str),
    ("parameters / trainable", "params", str),
    ("model states, computed (GiB)", "states_gib", gib),
    ("engine stand-in resident while training (GiB)", "engine_train_gib", gib),
    ("allocated after build (GiB)", "built_gib", gib),
    ("train step (s, last of --steps)", "step_s", lambda v: f"{v:.3f}"),
    ("peak allocated, train step (GiB)", "peak_alloc_gib", gib),
    ("peak reserved, train step (GiB)", "peak_reserved_gib", gib),
    ("trainer's peak (allocated less engine, GiB)", "trainer_peak_gib", gib),
    ("handoff: onload before the step (s)", "onload_s", lambda v: f"{v:.2f}"),
    ("handoff: offloads after it (s)", "offload_s", lambda v: f"{v:.2f}"),
    ("handoff: host memory the offload pins (GiB)", "pinned_host_gib", gib),
    ("handoff: host memory held pinned (GiB)", "pinned_host_gib_held", gib),
    ("handoff: host memory available (GiB)", "host_available_gib", gib),
    ("handoff: offload skipped", "offload_skipped", str),
    ("merged sync: flatten + copy into engine (s)", "sync_s", lambda v: f"{v:.3f}"),
    ("merged sync bytes (GiB)", "sync_bytes", lambda v: gib(v / GIB)),
    ("peak allocated, sync (GiB)", "sync_peak_gib", gib),
    ("adapter as PEFT dir: gather + save (s)", "adapter_save_s", lambda v: f"{v:.3f}"),
    ("adapter bytes on disk (MiB)", "adapter_bytes", lambda v: gib(v / (1 << 20))),
    ("base unchanged / max|B| / merged != base", "lora_checks", str),
    ("error", "error", str),
]


def cell(row: dict[str, Any], key: str, fmt: Callable[[Any], str]) -> str:
    if key == "params" and "total_params" in row:
        return f"{row['total_params']:,} / {row['trainable_params']:,}"
    if key == "lora_checks":
        if "base_unchanged" not in row:
            return "-"
        return f"{row['base_unchanged']} / {row['lora_b_max']:.2e} / {row['merged_changed']}"
    if key == "fits" and "arm" in row:
        return "no (OOM)" if row.get("oom_at") else ("error" if "error" in row else "yes")
    value = row.get(key)
    return "-" if value is None else fmt(value)


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """LoRA over full fine-tuning (the arm that trained: full-handoff, else full)."""
    lora = results.get(LORA, {})
    full = next((results[a] for a in (HANDOFF, FULL)
                 if a in results and results[a].get("step_s") is not None), {})

    def over(key: str, other: str | None = None) -> float:
        a, b = lora.get(key), full.get(other or key)
        numbers = isinstance(a, float | int) and isinstance(b, float | int)
        return a / b if numbers and b else math.nan

    return {"train step s": over("step_s"), "trainer's peak memory": over("trainer_peak_gib"),
            "peak reserved": over("peak_reserved_gib"), "merged sync s": over("sync_s"),
            "merged sync bytes": over("sync_bytes"),
            "adapter bytes / full sync bytes": over("adapter_bytes", "sync_bytes"),
            "adapter save s / full sync s": over("adapter_save_s", "sync_s")}


def print_table(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    names = list(results)
    print(f"\nLoRA vs full fine-tuning, one {args.device} device, shape {args.shape}, "
          f"{args.rows} rows x {args.tokens} tokens, {args.steps} steps, lr {args.lr}; "
          f"engine stand-in: {'bf16' if args.device == 'cuda' else 'float32'} weights + "
          f"{args.engine_kv_gib} GiB KV (plain allocations "
          "of the engine's size, not SGLang; the handoff arm releases them to train)")
    print("| | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for label, key, fmt in ROWS:
        cells = [cell(results[n], key, fmt) for n in names]
        if any(c != "-" for c in cells):
            print(f"| {label} | " + " | ".join(cells) + " |")
    print("\nratios, LoRA / full fine-tuning:")
    for label, value in ratios(results).items():
        print(f"  {label}: {value:.3g}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="7b", choices=sorted(SHAPE_NAMES))
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None, help="tokens per row")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--rank", type=int, default=16, help="the LoRA rank (alpha: 2 x rank)")
    p.add_argument("--engine-kv-gib", type=float, default=None)
    p.add_argument("--arm-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default=None, help="write the results here as JSON too")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    rows, tokens, kv = DEFAULTS[args.shape]
    args.rows, args.tokens = args.rows or rows, args.tokens or tokens
    args.engine_kv_gib = kv if args.engine_kv_gib is None else args.engine_kv_gib
    if args.child is not None:
        from lora_memory_arm import run_arm

        run_arm(args, ARMS[args.child])  # (writes args.result as it goes)
        return 0
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        p.error(f"unknown arms {sorted(unknown)}; known: {list(ARMS)}")
    with tempfile.TemporaryDirectory(prefix="kuberl-lora-mem-") as tmp:
        work = Path(tmp)
        write_config(args.shape, work / "model")
        results = run_children(args, work)
    print_table(args, results)
    must, expected = checks(results), expectations(results)
    for label, ok in must.items():
        print(f"check: {label}: {'ok' if ok else 'FAILED'}")
    for label, ok in expected.items():
        print(f"expected: {label}: {'yes' if ok else 'no'}")
    errors = [n for n, r in results.items() if "error" in r]
    ok = all(must.values()) and not errors
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"args": {k: v for k, v in vars(args).items() if v is not None},
             "results": results, "ratios": ratios(results), "checks": must,
             "expected": expected, "pass": ok}, indent=2, default=str))
    print("PASS" if ok else f"FAIL{' (arms failed: ' + ', '.join(errors) + ')' if errors else ''}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
