"""Waiting for and stopping the test clusters' daemons: one way, for every harness in devcluster."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(pid: int, term_wait_s: float = 10.0) -> None:
    """SIGTERM the process group ``pid`` leads (daemons flush their state), SIGKILL when it outlives
    ``term_wait_s``. Reaps it when it is our child; otherwise waits for it to be gone."""
    for sig, wait_s in ((signal.SIGTERM, term_wait_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return

        def gone() -> bool:
            try:
                return bool(os.waitpid(pid, os.WNOHANG)[0])
            except ChildProcessError:
                return not alive(pid)
        if wait_until(gone, wait_s, 0.05):
            return


def kill_leftovers(find: Callable[[], list[int]], rounds: int = 5) -> None:
    """SIGKILL what ``find`` lists until it lists nothing: a killed job step may still start its epilog."""
    for _ in range(rounds):
        leftovers = find()
        if not leftovers:
            return
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
