"""A real HTTP server standing in for the API server's RLJob /status endpoint: it answers
`requests` merge patches with 200 and records their bodies, for the trainer's reporter tests."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any


@contextmanager
def patch_recorder(requests: int = 1) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(the server's URL, the JSON bodies of the PATCHes it answered, in order)."""
    seen: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=lambda: [server.handle_request() for _ in range(requests)],
                     daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", seen
    finally:
        server.server_close()
