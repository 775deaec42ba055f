"""Run a site's hook program and gpushare's in one Slurm hook slot (TaskProlog, TaskEpilog, PrologSlurmctld,
EpilogSlurmctld, MailProg).

Why: each of those slurm.conf keys takes one program. A site that already runs its own (a TaskProlog setting
its environment, jobstats' EpilogSlurmctld and MailProg) would otherwise lose it or ours. ``gpushare
slurm-config --install-chains DIR`` writes one small wrapper per slot that execs this with both programs.

Semantics, in order: the site's program runs first with the hook's arguments, environment, stdin and
stdout/stderr (a TaskProlog's ``export`` lines reach slurmd unchanged); then ours runs with the same
arguments and the same stdin bytes. The exit status is the site's, always: ours failing (non-zero, missing,
killed, past ``--ours-timeout``) is one line on standard error and never changes what Slurm sees. No site
program (``--site ''``) is the same as a site program that succeeds silently.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

#: exit status of a site program that cannot be started, as a shell reports it
NOT_RUNNABLE = 127


def _stdin_bytes() -> bytes | None:
    """The hook's standard input, read once so both programs see it (MailProg may get a body); None when
    stdin is a terminal or closed."""
    try:
        if os.isatty(0):
            return None
        return sys.stdin.buffer.read()
    except (OSError, ValueError):
        return None


def _run(argv: list[str], data: bytes | None, timeout: float | None) -> int:
    """Run one program to its end. With a timeout it gets a process group of its own, killed whole when
    the time is up: a child left behind would hold the hook's stdout open and slurmd would wait on it."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
                            start_new_session=timeout is not None)
    try:
        proc.communicate(data, timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.wait()
        raise
    return proc.returncode


def run_chain(site: str, ours: str, args: list[str], ours_timeout: float | None) -> int:
    """The site's program, then ours; the site's exit status. Never raises for ours."""
    data = _stdin_bytes()
    sys.stdout.flush()
    status = 0
    if site:
        try:
            status = _run([site, *args], data, None)
        except OSError as exc:
            print(f"gpushare-chain: the site's program {site} could not start: {exc}", file=sys.stderr)
            status = NOT_RUNNABLE
        if status < 0:  # killed by a signal: report it as a shell would
            status = 128 - status
    try:
        code = _run([ours, *args], data, ours_timeout)
        if code != 0:
            print(f"gpushare-chain: {ours} exited {code}; the hook's status stays the site's ({status})",
                  file=sys.stderr)
    except subprocess.TimeoutExpired:
        print(f"gpushare-chain: {ours} killed after {ours_timeout:g} s; the hook's status stays the site's "
              f"({status})", file=sys.stderr)
    except OSError as exc:
        print(f"gpushare-chain: {ours} could not start ({exc}); the hook's status stays the site's ({status})",
              file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpushare-chain", description=__doc__.splitlines()[0])
    parser.add_argument("--site", required=True, help="the site's program for this slot ('' for none)")
    parser.add_argument("--ours", required=True, help="gpushare's program for this slot")
    parser.add_argument("--ours-timeout", type=float, default=300.0, help="seconds before ours is killed")
    parser.add_argument("args", nargs="*", help="the hook's own arguments (after --)")
    options = parser.parse_args(argv)
    return run_chain(options.site, options.ours, options.args, options.ours_timeout or None)


if __name__ == "__main__":
    sys.exit(main())
