"""What a run was asked for besides the RLJob: where it runs (a local Ray, --address, or a
cluster's RayJob) and where its outputs go (`kuberl run`'s flags)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from kuberl_api import RLJob


@dataclass
class Options:
    address: str | None
    in_cluster: bool
    output_dir: Path
    checkpoint_dir: Path
    prometheus_port: int
    tensorboard: Path | None
    seed: int
    wandb_project: str | None = None
    # environment.image's service: --environment-url (else what the operator set on the head,
    # else `kuberl run` serves the class itself: agents/service.py)
    environment_url: str | None = None
    # Every actor shares this machine: a local Ray, or (once joined: startup.HeadStart) a Ray
    # at --address whose nodes are all this machine; never with --in-cluster. Then the actors'
    # output goes to log files, CPU actors split the cores, and the weight-sync rendezvous
    # takes a free port (runs side by side never collide).
    one_machine: bool = field(init=False)

    def __post_init__(self) -> None:
        self.one_machine = not self.address and not self.in_cluster

    @property
    def log_dir(self) -> Path | None:
        """Where the engines' and training workers' output goes on one machine (the terminal
        is for the step table); None in a cluster, where it stays in the pods' logs."""
        return self.output_dir / "logs" if self.one_machine else None


def options(job: RLJob, args: argparse.Namespace) -> Options:
    out = Path(args.output_dir or Path("out") / job.name)
    ckpt = Path(job.spec.checkpoint.path) if args.in_cluster else out / "checkpoints"
    return Options(address=args.address, in_cluster=args.in_cluster, output_dir=out,
                   checkpoint_dir=ckpt, prometheus_port=getattr(args, "metrics_port", 0) or 0,
                   tensorboard=getattr(args, "tensorboard", None), seed=getattr(args, "seed", 0),
                   wandb_project=getattr(args, "wandb", None),
                   environment_url=getattr(args, "environment_url", None) or None)
