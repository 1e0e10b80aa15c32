"""The ConfigMap holding the validated job config, which the trainer on the head loads."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import yaml

from kuberl_api import WAIVED_ANNOTATION, RuleFailure
from kuberl_api.rljob import RLJob
from kuberl_operator.render import names
from kuberl_operator.render.meta import object_meta


def config_document(job: RLJob, waived: Sequence[RuleFailure] = ()) -> dict[str, Any]:
    """The RLJob as the trainer should see it: identity plus the full spec with every default
    filled in, by alias (camelCase, as users write it) so kuberl_api.load reads it back.

    status, labels, annotations and server fields are left out: they change while the job runs
    and would make the ConfigMap (and so the RayJob's config) churn for no reason. None values
    are dropped; every optional field defaults to None, so the round trip is exact.

    `waived`: the rules the operator waived for this job, which an earlier release accepted
    (status/ratchet.py); their fields go in an annotation that `kuberl run --in-cluster` reads
    (kuberl_api.load_rendered), so a trainer with this release's rules runs the job as well.
    """
    metadata: dict[str, Any] = {"name": job.name, "namespace": job.namespace}
    if waived:
        fields = sorted({f.field for f in waived})
        metadata["annotations"] = {WAIVED_ANNOTATION: json.dumps(fields)}
    return {
        "apiVersion": job.api_version,
        "kind": job.kind,
        "metadata": metadata,
        "spec": job.spec.model_dump(mode="json", by_alias=True, exclude_none=True),
    }


def config_yaml(job: RLJob, waived: Sequence[RuleFailure] = ()) -> str:
    # sort_keys: user-supplied maps (engineArgs, nodeSelector, env) come out in one order
    # whatever order they were written in, so an unchanged job never rewrites its ConfigMap.
    return yaml.safe_dump(config_document(job, waived), sort_keys=True, width=100)


def configmap(job: RLJob, waived: Sequence[RuleFailure] = ()) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(job, names.configmap(job.name), names.COMPONENT_CONFIG),
        "data": {names.CONFIG_KEY: config_yaml(job, waived)},
    }
