"""`.ci/tier`: the table of tier times `make test` and `.ci/run` print, and its warnings."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tier(times: Path, *args: str) -> str:
    return subprocess.run([sys.executable, str(ROOT / ".ci" / "tier"), *args], check=True,
                          capture_output=True, text=True,
                          env={"KUBERL_TIER_TIMES": str(times), "PATH": "/usr/bin:/bin"}).stdout


def write(times: Path, spans: dict[str, tuple[float, float | None]]) -> None:
    lines = []
    for name, (start, end) in spans.items():
        lines.append(f"start\t{name}\t{start}")
        if end is not None:
            lines.append(f"end\t{name}\t{end}")
    times.write_text("\n".join(lines) + "\n")


def test_recorded_tiers_are_reported_in_order_with_their_budgets(tmp_path: Path) -> None:
    times = tmp_path / "t.tsv"
    tier(times, "reset")
    for name in ("lint", "unit"):
        tier(times, "start", name)
        tier(times, "end", name)
    tier(times, "start", "integration")  # failed: never ended
    report = tier(times, "report")
    names = [line.split()[0] for line in report.splitlines()[3:]]
    assert names[:3] == ["lint", "unit", "integration"]
    assert re.search(r"^integration +did not finish +12 min$", report, re.M), report
    assert "warning" not in report

    write(times, {"unit": (0, 60), "e2e-build": (60, 70), "e2e": (70, 670)})
    report = tier(times, "report")
    assert re.search(r"^e2e +10.0 min +8 min$", report, re.M), report
    assert "warning: e2e took 10.0 min, over its budget of 8 min" in report
    assert "unit" in report and "warning: unit" not in report  # 1 min of 2


def test_the_total_is_judged_cold_when_the_control_plane_was_built(tmp_path: Path) -> None:
    times = tmp_path / "t.tsv"
    write(times, {"integration": (0, 600), "e2e-build": (600, 600 + 20 * 60)})
    report = tier(times, "report")
    assert "total (cold)" in report and "50 min" in report  # 30 min: within the cold budget
    assert "warning" not in report
    write(times, {"integration": (0, 600), "e2e-build": (600, 630), "e2e": (630, 2000)})
    report = tier(times, "report")
    assert "warning: the tiers took 33.3 min in all, over the warm budget of 30 min" in report
