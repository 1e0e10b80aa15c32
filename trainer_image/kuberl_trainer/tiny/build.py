"""Build (or reuse) the tiny job's directory: data/, tokenizer/, model/ and build.json.

build.json is written last, atomically, and names the full recipe; a directory whose build.json
matches the requested recipe and whose files are all present is reused as is, so `make demo`
pays for the SFT once. Anything else (no build.json, another seed, an interrupted build) is
rebuilt from scratch.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kuberl_trainer.tiny import data, sft, tokenizer as tok, tool
from kuberl_trainer.tiny.evaluate import accuracy, expert_loads, tool_measures
from kuberl_trainer.tiny.model import Experts, ModelShape, make_model, n_params

# Bump when a code change alters what a build produces, so older caches are rebuilt.
RECIPE = 2
# The fresh demo machine has 2 cores; a fixed count also keeps float reductions (and so the
# weights) identical from run to run.
THREADS = 2

TRAIN_FILE = "data/train.jsonl"
EVAL_FILE = "data/eval.jsonl"
TOKENIZER_DIR = "tokenizer"
MODEL_DIR = "model"
MANIFEST = "build.json"
REQUIRED = (TRAIN_FILE, EVAL_FILE, f"{TOKENIZER_DIR}/tokenizer.json",
            f"{MODEL_DIR}/config.json", f"{MODEL_DIR}/model.safetensors",
            f"{MODEL_DIR}/tokenizer.json")


@dataclass(frozen=True)
class BuildConfig:
    """Everything that determines the built files (the cache key)."""

    seed: int = 0
    # 300 x 64 at 5e-4 (~15 s on 2 idle cores): greedy 0.47, sampled 0.28 on eval, which
    # leaves GRPO room to show its climb: at lr 2e-4 the sampled reward rises by ~0.4 in 600
    # steps (bench/RESULTS.md has the sweep over 300/350/400). The SFT curve is steep here
    # (greedy 0.24 at 200 steps, 0.62 at 400, 0.78 at 500), so small changes matter.
    sft_steps: int = 300
    sft_batch_size: int = 64
    sft_lr: float = 5e-4
    n_eval: int = 500
    eval_samples: int = 8  # sampled accuracy: this many responses per prompt at temperature 1
    shape: ModelShape = field(default_factory=ModelShape)
    recipe: int = RECIPE
    # "add": a+b= (the demo); "tool": a+b+c= with a calculator to call (tool.py); "moe":
    # a+b= on a Qwen3-MoE model (model.Experts)
    variant: str = "add"
    n_train: int = 20000  # tool: problems drawn (add: all 8100 less the eval set)
    read_fraction: float = 1.0  # tool: the SFT rows that read a result (the rest answer)
    experts: Experts = field(default_factory=Experts)  # moe: the sparse MLPs

    def key(self) -> dict[str, Any]:
        key = asdict(self)
        if self.variant != "moe":  # the dense builds' keys (and caches) as before moe
            del key["experts"]
        if self.variant == "add":  # the add build's key (and cache) as before the variants
            for name in ("variant", "n_train", "read_fraction"):
                del key[name]
        if self.variant == "moe":  # the add variant's data: no draws, no reads
            for name in ("n_train", "read_fraction"):
                del key[name]
        return key


VARIANTS = ("add", "tool", "moe")
# The tool variant's warm start: reading a result is learnt in ~100 steps (greedy 1.0 at
# 150), while every SFT step pushes the never-trained call token down: 150 steps leave
# P(call) at ~0.008 (300: 0.006), rare enough that calling is RL's discovery.
TOOL_SFT_STEPS = 150
# The moe variant's warm start, chosen to land where the add variant's 300 steps do (greedy
# 0.47, sampled 0.28): the sparse model learns a little slower per step (seed 0: greedy 0.41,
# sampled 0.24 at 300 steps; 0.49 and 0.31 at 325; 0.63 and 0.47 at 400). A step costs ~1.5x
# a dense one on 2 cores (the experts run one after another): ~1 minute for the build.
MOE_SFT_STEPS = 325


def cached(out: Path, config: BuildConfig) -> dict[str, Any] | None:
    """The previous build's record if `out` holds a complete build of `config`, else None."""
    try:
        record: dict[str, Any] = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if record.get("config") != config.key():
        return None
    if not all((out / name).is_file() for name in REQUIRED):
        return None
    return record


