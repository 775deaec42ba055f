"""Waiting for and stopping the test clusters' daemons: one way, for every harness in devcluster.

Every wait has a deadline written for a quiet machine and stretched by :func:`time_scale` on a loaded one."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable


#: Set to a number to stretch every test wait by that factor (``make test`` under a known load, a slow CI box).
TIME_SCALE_VAR = "GPUSHARE_TEST_TIME_SCALE"
MAX_TIME_SCALE = 8.0


def time_scale() -> float:
    """How many times longer than on a quiet machine a test wait may take: ``$GPUSHARE_TEST_TIME_SCALE`` when
    set, else the one-minute load average per core, never below 1 nor above MAX_TIME_SCALE. A deadline written
    for a quiet two-core machine then holds at load 10 on the same two cores (factor 5), where daemons,
    Prologs and polls all wait their turn for a CPU; a quiet machine waits exactly as written."""
    value = os.environ.get(TIME_SCALE_VAR, "").strip()
    if value:
        try:
            return max(1.0, float(value))
        except ValueError:
            raise ValueError(f"{TIME_SCALE_VAR}={value!r}: not a number") from None
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 1.0
    return min(MAX_TIME_SCALE, max(1.0, per_core))


def scaled(timeout_s: float) -> float:
    """``timeout_s`` stretched by :func:`time_scale`: what a test's deadline means on this machine now."""
    return timeout_s * time_scale()


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout_s`` (scaled to the machine's load, :func:`scaled`)
    passed (False)."""
    deadline = time.monotonic() + scaled(timeout_s)
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


def release(held: list[subprocess.Popen[bytes]]) -> None:
    """Reap the daemons a harness held (stopped by now) and let go of them. Until this, a dead daemon is a zombie
    whose pid no new process can take: with several test sessions on one machine (about 80 new pids a second)
    a recycled pid would turn a late killpg of one cluster into a SIGKILL of another's daemon."""
    for proc in held:
        try:
            proc.poll()
        except OSError:
            pass
    held.clear()


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
