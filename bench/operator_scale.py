"""The operator at scale (issue 18): N RLJobs created in one burst on the real local control plane.

    flock /tmp/kuberl-e2e.lock .venv/bin/python bench/operator_scale.py --jobs 300,1000

Starts its own control plane (e2e/cluster.py, binaries built already), one namespace per size,
and the operator as the chart runs it: `python -m kuberl_operator` with the chart's defaults
(resync 30 s, not verbose, namespaced mode: --no-scanning) and the chart's identity (the chart
installed in the namespace, a 3 h token of its ServiceAccount). Not e2e's `Operator.start`,
which sets test timers (resync 1 s, -v) that would measure the tests' settings, not the chart's.

Per size: the RLJobs are POSTed by `--clients` threads, each on its own kept-alive connection;
a job's apply time is its create call's return. Two watch streams (RLJobs; RayJobs labelled
kuberl.dev/rljob) stamp each event on arrival: apply -> RayJob created is the first RayJob
event of the job, apply -> Accepted the first RLJob event with Accepted=True (creationTimestamp
has 1 s resolution, too coarse). Also: the operator's peak RSS (/proc VmRSS every 0.2 s), CPU
seconds (utime+stime) per phase, its /metrics (reconcile passes by result, duration
histogram), RayJobs per RLJob (> 1: duplicates), then delete-all (one deletecollection) ->
no child labelled kuberl.dev/rljob left (the garbage collector's time; what is left at the
timeout: orphans). kube-apiserver's, etcd's and the controller-manager's CPU are sampled too.

`--kuberay off` (default) stops the KubeRay operator after start: with it, N RLJobs make N
RayClusters and their pods, which measures KubeRay and kwok rather than this operator. `on`
keeps it (and adds cpu nodes); the table says which. Issue 18 gives absolute goals, so each row
prints measured vs goal.

The operator's cost as a ratio (issue 36): before each size's RLJobs, `--baseline rayjobs`
(default) POSTs the same N jobs' RayJobs directly, rendered by the operator's own pure
renderers (`render_children`, as `kuberl render` prints them), with the same clients, into a
namespace no operator watches; `--baseline all` POSTs every object rendered for a job (its
NetworkPolicy, ServiceAccount, Role, RoleBinding, ConfigMap and Secret, then the RayJob), what
`kuberl render | kubectl apply -f -` would do. Both bursts are timed the same way, from the
burst's start (the moment `kubectl apply -f` of N files would begin) to each job's RayJob on the
watch; the table's ratio is the RLJobs' p99 over the direct RayJobs' p99 (issue 36's goal:
<= 1.2x).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import http.client
import json
import math
import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
E2E = ROOT / "e2e"
if str(E2E) not in sys.path:
    sys.path.insert(0, str(E2E))

from cluster import Cluster, binaries  # noqa: E402
from polling import wait_for  # noqa: E402
from rljobs import Operator, cpu_job, http_get, namespace  # noqa: E402

from kuberl_api import parse  # noqa: E402
from kuberl_operator.render import render_children  # noqa: E402

LABEL = "kuberl.dev/rljob"
RLJOBS = "/apis/kuberl.dev/v1alpha1/namespaces/{ns}/rljobs"
# What the operator makes per RLJob (all labelled kuberl.dev/rljob), checked after delete-all.
CHILDREN = {
    "RayJob": "/apis/ray.io/v1/namespaces/{ns}/rayjobs",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
}
KUBERAY_CHILDREN = {  # with --kuberay on: KubeRay copies the label onto these
    "RayCluster": "/apis/ray.io/v1/namespaces/{ns}/rayclusters",
    "Pod": "/api/v1/namespaces/{ns}/pods",
}
GOALS = {"p99": 10.0, "rss_mib": 256.0, "ratio": 1.2}
# Where the baseline POSTs each rendered kind (namespaced).
COLLECTIONS = {
    ("v1", "ServiceAccount"): "/api/v1/namespaces/{ns}/serviceaccounts",
    ("v1", "ConfigMap"): "/api/v1/namespaces/{ns}/configmaps",
    ("v1", "Secret"): "/api/v1/namespaces/{ns}/secrets",
    ("v1", "Service"): "/api/v1/namespaces/{ns}/services",
    ("apps/v1", "Deployment"): "/apis/apps/v1/namespaces/{ns}/deployments",
    ("rbac.authorization.k8s.io/v1", "Role"):
        "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"):
        "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    ("networking.k8s.io/v1", "NetworkPolicy"):
        "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    ("ray.io/v1", "RayJob"): "/apis/ray.io/v1/namespaces/{ns}/rayjobs",
}
TICK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ API client and watches


class Client:
    """One kept-alive HTTPS connection as the cluster's admin (a TLS handshake per request
    would cost the API server more CPU than the requests)."""

    def __init__(self, cluster: Cluster, timeout: float | None = 60) -> None:
        pki = cluster.state_dir / "pki"
        self.ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        self.port = cluster.ports["apiserver"]
        self.timeout = timeout
        self.conn: http.client.HTTPSConnection | None = None

    def connect(self) -> http.client.HTTPSConnection:
        if self.conn is None:
            self.conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.ctx,
                                                    timeout=self.timeout)
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json") -> tuple[int, Any]:
        data = None if body is None else json.dumps(body)
        for attempt in range(3):
            conn = self.connect()
            try:
                conn.request(method, path, body=data, headers={
                    "Content-Type": content_type, "Accept": "application/json"})
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt == 2:
                    raise
                continue
            return resp.status, (json.loads(raw) if raw else None)
        raise AssertionError("unreachable")

    def items(self, path: str, query: str = "") -> tuple[list[dict[str, Any]], str]:
        status, body = self.request("GET", f"{path}?{query}")
        assert status == 200, (path, status, body)
        return body["items"], body["metadata"]["resourceVersion"]


def selector(exists: str = LABEL) -> str:
    return "labelSelector=" + urllib.parse.quote(exists)


class Watch(threading.Thread):
    """A watch stream from `rv` on; `on_event(arrival, type, obj)` for each event, stamped
    with time.monotonic() as its line arrives. Reconnects from the last resourceVersion."""

    def __init__(self, cluster: Cluster, path: str, query: str, rv: str,
                 on_event: Callable[[float, str, dict[str, Any]], None]) -> None:
        super().__init__(daemon=True, name=f"watch {path}")
        self.cluster, self.path, self.query, self.rv = cluster, path, query, rv
        self.on_event = on_event
        self.stopped = False
        self.errors = 0

    def run(self) -> None:
        while not self.stopped:
            client = Client(self.cluster, timeout=None)
            try:
                conn = client.connect()
                conn.request("GET", f"{self.path}?watch=1&allowWatchBookmarks=true"
                             f"&timeoutSeconds=1800&resourceVersion={self.rv}&{self.query}")
                resp = conn.getresponse()
                for line in resp:
                    now = time.monotonic()
                    ev = json.loads(line)
                    if ev["type"] == "ERROR":
                        raise RuntimeError(f"watch {self.path}: {ev['object']}")
                    self.rv = ev["object"]["metadata"]["resourceVersion"]
                    if ev["type"] != "BOOKMARK":
                        self.on_event(now, ev["type"], ev["object"])
            except Exception:
                if self.stopped:
                    return
                self.errors += 1
                time.sleep(0.5)
            finally:
                client.close()


def accepted(obj: dict[str, Any]) -> bool:
    return any(c.get("type") == "Accepted" and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


@dataclass
class Seen:
    """Arrival times per job, filled by the watch threads."""

    created: dict[str, float] = field(default_factory=dict)
    rayjob: dict[str, float] = field(default_factory=dict)
    accepted: dict[str, float] = field(default_factory=dict)
    rayjob_names: dict[str, set[str]] = field(default_factory=dict)
    rljob_events: int = 0
    rayjob_events: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_rljob(self, t: float, type_: str, obj: dict[str, Any]) -> None:
        with self.lock:
            self.rljob_events += 1
            name = obj["metadata"]["name"]
            if type_ != "DELETED" and name not in self.accepted and accepted(obj):
                self.accepted[name] = t

    def on_rayjob(self, t: float, type_: str, obj: dict[str, Any]) -> None:
        with self.lock:
            self.rayjob_events += 1
            job = (obj["metadata"].get("labels") or {}).get(LABEL)
            if job is None or type_ == "DELETED":
                return
            self.rayjob.setdefault(job, t)
            self.rayjob_names.setdefault(job, set()).add(obj["metadata"]["name"])


# ------------------------------------------------------------------ process sampling


def proc_cpu(pid: int) -> float:
    """utime + stime of a process, seconds (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def proc_rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Sampler(threading.Thread):
    """RSS (peak) and CPU seconds of the watched processes every `interval` s."""

    def __init__(self, pids: dict[str, int], interval: float = 0.2) -> None:
        super().__init__(daemon=True, name="sampler")
        self.pids, self.interval = pids, interval
        self.peak_rss: dict[str, float] = dict.fromkeys(pids, 0.0)
        self.stopped = False

    def cpu(self) -> dict[str, float]:
        out = {name: proc_cpu(pid) for name, pid in self.pids.items()}
        out["bench"] = sum(os.times()[:2])
        return out

    def run(self) -> None:
        while not self.stopped:
            for name, pid in self.pids.items():
                self.peak_rss[name] = max(self.peak_rss[name], proc_rss_mib(pid))
            time.sleep(self.interval)


# ------------------------------------------------------------------ the operator


class ChartOperator(Operator):
    """The chart's command line and defaults (resync 30 s, error backoff 5 s, not verbose),
    namespaced as the chart's watchNamespaces mode runs it, with the chart's identity."""

    def start(self) -> None:
        env = {**self.cluster.env, "PYTHONUNBUFFERED": "1",
               "KUBECONFIG": str(self.chart_identity())}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        args = [sys.executable, "-m", "kuberl_operator", "-n", self.ns, "--no-scanning",
                "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port),
                "--health-port", str(self.health_port)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         cwd=ROOT)
        wait_for("the operator's /healthz", lambda: self._healthy(), timeout=90,
                 detail=self.tail)

    def _healthy(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.tail()
        return http_get(f"http://127.0.0.1:{self.health_port}/healthz")[0] == 200


def scrape(op: Operator) -> dict[str, Any]:
    """reconcile_total by result and the duration histogram (cumulative buckets)."""
    text = op.metrics()
    out: dict[str, Any] = {"success": 0.0, "error": 0.0, "buckets": {}, "sum": 0.0,
                           "count": 0.0}
    for line in text.splitlines():
        if m := re.match(r'kuberl_operator_reconcile_total\{result="(\w+)"\} (\S+)', line):
            out[m[1]] = float(m[2])
        elif m := re.match(r'kuberl_operator_reconcile_duration_seconds_bucket\{le="([^"]+)"\}'
                           r' (\S+)', line):
            out["buckets"][float(m[1])] = float(m[2])
        elif m := re.match(r"kuberl_operator_reconcile_duration_seconds_(sum|count) (\S+)",
                           line):
            out[m[1]] = float(m[2])
    return out


def histogram_quantile(q: float, after: dict[str, Any], before: dict[str, Any]) -> float:
    """The upper bound of the bucket holding quantile q of the passes between two scrapes."""
    buckets = sorted(after["buckets"])
    counts = [after["buckets"][b] - before["buckets"].get(b, 0.0) for b in buckets]
    total = counts[-1] if counts else 0
    for le, c in zip(buckets, counts, strict=True):
        if total and c >= q * total:
            return le
    return math.nan


def apiserver_metrics(client: Client) -> str:
    client.close()  # a kept-alive connection may have idled out during GC
    try:
        conn = client.connect()
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    except (OSError, http.client.HTTPException):
        return ""
    finally:
        client.close()


def apiserver_rejections(client: Client) -> float:
    """API Priority and Fairness rejections (429s) since the API server started."""
    text = apiserver_metrics(client)
    if not text:
        return math.nan
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("apiserver_flowcontrol_rejected_requests_total{"))


_REQUESTS = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<n>\S+)$")


