"""`python -m kuberl_rollout.reference`: load the model, then serve until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

# Local files only: the engine must never reach out to the Hub (pods may have no egress, and
# tests must not depend on the network). Set before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from kuberl_wire.protocol import ENGINE_API_KEY_ENV, ENGINE_SECRET_ENV

if TYPE_CHECKING:
    from kuberl_rollout.reference.tp import Nodes, RankArgs


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
    p.add_argument("--expert-parallel-size", "--ep-size", "--ep", dest="ep_size", type=int,
                   default=1,
                   help="SGLang's flag: a mixture-of-experts layer's experts split over this "
                        "many groups of the TP ranks (it divides --tp-size); each rank's "
                        "checksums then cover only its own experts, as SGLang's rank holds "
                        "only those (kuberl_rollout.reference.moe)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="SGLang >= 0.5.7's flag (not in 0.5.6): /generate's "
                        "return_routed_experts answers meta_info.routed_experts, the experts "
                        "each token went to (a mixture-of-experts model only)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes the engine spans (SGLang's flag): --tp-size / --nnodes ranks on "
                        "each; node rank 0 serves the API, the others only /health")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank in the engine")
    p.add_argument("--dist-init-addr", default=None,
                   help="node rank 0's host:port, where the other nodes' ranks connect (their "
                        "shared key in $" + ENGINE_SECRET_ENV + "); needed with --nnodes > 1")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--weight-version", default="default", help="initial weight_version")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="with --device cuda: the share of each GPU that weights plus a KV-cache "
                        "pool take at start, as in SGLang (released and restored with the "
                        "kv_cache tag); default: no pool")
    p.add_argument("--enable-weights-cpu-backup", action="store_true",
                   help="keep the weights' values in host memory while released (SGLang's "
                        "flag); without it a release discards them, as SGLang's does, and "
                        "only a weight update after the resume restores the model")
    p.add_argument("--enable-metrics", action="store_true",
                   help="serve GET /metrics (Prometheus) with SGLang's names, as SGLang's flag")
    p.add_argument("--api-key", default=None,
                   help=f"SGLang's flag: every request but /health*, /metrics* and OPTIONS "
                        f"needs `Authorization: Bearer <key>` (else 401). Default: "
                        f"${ENGINE_API_KEY_ENV}, which kuberl's launcher sets, so no command "
                        f"line shows the key")
    p.add_argument("--max-batch-size", type=int, default=256,
                   help="most requests in the running batch (SGLang: --max-running-requests)")
    p.add_argument("--max-prefill-tokens", type=int, default=16384,
                   help="most prompt tokens prefilled in one step, as SGLang's flag (a longer "
                        "prompt still goes, alone)")
    p.add_argument("--batching", choices=["continuous", "batch"], default="continuous",
                   help="continuous: requests join the running batch at the next decode step "
                        "(SGLang's); batch: a batch runs to completion before the next starts")
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="how long the first request to reach an idle engine waits for others "
                        "to start with it")
    p.add_argument("--weight-sync-timeout", type=float, default=300.0,
                   help="seconds a weight-group rendezvous or broadcast may take")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default)")
    p.add_argument("--is-embedding", action="store_true",
                   help="SGLang's flag: serve --model-path, a *ForSequenceClassification "
                        "checkpoint, on POST /classify (and /encode), scored at the last token "
                        "as SGLang does; no generation, no weight updates "
                        "(kuberl_rollout.reference.classify_server)")
    add_lora_flags(p)
    return p


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    """SGLang 0.5.6's LoRA flags (ServerArgs), same names, types and defaults; the reference
    engine has no --lora-paths, so --enable-lora needs --max-lora-rank and
    --lora-target-modules, as SGLang's does without --lora-paths."""
    from kuberl_rollout.reference.lora import ALL_TARGETS, SUPPORTED_TARGETS

    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters: /load_lora_adapter, /unload_lora_adapter and "
                        "/generate's lora_path (kuberl_rollout.reference.lora_service)")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="the largest adapter rank a load accepts")
    p.add_argument("--lora-target-modules", nargs="*", default=None,
                   choices=[*SUPPORTED_TARGETS, ALL_TARGETS],
                   help="the linears adapters may target ('all': every supported one)")
    p.add_argument("--max-loaded-loras", type=int, default=None,
                   help="most adapters loaded at once (the base model not counted): a load "
                        "past it unloads the least recently used unpinned adapter")
    p.add_argument("--max-loras-per-batch", type=int, default=8,
                   help="most distinct adapters in the running batch, the base model "
                        "counted as one")


