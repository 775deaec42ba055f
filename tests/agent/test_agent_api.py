"""The agent's Unix-socket API under a burst of clients: a node ending many jobs runs many Epilogs at once,
and each must reach the agent rather than fall back to closing from the store."""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpushare.agent.api_server import ApiServer
from gpushare.node.api import AgentUnavailable, call


def _full_listener(path: Path) -> tuple[socket.socket, list[socket.socket]]:
    """A listening socket whose backlog is full, so the next connect fails with EAGAIN."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    queued: list[socket.socket] = []
    while True:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.setblocking(False)
        try:
            probe.connect(str(path))
        except BlockingIOError:
            probe.close()
            return listener, queued
        queued.append(probe)


def test_a_full_backlog_is_waited_out_not_reported_as_agent_down(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    listener, queued = _full_listener(path)

    def serve_later() -> None:  # the agent catches up after a moment: accept everything, answer the last
        time.sleep(0.3)
        listener.settimeout(5)  # a client that gave up must not hang the test
        try:
            conns = [listener.accept()[0] for _ in range(len(queued) + 1)]
        except TimeoutError:
            return
        conns[-1].recv(1024)
        conns[-1].sendall(b'{"ok":true}\n')
        for conn in conns:
            conn.close()

    server = threading.Thread(target=serve_later)
    server.start()
    try:
        assert call(path, {"op": "ping"}, timeout_s=5.0) == {"ok": True}
    finally:
        server.join()
        for sock in (listener, *queued):
            sock.close()


def test_a_backlog_that_never_drains_fails_within_the_timeout(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    listener, queued = _full_listener(path)
    started = time.monotonic()
    try:
        with pytest.raises(AgentUnavailable):
            call(path, {"op": "ping"}, timeout_s=0.5)
        assert time.monotonic() - started < 3.0
    finally:
        for sock in (listener, *queued):
            sock.close()


def test_two_hundred_clients_at_once_all_get_an_answer(tmp_path: Path) -> None:
    gate = threading.Event()

    def handler(request: dict) -> dict:
        gate.wait(5)  # every connection is held until all have arrived
        return {"ok": True, "job": request["job"]}

    server = ApiServer(tmp_path / "agent.sock", handler, allowed_uids=(os.geteuid(),)).start()
    try:
        with ThreadPoolExecutor(200) as pool:
            futures = [pool.submit(call, server.path, {"op": "close", "job": str(i)}, 10.0) for i in range(200)]
            time.sleep(0.5)
            gate.set()
            replies = [f.result() for f in futures]
    finally:
        server.stop()
    assert sorted(int(r["job"]) for r in replies) == list(range(200))
