"""What the RLJob CRD's validation rules cost the API server, per create and per status patch.

    flock /tmp/kuberl-e2e.lock .venv/bin/python bench/crd_validation_cost.py --jobs 50 --rounds 10

kube-apiserver's CPU profile during bench/operator_scale.py's burst put ~19% of its CPU in CEL
(`x-kubernetes-validations`), half of that under status updates: the RLJob's root-level rules
(metadata.name's length and form, and the immutability of spec sections once a job started,
which compare old and new spec sections) run on every status patch too, the operator's and the
trainer's heartbeats alike, although a status patch cannot change the spec.

One control plane (e2e/cluster.py), the same CRD installed under several groups that differ only
in their rules, exercised side by side in interleaved rounds (machines are noisy; compare the
ratios): per variant, N RLJobs created, then rounds of one status patch each (a trainer's
heartbeat: progress.step and lastHeartbeatTime), kube-apiserver's CPU seconds (/proc) measured
around each variant's share of a round. Variants:

- shipped: the CRD `kuberl crd` generates, as is;
- name-in-schema: metadata.name's two CEL rules replaced by `maxLength`/`pattern` on
  metadata.name (plain OpenAPI validation), the immutability rules kept;
- no-root-rules: no root-level rules at all (immutability left to the operator's
  Accepted=False condition);
- no-cel: no `x-kubernetes-validations` anywhere (the floor).

Each variant is also asked to create a job whose name is too long: the table says whether the
API server refused it.
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

from kuberl_operator.crd import rljob_crd  # noqa: E402

Obj = dict[str, Any]
NAME_RULES = ("self.metadata.name",)  # the root rules about the name (the rest: immutability)
NAME_SCHEMA = {"type": "object", "properties": {"name": {
    "type": "string", "maxLength": 40, "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$"}}}


def strip_rules(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip_rules(v) for k, v in node.items() if k != "x-kubernetes-validations"}
    if isinstance(node, list):
        return [strip_rules(v) for v in node]
    return node


def variant(name: str) -> Obj:
    """The shipped CRD under the group `<name>.bench.kuberl.dev`, with `name`'s rules."""
    crd = copy.deepcopy(rljob_crd())
    group = f"{name}.bench.kuberl.dev"
    crd["metadata"]["name"] = f"{crd['spec']['names']['plural']}.{group}"
    crd["spec"]["group"] = group
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = schema.get("x-kubernetes-validations", [])
    if name == "name-in-schema":
        schema["x-kubernetes-validations"] = [
            r for r in rules if not r["rule"].startswith(NAME_RULES)]
        schema["properties"]["metadata"] = NAME_SCHEMA
    elif name == "no-root-rules":
        schema.pop("x-kubernetes-validations", None)
    elif name == "no-cel":
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"] = strip_rules(schema)
    return crd


VARIANTS = ("shipped", "name-in-schema", "no-root-rules", "no-cel")


def path(group: str, ns: str, name: str = "", sub: str = "") -> str:
    out = f"/apis/{group}/v1alpha1/namespaces/{ns}/rljobs"
    return out + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


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
    refused: dict[str, str] = {}
    with namespace(cluster, "crdcost") as ns:
        for v in VARIANTS:
            group = f"{v}.bench.kuberl.dev"

            def create_all(group: str = group) -> None:
                for i in range(args.jobs):
                    body = cpu_job(f"job-{i:04d}", ns)
                    body["apiVersion"] = f"{group}/v1alpha1"
                    status, out = client.request("POST", path(group, ns), body)
                    assert status == 201, (status, out)
            cost[v]["create"] = measure(apiserver, create_all)[0] / args.jobs
            long_name = cpu_job("x" * 41, ns) | {"apiVersion": f"{group}/v1alpha1"}
            status, _ = client.request("POST", path(group, ns), long_name)
            refused[v] = "refused" if status == 422 else f"ACCEPTED ({status})"
        for r in range(args.rounds):
            for v in (VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))):
                group = f"{v}.bench.kuberl.dev"

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
    base = cost["shipped"]
    lines = ["| variant | API server CPU ms / create | ms / status patch | vs shipped | "
             "wall ms / status patch | 41-char name |", "|---|---|---|---|---|---|"]
    for v in VARIANTS:
        c = cost[v]
        lines.append(f"| {v} | {c['create'] * 1e3:.1f} | {c['patch'] * 1e3:.2f} | "
                     f"{c['patch'] / base['patch']:.2f}x | {c['patch_wall'] * 1e3:.1f} | "
                     f"{refused[v]} |")
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
    for v in VARIANTS:
        (crd_dir / f"{v}.yaml").write_text(json.dumps(variant(v)))  # (JSON is YAML)
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
