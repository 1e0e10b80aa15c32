"""What the RLJob's validation rules cost the API server, per create and per status patch.

    flock /tmp/kuberl-e2e.lock .venv/bin/python bench/crd_validation_cost.py --jobs 50 --rounds 10

kube-apiserver's CPU profile during bench/operator_scale.py's burst put ~19% of its CPU in CEL
(`x-kubernetes-validations`), half of that under status updates: the API server evaluates a
CRD's rules over the whole object on every write, /status included, although a status patch
cannot change the spec. kuberl now ships its rules as a ValidatingAdmissionPolicy that matches
the `rljobs` resource and not its `status` subresource (kuberl_operator/policy.py).

One control plane (e2e/cluster.py), the same CRD installed under several groups that differ only
in where their rules are, exercised side by side in interleaved rounds (machines are noisy;
compare the ratios): per variant, N RLJobs created, then rounds of one status patch each (a
trainer's heartbeat: progress.step and lastHeartbeatTime), kube-apiserver's CPU seconds (/proc)
measured around each variant's share of a round. Variants:

- shipped: the CRD `kuberl crd` generates (no CEL) and the policy `kuberl crd --policy`
  generates, bound to the variant's group;
- rules-in-crd: the CRD as kuberl shipped it before, every rule as `x-kubernetes-validations`
  (`crd.validated_schema()`), no policy;
- no-cel: the CRD alone, no rules anywhere (the floor; bad specs reach the operator).

Each variant is also asked to create a job whose name is too long (a rule: CEL in the CRD or the
policy) and one that trains megatron on CPU (a cross-field rule): the table says whether the API
server refused them.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for sub in (ROOT / "e2e", ROOT / "bench"):
    if str(sub) not in sys.path:
        sys.path.insert(0, str(sub))

from cluster import Cluster  # noqa: E402
from operator_scale import Client, proc_cpu  # noqa: E402
from rljobs import cpu_job, namespace  # noqa: E402

from kuberl_operator.crd import rljob_crd, validated_schema  # noqa: E402
from kuberl_operator.policy import rljob_policy, rljob_policy_binding  # noqa: E402

Obj = dict[str, Any]
VARIANTS = ("shipped", "rules-in-crd", "no-cel")


def group_of(name: str) -> str:
    return f"{name}.bench.kuberl.dev"


def variant(name: str) -> list[Obj]:
    """The shipped CRD under the group `<name>.bench.kuberl.dev`, with `name`'s rules: the CRD,
    and for `shipped` the policy and its binding."""
    crd = copy.deepcopy(rljob_crd())
    group = group_of(name)
    crd["metadata"]["name"] = f"{crd['spec']['names']['plural']}.{group}"
    crd["spec"]["group"] = group
    if name == "rules-in-crd":
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"] = validated_schema()
    if name != "shipped":
        return [crd]
    policy = f"rljobs.{group}"
    return [crd, rljob_policy(group=group, name=policy), rljob_policy_binding(policy)]


def path(group: str, ns: str, name: str = "", sub: str = "") -> str:
    out = f"/apis/{group}/v1alpha1/namespaces/{ns}/rljobs"
    return out + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


# Specs each variant is asked to create: refused where the rules run.
BAD: dict[str, Callable[[str], Obj]] = {
    "41-char name": lambda ns: cpu_job("x" * 41, ns),
    "megatron on CPU": lambda ns: cpu_job("megatron-on-cpu", ns, training={
        "backend": "megatron", "gpusPerNode": 0}),
}


def running_status(step: int) -> Obj:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {"status": {"phase": "Running", "rayJobName": "x-r0", "restarts": 0,
                       "progress": {"step": step, "lastHeartbeatTime": now}}}


def measure(apiserver: int, fn: Callable[[], None]) -> tuple[float, float]:
    cpu0, t0 = proc_cpu(apiserver), time.monotonic()
    fn()
    return proc_cpu(apiserver) - cpu0, time.monotonic() - t0


def run(cluster: Cluster, args: argparse.Namespace, say: Callable[[str], None]) -> str:
    client = Client(cluster)
    apiserver = cluster.pids["kube-apiserver"]
    cost: dict[str, dict[str, float]] = {v: {"create": 0.0, "patch": 0.0, "patch_wall": 0.0}
                                         for v in VARIANTS}
    refused: dict[str, dict[str, str]] = {v: {} for v in VARIANTS}
    chunks = [range(i, min(i + 10, args.jobs)) for i in range(0, args.jobs, 10)]
    with namespace(cluster, "crdcost") as ns:
        # Creates in chunks of 10, the variants interleaved (as the patches' rounds are).
        for c, chunk in enumerate(chunks):
            for v in (VARIANTS if c % 2 == 0 else tuple(reversed(VARIANTS))):

                def create(group: str = group_of(v), chunk: range = chunk) -> None:
                    for i in chunk:
                        body = cpu_job(f"job-{i:04d}", ns)
                        body["apiVersion"] = f"{group}/v1alpha1"
                        status, out = client.request("POST", path(group, ns), body)
                        assert status == 201, (status, out)
                cost[v]["create"] += measure(apiserver, create)[0] / args.jobs
        for v in VARIANTS:
            group = group_of(v)
            for case, body in BAD.items():
                bad = body(ns) | {"apiVersion": f"{group}/v1alpha1"}
                status, _ = client.request("POST", path(group, ns), bad)
                refused[v][case] = "refused" if status == 422 else f"ACCEPTED ({status})"
        for r in range(args.rounds):
            for v in (VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))):
                group = group_of(v)

                def patch_all(group: str = group, step: int = r) -> None:
                    for i in range(args.jobs):
                        status, out = client.request(
                            "PATCH", path(group, ns, f"job-{i:04d}", "status"),
                            running_status(step), "application/merge-patch+json")
                        assert status == 200, (status, out)
                cpu, wall = measure(apiserver, patch_all)
                cost[v]["patch"] += cpu / (args.jobs * args.rounds)
                cost[v]["patch_wall"] += wall / (args.jobs * args.rounds)
            say(f"round {r + 1}/{args.rounds}")
    client.close()
    base = cost["rules-in-crd"]
    lines = ["| variant | API server CPU ms / create | ms / status patch | vs rules-in-crd | "
             "wall ms / status patch | " + " | ".join(BAD) + " |",
             "|---|---|---|---|---|" + "---|" * len(BAD)]
    for v in VARIANTS:
        c = cost[v]
        lines.append(f"| {v} | {c['create'] * 1e3:.1f} | {c['patch'] * 1e3:.2f} | "
                     f"{c['patch'] / base['patch']:.2f}x | {c['patch_wall'] * 1e3:.1f} | "
                     + " | ".join(refused[v][case] for case in BAD) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=50, help="RLJobs per variant")
    p.add_argument("--rounds", type=int, default=10, help="status patches per RLJob")
    p.add_argument("--state-dir", default=None)
    args = p.parse_args(argv)

    def say(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    state = Path(args.state_dir or f"/tmp/kuberl-crdcost-{time.time():.0f}")
    crd_dir = state / "crds"
    crd_dir.mkdir(parents=True, exist_ok=True)
    for v in VARIANTS:  # (JSON is YAML)
        (crd_dir / f"{v}.yaml").write_text("\n---\n".join(json.dumps(o) for o in variant(v)))
    cluster = Cluster.start(state / "k8s", build_missing=False, crds=[crd_dir],
                            nodes={"cpu": 1}, log=say)
    try:
        say("control plane up; creating and patching")
        table = run(cluster, args, say)
    finally:
        cluster.stop(remove_state=True)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
