"""Environments as services (environment.image): kuberl_env's server and the trainer's client
(agents/remote.py), on real aiohttp servers in this process. The same episode runs to the same
trajectory in process and over HTTP; retried calls run the user's code once; the
environment's errors come back as errors naming it, never retried and never a reward; lost
answers and dead replicas are retried, then fail naming the URL; each episode stays on one
replica while episodes spread over them; idle episodes are reaped."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kuberl_env.__main__ import main as kuberl_env_main
from kuberl_env.server import EnvironmentServer
from kuberl_trainer.agents import EnvironmentFailure, RolloutContext, Trajectory, run_episode
from kuberl_trainer.agents.remote import EnvironmentService, EnvironmentUnavailable
from tests.unit.test_agents_environment import Calculator
from tests.unit.test_agents_trajectory import Engine

NAME = "calc:Calculator"


@dataclass
class Sample:  # the trainer's sample is a dataclass; reset gets it as a dict with attributes
    prompt: str
    label: str


class Made:
    """A factory that keeps what it made (the server's environments)."""

    def __init__(self, make: Callable[[], Any] = Calculator) -> None:
        self.make, self.made = make, []  # type: Callable[[], Any], list[Any]

    def __call__(self) -> Any:
        self.made.append(self.make())
        return self.made[-1]


async def start(factory: Callable[[], Any], **kwargs: Any) -> tuple[TestServer, str]:
    server = EnvironmentServer(factory, NAME, **kwargs)
    srv = TestServer(server.app())
    await srv.start_server()
    srv.env_server = server  # type: ignore[attr-defined]
    return srv, str(srv.make_url("")).rstrip("/")


@pytest.fixture
async def served() -> AsyncIterator[tuple[Made, str, EnvironmentServer]]:
    made = Made()
    srv, url = await start(made)
    yield made, url, srv.env_server  # type: ignore[attr-defined]
    await srv.close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def service(url: str, **kwargs: Any) -> EnvironmentService:
    return EnvironmentService(url, name=NAME, **{"backoff_s": 0.01, **kwargs})


async def episode(env: Any, *, max_turns: int = 5) -> tuple[Trajectory, Any]:
    ctx = RolloutContext(Engine([[7, 8]] * 5), {"max_new_tokens": 99})  # type: ignore[arg-type]
    traj = Trajectory(prompt_ids=[1, 2], budget=20)
    result = await run_episode(ctx, env, traj, Sample("1+1=", "2"), max_turns=max_turns,
                               args={"level": "1"}, name=NAME,
                               tokenize=lambda text: [ord(c) for c in text])
    return traj, result


async def post(url: str, path: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("plain", [False, True])
async def test_an_episode_over_http_is_the_episode_in_process(
        served: tuple[Made, str, EnvironmentServer], plain: bool) -> None:
    made, url, _ = served
    made.make = lambda: Calculator(turns=2, plain=plain)
    local = Calculator(turns=2, plain=plain)
    traj, result = await episode(local)
    remote_traj, remote_result = await episode(service(url)())
    assert remote_traj.ids == traj.ids == [20, 7, 8, 50, 51, 7, 8]
    assert remote_traj.loss_mask() == traj.loss_mask()
    assert (remote_result.rewards, remote_result.metrics, remote_result.done) == (
        result.rewards, result.metrics, result.done)
    (env,) = made.made
    assert env.closed and env.steps == 2
    sample, args = env.reset_with
    assert args == {"level": "1"}
    assert sample == {"prompt": "1+1=", "label": "2"} and sample.prompt == "1+1="


async def test_retried_calls_run_the_environment_once(
        served: tuple[Made, str, EnvironmentServer]) -> None:
    made, url, _ = served
    reset = {"episode": "e1", "sample": {"prompt": "p"}, "args": {}}
    first, again = await post(url, "/reset", reset), await post(url, "/reset", reset)
    assert first == again == (200, {"observation": {"ids": [20], "text": None, "stop": ["="],
                                                    "stop_token_ids": []}})
    step = {"episode": "e1", "step": 0, "action_ids": [7], "action_text": "7"}
    first, again = await post(url, "/step", step), await post(url, "/step", step)
    assert first == again and first[0] == 200 and first[1]["result"]["reward"] == 0.5
    (env,) = made.made
    assert env.steps == 1  # one reset, one step, however often asked
    status, body = await post(url, "/step", {**step, "step": 2})
    assert status == 409 and "step 2 out of order (the latest step is 0)" in body["error"]
    assert await post(url, "/close", {"episode": "e1"}) == (200, {"closed": True,
                                                                  "episode": "e1"})
    assert await post(url, "/close", {"episode": "e1"}) == (200, {"closed": False,
                                                                  "episode": "e1"})
    assert env.closed
    status, body = await post(url, "/step", {**step, "step": 1})
    assert status == 404 and body["error"] == "episode 'e1' was closed"
    status, body = await post(url, "/step", {**step, "episode": "nobody"})
    assert status == 404 and "episode 'nobody' is unknown here" in body["error"]


async def test_malformed_requests_get_json_errors(
        served: tuple[Made, str, EnvironmentServer]) -> None:
    _, url, _ = served
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/reset", data=b"{not json") as resp:
            assert resp.status == 400 and "not JSON" in (await resp.json())["error"]
        async with session.get(url + "/nowhere") as resp:
            assert resp.status == 404 and (await resp.json())["call"] == "nowhere"
        async with session.get(url + "/health") as resp:
            assert await resp.json() == {"status": "ok", "class": NAME, "episodes": 0}
    status, body = await post(url, "/step", {"episode": "e", "step": -1})
    assert status == 400 and "needs `step`" in body["error"]
    status, body = await post(url, "/reset", {"episode": "", "sample": {}})
    assert status == 400 and "`episode`" in body["error"]


async def test_the_environments_errors_name_it_and_are_never_retried(
        served: tuple[Made, str, EnvironmentServer]) -> None:
    made, url, _ = served
    made.make = lambda: Calculator(turns=9, fail_at=2)
    with pytest.raises(EnvironmentFailure, match=rf"^{NAME}.step at http://\S+: {NAME}.step "
                       r"failed: ConnectionError: the calculator's backend is down$") as info:
        await episode(service(url)())
    assert not isinstance(info.value, EnvironmentUnavailable)
    (env,) = made.made
    assert env.steps == 2 and env.closed  # the failing step ran once; close still ran


@pytest.mark.parametrize("answer, why", [
    (object(), "returned object; expected an Observation or a StepResult"),
    ({"observation": {"ids": [object()]}}, "returned a object"),
    ({"observation": {"txt": "5"}}, r"unknown observation fields \['txt'\]"),
])
async def test_answers_outside_the_protocol_are_refused_as_in_process(
        served: tuple[Made, str, EnvironmentServer], answer: Any, why: str) -> None:
    class Odd(Calculator):
        async def step(self, action_ids: list[int], action_text: str) -> Any:
            return answer

    made, url, _ = served
    made.make = Odd
    with pytest.raises(EnvironmentFailure, match=why):
        await episode(service(url)())
    assert made.made[0].closed


async def test_an_answer_lost_to_a_timeout_is_asked_again_and_the_step_runs_once(
        served: tuple[Made, str, EnvironmentServer]) -> None:
    class Slow(Calculator):
        async def step(self, action_ids: list[int], action_text: str) -> Any:
            if self.steps == 0:
                await asyncio.sleep(0.6)  # longer than the client waits for one answer
            return await super().step(action_ids, action_text)

    made, url, _ = served
    made.make = lambda: Slow(turns=2)
    traj, result = await episode(service(url, timeout_s=0.25)())
    assert traj.ids == [20, 7, 8, 50, 51, 7, 8] and result.rewards == [0.5, 0.5]
    assert made.made[0].steps == 2  # the first step ran once, its retries waited for it


async def test_a_timeout_that_persists_fails_naming_the_call_and_url(
        served: tuple[Made, str, EnvironmentServer]) -> None:
    class Hung(Calculator):
        async def step(self, action_ids: list[int], action_text: str) -> Any:
            await asyncio.sleep(3600)

    made, url, server = served
    made.make = Hung
    with pytest.raises(EnvironmentUnavailable, match=rf"{NAME}.step: the environment service "
                       rf"at {url} failed 3 times; the last: no answer within 0.1 s"):
        await episode(service(url, timeout_s=0.1, retries=2)())
    # no close tried (it would wait out the same retries): the server drops the episode,
    # its hung step cancelled, once nobody has asked about it for the idle timeout
    assert not made.made[0].closed and len(server.episodes) == 1
    server.episode_timeout_s = 0.0
    assert await server.reap() == 1
    assert made.made[0].closed and not server.episodes


async def test_server_errors_are_retried_and_refusals_are_not() -> None:
    answers = [503, 500, 200]
    calls: list[str] = []

    async def flaky(request: web.Request) -> web.Response:
        calls.append(request.path)
        if request.path == "/step":
            return web.json_response({"error": "episode 'x' is unknown here"}, status=404)
        status = answers.pop(0) if request.path == "/reset" else 200
        return web.json_response({"observation": None, "closed": True, "error": "busy"},
                                 status=status)

    app = web.Application()
    app.router.add_post("/{call}", flaky)
    srv = TestServer(app)
    await srv.start_server()
    try:
        env = service(str(srv.make_url("")).rstrip("/"))()
        assert await env.reset({"prompt": "p"}) is None
        with pytest.raises(EnvironmentFailure, match="is unknown here"):
            await env.step([1], "a")
        await env.close()
    finally:
        await srv.close()
    assert calls == ["/reset"] * 3 + ["/step", "/close"]


async def test_a_dead_service_fails_naming_its_url() -> None:
    url = closed_port_url()
    with pytest.raises(EnvironmentUnavailable, match=rf"{NAME}.reset: the environment service "
                       rf"at {url} failed 4 times; the last: Client"):
        await episode(service(url)())


async def test_episodes_spread_over_replicas_and_stay_on_theirs() -> None:
    servers = [await start(Made(lambda: Calculator(turns=2))) for _ in range(2)]
    try:
        svc = service("http://environment.test:8000")
        replicas = [url for _, url in servers]

        async def resolved() -> list[str]:
            return replicas

        svc.replicas = resolved  # type: ignore[method-assign]
        results = await asyncio.gather(*(episode(svc()) for _ in range(6)))
        assert all(r.rewards == [0.5, 0.5] for _, r in results)  # no step met another replica
        made = [srv.env_server.factory.made for srv, _ in servers]  # type: ignore[attr-defined]
        assert [len(m) for m in made] == [3, 3]
        assert all(env.steps == 2 and env.closed for m in made for env in m)
        assert sum(svc.open.values()) == 0
    finally:
        for srv, _ in servers:
            await srv.close()


async def test_a_reset_moves_off_a_dead_replica_and_steps_never_move(
        served: tuple[Made, str, EnvironmentServer]) -> None:
    made, live, _ = served
    made.make = lambda: Calculator(turns=2)
    dead = closed_port_url()
    svc = service("http://environment.test:8000")

    async def resolved() -> list[str]:
        return [dead, live]

    svc.replicas = resolved  # type: ignore[method-assign]
    env = svc()
    await env.reset({"prompt": "p"})
    assert env.replica == live
    replicas_of_step = [dead]

    async def moved() -> list[str]:
        return replicas_of_step

    svc.replicas = moved  # type: ignore[method-assign]
    await env.step([7], "7")  # pinned: never asks which replicas there are
    await env.close()
    assert made.made[0].steps == 1 and made.made[0].closed


async def test_a_headless_name_resolves_to_every_replica(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, int]] = []

    async def getaddrinfo(host: str, port: int, **_: Any) -> list[Any]:
        asked.append((host, port))
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.2", port)),
                (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::1", port, 0, 0)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", port))]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    svc = service("http://job-env:8000")
    assert await svc.replicas() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000",
                                    "http://[fd00::1]:8000"]
    await svc.replicas()
    assert asked == [("job-env", 8000)]  # cached for resolve_ttl_s
    assert svc.headers() == {"Host": "job-env:8000"}
    picks = [await svc.pick() for _ in range(3)]
    assert sorted(picks) == sorted(await svc.replicas())  # in turn while none is busy
    assert service("http://127.0.0.1:9/").resolves is False
    assert service("https://env.example.com").resolves is False