def check_lora_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """SGLang's check_lora_server_args, its messages; and no LoRA across TP processes."""
    if args.max_loras_per_batch <= 0:
        parser.error("max_loras_per_batch must be positive")
    if not args.enable_lora:
        return
    targets = args.lora_target_modules or []
    if "all" in targets and len(set(targets)) != 1:
        parser.error("If 'all' is specified in --lora-target-modules, it should be the only "
                     "module specified.")
    if not (args.max_lora_rank and targets):
        parser.error("When no initial --lora-paths is provided, you need to specify both "
                     "--max-lora-rank and --lora-target-modules for LoRA initialization.")
    if args.max_loaded_loras is not None and args.max_loaded_loras < args.max_loras_per_batch:
        parser.error("max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                     f"max_loaded_loras={args.max_loaded_loras}, "
                     f"max_loras_per_batch={args.max_loras_per_batch}")
    if args.tp_size > 1:
        parser.error("--enable-lora: the reference engine applies adapters in one process "
                     "only; use --tp-size 1 (its tensor parallel ranks do not shard adapters)")


# Flags of generation and weight sync, which an --is-embedding engine would ignore: refused
# unless at their defaults, so a command line never asks for what the engine does not do.
GENERATION_ONLY = ("tp_size", "nnodes", "mem_fraction_static", "enable_weights_cpu_backup",
                   "batching", "batch_wait_ms", "weight_sync_timeout", "enable_lora",
                   "ep_size", "enable_return_routed_experts")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    # SGLang's own checks of the same flags (ServerArgs: tp_size % nnodes == 0).
    if args.nnodes < 1 or args.tp_size % args.nnodes:
        parser.error(f"--tp-size {args.tp_size} must be divisible by --nnodes {args.nnodes}")
    if args.ep_size < 1 or args.tp_size % args.ep_size:  # (SGLang: moe_tp = tp / ep)
        parser.error(f"--ep-size {args.ep_size} must divide --tp-size {args.tp_size}")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank {args.node_rank} must be in [0, {args.nnodes})")
    if args.nnodes > 1 and not args.dist_init_addr:
        parser.error("--nnodes > 1 needs --dist-init-addr (node rank 0's host:port)")
    if args.nnodes > 1 and not os.environ.get(ENGINE_SECRET_ENV):
        parser.error(f"--nnodes > 1 needs the nodes' shared key in ${ENGINE_SECRET_ENV}")
    check_lora_args(parser, args)
    if args.is_embedding:
        given = [f"--{name.replace('_', '-')}" for name in GENERATION_ONLY
                 if getattr(args, name) != parser.get_default(name)]
        if given:
            parser.error(f"{', '.join(given)}: not with --is-embedding (a reward model is "
                         "served by one process, without tensor parallelism, generation "
                         "batching or weight updates)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    from aiohttp import web

    from kuberl_rollout.reference import fault
    from kuberl_rollout.reference.engine import ReferenceEngine
    from kuberl_rollout.reference.server import Server
    from kuberl_rollout.reference.tp import Nodes, Peers, RankArgs, rank_device

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    if args.is_embedding:
        serve_classifier(args)
        return
    per_node = args.tp_size // args.nnodes
    if args.device == "cuda" and per_node > torch.cuda.device_count():
        raise SystemExit(f"--tp-size {args.tp_size} over {args.nnodes} node(s) needs {per_node} "
                         f"GPUs here; this process sees {torch.cuda.device_count()}")
    nodes = Nodes(args.nnodes, args.node_rank, args.dist_init_addr or "",
                  os.environ.get(ENGINE_SECRET_ENV, "").encode())
    rank_args = RankArgs(args.model_path, args.tokenizer_path, args.device, args.dtype,
                         args.seed, args.weight_version, args.weight_sync_timeout,
                         args.torch_threads, args.mem_fraction_static, per_node,
                         args.enable_weights_cpu_backup, args.tp_size, args.ep_size)
    if args.node_rank > 0:
        serve_other_node(args, rank_args, nodes)
        return
    # The peers load their copies while this rank loads its own.
    peers = Peers(rank_args, args.tp_size, nodes)
    engine = ReferenceEngine(args.model_path, tokenizer_path=args.tokenizer_path,
                             device=rank_device(args.device, 0), dtype=args.dtype,
                             seed=args.seed, weight_version=args.weight_version,
                             mem_fraction_static=args.mem_fraction_static,
                             weights_cpu_backup=args.enable_weights_cpu_backup,
                             lora=lora_options(args),
                             return_routes=args.enable_return_routed_experts,
                             tp_size=args.tp_size, ep_size=args.ep_size)
    server = Server(engine, max_batch_size=args.max_batch_size,
                    batch_wait_s=args.batch_wait_ms / 1000,
                    max_prefill_tokens=args.max_prefill_tokens,
                    continuous=args.batching == "continuous",
                    weight_sync_timeout_s=args.weight_sync_timeout,
                    peers=peers if args.tp_size > 1 else None,
                    # /server_info reports them under SGLang's ServerArgs names
                    server_args={"host": args.host, "port": args.port,
                                 "random_seed": args.seed, "nnodes": args.nnodes,
                                 "node_rank": args.node_rank,
                                 "dist_init_addr": args.dist_init_addr,
                                 "mem_fraction_static": args.mem_fraction_static,
                                 "enable_metrics": args.enable_metrics,
                                 "ep_size": args.ep_size,
                                 "enable_return_routed_experts":
                                     args.enable_return_routed_experts,
                                 **lora_server_args(args)},
                    max_loaded_loras=args.max_loaded_loras,
                    enable_metrics=args.enable_metrics,
                    api_key=args.api_key or os.environ.get(ENGINE_API_KEY_ENV, ""))
    signal.signal(fault.SIGNAL, lambda *_: setattr(server, "die_at_next_bucket", True))
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


def lora_options(args: argparse.Namespace) -> dict[str, object] | None:
    """ReferenceEngine's `lora` (lora.AdapterSet's arguments); None without --enable-lora."""
    if not args.enable_lora:
        return None
    from kuberl_rollout.reference.lora import engine_targets

    return {"max_lora_rank": args.max_lora_rank,
            "targets": engine_targets(args.lora_target_modules),
            "max_loras_per_batch": args.max_loras_per_batch}


def lora_server_args(args: argparse.Namespace) -> dict[str, object]:
    """/server_info's LoRA entries, as SGLang's ServerArgs holds them after its checks."""
    from kuberl_rollout.reference.lora import engine_targets

    targets = args.lora_target_modules
    return {"enable_lora": args.enable_lora or None, "max_lora_rank": args.max_lora_rank,
            "lora_target_modules": sorted(engine_targets(targets))
            if args.enable_lora and targets else targets,
            "lora_paths": [] if args.enable_lora else None,
            "max_loaded_loras": args.max_loaded_loras,
            "max_loras_per_batch": args.max_loras_per_batch}


def serve_classifier(args: argparse.Namespace) -> None:
    """--is-embedding: the reward model on /classify (classify_server.py), one process."""
    from aiohttp import web

    from kuberl_rollout.reference.classifier import Classifier
    from kuberl_rollout.reference.classify_server import ClassifierServer

    classifier = Classifier(args.model_path, tokenizer_path=args.tokenizer_path,
                            device=args.device, dtype=args.dtype,
                            weight_version=args.weight_version,
                            max_batch_size=args.max_batch_size,
                            max_prefill_tokens=args.max_prefill_tokens)
    server = ClassifierServer(
        classifier, api_key=args.api_key or os.environ.get(ENGINE_API_KEY_ENV, ""),
        server_args={"host": args.host, "port": args.port, "random_seed": args.seed,
                     "enable_metrics": args.enable_metrics},
        enable_metrics=args.enable_metrics)
    logging.getLogger("kuberl.reference").info(
        "serving %s (%s, %d labels) on http://%s:%d/classify (%s, %s)", args.model_path,
        type(classifier.model).__name__, classifier.num_labels, args.host, args.port,
        args.device, args.dtype)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None,
                handler_cancellation=True)
    logging.shutdown()


