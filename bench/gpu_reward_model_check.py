"""A served scalar reward model on a GPU: the reference engine with --is-embedding --device cuda
(what `reward.model` with engine reference and gpusPerReplica 1 runs) scores the tiny reward
model's texts on /classify as HF transformers does in-process, on the same GPU and on CPU.

    python bench/gpu_reward_model_check.py [--device cuda] [--texts 256]

Builds the tiny policy (no SFT: its scores, not its judgement, are checked) and the tiny reward
model under /tmp, starts the engine as a real process, sends the texts in batches of 32 (each
batch one left-padded forward on the engine), and prints the largest differences. Exits
non-zero when a served score is further than 1e-4 from the in-process one on the same device.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

BATCH = 32
TOLERANCE = 1e-4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def post(url: str, body: dict[str, object]) -> object:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def texts(count: int) -> list[str]:
    """Additions with right, near and far answers, of several lengths."""
    rng = random.Random(0)
    out = []
    for _ in range(count):
        a, b = rng.randrange(100), rng.randrange(100)
        answer = a + b + rng.choice((0, 0, 1, -1, 10, 37))
        out.append(f"{a}+{b}={answer}")
    return out


def in_process(model_dir: Path, items: list[str], device: str) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32).to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        return [float(model(**tok(t, return_tensors="pt").to(device)).logits[0, 0])
                for t in items]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--texts", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("/tmp/kuberl-rm-check"))
    args = p.parse_args()
    from kuberl_trainer.tiny.build import BuildConfig, build
    from kuberl_trainer.tiny.reward_model import build_reward_model

    build(args.out / "policy", BuildConfig(sft_steps=0), log=lambda _: None)
    rm = args.out / "rm"
    build_reward_model(rm, args.out / "policy" / "model", log=lambda _: None)

    port = free_port()
    log = (args.out / "engine.log").open("w")
    engine = subprocess.Popen(
        [sys.executable, "-m", "kuberl_rollout.reference", "--is-embedding", "--model-path",
         str(rm), "--port", str(port), "--device", args.device], stdout=log,
        stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
                break
            except OSError:
                if engine.poll() is not None or time.monotonic() > deadline:
                    print((args.out / "engine.log").read_text()[-3000:])
                    return 1
                time.sleep(0.5)
        items = texts(args.texts)
        started = time.perf_counter()
        served: list[float] = []
        for i in range(0, len(items), BATCH):
            answer = post(url + "/classify", {"text": items[i:i + BATCH]})
            assert isinstance(answer, list)
            served += [float(a["embedding"][0]) for a in answer]
        seconds = time.perf_counter() - started
        info = post(url + "/classify", {"text": items[0]})
    finally:
        engine.terminate()
        engine.wait(30)
        log.close()
    same = in_process(rm, items, args.device)
    cpu = in_process(rm, items, "cpu")
    d_same = max(abs(a - b) for a, b in zip(served, same, strict=True))
    d_cpu = max(abs(a - b) for a, b in zip(served, cpu, strict=True))
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\nreward model served on {name} (--is-embedding, float32), {len(items)} texts in "
          f"batches of {BATCH}, {seconds:.2f} s")
    print("| served vs | max abs diff | score range |")
    print("|---|---|---|")
    spread = f"{min(served):.3f} .. {max(served):.3f}"
    print(f"| HF in-process, {args.device} | {d_same:.2e} | {spread} |")
    print(f"| HF in-process, cpu | {d_cpu:.2e} | |")
    print(f"one text alone: {json.dumps(info)[:200]}")
    ok = d_same <= TOLERANCE
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
