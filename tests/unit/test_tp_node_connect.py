"""A remote node's TP rank reaching node 0 (SGLang's --nnodes, as the reference engine does
it): it retries while node 0 is not listening yet (the nodes start in any order) and
announces itself; if node 0 never listens it gives up naming the address it tried."""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Listener

import pytest

from kuberl_rollout.reference.tp import Nodes, connect_to_node0
from kuberl_trainer.ray_actors import free_port

SECRET = b"shared-key"


def test_a_rank_started_before_node_0_waits_for_it_and_announces_itself() -> None:
    port = free_port()
    nodes = Nodes(count=2, rank=1, dist_init_addr=f"127.0.0.1:{port}", secret=SECRET)
    heard: list[object] = []

    def node0() -> None:
        time.sleep(0.6)  # node 0 is still loading: the rank's first attempts are refused
        with Listener(("127.0.0.1", port), authkey=SECRET) as listener, \
                listener.accept() as conn:
            heard.append(conn.recv())

    started = time.monotonic()
    thread = threading.Thread(target=node0)
    thread.start()
    conn = connect_to_node0(nodes, tp_rank=3, timeout_s=30)
    thread.join(timeout=30)
    conn.close()
    assert time.monotonic() - started >= 0.6
    assert heard == [("hello", 3)]


def test_a_rank_gives_up_on_a_node_0_that_never_listens() -> None:
    port = free_port()
    nodes = Nodes(count=2, rank=1, dist_init_addr=f"127.0.0.1:{port}", secret=SECRET)
    with pytest.raises(RuntimeError, match=f"tensor parallel rank 2 could not reach node 0 at "
                                           f"127.0.0.1:{port} within 0s"):
        connect_to_node0(nodes, tp_rank=2, timeout_s=0.4)