def build(out: Path, config: BuildConfig, *, force: bool = False,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build into `out` unless it already holds this build; returns build.json's content.
    Two builders of one directory (test workers, two `make demo`s) take turns: the second
    finds the first's build and reuses it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(out.parent / f".{out.name}.lock"):
        return _build_or_reuse(out, config, force=force, log=log)


def _build_or_reuse(out: Path, config: BuildConfig, *, force: bool,
                    log: Callable[[str], None]) -> dict[str, Any]:
    if not force and (record := cached(out, config)) is not None:
        log(f"tiny: reusing {out} (seed {config.seed}, {config.sft_steps} SFT steps)")
        return record
    out.mkdir(parents=True, exist_ok=True)
    # Drop the old record first: if this build dies midway, the directory reads as incomplete.
    (out / MANIFEST).unlink(missing_ok=True)
    with _threads(THREADS):
        record = _build(out, config, log)
    _write_json(out / MANIFEST, record)
    log(f"tiny: built {out}: greedy accuracy {record['greedy_accuracy']:.3f}, sampled "
        f"{record['sampled_accuracy']:.3f}, {record['seconds']['total']:.1f} s")
    return record


def _build(out: Path, config: BuildConfig, log: Callable[[str], None]) -> dict[str, Any]:
    if config.variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {config.variant!r}")
    start = time.perf_counter()
    tokenizer = tok.make_tokenizer()
    tok.save(tokenizer, out / TOKENIZER_DIR)
    if config.variant == "tool":
        train_t, held_t = tool.split(config.seed, config.n_train, config.n_eval)
        records = [p.record() for p in train_t], [p.record() for p in held_t]
        rows = sft.tool_rows(tokenizer, train_t, read_fraction=config.read_fraction,
                             seed=config.seed)
    else:
        train, held_out = data.split(config.seed, config.n_eval)
        records = [p.record() for p in train], [p.record() for p in held_out]
        rows = sft.encode(tokenizer, train)
    data.write_jsonl(out / TRAIN_FILE, records[0])
    data.write_jsonl(out / EVAL_FILE, records[1])

    moe = config.variant == "moe"
    model = make_model(config.shape, config.seed, config.experts if moe else None)
    log(f"tiny: SFT of a {n_params(model) / 1e6:.2f}M-parameter model ({config.variant}), "
        f"{config.sft_steps} steps x {config.sft_batch_size}")
    sft_start = time.perf_counter()
    losses = sft.train(model, rows, steps=config.sft_steps, batch_size=config.sft_batch_size,
                       lr=config.sft_lr, seed=config.seed, router_aux_loss=moe)
    sft_seconds = time.perf_counter() - sft_start
    with _no_progress_bars():  # a bar for one 3 MB file is noise in `make demo`'s output
        model.save_pretrained(str(out / MODEL_DIR))
    # The model directory alone is a complete HF checkpoint: model.path needs no tokenizer.
    tok.save(tokenizer, out / MODEL_DIR)

    measures: dict[str, Any]
    if config.variant == "tool":
        measures = tool_measures(model, tokenizer, held_t)
        greedy, sampled = measures.pop("greedy_accuracy"), measures.pop("sampled_accuracy")
    else:
        # moe: whether the router spreads tokens over the experts or collapses onto k of them
        measures = {"expert_loads": expert_loads(model, tokenizer, held_out)} if moe else {}
        greedy = accuracy(model, tokenizer, held_out, seed=config.seed)
        sampled = accuracy(model, tokenizer, held_out, temperature=1.0,
                           n_samples=config.eval_samples, seed=config.seed)
    return {
        "config": config.key(),
        "params": n_params(model),
        "vocab_size": len(tok.VOCAB),
        "train_problems": len(records[0]),
        "eval_problems": len(records[1]),
        **measures,
        "sft_final_loss": _tail_mean(losses),
        "greedy_accuracy": greedy,
        "sampled_accuracy": sampled,
        "seconds": {"sft": round(sft_seconds, 2),
                    "total": round(time.perf_counter() - start, 2)},
        "threads": THREADS,
        "torch": torch.__version__,
    }


def _tail_mean(losses: list[float], n: int = 20) -> float | None:
    tail = losses[-n:]
    return sum(tail) / len(tail) if tail else None


@contextlib.contextmanager
def exclusive(lock: Path) -> Iterator[None]:
    """An exclusive lock on the file `lock` (created) for the block (flock: released when the
    process dies, so a killed build never blocks the next)."""
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if before:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def _write_json(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
