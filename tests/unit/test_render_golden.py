"""Every shipped example renders exactly to its golden file in tests/goldens/.

A change to a renderer shows up here as a diff of what the cluster will get; if it is intended,
run `make goldens` (pytest --update-goldens) and review the golden diff like code.
"""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kuberl_api import load
from kuberl_operator.render import render_children

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
GOLDENS = REPO / "tests" / "goldens"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))
HEADER = ("# Generated from examples/{name} by tests/unit/test_render_golden.py "
          "(make goldens). Do not edit.\n")


class GoldenDumper(yaml.SafeDumper):
    """Stable, reviewable YAML: multi-line strings (the ConfigMap's rljob.yaml) as literal
    blocks rather than one escaped line, and no anchors/aliases."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


GoldenDumper.add_representer(str, _str)


def golden_text(example: Path) -> str:
    objects = render_children(load(example))
    body = yaml.dump_all(objects, Dumper=GoldenDumper, sort_keys=False, width=100)
    return HEADER.format(name=example.name) + body


def test_there_are_examples() -> None:
    assert len(EXAMPLE_FILES) >= 3, f"no examples found under {EXAMPLES}"


@pytest.mark.parametrize("example", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_render_matches_golden(example: Path, update_goldens: bool) -> None:
    golden = GOLDENS / example.name
    actual = golden_text(example)
    if update_goldens:
        GOLDENS.mkdir(parents=True, exist_ok=True)
        golden.write_text(actual)
        return
    assert golden.exists(), (f"no golden for {example.name}: run `make goldens` "
                             "(pytest --update-goldens) and review the new file")
    expected = golden.read_text()
    if actual != expected:
        diff = "".join(difflib.unified_diff(
            expected.splitlines(keepends=True), actual.splitlines(keepends=True),
            fromfile=f"tests/goldens/{example.name}", tofile="rendered"))
        pytest.fail(f"rendered objects differ from the golden file; if intended, run "
                    f"`make goldens` and review:\n{diff}")


def test_golden_parses_back_to_the_rendered_objects() -> None:
    """The golden formatting (literal blocks) is only presentation: it loads to the same data."""
    for example in EXAMPLE_FILES:
        docs = list(yaml.safe_load_all(golden_text(example)))
        assert docs == render_children(load(example))


def test_no_stale_goldens() -> None:
    stale = sorted({p.name for p in GOLDENS.glob("*.yaml")} - {p.name for p in EXAMPLE_FILES})
    assert not stale, f"goldens without an example (delete them): {stale}"


def test_goldens_do_not_depend_on_hash_seed() -> None:
    """Render in fresh interpreters with different string-hash seeds: anything iterating a set
    or otherwise hash-ordered would change the output."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import test_render_golden as g;"
        "sys.stdout.write(''.join(g.golden_text(p) for p in g.EXAMPLE_FILES))"
    )
    outputs = set()
    for seed in ("1", "2", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)],
                              capture_output=True, text=True, env=env, check=True)
        outputs.add(proc.stdout)
    assert len(outputs) == 1
    assert outputs.pop() == "".join(golden_text(p) for p in EXAMPLE_FILES)