def requests_served(client: Client) -> dict[str, float]:
    """Requests the API server answered since it started, by "VERB resource[/subresource]"
    (watches and the metrics scrape itself excluded)."""
    out: dict[str, float] = {}
    for line in apiserver_metrics(client).splitlines():
        if not (m := _REQUESTS.match(line)):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
        if labels.get("verb") in ("WATCH", "CONNECT") or not labels.get("resource"):
            continue
        what = labels["resource"] + (f"/{labels['subresource']}" if labels.get("subresource")
                                     else "")
        key = f"{labels['verb']} {what}"
        out[key] = out.get(key, 0.0) + float(m["n"])
    return out


def requests_per_job(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    """The requests between two counts, per job (what every client asked during a burst)."""
    out = {k: (after[k] - before.get(k, 0.0)) / n for k in after}
    return {k: v for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v >= 0.05}


# ------------------------------------------------------------------ one size


def quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return dict.fromkeys(("p50", "p95", "p99", "max"), math.nan)
    s = sorted(values)

    def q(p: float) -> float:  # nearest rank
        return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]

    return {"p50": q(0.50), "p95": q(0.95), "p99": q(0.99), "max": s[-1]}


Posts = Callable[[str, str], list[tuple[str, dict[str, Any]]]]


def rljob_posts(name: str, ns: str) -> list[tuple[str, dict[str, Any]]]:
    """What a user applies for one job through the operator: its RLJob."""
    return [(RLJOBS.format(ns=ns), cpu_job(name, ns))]


