"""No product module grows past 600 lines unless its docstring says why ("Long because: ..."):
a file that long is usually two rooms sharing one (docs/architecture.md says where things go)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("operator", "trainer_image", "rollout_image", "wire", "env_image")
LIMIT = 600
REASON = "Long because"


def too_long(root: Path) -> list[str]:
    found = []
    for path in sorted(p for d in PRODUCT for p in (root / d).rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        if lines > LIMIT and REASON not in (ast.get_docstring(ast.parse(text)) or ""):
            found.append(f"{path.relative_to(root)}: {lines} lines")
    return found


def test_no_product_module_over_600_lines_without_a_reason() -> None:
    assert too_long(ROOT) == []


def test_the_check_counts_and_reads_the_reason(tmp_path: Path) -> None:
    body = "x = 1\n" * (LIMIT + 1)
    (tmp_path / "trainer_image").mkdir()
    (tmp_path / "trainer_image" / "big.py").write_text('"""Big."""\n' + body)
    (tmp_path / "trainer_image" / "ok.py").write_text(f'"""{REASON}: one table."""\n' + body)
    (tmp_path / "trainer_image" / "small.py").write_text('"""Small."""\n' + "x = 1\n" * 10)
    assert too_long(tmp_path) == [f"trainer_image/big.py: {LIMIT + 2} lines"]
