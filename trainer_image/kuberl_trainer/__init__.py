"""The training loop on Ray (algorithms, backends, rollout manager, weight sync) — issue 3."""