def direct_posts(everything: bool) -> Posts:
    """What a user applies for one job without the operator: the RayJob the operator would
    render for the same RLJob (with `everything`, every object it renders, the RayJob last)."""
    def posts(name: str, ns: str) -> list[tuple[str, dict[str, Any]]]:
        children = render_children(parse(cpu_job(name, ns)))
        if not everything:
            children = children[-1:]
        assert children[-1]["kind"] == "RayJob", children[-1]["kind"]
        return [(COLLECTIONS[(c["apiVersion"], c["kind"])].format(ns=ns), c)
                for c in children]
    return posts


def create_burst(cluster: Cluster, ns: str, n: int, clients: int, seen: Seen,
                 posts: Posts = rljob_posts) -> list[str]:
    """`posts` for N jobs by `clients` threads; a job's create time is its last POST's return."""
    names = [f"scale-{i:05d}" for i in range(n)]
    local = threading.local()
    failures: list[str] = []

    def create(name: str) -> None:
        if not hasattr(local, "client"):
            local.client = Client(cluster)
        for path, obj in posts(name, ns):
            status, body = local.client.request("POST", path, obj)
            if status not in (200, 201, 409):
                failures.append(f"{name}: {status} {str(body)[:300]}")
                return
        done = time.monotonic()
        with seen.lock:
            seen.created[name] = done

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(create, names))
    if failures:
        print(f"  {len(failures)} creates failed, first: {failures[0]}", flush=True)
    return names


