"""The engines' API key against the pinned SGLang's own code: the launcher's --config file gives
SGLang the key without a command line showing it, and the reference engine refuses and admits
exactly the requests SGLang's --api-key middleware does, with its status and body."""

from __future__ import annotations

import asyncio
import json
import shutil
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kuberl_rollout.reference.server import api_key_check
from kuberl_trainer.engines.actors import write_api_key_config
from kuberl_wire.protocol import api_key_exempt
from tests.sglang_contract.cases import Case, all_cases

from fastapi import FastAPI, Request, Response  # isort: skip  (the pinned wheel's: conftest)
from sglang.srt.server_args import ServerArgs, prepare_server_args  # isort: skip
from sglang.srt.utils.common import add_api_key_middleware  # isort: skip

KEY = "kuberl-test-key_0123456789-ABCDEFGHIJ"
SGLANG_CASES = [c for c in all_cases() if c.sglang]
# What the trainer calls (docs/engine-contract.md's table; /classify: a served reward
# model's), and the paths around the edges of
# SGLang's rule (a prefix match: /healthz and /metrics_x pass too)
PATHS = ["/generate", "/classify", "/init_weights_update_group", "/update_weights_from_distributed",
         "/update_weights_from_tensor", "/destroy_weights_update_group",
         "/abort_weights_update_group", "/pause_generation",
         "/continue_generation", "/release_memory_occupation", "/resume_memory_occupation",
         "/flush_cache", "/abort_request", "/get_model_info", "/get_server_info",
         "/server_info", "/get_weight_version", "/get_weights_checksum", "/v1/loads",
         "/classify", "/encode",
         "/health", "/health_generate", "/healthz", "/metrics", "/metrics_x", "/ping", "/"]
HEADERS: list[dict[str, str]] = [
    {}, {"Authorization": f"Bearer {KEY}"}, {"Authorization": "Bearer wrong"},
    {"Authorization": KEY}, {"Authorization": f"bearer {KEY}"},
    {"Authorization": f"Bearer  {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
    {"X-API-Key": KEY}]
# (Not a header with trailing spaces: HTTP servers, uvicorn's and aiohttp's alike, strip a
# field value's surrounding whitespace before any middleware sees it; the raw ASGI call here
# would not.)


@pytest.mark.parametrize("case", SGLANG_CASES, ids=lambda c: c.name)
def test_sglang_reads_the_key_from_the_config_file_not_the_command_line(
        case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's own prepare_server_args (what `python -m sglang.launch_server` runs) merges
    the launcher's --config file: api_key is the key, every flag of the command line keeps
    its value, and the argv (what `ps` shows) does not hold the key."""
    monkeypatch.setattr(ServerArgs, "__post_init__", lambda self: None)
    path = write_api_key_config(KEY)
    try:
        assert path.stat().st_mode & 0o777 == 0o600
        assert path.parent.stat().st_mode & 0o777 == 0o700
        cmd = case.command(config_file=str(path))
        assert KEY not in " ".join(cmd)
        assert cmd[-2:] == ["--config", str(path)]
        args = prepare_server_args(cmd[3:])
        assert args.api_key == KEY
        assert {k: getattr(args, k) for k in case.expect} == case.expect
        without = prepare_server_args(case.command()[3:])
        assert without.api_key is None
    finally:
        shutil.rmtree(path.parent)


async def _sglang_answer(app: FastAPI, method: str, path: str,
                         headers: dict[str, str]) -> tuple[int, Any]:
    """One request through the ASGI app (no HTTP client library in the contract tier's
    environment): its status and decoded JSON body."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "server": ("127.0.0.1", 80),
             "client": ("127.0.0.1", 1234),
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)


def test_the_reference_engine_refuses_what_sglang_refuses() -> None:
    """SGLang 0.5.6's middleware (add_api_key_middleware, from the wheel) and the reference
    engine's (api_key_check), each in front of a handler that answers every path 200 {}: the
    same status and body for every path the trainer calls, with no key, the key, a wrong key
    and malformed headers; and kuberl_wire's rule says which pass."""
    sglang = FastAPI()
    add_api_key_middleware(sglang, KEY)

    @sglang.api_route("/{path:path}", methods=["GET", "POST", "OPTIONS"])
    async def anything(request: Request) -> Response:
        return Response(content="{}", media_type="application/json")

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({})

    reference = web.Application(middlewares=[api_key_check(KEY)])
    reference.router.add_route("*", "/{path:.*}", ok)

    async def compare() -> int:
        checked = 0
        async with TestClient(TestServer(reference)) as client:
            for path in PATHS:
                for method in ("GET", "POST", "OPTIONS"):
                    for headers in HEADERS:
                        want = await _sglang_answer(sglang, method, path, headers)
                        async with client.request(method, path, headers=headers) as resp:
                            got = (resp.status, await resp.json())
                        assert got == want, (method, path, headers)
                        admitted = headers.get("Authorization") == f"Bearer {KEY}"
                        assert (want[0] == 200) == (admitted or api_key_exempt(method, path))
                        checked += 1
        return checked

    assert asyncio.run(compare()) == len(PATHS) * 3 * len(HEADERS)
    # the rule's shape, stated: the trainer's admin and generate calls are refused without it
    assert not api_key_exempt("POST", "/update_weights_from_distributed")
    assert api_key_exempt("GET", "/health") and api_key_exempt("GET", "/metrics")
