"""Fixtures for the end-to-end tests: a local control plane (e2e/cluster.py) per test session.

    pytest e2e -m e2e                                   # starts and stops its own cluster
    KUBERL_E2E_STATE_DIR=~/.cache/kuberl/e2e/run pytest e2e -m e2e
                                                        # reuses the one `cluster.py up` started
                                                        # (test_rljob.py wants it started with
                                                        # `up --crds crds --train-nodes 4`)
    KUBERL_E2E_KEEP=1 pytest e2e -m e2e                 # keep its state dir (logs) afterwards

The binaries must be built first (`python e2e/cluster.py build`, cold: tens of minutes on two
cores): the fixture fails with that command rather than build inside a test's timeout.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent
if str(E2E) not in sys.path:
    sys.path.insert(0, str(E2E))

from cluster import Cluster, binaries  # noqa: E402
from rljobs import Operator, namespace  # noqa: E402

CRDS = E2E.parent / "crds"
NODES = {"train": 4, "rollout": 2, "cpu": 1}


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reuse = os.environ.get("KUBERL_E2E_STATE_DIR")
    if reuse:
        yield Cluster.attach(Path(reuse).expanduser())
        return
    missing = binaries().missing()
    if missing:
        pytest.fail(f"e2e binaries not built: {missing}; run `python e2e/cluster.py build`")
    # The project's CRD goes in at start, before the controller-manager, so that its garbage
    # collector follows RLJob owner references from the first second (see README); 4 train
    # nodes fit examples/multinode-megatron-rdma.yaml. Kueue's CRDs too (not Kueue: the `kueue`
    # fixture starts it), so that Workloads are collected with their jobs from the start.
    cluster = Cluster.start(tmp_path_factory.mktemp("k8s"), build_missing=False,
                            crds=[CRDS, *binaries().kueue_crds], nodes=NODES)
    try:
        yield cluster
    finally:
        cluster.stop(remove_state=not os.environ.get("KUBERL_E2E_KEEP"))


@pytest.fixture(scope="module")
def kueue(k8s_cluster: Cluster) -> Iterator[Cluster]:
    """Kueue running on the session's cluster for one test module (queues: e2e/queues.py),
    then stopped, its webhooks removed, so the other modules' RayJobs never meet it."""
    k8s_cluster.start_kueue()
    try:
        yield k8s_cluster
    finally:
        k8s_cluster.stop_kueue()


@pytest.fixture(scope="module")
def operator_ns(k8s_cluster: Cluster) -> Iterator[str]:
    with namespace(k8s_cluster, "e2e-op") as ns:
        yield ns


@pytest.fixture(scope="module")
def operator(k8s_cluster: Cluster, operator_ns: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(k8s_cluster, operator_ns, tmp_path_factory.mktemp("operator") / "operator.log")
    try:
        op.start()
        yield op
    finally:
        op.stop()
