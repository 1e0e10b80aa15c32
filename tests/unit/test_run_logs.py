"""Where a run's logs go: locally the actors' output goes to <output-dir>/logs/ and an error
names the file to read; in a cluster it stays in the pods' logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kuberl_trainer.engines.client import EngineError
from kuberl_trainer.explain import explain as explain_error, tail
from kuberl_trainer.options import Options


def opts(tmp_path: Path, address: str | None = None, in_cluster: bool = False) -> Options:
    return Options(address=address, in_cluster=in_cluster, output_dir=tmp_path / "out",
                   checkpoint_dir=tmp_path / "ckpt", prometheus_port=0, tensorboard=None,
                   seed=0)


def test_local_runs_log_to_the_output_dir_and_cluster_runs_to_stdout(tmp_path: Path) -> None:
    assert opts(tmp_path).log_dir == tmp_path / "out" / "logs"
    assert opts(tmp_path, address="auto").log_dir is None
    assert opts(tmp_path, address="auto", in_cluster=True).log_dir is None


def test_a_joined_ray_on_this_machine_only_is_one_machine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--address` to a Ray whose live nodes are all this machine (`ray start --head` here):
    the run behaves as a local one (log files, cores shared, free ports); a node elsewhere
    makes it a cluster run."""
    import ray

    from kuberl_trainer import startup

    here = "10.0.0.5"
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: here)
    nodes = [{"NodeManagerAddress": here, "Alive": True},
             {"NodeManagerAddress": "10.0.0.9", "Alive": False}]  # (a dead one: gone)
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert startup._only_this_machine()
    nodes.append({"NodeManagerAddress": "10.0.0.6", "Alive": True})
    assert not startup._only_this_machine()


def test_tail_reads_the_last_lines_of_a_long_file(tmp_path: Path) -> None:
    log = tmp_path / "engine-0.log"
    log.write_text("".join(f"line {i}\n" for i in range(100_000)))
    assert tail(log, 3) == ["line 99997", "line 99998", "line 99999"]
    empty = tmp_path / "empty.log"
    empty.write_text("")
    assert tail(empty, 3) == []


URL = "http://10.0.0.1:30000"


class _Engines:
    """What Session.explain asks of an EngineGroup: one engine, seen dead from the
    `alive_looks`-th look on (never, when None)."""

    def __init__(self, log: Path | None, alive_looks: int | None = 0) -> None:
        self.log, self.alive_looks, self.looks = log, alive_looks, 0

    def dead(self) -> dict[str, int]:
        self.looks += 1
        if self.alive_looks is None or self.looks <= self.alive_looks:
            return {}
        return {URL: -9}

    urls = [URL]

    def log_of(self, url: str) -> Path | None:
        return self.log

    def actor_of(self, url: str) -> object:
        raise RuntimeError("the actor is gone too")  # explaining must not raise


def explain(tmp_path: Path, exc: BaseException, engines: _Engines | None,
            address: str | None = None) -> str:
    return explain_error(exc, engines, opts(tmp_path, address).log_dir)  # type: ignore[arg-type]


def test_an_engine_death_names_its_log_and_quotes_its_end(tmp_path: Path) -> None:
    log = tmp_path / "engine-0.log"
    log.write_text("".join(f"routine {i}\n" for i in range(50)) + "Traceback: out of memory\n")
    text = explain(tmp_path, RuntimeError("\x1b[36mray::X\x1b[39m failed"), _Engines(log))
    first, *rest = text.splitlines()
    assert first == ("engine died: http://10.0.0.1:30000 exited with code -9 "
                     "(ray::X failed)")  # Ray's colours stripped
    assert str(log) in rest[0]
    assert rest[-1] == "  Traceback: out of memory" and len(rest) == 1 + 20


def test_other_errors_point_to_the_logs_on_a_local_run_only(tmp_path: Path) -> None:
    local = explain(tmp_path, ValueError("bad"), None)
    assert local == f"ValueError: bad\n(the engines' and training workers' logs: " \
                    f"{tmp_path / 'out' / 'logs'}/)"
    assert explain(tmp_path, ValueError("bad"), None, address="auto") == "ValueError: bad"
    # In a cluster an engine has no log file here: the error alone (its pod has the log).
    assert explain(tmp_path, OSError("x"), _Engines(None), address="auto").count("\n") == 0


def test_a_dropped_connection_waits_a_moment_for_the_engine_to_be_seen_dead(
        tmp_path: Path) -> None:
    """The client sees the socket close before the killed server's exit can be reaped."""
    log = tmp_path / "engine-0.log"
    log.write_text("updated 51 tensors, weight_version 3\n")
    engines = _Engines(log, alive_looks=1)
    text = explain(tmp_path, EngineError(URL, "ServerDisconnectedError"), engines)
    assert text.startswith(f"engine died: {URL} exited with code -9") and engines.looks == 2


def test_an_engine_that_answers_with_an_error_is_not_waited_for(tmp_path: Path) -> None:
    log = tmp_path / "engine-0.log"
    log.write_text("ERROR kuberl.reference: POST /generate failed\nTraceback: boom\n")
    engines = _Engines(log, alive_looks=None)
    text = explain(tmp_path, EngineError(URL, "internal error", status=500), engines)
    assert engines.looks == 1
    assert text.splitlines()[0] == f"engine {URL} (HTTP 500): internal error"
    assert text.splitlines()[-1] == "  Traceback: boom" and str(log) in text
