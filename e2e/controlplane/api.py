"""A minimal API client (admin client certificate); kubectl is used for YAML files."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .base import ClusterError


class Api:
    def __init__(self, server: str, ca: Path, cert: Path, key: Path) -> None:
        self.server = server
        self._ctx = ssl.create_default_context(cafile=str(ca))
        self._ctx.load_cert_chain(str(cert), str(key))

    def request(self, method: str, path: str, body: Any = None, *,
                content_type: str = "application/json", timeout: float = 10.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method,
                                     headers={"Content-Type": content_type,
                                              "Accept": "application/json"})
        with urllib.request.urlopen(req, context=self._ctx, timeout=timeout) as resp:
            raw = resp.read()
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode()

    def get(self, path: str) -> Any:
        """The object, or None for a 404."""
        try:
            return self.request("GET", path)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def create(self, path: str, obj: Mapping[str, Any]) -> Any:
        """POST; an object that already exists is left as it is."""
        try:
            return self.request("POST", path, obj)
        except urllib.error.HTTPError as e:
            if e.code == 409:
                return None
            raise ClusterError(f"POST {path}: {e.code} {e.read().decode(errors='replace')}") from e

    def readyz(self) -> bool:
        try:
            return bool(self.request("GET", "/readyz", timeout=3) == "ok")
        except (OSError, urllib.error.URLError, ssl.SSLError):
            return False
