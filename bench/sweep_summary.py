"""Summarise bench/tiny_sweep.sh logs: per run, reward by window and the first-5/last-5 climb.

    python3 bench/sweep_summary.py OUT_DIR [WINDOW [STEPS]]

STEPS cuts every run to its first STEPS steps (what a shorter run would have shown: a run
repeats exactly on the same machine, so a prefix of a long run is exactly the short run there).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def rewards(log: Path) -> list[float]:
    rows = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[0].isdigit():
            rows.append(float(parts[1]))
    return rows


def main() -> None:
    out = Path(sys.argv[1])
    window = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else None
    for log in sorted(out.glob("*_*_*.log")):
        r = rewards(log)[:steps]
        if len(r) < 10:
            print(f"{log.stem:<20} incomplete ({len(r)} steps)")
            continue
        first, last = sum(r[:5]) / 5, sum(r[-5:]) / 5
        windows = [sum(r[i:i + window]) / len(r[i:i + window]) for i in range(0, len(r), window)]
        greedy = re.search(r"greedy eval accuracy ([\d.]+) -> ([\d.]+)", log.read_text())
        g = f"{greedy.group(1)}->{greedy.group(2)}" if greedy and steps is None else "-"
        print(f"{log.stem:<20} {first:.3f}->{last:.3f} ({last - first:+.3f}) greedy {g}  "
              + " ".join(f"{w:.2f}" for w in windows))


if __name__ == "__main__":
    main()
