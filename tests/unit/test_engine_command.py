"""The engine server's command line (actors.EngineServer._command): what the spec puts there
beside kuberl's own flags."""

from __future__ import annotations

from typing import Any

from kuberl_api import parse
from kuberl_trainer.actors import EngineServer


def command(**spec: Any) -> list[str]:
    body = {"model": {"path": "/m"}, "data": {"prompts": "/d.jsonl"}} | spec
    rlj = parse({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
                 "metadata": {"name": "e"}, "spec": body})
    server = EngineServer(rlj.spec.model_dump_json(by_alias=True), index=0, seed=7)
    return server._command("/m", 30001)


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_sglang_gets_tp_seed_tokenizer_and_engine_args() -> None:
    cmd = command(model={"path": "/m", "tokenizer": "/tok"},
                  rollout={"gpusPerEngine": 2, "engineArgs": {
                      "mem-fraction-static": "0.7", "enable-memory-saver": ""}})
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert flag(cmd, "--tp-size") == "2" and flag(cmd, "--random-seed") == "7"
    assert flag(cmd, "--tokenizer-path") == "/tok"  # engines detokenize what rewards read
    assert flag(cmd, "--mem-fraction-static") == "0.7"
    # an empty value is a switch: the next flag (args go in name order) follows it directly
    assert cmd[cmd.index("--enable-memory-saver") + 1] == "--mem-fraction-static"


def test_reference_engine_on_cpu_without_a_tokenizer() -> None:
    cmd = command(training={"backend": "fsdp", "gpusPerNode": 0},
                  rollout={"engine": "reference", "gpus": 0,
                           "engineArgs": {"max-batch-size": "64"}})
    assert cmd[1:3] == ["-m", "kuberl_rollout.reference"]
    assert flag(cmd, "--device") == "cpu" and flag(cmd, "--seed") == "7"
    assert "--tokenizer-path" not in cmd  # the engine reads the model directory's
    assert flag(cmd, "--max-batch-size") == "64"
