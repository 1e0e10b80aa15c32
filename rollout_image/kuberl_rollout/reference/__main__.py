"""`python -m kuberl_rollout.reference`: load the model, then serve until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import sys

# Local files only: the engine must never reach out to the Hub (pods may have no egress, and
# tests must not depend on the network). Set before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kuberl_rollout.reference",
                                description=__doc__)
    p.add_argument("--model-path", required=True, help="local HF checkpoint directory")
    p.add_argument("--tokenizer-path", default=None, help="default: --model-path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--seed", type=int, default=0,
                   help="seeds requests that carry no sampling_seed (SGLang: --random-seed)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor parallel size: this many processes (GPUs 0..N-1 of those "
                        "visible, with --device cuda), each a member of the weight-update "
                        "group as SGLang's TP workers are (see kuberl_rollout.reference.tp)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--weight-version", default="default", help="initial weight_version")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="with --device cuda: the share of each GPU that weights plus a KV-cache "
                        "pool take at start, as in SGLang (released and restored with the "
                        "kv_cache tag); default: no pool")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="how long the first request of a batch waits for others to join")
    p.add_argument("--weight-sync-timeout", type=float, default=300.0,
                   help="seconds a weight-group rendezvous or broadcast may take")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    from aiohttp import web

    from kuberl_rollout.reference.engine import ReferenceEngine
    from kuberl_rollout.reference.server import Server
    from kuberl_rollout.reference.tp import Peers, RankArgs, rank_device

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    if args.device == "cuda" and args.tp_size > torch.cuda.device_count():
        raise SystemExit(f"--tp-size {args.tp_size} needs {args.tp_size} GPUs; this process "
                         f"sees {torch.cuda.device_count()}")
    # The peers load their copies while this rank loads its own.
    peers = Peers(RankArgs(args.model_path, args.tokenizer_path, args.device, args.dtype,
                           args.seed, args.weight_version, args.weight_sync_timeout,
                           args.torch_threads, args.mem_fraction_static), args.tp_size)
    engine = ReferenceEngine(args.model_path, tokenizer_path=args.tokenizer_path,
                             device=rank_device(args.device, 0), dtype=args.dtype,
                             seed=args.seed, weight_version=args.weight_version,
                             mem_fraction_static=args.mem_fraction_static)
    server = Server(engine, max_batch_size=args.max_batch_size,
                    batch_wait_s=args.batch_wait_ms / 1000,
                    weight_sync_timeout_s=args.weight_sync_timeout,
                    peers=peers if args.tp_size > 1 else None,
                    # /server_info reports them under SGLang's ServerArgs names
                    server_args={"host": args.host, "port": args.port,
                                 "random_seed": args.seed,
                                 "mem_fraction_static": args.mem_fraction_static})
    peers.wait_ready()
    logging.getLogger("kuberl.reference").info(
        "serving %s on http://%s:%d (%s, %s)", args.model_path, args.host, args.port,
        args.device, args.dtype)
    web.run_app(server.app(), host=args.host, port=args.port, print=None,
                access_log=None, handler_cancellation=True)
    peers.stop()
    # The worker thread may sit in a collective or a long batch; don't let interpreter
    # shutdown wait for it once the server has stopped.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
