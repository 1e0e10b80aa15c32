"""The command line: build, up, down, status, env."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from .base import ClusterError
from .cluster import Cluster
from .kwok import DEFAULT_NODES
from .versions import build, default_state_dir

DESCRIPTION = "A local Kubernetes control plane for kuberl's end-to-end tests."


def _exports(c: Cluster) -> str:
    return f"export KUBECONFIG={c.kubeconfig}\nexport PATH={c.bin_dir}:$PATH"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="e2e/cluster.py", description=DESCRIPTION)
    sub = p.add_subparsers(dest="cmd", required=True)
    p_build = sub.add_parser("build", help="build the binaries that are missing (e2e/build.sh)")
    p_build.add_argument("components", nargs="*")
    p_up = sub.add_parser("up", help="start a cluster (replacing one left in the state dir)")
    p_down = sub.add_parser("down", help="stop the cluster and remove its state dir")
    p_status = sub.add_parser("status", help="what runs, ports, health, nodes")
    p_env = sub.add_parser("env", help="print the export lines for a running cluster")
    for s in (p_up, p_down, p_status, p_env):
        s.add_argument("--state-dir", type=Path, default=None,
                       help=f"default: {default_state_dir()}")
    for pool, n in DEFAULT_NODES.items():
        p_up.add_argument(f"--{pool}-nodes", type=int, default=n, help=f"default {n}")
    p_up.add_argument("--crds", type=Path, action="append", default=[], metavar="PATH",
                      help="more CRD files or directories to install (repeatable), e.g. crds/")
    p_up.add_argument("--kueue", action="store_true", help="also run Kueue (RayJob queueing)")
    p_up.add_argument("--timeout", type=float, default=300)
    p_up.add_argument("--no-build", action="store_true", help="fail instead of building")
    p_down.add_argument("--keep-state", action="store_true", help="keep logs and data")
    return p


def say(msg: str) -> None:
    print(f"[cluster.py] {msg}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "build":
        build(args.components)
        return 0
    if args.cmd == "up":
        counts = {pool: getattr(args, f"{pool}_nodes") for pool in DEFAULT_NODES}
        c = Cluster.start(args.state_dir, nodes=counts, build_missing=not args.no_build,
                          crds=args.crds, kueue=args.kueue, timeout=args.timeout,
                          die_with_parent=False, log=say)
        say(f"up in {c.timings['total']:.1f}s; logs in {c.log_dir}")
        print(_exports(c))
        return 0
    try:
        c = Cluster.attach(args.state_dir)
    except ClusterError as e:
        say(str(e))
        return 0 if args.cmd == "down" else 1
    if args.cmd == "down":
        c.stop(remove_state=not args.keep_state)
        say("down")
    elif args.cmd == "status":
        print(c.describe())
        return 0 if all(c.running().values()) else 1
    elif args.cmd == "env":
        print(_exports(c))
    return 0
