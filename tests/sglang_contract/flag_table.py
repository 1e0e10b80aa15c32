"""The table of SGLang's server flags kuberl checks rollout.engineArgs against, made from the
pinned release's own parser (`ServerArgs.add_cli_args`).

kuberl_api cannot import SGLang (the operator and the CLI don't install it), so the table ships
as data (operator/kuberl_api/sglang_flags.json); the contract tier checks that it equals what
the pinned parser yields, so an SGLang upgrade that adds, drops or retypes a flag fails there.

    KUBERL_SGLANG_PATH=~/.cache/kuberl/sglang-<version>-<hash> \\
        .venv/bin/python -m tests.sglang_contract.flag_table --write   # regenerate
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from typing import Any

from kuberl_api.engine_flags import TABLE_PATH

KINDS = {None: "one", "?": "optional", "+": "list", "*": "list"}


def describe(action: argparse.Action) -> dict[str, Any]:
    """One flag's entry: kind (switch, one value, an optional value, a list), the type its
    values parse to, and its choices."""
    if action.nargs == 0:  # store_true / store_false / store_const
        return {"kind": "switch"}
    entry: dict[str, Any] = {"kind": KINDS[action.nargs]}  # type: ignore[index]
    kind = action.type
    name = getattr(kind, "__name__", "")
    entry["type"] = ("int" if kind is int else "float" if kind is float
                     else "json" if name in ("loads", "json_list_type") else "str")
    if action.choices:
        entry["choices"] = [str(c) for c in action.choices]
    if type(action) is not argparse._StoreAction:
        entry["custom"] = True  # its own Action class checks values further (lora-paths)
    return entry


def flag_table() -> dict[str, Any]:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags: dict[str, Any] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                flags[option[2:]] = describe(action)
    return {"sglang": importlib.metadata.version("sglang"), "flags": dict(sorted(flags.items()))}


def render(table: dict[str, Any]) -> str:
    """One flag per line: reviewable diffs when SGLang changes."""
    lines = [f'  {json.dumps(k)}: {json.dumps(v)}' for k, v in table["flags"].items()]
    return ('{\n "sglang": ' + json.dumps(table["sglang"]) + ',\n "flags": {\n'
            + ",\n".join(lines) + "\n }\n}\n")


def main() -> None:
    path = os.environ.get("KUBERL_SGLANG_PATH")
    if path:
        sys.path.insert(0, path)
    text = render(flag_table())
    if "--write" in sys.argv:
        TABLE_PATH.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
