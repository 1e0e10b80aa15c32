"""`python -m kuberl_operator`: the operator with its /metrics and /healthz endpoints.

    python -m kuberl_operator [-n NAMESPACE ...] [--metrics-port 8080] [--health-port 8081]
        [--resync-seconds 30] [--head-lost-grace-seconds 120] [--no-scanning] [-v]

Every flag has a KUBERL_* environment variable (see kuberl_operator.settings). Credentials:
the pod's service account, else $KUBECONFIG / ~/.kube/config, found alike by kopf (for its
watches) and by the `kubernetes` client (every read and write: reconcile.kube). Run one
replica (Deployment strategy Recreate): the operator runs standalone, without kopf's peering.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import kopf

from kuberl_operator import metrics
from kuberl_operator.reconcile.handlers import register
from kuberl_operator.settings import Config, kopf_settings, parse_args


def run(config: Config) -> None:
    kopf.configure(verbose=config.verbose)
    if not config.verbose:
        # kopf's "Handler 'rljob_event' succeeded." for every watch event (60-77% of the log
        # at 300 jobs); the controller logs what each pass did, and kopf's errors still show.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    m = metrics.default()
    if config.metrics_port:
        metrics.serve(config.metrics_host, config.metrics_port)
    registry = kopf.OperatorRegistry()
    register(registry, config, m)
    kopf.run(registry=registry, settings=kopf_settings(config), standalone=True,
             clusterwide=not config.namespaces, namespaces=config.namespaces,
             liveness_endpoint=config.liveness_endpoint)


def main(argv: Sequence[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
