"""`kuberl validate` and friends: bad input fails before anything starts, with the field named."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kuberl_cli.main import main

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


def test_validate_names_file_and_field(tmp_path: Path, capsys: Any) -> None:
    f = tmp_path / "job.yaml"
    f.write_text(GOOD.replace("{path: /models/qwen}", "{path: /models/qwen, revision: main}"))
    assert main(["validate", str(f)]) == 1
    err = capsys.readouterr().err
    assert str(f) in err and "spec.model.revision" in err


@pytest.mark.parametrize(("section", "field"), [
    ("training: {backend: megatron, parallelism: {ep: 2}}", "spec.training.parallelism.ep"),
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
