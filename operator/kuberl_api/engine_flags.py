"""The engine server flags rollout.engineArgs / engineListArgs may and may not set: the flags
kuberl sets itself and those it refuses (the tables the RLJob's rules are made from), the
reference engine's own, and SGLang's, as the pinned release's parser defines them, with the
checks of engineArgs / engineListArgs against them.

The table (sglang_flags.json beside this file) is made from SGLang's own
`ServerArgs.add_cli_args` by tests/sglang_contract/flag_table.py; the contract tier fails when
it differs from the pinned release. With it a flag SGLang would refuse at start (a misspelt
name, a switch given a value, a number that is not one, a value outside its choices) is
refused when the RLJob is validated, naming the field, instead of as a crashed engine minutes
into a job. What the table cannot see: checks SGLang makes after parsing (ServerArgs.
__post_init__: combinations of flags, the model's config, the GPU's memory) and the further
checks of flags SGLang parses with an Action of its own (`custom`: --lora-paths).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("sglang_flags.json")
SWITCH_VALUES = ("", "true", "false")  # kuberl_trainer.engines.command's reading of them
_ARTICLE = {"int": "an integer", "float": "a number", "json": "JSON", "str": "a string"}

# engineArgs / engineListArgs keys: flag names without the leading '--'.
ENGINE_ARG_PATTERN = r"^[a-z0-9][a-z0-9-]*$"
# The engine server flags kuberl passes itself (engines/command.py: SGLang's
# and the reference engine's), with SGLang's aliases of them, and where each value comes from.
# An engineArgs entry for one would be a second, conflicting value of the flag.
KUBERL_ENGINE_FLAGS: dict[str, tuple[str, ...]] = {
    "model.path": ("model-path", "model"),
    "model.tokenizer": ("tokenizer-path",),
    "the Ray node the engine runs on: host 0.0.0.0, a free port": ("host", "port"),
    "rollout.gpusPerEngine": ("tp-size", "tensor-parallel-size", "tp"),
    "the run's seed and the engine's index": ("random-seed", "seed"),
    "the rollout GPUs (cuda with GPUs, cpu without)": ("device",),
    "the CPU cores the engine shares": ("torch-threads",),
    "the Ray node the engine runs on: a second free port": ("nccl-port",),
    "rollout.memoryFraction": ("mem-fraction-static",),
    "rollout.gpusPerEngine and gpusPerNode (an engine spans gpusPerEngine / gpusPerNode "
    "nodes) and the Ray nodes its parts run on": (
        "dist-init-addr", "nccl-init-addr", "nnodes", "node-rank"),
    "the job's engine API key (the operator's per-job Secret, given to SGLang in a --config "
    "file)": ("api-key", "config"),
    "reward.model.form (a scalar reward model is served as an embedding model; a policy or a "
    "judge generates)": ("is-embedding",),
    # The engines hold the adapter the trainer sends each step (/load_lora_adapter): its rank,
    # its modules and how many adapters an engine keeps follow from how kuberl syncs it.
    "training.lora (sync: adapter: the adapter's rank and target modules, and the adapters "
    "an engine holds)": ("enable-lora", "max-lora-rank", "lora-target-modules",
                         "max-loaded-loras", "max-loras-per-batch"),
    # (SGLang >= 0.5.7's flag; kuberl refuses routingReplay rollout on SGLang 0.5.6 engines)
    "algorithm.routingReplay (rollout: the engines return each token's experts)": (
        "enable-return-routed-experts",),
}
KUBERL_ENGINE_FLAG_SOURCE = {flag: source for source, flags in KUBERL_ENGINE_FLAGS.items()
                             for flag in flags}
# The same for a served reward model's engines (engines/command.py's reward_engine_command):
# its own model, GPUs and form; one node each; no memory fraction of kuberl's (SGLang sizes
# its pool, or engineArgs mem-fraction-static does).
REWARD_ENGINE_FLAGS: dict[str, tuple[str, ...]] = {
    "reward.model.path": ("model-path", "model"),
    "reward.model.tokenizer": ("tokenizer-path",),
    "the Ray node the replica runs on: host 0.0.0.0, free ports": ("host", "port",
                                                                    "nccl-port"),
    "reward.model.gpusPerReplica": ("tp-size", "tensor-parallel-size", "tp"),
    "the run's seed and the replica's index": ("random-seed", "seed"),
    "reward.model.gpusPerReplica (cuda with GPUs, cpu without) and the cores it shares": (
        "device", "torch-threads"),
    "one node per replica": ("dist-init-addr", "nccl-init-addr", "nnodes", "node-rank"),
    "the job's engine API key": ("api-key", "config"),
    "reward.model.form (scalar: an embedding model, judge: a generator)": ("is-embedding",),
}
REWARD_ENGINE_FLAG_SOURCE = {flag: source for source, flags in REWARD_ENGINE_FLAGS.items()
                             for flag in flags}
REWARD_ENGINE_FLAGS_REFUSED: dict[str, tuple[str, ...]] = {
    "a replica's GPUs are reward.model.gpusPerReplica tensor parallel ranks (more replicas: "
    "replicas)": ("data-parallel-size", "dp-size", "pipeline-parallel-size", "pp-size"),
    "a replica's GPUs are the ones its Ray actor holds, from the first": (
        "base-gpu-id", "gpu-id-step"),
    "the trainer sends the reward model text, which it tokenizes": ("skip-tokenizer-init",),
}
REWARD_ENGINE_FLAG_REFUSAL = {flag: reason for reason, flags in REWARD_ENGINE_FLAGS_REFUSED.items()
                              for flag in flags}
# SGLang flags that would contradict what the spec decides or what the trainer relies on,
# with the reason each is refused.
ENGINE_FLAGS_REFUSED: dict[str, tuple[str, ...]] = {
    "an engine's GPUs are rollout.gpusPerEngine tensor parallel ranks, each a member of the "
    "weight-update group (data or pipeline parallel ranks would change the GPU count and "
    "the group's layout)": ("data-parallel-size", "dp-size", "pipeline-parallel-size",
                            "pp-size"),
    "the engine's GPUs are the ones its Ray actor holds, from the first": (
        "base-gpu-id", "gpu-id-step"),
    "rewards read the text the engines detokenize": ("skip-tokenizer-init",),
}
ENGINE_FLAG_REFUSAL = {flag: reason for reason, flags in ENGINE_FLAGS_REFUSED.items()
                       for flag in flags}
# The reference engine's own flags (kuberl_rollout.reference's argparse) that kuberl leaves to
# the user; it refuses any other flag at start.
REFERENCE_ENGINE_FLAGS = ("dtype", "weight-version", "max-batch-size", "max-prefill-tokens",
                          "batching", "batch-wait-ms", "weight-sync-timeout",
                          "enable-weights-cpu-backup", "enable-metrics",
                          "expert-parallel-size", "ep-size", "ep")
ENGINE_ARG_NAMES = ("engineArgs keys are flag names without the leading '--': lowercase "
                    "letters, digits and '-' (e.g. chunked-prefill-size)")
REFERENCE_ENGINE_ARGS = ("the reference engine takes only these engineArgs: "
                         + ", ".join(REFERENCE_ENGINE_FLAGS))
MAX_ENGINE_LIST_ITEMS = 256
ENGINE_LIST_ARGS_TWICE = "a flag may be in engineArgs or in engineListArgs, not in both"
REFERENCE_ENGINE_LIST_ARGS = "the reference engine has no list flags: engineListArgs must be empty"


@dataclass(frozen=True)
class Flag:
    kind: str  # switch | one (a value) | optional (a value or none) | list (nargs + or *)
    type: str = "str"  # int | float | json | str: what each value must parse as
    choices: tuple[str, ...] | None = None
    # SGLang parses its values with an Action of its own (--lora-paths: JSON objects or
    # name=path), whose further checks the table does not model.
    custom: bool = False


@cache
def sglang_flags() -> tuple[str, dict[str, Flag]]:
    """(the SGLang version the table was made from, flag name without '--' -> Flag)."""
    table = json.loads(TABLE_PATH.read_text())
    flags = {name: Flag(f["kind"], f.get("type", "str"),
                        tuple(f["choices"]) if "choices" in f else None, f.get("custom", False))
             for name, f in table["flags"].items()}
    return table["sglang"], flags


def _unknown(name: str) -> str:
    version, flags = sglang_flags()
    close = difflib.get_close_matches(name, list(flags), n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"SGLang {version} has no flag --{name}{hint}"


def _value_problem(name: str, flag: Flag, value: str) -> str | None:
    try:
        if flag.type == "int":
            parsed: object = int(value)
        elif flag.type == "float":
            parsed = float(value)
        elif flag.type == "json":
            parsed = json.loads(value)
        else:
            parsed = value
    except ValueError:
        return f"--{name} takes {_ARTICLE[flag.type]}, not {value!r}"
    if flag.choices is not None and str(parsed) not in flag.choices:
        return f"--{name} takes one of: {', '.join(flag.choices)} (not {value!r})"
    return None


def engine_arg_problem(name: str, value: str) -> str | None:
    """Why SGLang would refuse `--name value` as kuberl passes an engineArgs entry, or None."""
    flag = sglang_flags()[1].get(name)
    if flag is None:
        return _unknown(name)
    if flag.kind == "switch":
        if value not in SWITCH_VALUES:
            return (f"--{name} is a switch: 'true' (or '') turns it on, 'false' leaves it "
                    f"off (not {value!r})")
        return None
    if value in SWITCH_VALUES and not (flag.kind == "optional" and value == ""):
        return (f"--{name} takes {_ARTICLE[flag.type]}: 'true', 'false' and '' are for "
                "switches")
    if flag.kind == "optional" and value == "":
        return None
    return _value_problem(name, flag, value)


def engine_list_arg_problem(name: str, values: list[str]) -> str | None:
    """Why SGLang would refuse `--name v1 v2 ...` (an engineListArgs entry), or None."""
    flag = sglang_flags()[1].get(name)
    if flag is None:
        return _unknown(name)
    if flag.kind != "list":
        what = "no value" if flag.kind == "switch" else "a single value"
        return f"--{name} takes {what}, not a list: set it in engineArgs"
    for value in values:
        problem = _value_problem(name, flag, value)
        if problem is not None:
            return problem
    return None
