"""The training loops: `sync_loop` (generate, train, sync, one after the other) and
`async_loop` (the engines generate ahead while the trainers train, within a staleness bound:
`staleness`), both over the same `parts`."""
