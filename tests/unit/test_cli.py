"""`kuberl validate` and friends: bad input fails before anything starts, with the field named."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kuberl_cli.main import main
from kuberl_trainer import ray_auth


@pytest.fixture(autouse=True)
def _ray_auth_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kuberl run` sets Ray's auth variables in its environment: restored after each test."""
    for key in (ray_auth.MODE_ENV, ray_auth.TOKEN_ENV, ray_auth.TOKEN_PATH_ENV):
        monkeypatch.delenv(key, raising=False)

GOOD = """\
apiVersion: kuberl.dev/v1alpha1
kind: RLJob
metadata: {name: demo}
spec:
  model: {path: /models/qwen}
  data: {prompts: /data/train.jsonl}
"""


def test_validate_good(tmp_path: Path, capsys: Any) -> None:
    f = tmp_path / "job.yaml"
    f.write_text(GOOD)
    assert main(["validate", str(f)]) == 0
    assert "default/demo is valid" in capsys.readouterr().out


def test_validate_counts_a_served_reward_models_gpus(capsys: Any) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "reward-model.yaml"
    assert main(["validate", str(example)]) == 0
    assert "4 engine(s), a reward model on 2x1 GPUs, 400 steps" in capsys.readouterr().out


def test_validate_names_file_and_field(tmp_path: Path, capsys: Any) -> None:
    f = tmp_path / "job.yaml"
    f.write_text(GOOD.replace("{path: /models/qwen}", "{path: /models/qwen, revision: main}"))
    assert main(["validate", str(f)]) == 1
    err = capsys.readouterr().err
    assert str(f) in err and "spec.model.revision" in err


@pytest.mark.parametrize(("section", "field"), [
    ("training: {backend: megatron, parallelism: {cp: 2}}", "spec.training.parallelism.cp"),
])
def test_validate_refuses_what_is_not_supported_yet(tmp_path: Path, capsys: Any, section: str,
                                                    field: str) -> None:
    f = tmp_path / "job.yaml"
    f.write_text(GOOD + f"  {section}\n")
    assert main(["validate", str(f)]) == 1
    err = capsys.readouterr().err
    problem = next(line for line in err.splitlines() if f"{field}:" in line)
    assert "not supported yet" in problem, err


def test_missing_file(tmp_path: Path, capsys: Any) -> None:
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read the manifest" in capsys.readouterr().err


def test_malformed_yaml(tmp_path: Path, capsys: Any) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("spec: [unclosed\n")
    assert main(["validate", str(f)]) == 1
    assert "not valid YAML" in capsys.readouterr().err


def test_two_documents(tmp_path: Path, capsys: Any) -> None:
    f = tmp_path / "job.yaml"
    f.write_text(GOOD + "---\n" + GOOD)
    assert main(["validate", str(f)]) == 1
    assert "exactly one YAML document, found 2" in capsys.readouterr().err


CODE = GOOD + """\
  rollout: {function: my_agent:run}
  code: {configMap: my-agent}
"""


@pytest.mark.parametrize(("in_cluster", "noticed"), [(False, True), (True, False)])
def test_run_says_that_code_is_mounted_only_in_a_cluster(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, in_cluster: bool,
        noticed: bool) -> None:
    """Locally spec.code mounts nothing: `kuberl run` says so (and where the modules come
    from) and runs on; on the head, where the operator mounted it, it says nothing."""
    ran: list[Any] = []
    fake = types.ModuleType("kuberl_trainer.run")
    fake.run = lambda job, args: ran.append(job) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kuberl_trainer.run", fake)
    f = tmp_path / "job.yaml"
    f.write_text(CODE)
    assert main(["run", str(f), *(["--in-cluster"] if in_cluster else [])]) == 0
    assert len(ran) == 1
    err = capsys.readouterr().err
    assert ("spec.code (ConfigMap my-agent) is mounted only in a cluster" in err) == noticed
    assert ("current directory and PYTHONPATH" in err) == noticed


@pytest.mark.parametrize(("in_cluster", "imports"), [(False, True), (True, False)])
def test_run_imports_the_jobs_modules_from_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_cluster: bool,
        imports: bool) -> None:
    """The `kuberl` console script's import path starts with its bin directory, not the
    current one: `kuberl run` puts the current directory first, so a loss function (or any
    of the job's functions) beside the manifest imports, on the head and (Ray adds the
    driver's current directory to its workers') in the training ranks. On the head in a
    cluster the code comes from spec.code's mount instead."""
    (tmp_path / "my_losses_beside.py").write_text("def loss(inp):\n    return None\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_losses_beside", raising=False)
    found: list[bool] = []
    fake = types.ModuleType("kuberl_trainer.run")
    fake.run = lambda job, args: found.append(  # type: ignore[attr-defined]
        importlib.util.find_spec("my_losses_beside") is not None) or 0
    monkeypatch.setitem(sys.modules, "kuberl_trainer.run", fake)
    (tmp_path / "job.yaml").write_text(GOOD)
    assert main(["run", "job.yaml", *(["--in-cluster"] if in_cluster else [])]) == 0
    assert found == [imports]


