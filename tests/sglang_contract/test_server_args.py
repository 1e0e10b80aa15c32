"""Every engine command line kuberl builds (each example, plus spec variants: colocated,
gpusPerEngine 2/4, switches, list flags) parses with the pinned SGLang's own server-argument
parser to the values the spec intends."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from typing import Any

import pytest

from kuberl_api.engine_flags import (
    SWITCH_VALUES,
    TABLE_PATH,
    engine_arg_problem,
    engine_list_arg_problem,
    sglang_flags,
)
from kuberl_api.spec import ENGINE_FLAG_REFUSAL, KUBERL_ENGINE_FLAG_SOURCE
from kuberl_trainer.engines.command import SGLANG_VERSION, engine_arg_flags
from tests.sglang_contract.cases import Case, all_cases
from tests.sglang_contract.flag_table import flag_table

from sglang.srt.server_args import ServerArgs  # isort: skip  (the pinned wheel: conftest)

SGLANG_CASES = [c for c in all_cases() if c.sglang]


def sglang_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def server_args(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> ServerArgs:
    """What `python -m sglang.launch_server argv` starts with: its parser, then
    ServerArgs.from_cli_args (as sglang.srt.server_args.prepare_server_args does). Its
    __post_init__ is skipped: it measures the GPU's memory and reads the model's HF config,
    neither of which exists here; it only fills defaults left None and validates backends."""
    monkeypatch.setattr(ServerArgs, "__post_init__", lambda self: None)
    return ServerArgs.from_cli_args(sglang_parser().parse_args(argv))


def test_the_pinned_release_is_installed() -> None:
    assert importlib.metadata.version("sglang") == SGLANG_VERSION


def test_there_are_sglang_cases() -> None:
    assert len(SGLANG_CASES) >= 8 and any(c.name.startswith("example:") for c in SGLANG_CASES)


@pytest.mark.parametrize("case", SGLANG_CASES, ids=lambda c: c.name)
def test_command_parses_to_the_intended_values(case: Case,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cmd = case.command()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    args = server_args(cmd[3:], monkeypatch)
    got: dict[str, Any] = {key: getattr(args, key) for key in case.expect}
    assert got == case.expect


def test_kuberl_refuses_every_spelling_of_the_flags_it_sets() -> None:
    """engineArgs may not repeat a flag kuberl passes (nor one that makes an engine span
    nodes) under any of SGLang's names for it."""
    dests = {"model_path", "tokenizer_path", "host", "port", "nccl_port", "tp_size",
             "random_seed", "device", "dist_init_addr", "nnodes", "node_rank",
             "tensor_parallel_size", "api_key", "config"}
    spellings = {s[2:] for a in sglang_parser()._actions if a.dest in dests
                 for s in a.option_strings if s.startswith("--")}
    assert spellings, "SGLang's parser has none of the flags kuberl sets?"
    assert spellings <= set(KUBERL_ENGINE_FLAG_SOURCE), spellings - set(KUBERL_ENGINE_FLAG_SOURCE)
    # ... nor those that would change the GPU layout or what the trainer reads
    refused = {"data_parallel_size", "pipeline_parallel_size", "base_gpu_id", "gpu_id_step",
               "skip_tokenizer_init"}
    spellings = {s[2:] for a in sglang_parser()._actions if a.dest in refused
                 for s in a.option_strings if s.startswith("--")}
    assert len(spellings) >= len(refused)
    assert spellings <= set(ENGINE_FLAG_REFUSAL), spellings - set(ENGINE_FLAG_REFUSAL)