def wait_all(seen: Seen, names: list[str], timeout: float, say: Callable[[str], None]) -> bool:
    deadline = time.monotonic() + timeout
    last = 0.0
    while time.monotonic() < deadline:
        with seen.lock:
            done_rj, done_acc = len(seen.rayjob), len(seen.accepted)
        if done_rj >= len(names) and done_acc >= len(names):
            return True
        if time.monotonic() - last > 10:
            say(f"  RayJobs {done_rj}/{len(names)}, Accepted {done_acc}/{len(names)}")
            last = time.monotonic()
        time.sleep(0.1)
    return False


def leftovers(client: Client, ns: str, kinds: dict[str, str], full: bool = False) -> dict[str, int]:
    """Children labelled kuberl.dev/rljob still there (limit=1 while polling: is it empty)."""
    out = {}
    for kind, path in kinds.items():
        items, _ = client.items(path.format(ns=ns), selector() + ("" if full else "&limit=1"))
        if items:
            out[kind] = len(items)
    return out


def delete_and_gc(cluster: Cluster, ns: str, kinds: dict[str, str], timeout: float,
                  say: Callable[[str], None]) -> tuple[float, dict[str, int], float]:
    """deletecollection of the RLJobs -> no labelled child left. Returns (seconds, orphans,
    seconds until the RLJobs themselves were gone)."""
    client = Client(cluster)
    t0 = time.monotonic()
    status, body = client.request("DELETE", RLJOBS.format(ns=ns))
    assert status == 200, (status, str(body)[:300])
    rljobs_gone = math.nan
    last = 0.0
    while time.monotonic() - t0 < timeout:
        if math.isnan(rljobs_gone) and not client.items(RLJOBS.format(ns=ns), "limit=1")[0]:
            rljobs_gone = time.monotonic() - t0
        if not leftovers(client, ns, kinds):
            return time.monotonic() - t0, {}, rljobs_gone
        if time.monotonic() - last > 15:
            say(f"  GC: left {leftovers(client, ns, kinds, full=True)}")
            last = time.monotonic()
        time.sleep(0.5)
    return math.nan, leftovers(client, ns, kinds, full=True), rljobs_gone


@dataclass
class Baseline:
    """The same N jobs' rendered RayJobs (or all their objects) POSTed directly."""

    jobs: int
    what: str
    rayjob_from_start: dict[str, float]
    rayjob: dict[str, float]
    missing_rayjob: int
    burst_s: float
    apiserver_cpu: float
    requests: dict[str, float]


def run_baseline(cluster: Cluster, n: int, args: argparse.Namespace,
                 say: Callable[[str], None]) -> Baseline:
    """N jobs applied without the operator (none watches the namespace), timed as run_size
    times the RLJobs: from the burst's start and from each job's last create to its RayJob."""
    posts = direct_posts(args.baseline == "all")
    apiserver = cluster.pids["kube-apiserver"]
    with namespace(cluster, f"base{n}") as ns:
        client = Client(cluster)
        seen = Seen()
        path = CHILDREN["RayJob"].format(ns=ns)
        _, rv = client.items(path, selector() + "&limit=1")
        watch = Watch(cluster, path, selector(), rv, seen.on_rayjob)
        watch.start()
        time.sleep(2)  # the watch is open
        say(f"baseline: {n} jobs' {args.baseline} POSTed directly in {ns}")
        served0, cpu0 = requests_served(client), proc_cpu(apiserver)
        t0 = time.monotonic()
        names = create_burst(cluster, ns, n, args.clients, seen, posts)
        burst = time.monotonic() - t0
        wait_for("every direct RayJob on the watch", lambda: len(seen.rayjob) >= n,
                 timeout=args.timeout)
        cpu, served = proc_cpu(apiserver) - cpu0, requests_served(client)
        watch.stopped = True
        client.close()
        say(f"  created in {burst:.1f} s")
    wait_for("the baseline namespace deleted", lambda: cluster.api().get(
        f"/api/v1/namespaces/{ns}") is None, timeout=300)
    with seen.lock:
        from_start = [seen.rayjob[j] - t0 for j in names if j in seen.rayjob]
        latencies = [seen.rayjob[j] - seen.created[j] for j in names
                     if j in seen.rayjob and j in seen.created]
    return Baseline(jobs=n, what=args.baseline, rayjob_from_start=quantiles(from_start),
                    rayjob=quantiles(latencies), missing_rayjob=n - len(from_start),
                    burst_s=burst, apiserver_cpu=cpu, requests=requests_per_job(served0, served, n))


