"""Pins that must agree across files: a mismatch breaks pods at run time, not at build time."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from kuberl_operator.render.rayjob import RAY_VERSION

ROOT = Path(__file__).resolve().parents[2]


def test_image_extras_pin_the_rendered_ray_version() -> None:
    """KubeRay starts pods with the RayJob's rayVersion; the images must carry that Ray."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra in ("trainer", "rollout"):
        pins = [d for d in extras[extra] if re.match(r"ray(\[.*\])?==", d)]
        assert pins == [f"ray[default]=={RAY_VERSION}"], (extra, pins)


def test_dockerfiles_install_the_distribution_like_ci() -> None:
    for name, extra in (("Dockerfile.trainer", "trainer,megatron,kernels"),
                        ("Dockerfile.rollout", "rollout"),
                        ("Dockerfile.environment", "environment")):
        text = (ROOT / name).read_text()
        assert f'pip install ".[{extra}]"' in text, name
        assert re.search(r"^FROM \S+:\S+", text, re.M), f"{name}: base image must be pinned"


def test_megatron_extra_pins_one_release() -> None:
    """The trainer image gets megatron-core from the `megatron` extra, pinned to the release
    the backend was checked against (megatron-core's APIs move between minor releases)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert [d for d in extras["megatron"] if d.startswith("megatron-core")] == [
        "megatron-core==0.16.1"]


def test_kernels_extra_pins_the_checked_liger_release() -> None:
    """training.fusedKernels: liger needs Liger Kernel in the trainer image, at the release
    whose kernels were checked against the plain path (its patch table moves between
    releases)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["kernels"] == ["liger-kernel==0.8.5"]


def test_every_image_copies_every_package_the_wheel_needs() -> None:
    """pip builds the one wheel from the sources in the image: a package directory the wheel
    lists and the Dockerfile does not copy fails the build."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"][
        "targets"]["wheel"]["packages"]
    roots = {p.split("/")[0] for p in packages}
    for dockerfile in sorted(ROOT.glob("Dockerfile.*")):
        copied = set(re.findall(r"^COPY (\S+)/ ", dockerfile.read_text(), re.M))
        assert roots <= copied, (dockerfile.name, sorted(roots - copied))


def test_the_environment_image_needs_no_trainer_dependency() -> None:
    """An environment image installs only the `environment` extra: the server's own needs."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert [d.split("==")[0] for d in extras["environment"]] == ["aiohttp"]