def test_true_and_false_are_what_sglang_switches_mean() -> None:
    """'true' passes a store_true flag alone, 'false' leaves it out (SGLang's default); no flag
    takes
    'true'/'false' as a value that this would change (no type=bool or true/false choices)."""
    parser = sglang_parser()
    switches = [a for a in parser._actions if isinstance(a, argparse._StoreTrueAction)]
    assert any(a.dest == "enable_memory_saver" for a in switches)
    base = ["--model-path", "/m"]
    for action in switches:
        name = action.option_strings[-1][2:]
        on = parser.parse_args(base + engine_arg_flags({name: "true"}))
        off = parser.parse_args(base + engine_arg_flags({name: "false"}))
        # 'false' leaves SGLang's default: False, except where None means "the model decides"
        # (enable-multimodal in 0.5.6).
        assert getattr(on, action.dest) is True, name
        assert getattr(off, action.dest) == action.default in (False, None), name
    for action in parser._actions:
        assert action.type is not bool, action.option_strings
        assert not {"true", "false"} & set(map(str, action.choices or ())), action.option_strings


def test_list_flags_take_their_values_after_one_flag() -> None:
    """SGLang's list flags are nargs '+'/'*' with the default store action (none appends):
    engineListArgs passes one flag and its values, as they need."""
    parser = sglang_parser()
    lists = [a for a in parser._actions if a.nargs in ("+", "*") and a.option_strings]
    assert any(a.dest == "cuda_graph_bs" for a in lists)
    assert not [a for a in parser._actions if isinstance(a, argparse._AppendAction)]
    args = parser.parse_args(["--model-path", "/m",
                              *engine_arg_flags({"cuda-graph-bs": ["1", "2", "4"]})])
    assert args.cuda_graph_bs == [1, 2, 4]


def test_the_shipped_flag_table_is_the_pinned_parsers() -> None:
    """kuberl_api checks engineArgs against a table of SGLang's flags (it cannot import
    SGLang); that table must be exactly what the pinned release's parser defines
    (regenerate: python -m tests.sglang_contract.flag_table --write)."""
    shipped = json.loads(TABLE_PATH.read_text())
    made = flag_table()
    assert shipped["sglang"] == made["sglang"] == SGLANG_VERSION
    assert shipped["flags"] == made["flags"], sorted(
        set(shipped["flags"]).symmetric_difference(made["flags"]))


PROBES = ("", "true", "false", "7", "0.5", "-3", "abc", '["a", "b"]', '{"k": 1}')


def sglang_accepts(parser: argparse.ArgumentParser, argv: list[str]) -> bool:
    try:
        parser.parse_args(["--model-path", "/m", *argv])
    except (argparse.ArgumentError, SystemExit, ValueError, TypeError, AssertionError):
        return False
    return True


def test_engine_args_kuberl_accepts_sglang_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    """For every SGLang flag and a spread of values (each choice too): what kuberl's
    validation lets through, SGLang's parser takes as kuberl passes it; what SGLang's parser
    refuses, kuberl refuses, except the further checks of SGLang's own Action classes
    (`custom`, --lora-paths). kuberl is stricter in one way only: 'true', 'false' and '' are
    for switches (a flag taking a value would get the literal string, or be left out)."""
    parser = sglang_parser()
    _, flags = sglang_flags()
    checked = 0
    for name, flag in flags.items():
        for value in (*PROBES, *(flag.choices or ())):
            ours = engine_arg_problem(name, value) is None
            theirs = sglang_accepts(parser, engine_arg_flags({name: value}))
            capsys.readouterr()  # argparse's usage lines
            assert not ours or theirs or flag.custom, (
                name, value, "kuberl lets through what SGLang refuses")
            assert ours or not theirs or value in SWITCH_VALUES, (
                name, value, engine_arg_problem(name, value))
            checked += 1
        if flag.kind == "list":
            values = ["1", "2"] if flag.type in ("int", "float") else ["a", "b"]
            values = list(flag.choices[:2]) if flag.choices else values
            ours = engine_list_arg_problem(name, values) is None
            theirs = sglang_accepts(parser, engine_arg_flags({name: values}))
            capsys.readouterr()
            assert ours == theirs or flag.custom, (name, values)
    assert checked > 2000
