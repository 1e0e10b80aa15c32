"""Polling for the e2e tests: wait until the cluster shows what a test expects, or fail
saying what was awaited and what was last seen."""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Callable
from typing import Any


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 60, interval: float = 0.25,
             detail: Callable[[], str] | None = None) -> Any:
    """fn() until truthy (returned); AssertionError naming `what` and the last value after
    `timeout` s. API errors while polling count as "not yet"."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = fn()
        except (OSError, urllib.error.URLError, KeyError, ValueError) as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            extra = f"\n{detail()}" if detail else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} "
                                 f"(last: {last!r:.2000}){extra}")
        time.sleep(interval)
