"""The engine server's command line (kuberl_trainer.engines.command, run by
engine_actors.EngineServer): kuberl's own flags, the colocated defaults and rollout.engineArgs /
engineListArgs. The contract tier (tests/sglang_contract/) parses the same commands with the
pinned SGLang's own parser."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kuberl_api import parse
from kuberl_api.spec import RLJobSpec
from kuberl_trainer.engines.actors import EngineServer
from kuberl_trainer.engines.client import EngineError
from kuberl_trainer.engines.command import engine_arg_flags, engine_dtype
from kuberl_wire.protocol import ENGINE_SECRET_ENV
from tests.sglang_contract.cases import DIST_INIT_ADDR, NCCL_PORT, PORT, all_cases


def spec_json(**spec: Any) -> str:
    body = {"model": {"path": "/m"}, "data": {"prompts": "/d.jsonl"}} | spec
    rlj = parse({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
                 "metadata": {"name": "e"}, "spec": body})
    return rlj.spec.model_dump_json(by_alias=True)


def command(**spec: Any) -> list[str]:
    return EngineServer(spec_json(**spec), index=0, seed=7)._command("/m", 30001, 30002)


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_sglang_gets_ports_tp_seed_tokenizer_and_engine_args() -> None:
    cmd = command(model={"path": "/m", "tokenizer": "/tok"}, placement="disaggregated",
                  rollout={"gpus": 8, "gpusPerEngine": 2, "memoryFraction": 0.8,
                           "engineArgs": {"enable-memory-saver": "", "disable-radix-cache": ""}})
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert flag(cmd, "--port") == "30001" and flag(cmd, "--nccl-port") == "30002"
    assert flag(cmd, "--tp-size") == "2" and flag(cmd, "--random-seed") == "7"
    assert flag(cmd, "--tokenizer-path") == "/tok"  # engines detokenize what rewards read
    assert flag(cmd, "--mem-fraction-static") == "0.8"  # rollout.memoryFraction
    # an empty value is a switch: the next flag (args go in name order) follows it directly
    assert cmd[cmd.index("--disable-radix-cache") + 1] == "--enable-memory-saver"


def test_colocated_sglang_saves_memory_unless_told_otherwise() -> None:
    colocated = {"training": {"backend": "megatron", "gpusPerNode": 8}, "placement": "colocate"}
    cmd = command(**colocated)
    assert "--enable-memory-saver" in cmd and flag(cmd, "--mem-fraction-static") == "0.7"
    cmd = command(**colocated, rollout={"memoryFraction": 0.5,
                                        "engineArgs": {"enable-memory-saver": "true"}})
    assert flag(cmd, "--mem-fraction-static") == "0.5"
    assert cmd.count("--mem-fraction-static") == 1 and cmd.count("--enable-memory-saver") == 1
    disaggregated = command(placement="disaggregated", rollout={"gpus": 8})
    assert "--enable-memory-saver" not in disaggregated
    assert "--mem-fraction-static" not in disaggregated


def test_switches_and_list_flags() -> None:
    assert engine_arg_flags({"b": "true", "a": "", "c": "false", "d": "x",
                             "e": ["1", "2"]}) == ["--a", "--b", "--d", "x", "--e", "1", "2"]
    cmd = command(placement="disaggregated", rollout={
        "gpus": 8, "engineListArgs": {"cuda-graph-bs": ["1", "2", "4"]}})
    i = cmd.index("--cuda-graph-bs")
    assert cmd[i:i + 4] == ["--cuda-graph-bs", "1", "2", "4"]  # one flag, nargs values


def test_reference_engine_gets_tp_size_and_its_own_flags() -> None:
    cmd = command(training={"backend": "fsdp", "gpusPerNode": 0},
                  rollout={"engine": "reference", "gpus": 0,
                           "engineArgs": {"max-batch-size": "64"}})
    assert cmd[1:3] == ["-m", "kuberl_rollout.reference"]
    assert flag(cmd, "--device") == "cpu" and flag(cmd, "--seed") == "7"
    assert flag(cmd, "--tp-size") == "1" and "--nccl-port" not in cmd
    assert "--tokenizer-path" not in cmd  # the engine reads the model directory's
    assert flag(cmd, "--max-batch-size") == "64"
    assert "--mem-fraction-static" not in cmd  # no GPU pool to size on CPU
    gpu = command(training={"backend": "megatron", "gpusPerNode": 4},
                  rollout={"engine": "reference", "gpusPerEngine": 2})
    assert flag(gpu, "--tp-size") == "2" and flag(gpu, "--device") == "cuda"
    # colocated on GPUs it holds the same static pool an SGLang engine would
    assert flag(gpu, "--mem-fraction-static") == "0.7"


def test_reference_engine_parses_every_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference engine's own argparse takes what kuberl passes it (with the nodes'
    shared key in the environment, as EngineServer passes it)."""
    from kuberl_rollout.reference.__main__ import parse_args

    monkeypatch.setenv(ENGINE_SECRET_ENV, "k")
    for case in all_cases():
        if not case.sglang:
            args = parse_args(case.command()[3:])
            assert (args.port, args.tp_size) == (PORT, case.tp_size)
            assert (args.nnodes, args.node_rank) == (case.spec.engine_nodes, case.node_rank)
            assert args.dist_init_addr == (DIST_INIT_ADDR if args.nnodes > 1 else None)


