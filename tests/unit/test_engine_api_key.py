"""The engines' API key on the trainer's side: the client sends it, the engine actor hands it
to SGLang in a private --config file (never on the command line) and keeps it out of the
output it forwards, the reference engine takes it from its environment."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from kuberl_trainer.engines.actors import REDACTED, EngineServer
from kuberl_trainer.engines.client import EngineClient
from kuberl_wire.protocol import ENGINE_API_KEY_ENV
from tests.unit.test_engine_command import spec_json

KEY = "unit-test-engine-key-5d1e"
REFERENCE = {"training": {"backend": "fsdp", "gpusPerNode": 0},
             "rollout": {"engine": "reference", "gpus": 0}}


async def test_the_client_sends_the_key_from_the_environment_unless_given_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str | None] = []

    async def info(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"model_path": "/m"})

    app = web.Application()
    app.router.add_get("/get_model_info", info)
    srv = TestServer(app)
    await srv.start_server()
    url = str(srv.make_url("")).rstrip("/")
    try:
        monkeypatch.setenv(ENGINE_API_KEY_ENV, KEY)
        for client in (EngineClient([url]), EngineClient([url], api_key="other"),
                       EngineClient([url], api_key="")):
            async with client:
                await client.get_model_info(url)
        monkeypatch.delenv(ENGINE_API_KEY_ENV)
        async with EngineClient([url]) as client:
            await client.get_model_info(url)
    finally:
        await srv.close()
    assert seen == [f"Bearer {KEY}", "Bearer other", None, None]


def wait_exit(server: EngineServer) -> None:
    deadline = time.monotonic() + 30
    while server.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.2)  # the output thread's last lines


def test_sglang_reads_the_key_from_a_private_file_and_its_output_never_shows_it(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """SGLang 0.5.6 logs its ServerArgs (api_key included) at start: the actor forwards that
    line with the key replaced. Its --config file is 0600 in a 0700 directory on /dev/shm,
    and gone once the server is stopped."""
    monkeypatch.setenv(ENGINE_API_KEY_ENV, KEY)
    monkeypatch.setattr("kuberl_trainer.engines.actors.node_ip", lambda: "127.0.0.1")
    server = EngineServer(spec_json(), 0, 7)
    commands: list[list[str]] = []
    real = server._command

    def launched(*args: object) -> list[str]:
        commands.append(real(*args))  # type: ignore[arg-type]
        config = commands[-1][-1]
        # as SGLang does: the key read from the file, then logged with the ServerArgs
        return [sys.executable, "-c", "import json, sys; path = sys.argv[1]; "
                "print('server_args=ServerArgs(api_key=%r, port=1)' "
                "% json.load(open(path))['api-key'])", config]

    monkeypatch.setattr(server, "_command", launched)
    server.start("/m")
    wait_exit(server)
    cmd = commands[0]
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and cmd[-2] == "--config"
    assert KEY not in " ".join(cmd)
    config = Path(cmd[-1])
    if os.access("/dev/shm", os.W_OK):
        assert config.parent.parent == Path("/dev/shm")
    assert config.stat().st_mode & 0o777 == 0o600
    assert config.parent.stat().st_mode & 0o777 == 0o700
    assert yaml.safe_load(config.read_text()) == {"api-key": KEY}
    tail = "\n".join(server.log_tail())
    assert KEY not in tail and KEY not in capfd.readouterr().out
    assert REDACTED.decode() in tail
    server.stop()
    assert not config.parent.exists()


def test_the_reference_engine_takes_the_key_from_its_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_API_KEY_ENV, KEY)
    monkeypatch.setattr("kuberl_trainer.engines.actors.node_ip", lambda: "127.0.0.1")
    server = EngineServer(spec_json(**REFERENCE), 0, 7)
    commands: list[list[str]] = []
    real = server._command

    def launched(*args: object) -> list[str]:
        commands.append(real(*args))  # type: ignore[arg-type]
        return [sys.executable, "-c",
                f"import os; print(os.environ[{ENGINE_API_KEY_ENV!r}] == {KEY!r})"]

    monkeypatch.setattr(server, "_command", launched)
    server.start("/m")
    wait_exit(server)
    assert KEY not in " ".join(commands[0]) and "--config" not in commands[0]
    assert server.log_tail() == ["True"]


def test_without_a_key_sglang_gets_no_config_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINE_API_KEY_ENV, raising=False)
    server = EngineServer(spec_json(), 0, 7)
    assert "--config" not in server._command("/m", 30001, 30002)
