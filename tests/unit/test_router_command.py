"""The router's command line (kuberl_trainer.engines.router.router_command): what keeps the
fleet the only judge of engine health and a request from being sent twice."""

from kuberl_trainer.engines.router import router_command


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_group_affinity_policy_and_only_the_fleet_judges_health() -> None:
    cmd = router_command(["http://a:1", "http://b:2"], port=7000, prometheus_port=7001,
                         request_timeout_s=600.0)
    assert cmd[1:3] == ["-m", "sglang_router.launch_router"]
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3] == [
        "http://a:1", "http://b:2"]
    # a routing key per group, new keys to the least loaded engine
    assert (flag(cmd, "--policy"), flag(cmd, "--assignment-mode")) == ("manual", "min_load")
    # its own checks would take out an engine paused for a weight update (503s)
    assert "--disable-health-check" in cmd and "--disable-circuit-breaker" in cmd
    # bound to the loop's own machine, on the ports given
    assert (flag(cmd, "--host"), flag(cmd, "--port")) == ("127.0.0.1", "7000")
    assert (flag(cmd, "--prometheus-host"), flag(cmd, "--prometheus-port")) == (
        "127.0.0.1", "7001")


def test_the_router_gives_up_no_sooner_than_the_client() -> None:
    """(A router that timed out first would retry the request on another engine while the
    first still computed it: one generation twice.)"""
    for client_s, router_s in ((600.0, "600"), (0.2, "1"), (90.4, "91")):
        cmd = router_command(["http://a:1"], port=1, prometheus_port=2,
                             request_timeout_s=client_s)
        assert flag(cmd, "--request-timeout-secs") == router_s
