"""A test's fault switch (kuberl never uses it; SGLang has none): an engine that dies in the
middle of a weight update's broadcast and leaves its peers nothing to notice.

SIGUSR1 (`SIGNAL`) arms the engine; the next /update_weights_from_distributed to arrive makes
it `vanish` before its ranks join that bucket's broadcast, while the trainer's broadcast and
the other engines' receives are in flight. The engine's server process exits (SIGKILL, as an
OOM kill: the fleet sees it dead), but its weight-sync connections stay open and silent for
`hold_s` (the group's timeout), held by a forked child that does nothing else: what the peers
of an engine on a node that vanished see, or NCCL's peers over NVLink when one dies. Its HTTP
connections are closed, as a dead process's are (the trainer's bucket request fails at once).
On one machine gloo would otherwise notice the dead process's closed sockets and fail some of
the others' collectives early, depending on timing: the survivors' fate would be chance.
Tests and bench/engine_death.py kill an engine mid-broadcast this way; the child still holding
the connections shows in `pgrep -f "kuberl_rollout.reference .*--port P"` until it exits.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import time
from typing import NoReturn

LOG = logging.getLogger("kuberl.reference")
SIGNAL = signal.SIGUSR1


def vanish(http_port: int, hold_s: float) -> NoReturn:
    """Exit now (SIGKILL), the HTTP connections on `http_port` closed and every other
    connection left open and silent for `hold_s` seconds."""
    LOG.warning("fault switch: dying mid-broadcast; the weight-sync connections stay open "
                "%.0f s", hold_s)
    logging.shutdown()
    ready_r, ready_w = os.pipe()
    if os.fork() == 0:  # the child: only this thread, and the process's descriptors
        for fd in _sockets_on_port(http_port):
            os.close(fd)
        os.write(ready_w, b"x")
        time.sleep(hold_s)
        os._exit(0)
    os.read(ready_r, 1)  # (the child has closed its copies of the HTTP connections)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


def _sockets_on_port(port: int) -> list[int]:
    """This process's TCP sockets bound to local `port` (the server's listening socket and
    the connections it accepted)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            local = sock.getsockname()
        except OSError:
            local = None
        finally:
            sock.detach()  # (the descriptor stays open: only a view of it was made)
        if isinstance(local, tuple) and local[1] == port:
            found.append(fd)
    return found
