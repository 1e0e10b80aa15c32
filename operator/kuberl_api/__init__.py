"""The RLJob API (kuberl.dev/v1alpha1): one pydantic model, the single source of truth for the
CRD schema, the operator's renderers and the trainer's config. Imports only pydantic and yaml."""

from kuberl_api.base import RuleFailure
from kuberl_api.errors import InvalidRLJob, format_errors
from kuberl_api.load import (
    WAIVED_ANNOTATION,
    load,
    load_rendered,
    loads,
    parse,
    parse_waiving,
    spec_from_driver,
)
from kuberl_api.rljob import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    RLJob,
)
from kuberl_api.spec import RLJobSpec
from kuberl_api.status import Condition, RLJobStatus

__all__ = [
    "API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION", "WAIVED_ANNOTATION", "Condition",
    "InvalidRLJob", "RLJob", "RLJobSpec", "RLJobStatus", "RuleFailure", "format_errors", "load",
    "load_rendered", "loads", "parse", "parse_waiving", "spec_from_driver",
]
