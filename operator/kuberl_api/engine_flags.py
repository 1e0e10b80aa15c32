"""SGLang's server flags, as the pinned release's parser defines them, and the checks of
rollout.engineArgs / engineListArgs against them.

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
