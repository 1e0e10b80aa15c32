"""The `kuberl` command.

    kuberl crd [--output FILE]      print (or write) the RLJob CRD generated from the model
    kuberl crd --policy [-o FILE]   ... or the ValidatingAdmissionPolicy with the RLJob's rules
    kuberl validate RLJOB.yaml      check a manifest the way the operator will
    kuberl render RLJOB.yaml        print every child object the operator would create
    kuberl run RLJOB.yaml           run the job on local Ray (the training loop)
    kuberl graceful-stop ROLE       the Ray pods' preStop hook: let the driver save first

Heavy packages (kopf, ray, torch) are imported only by the subcommand that needs them, so
`kuberl validate` and `kuberl render` start fast and work with the base install.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import yaml

from kuberl_api import InvalidRLJob, RLJob, load, load_rendered


def _cmd_crd(args: argparse.Namespace) -> int:
    if args.policy:
        from kuberl_operator.policy import rljob_policy_yaml

        text = rljob_policy_yaml()
    else:
        from kuberl_operator.crd import rljob_crd_yaml

        text = rljob_crd_yaml()
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _load(path: str) -> RLJob:
    return load(path)


def _cmd_validate(args: argparse.Namespace) -> int:
    job = _load(args.manifest)
    spec = job.spec
    reward = spec.reward.model if spec.reward.type == "model" else None
    served = ("" if reward is None
              else f", a reward model on {reward.replicas}x{reward.gpus_per_replica} GPUs"
              if reward.gpus_per_replica else f", a reward model on {reward.replicas} CPU pod(s)")
    print(f"{args.manifest}: RLJob {job.namespace}/{job.name} is valid "
          f"({spec.placement}, {spec.training.nodes}x{spec.training.gpus_per_node} training "
          f"GPUs, {spec.num_engines} engine(s){served}, {spec.schedule.num_rollouts} steps)")
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    from kuberl_operator.render import render_children

    job = _load(args.manifest)
    if args.namespace:
        job.metadata.namespace = args.namespace
    children = render_children(job, attempt=args.attempt)
    sys.stdout.write(yaml.safe_dump_all(children, sort_keys=False, width=100))
    return 0


def code_notice(job: RLJob) -> str | None:
    """What `kuberl run` says about spec.code outside a cluster: it mounts nothing here (there
    is no ConfigMap or PVC to read), so the modules come from where they always do locally.
    A notice rather than a refusal: the same manifest runs in both places."""
    source = job.spec.code.source
    if source is None:
        return None
    return (f"notice: spec.code ({source}) is mounted only in a cluster; kuberl run imports "
            "rollout.function, environment.class, reward.function and "
            "algorithm.lossFunction from the current directory and PYTHONPATH")


def importable_from_cwd() -> None:
    """The current directory first on this process's import path, as `python -m` and
    `python -c` put it but a console script (`kuberl`, whose sys.path starts with its own
    bin directory) does not: `kuberl run` imports the job's own modules from where it runs.
    Ray adds the driver's current directory to its workers' path too (ray.init), so the
    training ranks import a loss function from there as the head does."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


def _cmd_run(args: argparse.Namespace) -> int:
    if args.in_cluster:
        # The config the operator rendered: the rules it waived for this job (an earlier
        # release accepted it; kuberl_operator/status/ratchet.py) are waived here too.
        job, waived = load_rendered(args.manifest)
        for failure in waived:
            print(f"notice: accepted by an earlier kuberl release, refused by this one: "
                  f"{failure.line()}", file=sys.stderr)
    else:
        job = _load(args.manifest)
    notice = None if args.in_cluster else code_notice(job)
    if notice:
        print(notice, file=sys.stderr)
    if not args.in_cluster:
        importable_from_cwd()
    try:
        from kuberl_trainer import ray_auth
    except ImportError as exc:
        print(f"kuberl run: the training loop is not installed in this environment ({exc}); "
              "install kuberl[trainer]", file=sys.stderr)
        return 2
    if not args.address:
        # The Ray this run starts checks a token (new per run), set before Ray is imported:
        # Ray reads it once, then. A run that joins (--address) brings that Ray's own.
        ray_auth.enable_for_local_ray()
    try:
        from kuberl_trainer.run import run
    except ImportError as exc:
        print(f"kuberl run: the training loop is not installed in this environment ({exc}); "
              "install kuberl[trainer]", file=sys.stderr)
        return 2
    result: int = run(job, args)
    return result


