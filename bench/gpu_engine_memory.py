"""The reference engine's GPU memory behaves like SGLang's static memory (issue 13).

A TP=2 reference engine on GPUs 0-1 with `--mem-fraction-static F`: at start each TP process
holds about F of its card (weights plus a KV-cache pool); releasing the kv_cache tag hands the
pool back on both cards, resuming takes it again, and a resume while another process holds the
card fails instead of pretending. Memory is read with nvidia-smi (what other processes see).

    PYTHONPATH=operator:trainer_image:rollout_image:wire python3 bench/gpu_engine_memory.py \\
        --fraction 0.5

Exits 1 if any expectation fails. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
from gpu_common import build_model, card, gpu_memory_used_gib as used_gb  # bench/ on path
from gpu_tp_sync import start_engine


def post(url: str, path: str, body: dict[str, object]) -> tuple[int, str]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=Path("/tmp/mem"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(args.out / "qwen2.5-0.5b", "qwen2.5-0.5b")
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    base = used_gb()
    proc, url = start_engine(model_dir, "0,1", 2, args.out / "engine.log",
                             "--mem-fraction-static", str(args.fraction))
    rows, ok = [], True

    def row(what: str, expect: str, good: bool) -> None:
        nonlocal ok
        now = used_gb()
        rows.append((what, now[0] - base[0], now[1] - base[1], expect, good))
        ok &= good

    try:
        time.sleep(1)
        held = used_gb()
        row("started", f"~{args.fraction * total:.0f} GiB each",
            all(abs((held[i] - base[i]) - args.fraction * total) < 0.1 * total for i in (0, 1)))
        status, _ = post(url, "/release_memory_occupation", {"tags": ["kv_cache"]})
        time.sleep(1)
        freed = used_gb()
        row("kv_cache released", "weights + context only",
            status == 200 and all(freed[i] - base[i] < 0.1 * total for i in (0, 1)))
        status, _ = post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        time.sleep(1)
        again = used_gb()
        row("kv_cache resumed", "as at start",
            status == 200 and all(abs(again[i] - held[i]) < 0.05 * total for i in (0, 1)))
        post(url, "/release_memory_occupation", {"tags": ["kv_cache"]})
        hog = torch.empty(int((1 - args.fraction / 2) * total * 2**30), dtype=torch.uint8,
                          device="cuda:1")
        status, text = post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        row("resume while GPU 1 is taken", "refused (out of memory)",
            status >= 400 and "memory" in text.lower())
        del hog
        torch.cuda.empty_cache()
        status, _ = post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        time.sleep(1)
        row("resumed once GPU 1 is free", "as at start", status == 200)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"\n{card()}, {total:.0f} GiB each, TP=2 reference engine, "
          f"--mem-fraction-static {args.fraction}")
    print("| step | GPU 0 GiB | GPU 1 GiB | expected | ok |\n|---|---|---|---|---|")
    for what, g0, g1, expect, good in rows:
        print(f"| {what} | {g0:.1f} | {g1:.1f} | {expect} | {'yes' if good else 'NO'} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
