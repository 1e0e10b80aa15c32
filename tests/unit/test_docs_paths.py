"""Every file, folder and module the docs name exists: a reader sent to
`engines/fleet.py` or `kuberl_trainer.rollout.manager.RolloutManager` finds it there (docs
rot first when code moves)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
PACKAGES = {"kuberl_trainer": "trainer_image", "kuberl_api": "operator",
            "kuberl_operator": "operator", "kuberl_cli": "operator",
            "kuberl_rollout": "rollout_image", "kuberl_wire": "wire", "kuberl_env": "env_image"}
# A file path: folders, then a name with a source or config suffix (`engines/fleet.py`,
# `trainer_image/kuberl_trainer/loops/`); a folder path ends with "/" and holds a package
# name or a known folder. Dotted modules: `kuberl_trainer.rollout.manager.RolloutManager`.
FILE = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w.-]*/)*[A-Za-z_][\w-]*"
                  r"\.(?:py|md|yaml|json|toml|sh))\b")
FOLDER = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w-]*/)+)(?![\w.])")
MODULE = re.compile(r"\b((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+)")
OUTSIDE = ("../shared/", "http", "out/", "~/", "/tmp/", "/etc/", "/dev/")
# What lives in a user's model directory or in a checkpoint, not in this repository.
NOT_OURS = {"config.json", "model/", "critic/", "adapter/"}


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [f for f in out if (ROOT / f).exists()]


FILES = tracked()
FOLDERS = {str(Path(f).parent) + "/" for f in FILES} | {
    "/".join(f.split("/")[:i]) + "/" for f in FILES for i in range(1, f.count("/") + 1)}


def exists_as_file(path: str) -> bool:
    """Named from the repo's root, or from inside a package (`engines/fleet.py`)."""
    return any(f == path or f.endswith("/" + path) for f in FILES)


def exists_as_folder(path: str) -> bool:
    return any(d == path or d.endswith("/" + path) for d in FOLDERS)


def module_exists(dotted: str) -> bool:
    """The longest importable prefix as a file or package, and what follows it (at most a
    class and its member) named in that module's source."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT / PACKAGES[parts[0]] / Path(*parts[:cut])
        source = (base.with_suffix(".py") if base.with_suffix(".py").is_file() else
                  base / "__init__.py" if (base / "__init__.py").is_file() else None)
        if source is not None:
            rest = parts[cut:]
            text = source.read_text()
            return len(rest) <= 2 and all(re.search(rf"\b{re.escape(n)}\b", text)
                                          for n in rest)
    return False


def named(doc: Path) -> list[tuple[str, str]]:
    text = doc.read_text()
    found = [("file", m) for m in FILE.findall(text)]
    found += [("folder", m) for m in FOLDER.findall(text)]
    found += [("module", m.rstrip(".")) for m in MODULE.findall(text)]
    return [(kind, name) for kind, name in found
            if not name.startswith(OUTSIDE) and name not in NOT_OURS]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    check = {"file": exists_as_file, "folder": exists_as_folder, "module": module_exists}
    missing = sorted({f"{kind} {name}" for kind, name in named(doc)
                      if not check[kind](name)})
    assert missing == [], f"{doc.relative_to(ROOT)} names what does not exist: {missing}"


def test_the_check_finds_a_moved_module() -> None:
    """The checker itself: a path that moved away is caught, one that exists passes."""
    assert exists_as_file("engines/fleet.py") and not exists_as_file("engine_client.py")
    assert module_exists("kuberl_trainer.rollout.manager.RolloutManager")
    assert not module_exists("kuberl_trainer.engine_client")
    assert not module_exists("kuberl_trainer.rollout.manager.NoSuchThing")
    assert exists_as_folder("kuberl_trainer/engines/") and not exists_as_folder("megatron2/")
