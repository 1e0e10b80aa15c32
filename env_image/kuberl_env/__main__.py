"""`python -m kuberl_env module:Class [--port N]`: serve an environment class over HTTP.

The class is imported once, at start (the current directory and PYTHONPATH are searched); a
class that cannot be imported, or whose reset, step or close is not `async def`, stops the
server at once with exit code 2 and the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from kuberl_env import protocol

EXIT_BAD_CLASS = 2


class BadClass(Exception):
    pass


def load_class(path: str) -> Any:
    """The class `path` ("module:Class") names, checked for the protocol's async methods."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise BadClass(f"{path!r} must look like 'module:Class'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing user code: syntax, deps, ...
        raise BadClass(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") \
            from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise BadClass(f"module {module_name!r} has no attribute {attr!r}")
    if not callable(cls):
        raise BadClass(f"{path!r} is not a class (got {type(cls).__name__})")
    for method in ("reset", "step", "close"):
        if not inspect.iscoroutinefunction(getattr(cls, method, None)):
            raise BadClass(f"{path!r} needs `async def {method}`")
    return cls


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kuberl_env", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("environment_class", metavar="module:Class")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=protocol.DEFAULT_PORT,
                        help=f"port to listen on (default {protocol.DEFAULT_PORT}; 0: a free "
                        "one, see --port-file)")
    parser.add_argument("--port-file", type=Path, default=None,
                        help="write the port listened on to this file once it listens")
    parser.add_argument("--episode-timeout", type=float,
                        default=protocol.DEFAULT_EPISODE_TIMEOUT_S,
                        help="close episodes idle for this many seconds")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="exit when the process that started this one is gone (a local "
                        "run's server never outlives its run)")
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace, cls: Any) -> None:
    from aiohttp import web

    from kuberl_env.server import EnvironmentServer

    server = EnvironmentServer(cls, args.environment_class,
                               episode_timeout_s=args.episode_timeout,
                               exit_with_parent=args.exit_with_parent)
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    if args.port_file is not None:  # written whole, then renamed: a reader never sees half
        tmp = args.port_file.with_name(args.port_file.name + ".tmp")
        tmp.write_text(str(port))
        os.replace(tmp, args.port_file)
    logging.getLogger("kuberl.env").info("serving %s on http://%s:%d", args.environment_class,
                                         args.host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()  # closes the open episodes


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        cls = load_class(args.environment_class)
    except BadClass as exc:
        print(f"kuberl_env: cannot serve environment class {args.environment_class!r}: {exc}",
              file=sys.stderr, flush=True)
        return EXIT_BAD_CLASS
    asyncio.run(serve(args, cls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
