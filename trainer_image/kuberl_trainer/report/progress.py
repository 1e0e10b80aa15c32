"""What a person watching `kuberl run` sees: a progress bar and one line per step."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

COLUMNS = (("step", "{:>5d}"), ("reward_mean", "{:>7.3f}"), ("reward_std", "{:>6.3f}"),
           ("response_length_mean", "{:>6.1f}"), ("time_generate_s", "{:>6.2f}"),
           ("time_train_s", "{:>6.2f}"), ("time_sync_s", "{:>6.2f}"))
HEADER = "step  reward    std   len   gen_s  train_s sync_s"


class Progress:
    def __init__(self, total: int, start: int = 0) -> None:
        # The bar only on a terminal; in logs (CI, kubectl logs) the per-step lines suffice.
        self.bar = tqdm(total=total, initial=start, unit="step", file=sys.stderr,
                        dynamic_ncols=True, leave=False, disable=not sys.stderr.isatty())
        self.header_printed = False
        self.rewards: list[float] = []

    def step(self, record: dict[str, Any]) -> None:
        if not self.header_printed:
            self.bar.write(HEADER, file=sys.stdout)
            self.header_printed = True
        self.rewards.append(float(record.get("reward_mean", 0.0)))
        cells = [fmt.format(record.get(k, 0)) for k, fmt in COLUMNS]
        self.bar.write("  ".join(cells), file=sys.stdout)
        self.bar.set_postfix(reward=f"{record.get('reward_mean', 0):.3f}")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        if len(self.rewards) >= 2:
            k = min(5, len(self.rewards) // 2)
            first = sum(self.rewards[:k]) / k
            last = sum(self.rewards[-k:]) / k
            print(f"reward: first-{k} mean {first:.3f} -> last-{k} mean {last:.3f} "
                  f"({last - first:+.3f}) over {len(self.rewards)} steps")