def _cmd_graceful_stop(args: argparse.Namespace) -> int:
    from kuberl_cli.graceful_stop import main as graceful_stop

    return graceful_stop(args.role, args.within)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kuberl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    crd = sub.add_parser("crd", help="print the RLJob CustomResourceDefinition")
    crd.add_argument("--output", "-o", help="write to this file instead of stdout")
    crd.add_argument("--policy", action="store_true",
                     help="the ValidatingAdmissionPolicy and its binding that check the RLJob's "
                     "rules at create and update (crds/rljob-policy.yaml) instead of the CRD")
    crd.set_defaults(func=_cmd_crd)

    validate = sub.add_parser("validate", help="validate an RLJob manifest")
    validate.add_argument("manifest")
    validate.set_defaults(func=_cmd_validate)

    render = sub.add_parser("render", help="print the objects the operator would create")
    render.add_argument("manifest")
    render.add_argument("--namespace", "-n", help="override metadata.namespace")
    render.add_argument("--attempt", type=int, default=0,
                        help="restart attempt to render (0 = first run)")
    render.set_defaults(func=_cmd_render)

    run = sub.add_parser("run", help="run the job on local (or --address) Ray")
    run.add_argument("manifest")
    run.add_argument("--address", default=None, help="Ray address (default: start local Ray)")
    run.add_argument("--in-cluster", action="store_true",
                     help="running as the RayJob entrypoint: report progress to the RLJob")
    run.add_argument("--output-dir", default=None,
                     help="where metrics.jsonl and (locally) checkpoints go; default out/NAME")
    run.add_argument("--metrics-port", type=int, default=0,
                     help="serve per-step metrics for Prometheus on this port (0: off)")
    run.add_argument("--tensorboard", type=Path, default=None,
                     help="also write TensorBoard scalars here (needs tensorboard installed)")
    run.add_argument("--wandb", metavar="PROJECT", default=None,
                     help="also log to Weights & Biases (needs wandb installed and logged in)")
    run.add_argument("--seed", type=int, default=0, help="seed for data order and sampling")
    run.add_argument("--environment-url", default=None, metavar="URL",
                     help="environment.image: use the environment service at URL (e.g. a "
                     "container of the image: http://127.0.0.1:8000) instead of serving "
                     "environment.class as a local subprocess")
    run.set_defaults(func=_cmd_run)

    stop = sub.add_parser("graceful-stop", help="preStop hook of the Ray pods: the head asks "
                          "the driver to save a checkpoint and waits; train pods wait for it")
    stop.add_argument("role", choices=["head", "worker"])
    stop.add_argument("--within", type=float, default=60.0,
                      help="seconds to wait at most (the grace period less Ray's margin)")
    stop.set_defaults(func=_cmd_graceful_stop)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except InvalidRLJob as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return code


def entry() -> None:
    """The `kuberl` command (and `python -m kuberl_cli.main`): main(), then exit. A command
    that loaded torch and Ray (`run`) leaves without the interpreter's teardown: freeing
    their modules and C++ state took 1.4 s of every local run's end on 2 cores, after the
    run had closed its files and shut Ray down. The exit handlers still run, and the output
    is flushed, first."""
    code = main()
    if "torch" in sys.modules:
        _leave(code)
    sys.exit(code)


def _leave(code: int) -> NoReturn:  # pragma: no cover (coverage stops in its exit handler)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
