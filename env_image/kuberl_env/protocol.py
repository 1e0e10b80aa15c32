"""The environment service's wire: paths, the port, the request fields, and how an
environment's answers become JSON. Standard library only: the operator (the port, the probe)
and the trainer's client (the paths and fields) import it too."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Final

DEFAULT_PORT: Final = 8000
PORT_NAME: Final = "env-http"  # the container port's name (IANA_SVC_NAME, at most 15)
HEALTH: Final = "/health"
RESET: Final = "/reset"
STEP: Final = "/step"
CLOSE: Final = "/close"
# Episodes nobody touched for this long are closed and dropped (a trainer that died, a close
# that never arrived, a step that hung and was given up on). At least the longest call the
# trainer waits for (environment.timeoutSeconds, at most 3600): its retries touch the episode.
DEFAULT_EPISODE_TIMEOUT_S: Final = 3600.0


def takes_seed(reset: Callable[..., Any]) -> bool:
    """Whether an environment's `reset` declares a `seed` parameter: it then gets the
    trajectory's seed (the same on a resumed run). A `**kwargs` alone does not count: an
    environment that never asked for a seed must not receive one."""
    try:
        parameter = inspect.signature(reset).parameters.get("seed")
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    return parameter is not None and parameter.kind in (
        inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class WireError(ValueError):
    """What an environment returned cannot go over the wire (not a dict, an Observation or a
    StepResult, or a value JSON cannot carry)."""


class Sample(dict[str, Any]):
    """The sample `reset` gets, as a dict that also reads as attributes: `sample.prompt` and
    `sample["prompt"]` both work, as `sample.prompt` does in process."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def sample_to_wire(sample: Any) -> dict[str, Any]:
    """The trainer's sample (a dataclass, or a mapping) as a JSON object."""
    if dataclasses.is_dataclass(sample) and not isinstance(sample, type):
        return _object(dataclasses.asdict(sample), "sample")
    if isinstance(sample, Mapping):
        return _object(sample, "sample")
    raise WireError(f"a sample must be a dataclass or a mapping, not {type(sample).__name__}")


def answer_to_wire(value: Any, where: str) -> dict[str, Any] | None:
    """An environment's answer (None, a dict, or a dataclass such as kuberl_trainer.agents'
    Observation and StepResult) as JSON; the trainer checks its fields, as it does in
    process."""
    if value is None:
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise WireError(f"{where} returned {type(value).__name__}; expected an Observation or a "
                        "StepResult, or a dict of their fields")
    return _object(value, where)


def _object(value: Mapping[Any, Any], where: str) -> dict[str, Any]:
    return {str(k): to_json(v, where) for k, v in value.items()}


def to_json(value: Any, where: str) -> Any:
    """`value` with tuples as lists and numpy-like scalars and arrays as Python values; a value
    JSON cannot carry is refused, naming it."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): to_json(v, where) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v, where) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_json(dataclasses.asdict(value), where)
    for convert in ("tolist", "item"):  # numpy and torch values, without importing them
        method = getattr(value, convert, None)
        if callable(method):
            return to_json(method(), where)
    raise WireError(f"{where} returned a {type(value).__name__} ({value!r:.80}), which JSON "
                    "cannot carry")