@dataclass
class Result:
    jobs: int
    rayjob: dict[str, float]
    rayjob_from_start: dict[str, float]
    accepted: dict[str, float]
    missing_rayjob: int
    missing_accepted: int
    burst_s: float
    done_s: float
    rss_peak: float
    cpu: dict[str, dict[str, float]]
    passes: dict[str, float]
    duration: dict[str, float]
    duplicates: int
    gc_s: float
    rljobs_gone_s: float
    orphans: dict[str, int]
    gc_rate: float
    rejections: float
    watch_errors: int
    log_warnings: int
    requests: dict[str, float] = field(default_factory=dict)
    baseline: Baseline | None = None

    def ratio(self) -> float:
        """apply -> RayJob p99 through the operator over applying the RayJobs directly (both
        from the burst's start)."""
        if self.baseline is None:
            return math.nan
        return self.rayjob_from_start["p99"] / self.baseline.rayjob_from_start["p99"]


def profile_apiserver(cluster: Cluster, args: argparse.Namespace, n: int,
                      say: Callable[[str], None]) -> threading.Thread | None:
    """With --profile-seconds: kube-apiserver's own CPU profile (its /debug/pprof, on by
    default) over the start of the burst, saved for `go tool pprof` (where its CPU goes)."""
    if not args.profile_seconds:
        return None
    out = Path(args.state_dir) / f"apiserver-cpu-{n}.pprof"

    def run() -> None:
        client = Client(cluster, timeout=args.profile_seconds + 30)
        conn = client.connect()
        conn.request("GET", f"/debug/pprof/profile?seconds={args.profile_seconds:.0f}")
        resp = conn.getresponse()
        out.write_bytes(resp.read())
        client.close()
        say(f"  kube-apiserver CPU profile ({resp.status}): go tool pprof -top {out}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def run_size(cluster: Cluster, n: int, args: argparse.Namespace, pids: dict[str, int],
             say: Callable[[str], None]) -> Result:
    kinds = {**CHILDREN, **(KUBERAY_CHILDREN if args.kuberay == "on" else {})}
    with namespace(cluster, f"scale{n}") as ns:
        log = Path(args.state_dir) / f"operator-{n}.log"
        for stale in (log, log.with_suffix(".kubeconfig")):  # an earlier run's, kept (--keep)
            stale.unlink(missing_ok=True)
        op = ChartOperator(cluster, ns, log)
        op.start()
        atexit.register(op.stop)  # also when this script fails: no operator left behind
        assert op.proc is not None
        sampler = Sampler({"operator": op.proc.pid, **pids})
        sampler.start()
        client = Client(cluster)
        seen = Seen()
        watches = []
        for path, query, fn in ((RLJOBS, "", seen.on_rljob),
                                (CHILDREN["RayJob"], selector(), seen.on_rayjob)):
            _, rv = client.items(path.format(ns=ns), query + "&limit=1")
            watches.append(Watch(cluster, path.format(ns=ns), query, rv, fn))
            watches[-1].start()
        rejected0 = apiserver_rejections(client)
        time.sleep(2)  # the watches are open; the operator's idle CPU settles
        m0, cpu0, served0 = scrape(op), sampler.cpu(), requests_served(client)
        say(f"{n} RLJobs in namespace {ns}: creating with {args.clients} clients")
        profiler = profile_apiserver(cluster, args, n, say)
        t0 = time.monotonic()
        names = create_burst(cluster, ns, n, args.clients, seen)
        burst = time.monotonic() - t0
        say(f"  created in {burst:.1f} s")
        complete = wait_all(seen, names, args.timeout, say)
        done = time.monotonic() - t0
        if profiler is not None:
            profiler.join()
        m1, cpu1, served1 = scrape(op), sampler.cpu(), requests_served(client)
        say(f"  {'all' if complete else 'NOT all'} RayJobs and Accepted after {done:.1f} s; "
            f"settling {args.settle:.0f} s (one resync of every job)")
        time.sleep(args.settle)
        m2, cpu2 = scrape(op), sampler.cpu()
        rayjobs, _ = client.items(CHILDREN["RayJob"].format(ns=ns), selector())
        per_job: dict[str, int] = {}
        for rj in rayjobs:
            job = rj["metadata"]["labels"][LABEL]
            per_job[job] = per_job.get(job, 0) + 1
        with seen.lock:  # listed now, or ever seen by the watch
            duplicates = sum(1 for j in names if max(per_job.get(j, 0), len(
                seen.rayjob_names.get(j, ()))) > 1)
        client.close()
        children = sum(leftovers(client, ns, kinds, full=True).values())
        t_del = time.monotonic()
        gc_s, orphans, gone = delete_and_gc(cluster, ns, kinds, args.gc_timeout, say)
        gc_rate = (children - sum(orphans.values())) / (time.monotonic() - t_del)
        cpu3 = sampler.cpu()
        rejected1 = apiserver_rejections(client)
        for w in watches:
            w.stopped = True
        sampler.stopped = True
        op.stop()
        text = log.read_text(errors="replace")
    with seen.lock:
        lat_rj = [seen.rayjob[j] - seen.created[j] for j in names
                  if j in seen.rayjob and j in seen.created]
        from_start = [seen.rayjob[j] - t0 for j in names if j in seen.rayjob]
        lat_acc = [seen.accepted[j] - seen.created[j] for j in names
                   if j in seen.accepted and j in seen.created]

    def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        return {k: b[k] - a[k] for k in a}

    return Result(
        jobs=n, rayjob=quantiles(lat_rj), rayjob_from_start=quantiles(from_start),
        accepted=quantiles(lat_acc),
        missing_rayjob=n - len(lat_rj), missing_accepted=n - len(lat_acc),
        burst_s=burst, done_s=done, rss_peak=sampler.peak_rss["operator"],
        cpu={"burst": delta(cpu0, cpu1), "settle": delta(cpu1, cpu2),
             "gc": delta(cpu2, cpu3)},
        passes={"burst": m1["success"] - m0["success"] + m1["error"] - m0["error"],
                "errors": m2["error"] - m0["error"],
                "settle": m2["success"] - m1["success"] + m2["error"] - m1["error"]},
        duration={"mean": (m1["sum"] - m0["sum"]) / max(1.0, m1["count"] - m0["count"]),
                  "p50": histogram_quantile(0.5, m1, m0),
                  "p99": histogram_quantile(0.99, m1, m0)},
        duplicates=duplicates, gc_s=gc_s, rljobs_gone_s=gone, orphans=orphans, gc_rate=gc_rate,
        rejections=rejected1 - rejected0, watch_errors=sum(w.errors for w in watches),
        log_warnings=sum(1 for line in text.splitlines()
                         if "[WARNING" in line or "[ERROR" in line or "Traceback" in line),
        requests=requests_per_job(served0, served1, n))