def test_an_engine_over_nodes_gets_each_nodes_rank_and_node_zeros_address() -> None:
    wide = spec_json(placement="disaggregated", rollout={"gpus": 32, "gpusPerEngine": 16})
    for rank in (0, 1):
        cmd = EngineServer(wide, index=0, seed=7, node_rank=rank)._command(
            "/m", 30001, 30002, "10.0.0.1:29000")
        assert flag(cmd, "--nnodes") == "2" and flag(cmd, "--node-rank") == str(rank)
        assert flag(cmd, "--dist-init-addr") == "10.0.0.1:29000"
        assert flag(cmd, "--tp-size") == "16"
    with pytest.raises(ValueError, match="dist-init address"):
        EngineServer(wide, index=0, seed=7, node_rank=1)._command("/m", 30001, 30002)
    narrow = EngineServer(spec_json(placement="disaggregated", rollout={"gpus": 8}), 0, 7)
    assert "--nnodes" not in narrow._command("/m", 30001, 30002)


def test_the_reference_engine_refuses_what_sglang_refuses_of_nodes(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kuberl_rollout.reference.__main__ import parse_args

    base = ["--model-path", "/m", "--tp-size", "4", "--dist-init-addr", "h:1"]
    monkeypatch.setenv(ENGINE_SECRET_ENV, "k")
    for extra, words in ((["--nnodes", "3"], "divisible by --nnodes"),
                         (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2"),
                         (["--nnodes", "2", "--dist-init-addr", ""], "needs --dist-init-addr")):
        with pytest.raises(SystemExit):
            parse_args(base + extra)
        assert words in capsys.readouterr().err
    monkeypatch.delenv(ENGINE_SECRET_ENV)
    with pytest.raises(SystemExit):
        parse_args([*base, "--nnodes", "2"])
    assert ENGINE_SECRET_ENV in capsys.readouterr().err


def test_every_case_names_its_ports_once() -> None:
    for case in all_cases():
        cmd = case.command()
        assert cmd.count("--port") == 1 and flag(cmd, "--port") == str(PORT), case.name
        if case.sglang:
            assert flag(cmd, "--nccl-port") == str(NCCL_PORT), case.name
        flags = [a for a in cmd if a.startswith("--")]
        assert len(flags) == len(set(flags)), (case.name, flags)


def test_engine_output_is_forwarded_and_its_tail_kept(monkeypatch: pytest.MonkeyPatch,
                                                       capfd: pytest.CaptureFixture[str]) -> None:
    """A server that dies is explained by its last lines, in a cluster too (where its output
    is only in the pod's log): the actor keeps them (EngineServer.log_tail)."""
    server = EngineServer(spec_json(training={"backend": "fsdp", "gpusPerNode": 0},
                                    rollout={"engine": "reference", "gpus": 0}), 0, 7)
    script = "import sys\nfor i in range(300): print('line', i)\nsys.exit('bad flag')"
    monkeypatch.setattr(server, "_command", lambda *_: [sys.executable, "-c", script])
    monkeypatch.setattr("kuberl_trainer.engines.actors.node_ip", lambda: "127.0.0.1")
    server.start("/m")
    deadline = time.monotonic() + 30
    while (server.poll() is None or not server.log_tail() or server.log_tail()[-1] != "bad flag"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert server.poll() == 1
    assert server.log_tail(3) == ["line 298", "line 299", "bad flag"]
    assert "line 0" in capfd.readouterr().out  # forwarded to the actor's stdout as well


async def test_start_wait_ends_when_the_server_exits() -> None:
    """The start-up wait stops at the first look that sees the server process gone, with its
    exit code, rather than polling /health until the start timeout."""
    from kuberl_trainer.engines.client import EngineClient

    url = "http://127.0.0.1:9"  # nothing listens: /health never answers
    looks = []

    def exited() -> dict[str, int]:
        looks.append(1)
        return {url: 2} if len(looks) >= 3 else {}

    client = EngineClient([url])
    started = time.monotonic()
    try:
        with pytest.raises(EngineError, match="exited with code 2 while starting"):
            await client.wait_healthy(timeout_s=60, interval_s=0.05, exited=exited)
    finally:
        await client.close()
    assert time.monotonic() - started < 20 and len(looks) == 3


def test_a_cluster_engine_death_quotes_the_lines_its_actor_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In a cluster there is no log file to read: the error quotes EngineServer.log_tail."""

    from kuberl_trainer import explain as explain_mod

    url = "http://10.0.0.2:30000"

    class Actor:
        class log_tail:
            @staticmethod
            def remote(lines: int) -> list[str]:
                return ["loading", "error: unrecognized arguments: --bogus"][-lines:]

    class Engines:
        urls = [url]

        def dead(self) -> dict[str, int]:
            return {url: 2}

        def actor_of(self, url: str) -> Actor:
            return Actor()

        def log_of(self, url: str) -> Path | None:
            return None

    monkeypatch.setattr(explain_mod.ray, "get", lambda ref, timeout=None: ref)
    # (in a cluster: no log directory)
    text = explain_mod.explain(EngineError(url, "exited with code 2 while starting"),
                               Engines(), log_dir=None)  # type: ignore[arg-type]
    assert text.startswith(f"engine died: {url} exited with code 2")
    assert text.splitlines()[-1] == "  error: unrecognized arguments: --bogus"


def _spec(**spec: Any) -> RLJobSpec:
    return RLJobSpec.model_validate_json(spec_json(**spec))


def test_engine_dtype_is_the_engine_args_dtype_else_each_engines_default(tmp_path: Path
                                                                         ) -> None:
    """The dtype weight sync sends in: what the engine serves. engineArgs' dtype (SGLang's
    spellings too); else the reference engine's own default (float32, whatever the model
    says), or SGLang's "auto": the config's dtype, float32 served as float16 (bf16 for
    Gemma), as SGLang 0.5.6's ModelConfig resolves it."""
    from kuberl_rollout.reference.__main__ import build_parser

    def config(**fields: Any) -> dict[str, Any]:
        (tmp_path / "config.json").write_text(json.dumps(fields))
        return {"path": str(tmp_path)}

    reference = {"training": {"backend": "fsdp", "gpusPerNode": 0},
                 "rollout": {"engine": "reference", "gpus": 0}}
    sglang = {"placement": "disaggregated", "rollout": {"gpus": 8}}
    assert engine_dtype(_spec(model=config(dtype="bfloat16"), **reference)) == "float32"
    assert build_parser().get_default("dtype") == "float32"  # the same default
    assert engine_dtype(_spec(model=config(), training=reference["training"], rollout={
        "engine": "reference", "gpus": 0, "engineArgs": {"dtype": "bfloat16"}})) == "bfloat16"
    for fields, served in [({"dtype": "bfloat16"}, "bfloat16"),
                           ({"torch_dtype": "float16"}, "float16"),  # the older key
                           ({"torch_dtype": "float32"}, "float16"),
                           ({}, "float16"),
                           ({"dtype": "float32", "model_type": "gemma2"}, "bfloat16")]:
        assert engine_dtype(_spec(model=config(**fields), **sglang)) == served, fields
    model = config(dtype="bfloat16")
    for asked, served in [("auto", "bfloat16"), ("half", "float16"), ("float", "float32"),
                          ("float32", "float32")]:
        assert engine_dtype(_spec(model=model, placement="disaggregated", rollout={
            "gpus": 8, "engineArgs": {"dtype": asked}})) == served, asked


def test_every_engine_arg_allowed_for_the_reference_engine_is_one_of_its_flags() -> None:
    """The API lets engineArgs set exactly the flags the reference engine's parser has, less
    those kuberl sets itself: an allowed flag it did not know would fail at engine start, a
    flag it has but the API refused could never be used."""
    from kuberl_api.spec import KUBERL_ENGINE_FLAG_SOURCE, REFERENCE_ENGINE_FLAGS
    from kuberl_rollout.reference.__main__ import build_parser

    flags = {opt[2:] for action in build_parser()._actions for opt in action.option_strings
             if opt.startswith("--")} - {"help"}
    assert set(REFERENCE_ENGINE_FLAGS) <= flags
    assert flags - set(KUBERL_ENGINE_FLAG_SOURCE) == set(REFERENCE_ENGINE_FLAGS)