def serve_other_node(args: argparse.Namespace, rank_args: RankArgs, nodes: Nodes) -> None:
    """Node rank >= 1 of an engine: run this node's TP ranks (they connect to node 0 and take
    their work from it) and answer /health, /health_generate and /ping on --port, as SGLang's
    non-zero node ranks do; exit when a rank exits (node 0 gone, or the rank failed), with
    its exit code."""
    import threading

    from aiohttp import web

    from kuberl_rollout.reference.tp import start_node_ranks

    log = logging.getLogger("kuberl.reference")
    procs = start_node_ranks(rank_args, args.tp_size, nodes)

    def watch() -> None:
        for proc in procs:
            proc.join()
            log.error("tensor parallel process %s exited with code %s", proc.name,
                      proc.exitcode)
            for other in procs:
                if other.is_alive():
                    other.terminate()
            logging.shutdown()
            os._exit(proc.exitcode or 0)

    threading.Thread(target=watch, daemon=True, name="tp-watch").start()

    async def ok(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    for path in ("/health", "/health_generate", "/ping"):
        app.router.add_get(path, ok)
    log.info("node %d of %d: tensor parallel ranks %s joining %s; /health on http://%s:%d",
             args.node_rank, args.nnodes, list(nodes.ranks(args.tp_size)),
             args.dist_init_addr, args.host, args.port)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    for proc in procs:
        proc.terminate()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