# ------------------------------------------------------------------ report


def fmt(x: float, unit: str = "s") -> str:
    return "-" if math.isnan(x) else f"{x:.2f} {unit}".strip()


def table(results: list[Result], args: argparse.Namespace) -> str:
    cols = [f"{r.jobs} jobs" for r in results]
    rows: list[tuple[str, list[str], str]] = []

    def row(name: str, values: list[str], goal: str = "") -> None:
        rows.append((name, values, goal))

    row("create burst (all POSTs returned)", [fmt(r.burst_s) for r in results])
    if any(r.baseline for r in results):
        what = next(r.baseline.what for r in results if r.baseline)
        base = [r.baseline for r in results]
        row(f"direct {what}: create burst", [fmt(b.burst_s) if b else "-" for b in base])
        for q in ("p50", "p99"):
            row(f"direct {what}: burst start -> RayJob {q}",
                [fmt(b.rayjob_from_start[q]) if b else "-" for b in base])
        row(f"direct {what}: create -> RayJob p99",
            [fmt(b.rayjob["p99"]) if b else "-" for b in base])
        row(f"direct {what}: kube-apiserver CPU s, burst",
            [f"{b.apiserver_cpu:.1f}" if b else "-" for b in base])
        for q in ("p50", "p99"):
            row(f"RLJobs: burst start -> RayJob {q}",
                [fmt(r.rayjob_from_start[q]) for r in results])
        row("**ratio: RLJobs / direct, burst start -> RayJob p99**",
            [f"{r.ratio():.2f}x" for r in results], f"<= {GOALS['ratio']}x")
    for what, key in (("apply -> RayJob", "rayjob"), ("apply -> Accepted", "accepted")):
        for q in ("p50", "p95", "p99", "max"):
            goal = f"< {GOALS['p99']:.0f} s" if q == "p99" else ""
            row(f"{what} {q}", [fmt(getattr(r, key)[q]) for r in results], goal)
    row("jobs never reaching RayJob / Accepted",
        [f"{r.missing_rayjob} / {r.missing_accepted}" for r in results], "0 / 0")
    row("all done after (from first create)", [fmt(r.done_s) for r in results])
    row("throughput to Accepted", [f"{r.jobs / r.done_s:.0f} jobs/s" for r in results])
    row("operator RSS peak", [fmt(r.rss_peak, "MiB") for r in results],
        f"< {GOALS['rss_mib']:.0f} MiB")
    for phase, label in (("burst", "burst"),
                         ("settle", f"next {args.settle:.0f} s (resync: every 30 s)"),
                         ("gc", "delete + GC")):
        row(f"operator CPU s, {label}", [fmt(r.cpu[phase]["operator"], "") for r in results])
    row("kube-apiserver / etcd CPU s, burst",
        [f"{r.cpu['burst']['kube-apiserver']:.1f} / {r.cpu['burst']['etcd']:.1f}"
         for r in results])
    row("controller-manager CPU s, delete + GC",
        [fmt(r.cpu["gc"]["kube-controller-manager"], "") for r in results])
    row("this benchmark's CPU s, burst", [fmt(r.cpu["burst"]["bench"], "") for r in results])
    row("API requests per job, burst (every client; >= 0.05)",
        [", ".join(f"{k} {v:.2f}" for k, v in r.requests.items()) for r in results])
    if any(r.baseline for r in results):
        row("direct: API requests per job, burst",
            [", ".join(f"{k} {v:.2f}" for k, v in r.baseline.requests.items())
             if r.baseline else "-" for r in results])
    row("reconcile passes, burst / settle window",
        [f"{r.passes['burst']:.0f} / {r.passes['settle']:.0f}" for r in results])
    row("reconcile duration mean / p50 / p99 (bucket)",
        [f"{r.duration['mean']:.2f} / {r.duration['p50']:g} / {r.duration['p99']:g} s"
         for r in results])
    row("reconcile errors (metrics)", [f"{r.passes['errors']:.0f}" for r in results], "0")
    row("operator log warnings/errors", [str(r.log_warnings) for r in results])
    row("API server 429s (APF)", [f"{r.rejections:.0f}" for r in results])
    row("duplicates (RLJobs with > 1 RayJob)", [str(r.duplicates) for r in results], "0")
    row("RLJobs gone after delete-all", [fmt(r.rljobs_gone_s) for r in results])
    row("GC: delete-all -> no labelled child", [fmt(r.gc_s) for r in results])
    row("GC rate (children deleted / s)", [f"{r.gc_rate:.1f}" for r in results])
    row("children left at the GC timeout", [str(sum(r.orphans.values())) + (
        f" {r.orphans}" if r.orphans else "") for r in results], "0")
    head = f"| (KubeRay {args.kuberay}) | " + " | ".join(cols) + " | goal |"
    lines = [head, "|---" * (len(cols) + 2) + "|"]
    lines += [f"| {n} | " + " | ".join(v) + f" | {g} |" for n, v, g in rows]
    return "\n".join(lines)


