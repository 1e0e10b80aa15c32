"""Ray's token authentication (Ray >= 2.52) for the Ray a run starts or joins (issue 36).

With it off (Ray's default), anyone who reaches a Ray's GCS (6379) or dashboard / Jobs API
(8265) can run code with the job's GPUs, data and credentials. Ray turns it on per process from
its environment, read once when `ray._raylet` is imported: RAY_AUTH_MODE=token, and the token
in RAY_AUTH_TOKEN (or a file named by RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token). Every Ray
process checks it on each gRPC call (an unauthenticated `ray.init(address=...)` retries, then
fails with a ConnectionError), and the dashboard answers HTTP 401 without an
`Authorization: Bearer <token>` header and 403 with a wrong one (Ray's JobSubmissionClient
sends it from the same environment).

- In a cluster KubeRay does it all: the RayJob's `authOptions: {mode: token}` makes it create a
  Secret with a random token and set both variables on every Ray container and the submitter;
  the trainer, the RayJob's driver in the head container, inherits them.
- `kuberl run` with no --address starts its own Ray: `enable_for_local_ray` sets both in its
  environment before Ray is imported, with a new random token per run unless the caller gave
  one (so a person can reach that Ray with the same RAY_AUTH_TOKEN). Only in the process's
  environment (the local Ray's processes inherit it), never on a command line or on disk:
  with a token in the environment Ray never writes ~/.ray/auth_token.
- `kuberl run --address` joins a Ray that was started elsewhere: its environment must carry
  that Ray's token (RAY_AUTH_MODE=token with RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH);
  `JoinRefused` says so when the join fails without one.

No Ray import here: this module must run before Ray is imported.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import MutableMapping

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
TOKEN_MODE = "token"


def enable_for_local_ray(environ: MutableMapping[str, str] | None = None) -> None:
    """Token authentication for a Ray this process will start: RAY_AUTH_MODE=token, and a new
    random RAY_AUTH_TOKEN unless one is set (or RAY_AUTH_TOKEN_PATH names the caller's)."""
    env = os.environ if environ is None else environ
    env[MODE_ENV] = TOKEN_MODE
    if not env.get(TOKEN_ENV) and not env.get(TOKEN_PATH_ENV):
        env[TOKEN_ENV] = secrets.token_urlsafe(32)


def has_token(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether this process would send a token: the mode on and a token to send."""
    env = os.environ if environ is None else environ
    return env.get(MODE_ENV) == TOKEN_MODE and bool(
        env.get(TOKEN_ENV) or env.get(TOKEN_PATH_ENV)
        or os.path.exists(os.path.expanduser("~/.ray/auth_token")))


class JoinRefused(ConnectionError):
    """`kuberl run --address` could not join the Ray there."""

    def __init__(self, address: str, cause: BaseException) -> None:
        self.address = address
        detail = f"{type(cause).__name__}: {cause}".rstrip(": ")
        if has_token():
            hint = ("this process sends a token (RAY_AUTH_MODE=token): check that it is that "
                    "Ray's token and that the address is right")
        else:
            hint = ("kuberl's Rays run with token authentication, and this process has no "
                    f"token: set {MODE_ENV}=token and {TOKEN_ENV}=<that Ray's token> (or "
                    f"{TOKEN_PATH_ENV}=<a file holding it>) in kuberl run's environment; in a "
                    "cluster the token is the `auth_token` key of the Secret KubeRay names "
                    "after the RayCluster")
        super().__init__(f"could not join the Ray at {address} ({detail}): {hint}")