async def test_idle_episodes_are_reaped_and_say_so() -> None:
    made = Made()
    srv, url = await start(made, episode_timeout_s=0.05)
    try:
        await post(url, "/reset", {"episode": "idle", "sample": {}, "args": {}})
        await asyncio.sleep(0.3)  # the reaper runs every timeout / 4
        assert made.made[0].closed
        status, body = await post(url, "/step", {"episode": "idle", "step": 0,
                                                 "action_ids": [], "action_text": ""})
        assert status == 404 and "was closed after 0.05 s idle" in body["error"]
    finally:
        await srv.close()


def test_a_class_that_cannot_be_served_stops_the_server_at_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert kuberl_env_main(["no_such_module_here:Env"]) == 2
    assert "cannot import module 'no_such_module_here'" in capsys.readouterr().err
    assert kuberl_env_main(["tests.unit.test_environment_service:Sample"]) == 2
    assert "needs `async def reset`" in capsys.readouterr().err


class Seeded:
    """Draws its observation from the seed its reset declares (an environment's randomness)."""

    async def reset(self, sample: Any, *, seed: int | None, **args: str) -> dict[str, Any]:
        self.seed = seed
        return {"ids": [30 + (seed or 0) % 7]}

    async def step(self, action_ids: list[int], action_text: str) -> dict[str, Any]:
        return {"done": True}

    async def close(self) -> None:
        pass