def verdict(r: Result) -> str:
    fails = []
    if not r.rayjob["p99"] < GOALS["p99"] or r.missing_rayjob:
        fails.append(f"apply->RayJob p99 {fmt(r.rayjob['p99'])}")
    if not r.accepted["p99"] < GOALS["p99"] or r.missing_accepted:
        fails.append(f"apply->Accepted p99 {fmt(r.accepted['p99'])}")
    if not r.rss_peak < GOALS["rss_mib"]:
        fails.append(f"RSS {r.rss_peak:.0f} MiB")
    if r.passes["errors"]:
        fails.append(f"{r.passes['errors']:.0f} reconcile errors")
    if r.duplicates:
        fails.append(f"{r.duplicates} duplicates")
    if r.orphans:
        fails.append(f"GC unfinished at the timeout, {sum(r.orphans.values())} children left")
    ratio = "" if r.baseline is None else (
        f"; operator cost {r.ratio():.2f}x applying the RayJobs directly (burst start -> "
        f"RayJob p99 {fmt(r.rayjob_from_start['p99'])} vs "
        f"{fmt(r.baseline.rayjob_from_start['p99'])}; goal <= {GOALS['ratio']}x)")
    return (f"{r.jobs} jobs: " + ("MEETS the goal (p99 < 10 s, RSS < 256 MiB, no errors, "
                                  "duplicates or orphans)" if not fails
                                  else "MISSES the goal: " + ", ".join(fails)) + ratio)


