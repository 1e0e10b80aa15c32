#!/usr/bin/env python3
"""A local Kubernetes control plane for kuberl's end-to-end tests (envtest + kind, from parts).

Runs, all on 127.0.0.1 with free ports, from binaries that ``e2e/build.sh`` builds once per
version into ``${XDG_CACHE_HOME:-~/.cache}/kuberl/e2e/`` (one module each in ``controlplane/``):

- etcd; kube-apiserver (RBAC + Node authorization, service-account issuer, default admission);
  kube-controller-manager (service-account credentials, token controller, garbage collector);
  kube-scheduler;
- kwok, the fake kubelet, with its stock stages (node-initialize, node-heartbeat-with-lease,
  pod-ready, pod-complete, pod-delete): scheduled pods become Running and Ready;
- fake nodes in three pools (see ``POOLS``): ``pool=train`` and ``pool=rollout`` with 8
  ``nvidia.com/gpu`` each, tainted, and an untainted ``pool=cpu`` for Ray heads;
- the KubeRay operator (webhooks off), as a ServiceAccount bound to KubeRay's own ClusterRole,
  after its CRDs;
- optionally Kueue (``up --kueue``, ``Cluster.start(kueue=True)``, ``Cluster.start_kueue()``):
  its manager with the ``ray.io/rayjob`` integration and its webhooks.

Command line (with the project's venv: `make cluster-up` and `make cluster-down` run it so)::

    .venv/bin/python e2e/cluster.py build   # e2e/build.sh: the binaries, once per version
    .venv/bin/python e2e/cluster.py up      # start; prints `export KUBECONFIG=... PATH=...`
    .venv/bin/python e2e/cluster.py status  # what runs, on which ports, node pools
    .venv/bin/python e2e/cluster.py down    # stop everything and remove the state dir

From Python (a session-scoped pytest fixture)::

    from e2e.cluster import Cluster       # or put e2e/ on sys.path: from cluster import Cluster
    cluster = Cluster.start(tmp_path_factory.mktemp("k8s"))
    try:
        yield cluster                     # cluster.kubeconfig, cluster.kubectl("get", "nodes")
    finally:
        cluster.stop()
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # `python e2e/cluster.py`, `from e2e.cluster import ...`
    sys.path.insert(0, str(HERE))

from controlplane import *  # noqa: E402, F403 (this module is the package's import path)
from controlplane import __all__ as __all__  # noqa: E402
from controlplane.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
