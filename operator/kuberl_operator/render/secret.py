"""The Secret holding one attempt's engine API key: the engines check it (SGLang's --api-key)
and the trainer sends it; every Ray pod reads it through a secretKeyRef (pod.engine_key_env).

Pure: the key is an argument. The operator makes a random one per attempt
(reconcile/controller.py) and creates the Secret once, before the RayJob; `kuberl render` and
the goldens show RENDERED_KEY in its place. Immutable: a changed key would split a running
attempt (pods started before the change and after it would disagree).
"""

from __future__ import annotations

import base64
from typing import Any

from kuberl_api.rljob import RLJob
from kuberl_operator.render import names
from kuberl_operator.render.meta import object_meta

# What `kuberl render` shows in place of a key (the operator never renders with it)
RENDERED_KEY = "generated-by-the-operator-per-attempt"


def engine_key_secret(job: RLJob, attempt: int, api_key: str) -> dict[str, Any]:
    if not api_key:
        raise ValueError("an engine API key must not be empty")
    encoded = base64.b64encode(api_key.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(job, names.engine_key_secret(job.name, attempt),
                                names.COMPONENT_ENGINE_KEY, attempt),
        "type": "Opaque",
        "immutable": True,
        "data": {names.ENGINE_API_KEY_SECRET_KEY: encoded},
    }
