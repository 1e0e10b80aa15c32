"""The job's NetworkPolicy: its pods (the Ray head, the worker groups, the submitter, the
environment service's pods) accept connections only from each other and from the peers the
operator is configured with (the chart's: the operator, KubeRay's operator, which polls each
head's dashboard for the job's state, and the metrics scrapers it names).

One per RLJob, not per attempt: it selects the job's pods by the job's label alone, so it
covers every attempt's pods and is applied (unchanged) with each attempt's children, before
the RayJob, so no pod of the job runs unprotected. The garbage collector deletes it with the
RLJob; it outlives a finished attempt's pods at no cost.

Ingress only: egress is left as the cluster has it (a job downloads models, calls reward
services, writes to object stores; the RLJob has no field to restrict it: a namespace's own
default-deny egress policy still applies, NetworkPolicies add up).

A job with network.hostNetwork gets none: its GPU pods live on the node's network, where no
NetworkPolicy isolates them, and their connections to the head arrive from node addresses
that no pod selector matches, so a policy would cut the head off from its own workers.
(Traffic from the node a pod runs on, such as kubelet probes, is always allowed.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kuberl_api.rljob import RLJob
from kuberl_operator.render import names
from kuberl_operator.render.meta import object_meta

API_VERSION = "networking.k8s.io/v1"
# What a peer of a NetworkPolicy rule may say (networking.k8s.io/v1 NetworkPolicyPeer).
PEER_KEYS = frozenset({"podSelector", "namespaceSelector", "ipBlock"})


@dataclass(frozen=True)
class IngressPolicy:
    """The operator's setting: whether jobs get a NetworkPolicy, and who outside a job may
    reach its pods (NetworkPolicyPeers, as the chart writes them)."""

    enabled: bool = True
    allowed_from: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)


def check_peers(peers: Sequence[Any]) -> tuple[dict[str, Any], ...]:
    """`peers` as NetworkPolicyPeers, or ValueError naming the first that is not one."""
    out = []
    for i, peer in enumerate(peers):
        if not isinstance(peer, Mapping) or not peer or not set(peer) <= PEER_KEYS:
            raise ValueError(f"peer {i} ({peer!r}) is not a NetworkPolicyPeer: a non-empty "
                             f"mapping of {', '.join(sorted(PEER_KEYS))}")
        out.append(dict(peer))
    return tuple(out)


def job_pods(job: RLJob) -> dict[str, Any]:
    """The selector of the job's pods, and nothing else (names.selector)."""
    return {"matchLabels": names.selector(job.name)}


def network_policy(job: RLJob, policy: IngressPolicy) -> dict[str, Any] | None:
    """The NetworkPolicy, or None (off, or a host-network job)."""
    if not policy.enabled or job.spec.network.host_network:
        return None
    peers = [{"podSelector": job_pods(job)}, *(dict(p) for p in policy.allowed_from)]
    return {
        "apiVersion": API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": object_meta(job, names.network_policy(job.name), names.COMPONENT_NETWORK),
        "spec": {
            "podSelector": job_pods(job),
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers}],
        },
    }