def fake_run(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str | None]]:
    """kuberl_trainer.run replaced: each call records Ray's auth variables as the run sees them."""
    seen: list[dict[str, str | None]] = []
    fake = types.ModuleType("kuberl_trainer.run")
    keys = (ray_auth.MODE_ENV, ray_auth.TOKEN_ENV)
    fake.run = lambda job, args: seen.append(  # type: ignore[attr-defined]
        {k: os.environ.get(k) for k in keys}) or 0
    monkeypatch.setitem(sys.modules, "kuberl_trainer.run", fake)
    return seen


def test_run_starts_its_ray_with_a_new_random_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local run's Ray checks a token: set before Ray is imported, new for every run, never
    on the command line (the run's argv is the caller's)."""
    seen = fake_run(monkeypatch)
    f = tmp_path / "job.yaml"
    f.write_text(GOOD)
    assert main(["run", str(f)]) == 0
    first = seen[-1]
    assert first[ray_auth.MODE_ENV] == "token"
    token = first[ray_auth.TOKEN_ENV]
    assert token and len(token) >= 32
    monkeypatch.delenv(ray_auth.TOKEN_ENV)
    assert main(["run", str(f)]) == 0
    assert seen[-1][ray_auth.TOKEN_ENV] not in (None, token)


def test_run_keeps_the_callers_token_and_a_join_brings_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = fake_run(monkeypatch)
    f = tmp_path / "job.yaml"
    f.write_text(GOOD)
    monkeypatch.setenv(ray_auth.TOKEN_ENV, "the-callers-token")
    assert main(["run", str(f)]) == 0
    assert seen[-1] == {ray_auth.MODE_ENV: "token", ray_auth.TOKEN_ENV: "the-callers-token"}
    monkeypatch.delenv(ray_auth.MODE_ENV)
    monkeypatch.delenv(ray_auth.TOKEN_ENV)
    assert main(["run", str(f), "--address", "10.0.0.1:6379"]) == 0
    assert seen[-1] == {ray_auth.MODE_ENV: None, ray_auth.TOKEN_ENV: None}


def test_a_local_ray_without_token_auth_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray reads RAY_AUTH_MODE once, at import: a process that imported Ray without it would
    start an open Ray; HeadStart refuses to rather than run so."""
    from kuberl_trainer import startup

    monkeypatch.setattr(startup, "is_token_auth_enabled", lambda: False)
    opts = types.SimpleNamespace(address=None)
    with pytest.raises(RuntimeError, match="token authentication"):
        startup._start_ray(None, opts)  # type: ignore[arg-type]


def test_a_refused_join_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/nonexistent")
    msg = str(ray_auth.JoinRefused("10.0.0.1:6379", ConnectionError()))
    assert "could not join the Ray at 10.0.0.1:6379 (ConnectionError)" in msg
    assert "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=" in msg
    monkeypatch.setenv(ray_auth.MODE_ENV, "token")
    monkeypatch.setenv(ray_auth.TOKEN_ENV, "t")
    assert "check that it is that Ray's token" in str(
        ray_auth.JoinRefused("x:1", ConnectionError("boom")))


# A config the operator rendered for a job an earlier release accepted (status/ratchet.py): a
# tokenizer outside the model's PVC, which this release's rules refuse.
WAIVED = """\
apiVersion: kuberl.dev/v1alpha1
kind: RLJob
metadata:
  name: demo
  annotations: {kuberl.dev/waived-rules: '["spec.model.tokenizer"]'}
spec:
  model: {path: /models/qwen, tokenizer: /mnt/tok, storage: {pvc: m, mountPath: /models}}
  data: {prompts: /data/train.jsonl}
"""


@pytest.mark.parametrize("in_cluster", [True, False])
def test_run_in_cluster_waives_what_the_operator_waived(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, in_cluster: bool) -> None:
    """On the head (`--in-cluster`) the config's waived rules are waived, with a notice naming
    each; the same file given to a local run is refused like any manifest (only the operator
    may waive a rule, for a job it accepted under an earlier release)."""
    ran: list[Any] = []
    fake = types.ModuleType("kuberl_trainer.run")
    fake.run = lambda job, args: ran.append(job) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kuberl_trainer.run", fake)
    f = tmp_path / "rljob.yaml"
    f.write_text(WAIVED)
    code = main(["run", str(f), "--address", "auto", *(["--in-cluster"] if in_cluster else [])])
    err = capsys.readouterr().err
    if in_cluster:
        assert code == 0 and ran[0].spec.model.tokenizer == "/mnt/tok", err
        assert "refused by this one: spec.model.tokenizer: tokenizer must lie under" in err, err
    else:
        assert code == 1 and not ran, err
        assert "spec.model.tokenizer: tokenizer must lie under" in err, err
