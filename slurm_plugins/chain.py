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

A slot may name several site programs, and they run as Slurm itself would run them (``--slot`` says which
slot; docs/deployment.md, Hook slots the site already uses). Prolog and Epilog: each ``--site`` is a glob
pattern (a plain path is a pattern matching itself); slurmd runs the files each pattern matches in reverse
byte order (z before a), the patterns in the order slurm.conf gives them (Slurm 24.05+ takes several lines),
and stops at the first that fails, whose status is the slot's; a pattern that matches nothing fails the slot
before any file runs. The other slots take plain paths: each runs, and the slot's status is the first
non-zero one.
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import subprocess
import sys

#: exit status of a site program that cannot be started, as a shell reports it
NOT_RUNNABLE = 127
#: ... and of one that exists but may not be executed
NOT_EXECUTABLE = 126
#: slurm.conf slots whose value is a glob pattern, run by slurmd (slurm.conf(5), Prolog and Epilog)
GLOB_SLOTS = ("Prolog", "Epilog")


def site_programs(slot: str, entries: list[str]) -> tuple[list[str], str]:
    """The programs Slurm runs for ``entries`` of ``slot``, in its order; (programs, why none) where an
    entry of a glob slot matches no file (slurmd then fails the slot without running any of them)."""
    entries = [e for e in entries if e]
    if slot not in GLOB_SLOTS:
        return entries, ""
    programs: list[str] = []
    for pattern in entries:
        matches = sorted(glob.glob(pattern), reverse=True)  # slurmd pushes glob(3)'s sorted list onto a stack
        if not matches:
            return [], f"{pattern} matches no file (slurmd fails the {slot} there too)"
        programs.extend(matches)
    return programs, ""


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


def _run_site(program: str, args: list[str], data: bytes | None) -> int:
    try:
        status = _run([program, *args], data, None)
    except OSError as exc:
        print(f"gpushare-chain: the site's program {program} could not start: {exc}", file=sys.stderr)
        return NOT_EXECUTABLE if isinstance(exc, PermissionError) else NOT_RUNNABLE
    return 128 - status if status < 0 else status  # killed by a signal: report it as a shell would


def run_site(slot: str, entries: list[str], args: list[str], data: bytes | None) -> int:
    """The site's programs of ``slot`` as Slurm runs them (module docstring); the slot's status."""
    programs, why = site_programs(slot, entries)
    if why:
        print(f"gpushare-chain: {why}", file=sys.stderr)
        return 1
    status = 0
    for program in programs:
        code = _run_site(program, args, data)
        if code and slot in GLOB_SLOTS:
            return code
        status = status or code
    return status


def run_chain(site: str | list[str], ours: str, args: list[str], ours_timeout: float | None,
              slot: str = "") -> int:
    """The site's programs, then ours; the site's exit status. Never raises for ours."""
    data = _stdin_bytes()
    sys.stdout.flush()
    status = run_site(slot, [site] if isinstance(site, str) else site, args, data)
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
    parser.add_argument("--site", required=True, action="append",
                        help="the site's program for this slot, repeated for each it names ('' for none); a glob "
                             "pattern in Prolog and Epilog")
    parser.add_argument("--slot", default="", help="the slurm.conf key this chain stands in (how the site's "
                                                   "programs run)")
    parser.add_argument("--ours", required=True, help="gpushare's program for this slot")
    parser.add_argument("--ours-timeout", type=float, default=300.0, help="seconds before ours is killed")
    parser.add_argument("args", nargs="*", help="the hook's own arguments (after --)")
    options = parser.parse_args(argv)
    return run_chain(options.site, options.ours, options.args, options.ours_timeout or None, options.slot)


if __name__ == "__main__":
    sys.exit(main())