async def seeded_episode(env: Any, seed: int) -> Trajectory:
    ctx = RolloutContext(Engine([[7, 8]] * 5),  # type: ignore[arg-type]
                         {"max_new_tokens": 99, "sampling_seed": seed})
    traj = Trajectory(prompt_ids=[1, 2], budget=20)
    await run_episode(ctx, env, traj, Sample("1+1=", "2"), max_turns=2, args={}, name=NAME,
                      tokenize=lambda text: [ord(c) for c in text])
    return traj


async def test_a_reset_that_declares_seed_gets_the_trajectorys_in_process_and_over_http(
) -> None:
    """The trajectory's seed (its first turn's sampling seed, ctx.seed) reaches a reset that
    asks for it, in process and through the server: a resumed run, sending the same seeds,
    sees the same observations. A reset that does not declare it (Calculator, with **args)
    is never given one."""
    local = Seeded()
    assert (await seeded_episode(local, 12)).ids[0] == 30 + 12 % 7 and local.seed == 12
    made = Made(Seeded)
    srv, url = await start(made)
    try:
        remote = await seeded_episode(service(url)(), 12)
        assert remote.ids[0] == 30 + 12 % 7 and made.made[0].seed == 12
        plain = Made()
        srv2, url2 = await start(plain)
        try:
            await seeded_episode(service(url2)(), 12)
            assert "seed" not in plain.made[0].reset_with[1]
        finally:
            await srv2.close()
        status, body = await post(url, "/reset", {"episode": "e1", "sample": {}, "args": {},
                                                  "seed": "12"})
        assert status == 400 and "seed" in body["error"]
    finally:
        await srv.close()