# ------------------------------------------------------------------ main


def scale_namespaces(cluster: Cluster) -> list[str]:
    return [ns["metadata"]["name"] for ns in cluster.api().get("/api/v1/namespaces")["items"]
            if ns["metadata"]["name"].startswith("scale")]


@contextlib.contextmanager
def control_plane(args: argparse.Namespace, n_max: int,
                  say: Callable[[str], None]) -> Iterator[Cluster]:
    missing = binaries().missing()
    if missing:
        sys.exit(f"e2e binaries not built: {missing}; run `python e2e/cluster.py build`")
    # The components run niced by default (19: tests yield to interactive work); here they
    # compete with nothing but the operator and this script, at the same niceness.
    os.environ.setdefault("KUBERL_E2E_NICE", str(args.nice))
    cpu_nodes = max(1, math.ceil(n_max * 2 / 100)) if args.kuberay == "on" else 1
    t0 = time.monotonic()
    # Kueue's CRDs (not Kueue) as in e2e: the operator's Workload watch runs, as it does on a
    # cluster with Kueue, and kopf has no unserved resource to warn about.
    cluster = Cluster.start(Path(args.state_dir) / "k8s", build_missing=False,
                            crds=[ROOT / "crds", *binaries().kueue_crds],
                            nodes={"cpu": cpu_nodes})
    say(f"control plane up in {time.monotonic() - t0:.0f} s ({cluster.state_dir})")
    try:
        if args.kuberay == "off":
            pid = cluster.pids["kuberay-operator"]
            os.kill(pid, signal.SIGTERM)
            wait_for("KubeRay stopped", lambda: not cluster.running()["kuberay-operator"], 15)
        yield cluster
    finally:
        cluster.stop(remove_state=not args.keep)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="1000",
                   help="RLJobs per burst; a comma-separated list runs each size in turn "
                   "(fresh namespace and operator, same control plane): 300,1000")
    p.add_argument("--kuberay", choices=("on", "off"), default="off")
    p.add_argument("--baseline", choices=("rayjobs", "all", "off"), default="rayjobs",
                   help="before each size's RLJobs, POST the same jobs' rendered RayJobs (or "
                   "all their rendered objects) directly, for the operator's cost as a ratio")
    p.add_argument("--clients", type=int, default=16, help="concurrent create calls")
    p.add_argument("--settle", type=float, default=35.0,
                   help="seconds to watch after all jobs are Accepted (>= one 30 s resync)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds for every job to get its RayJob and Accepted")
    p.add_argument("--gc-timeout", type=float, default=300.0)
    p.add_argument("--nice", type=int, default=0, help="niceness of the control plane")
    p.add_argument("--state-dir", default=None,
                   help="where the control plane, logs and operator logs go (default: a "
                   "fresh dir under /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the state dir (logs) afterwards")
    p.add_argument("--profile-seconds", type=float, default=0,
                   help="also take kube-apiserver's CPU profile over the first S seconds of "
                   "each burst (into the state dir)")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.jobs.split(",")]
    if args.state_dir is None:
        args.state_dir = f"/tmp/kuberl-scale-{os.getpid()}"
    Path(args.state_dir).mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    say(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    results: list[Result] = []
    with control_plane(args, max(sizes), say) as cluster:
        pids = {name: cluster.pids[name]
                for name in ("kube-apiserver", "etcd", "kube-controller-manager")}
        for i, n in enumerate(sizes):
            baseline = None if args.baseline == "off" else run_baseline(cluster, n, args, say)
            results.append(run_size(cluster, n, args, pids, say))
            results[-1].baseline = baseline
            (Path(args.state_dir) / f"result-{n}.json").write_text(
                json.dumps(dataclasses.asdict(results[-1]), indent=1))
            say(verdict(results[-1]))
            if i + 1 < len(sizes):  # its namespace (Events, the chart) gone before the next
                print(table(results, args), flush=True)
                try:
                    wait_for("the last namespace deleted",
                             lambda: not scale_namespaces(cluster), timeout=180)
                except AssertionError as exc:  # measured anyway; said so
                    say(f"  {exc}".splitlines()[0])
    say(f"load average at the end {os.getloadavg()[0]:.2f}")
    print()
    print(table(results, args))
    print()
    for r in results:
        print(verdict(r))
    if args.keep:
        print(f"\nstate and operator logs kept in {args.state_dir}")
    else:
        for n in sizes:
            for suffix in (".log", ".kubeconfig"):
                with contextlib.suppress(OSError):
                    (Path(args.state_dir) / f"operator-{n}{suffix}").unlink()
        with contextlib.suppress(OSError):
            Path(args.state_dir).rmdir()  # only if nothing else is there
    return 0


if __name__ == "__main__":
    sys.exit(main())
