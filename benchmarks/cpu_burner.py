"""Hold every core busy for a bounded time: the load under which the Slurm test tiers must still pass
(docs/testing.md, "Under load").

    python benchmarks/cpu_burner.py --seconds 900 -- env GPUSHARE_TEST_SLURM=22.05 .venv/bin/python -m pytest -q -m slurm

starts one busy Python loop per core (``--procs`` to change it; ``--procs 8`` on two cores is the load 8-10
of several builds sharing a machine), runs the command, stops the loops when it ends and exits with its
status. Without a command it burns for ``--seconds`` and stops. Each loop also stops by itself at the
deadline or when the burner is gone (killed), so no loop outlives it. The load average at the start and end
is printed to stderr.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def _burn(deadline: float, parent: int) -> None:
    """A busy loop until ``deadline`` or until ``parent`` is gone (this process re-parented)."""
    n = 0
    while True:
        n += 1
        if n % 100_000 == 0 and (time.monotonic() >= deadline or os.getppid() != parent):
            os._exit(0)


def start(procs: int, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    parent = os.getpid()
    pids = []
    for _ in range(procs):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            _burn(deadline, parent)
        pids.append(pid)
    return pids


def stop(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 1, help="busy loops (default: one per core)")
    parser.add_argument("--seconds", type=float, default=600.0, help="the longest the loops run (default 600)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...: run it under the load")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.procs < 1 or args.seconds <= 0:
        parser.error("--procs and --seconds must be positive")
    pids = start(args.procs, args.seconds)
    print(f"cpu_burner: {args.procs} busy loops for at most {args.seconds:.0f} s; {load()}", file=sys.stderr, flush=True)
    began = time.monotonic()
    try:
        if command:
            rc = subprocess.call(command)
        else:
            time.sleep(args.seconds)
            rc = 0
    except KeyboardInterrupt:
        rc = 130
    finally:
        print(f"cpu_burner: stopping after {time.monotonic() - began:.0f} s; {load()}", file=sys.stderr, flush=True)
        stop(pids)
    return rc


if __name__ == "__main__":
    sys.exit(main())
