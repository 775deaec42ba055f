"""Slurm's ``MailProg`` wrapper: the end-of-job mail gains the job's ``gpushare jobstats`` summary and advice.

Use: a two-line script as slurm.conf's ``MailProg`` (slurmctld gives it no arguments of ours)::

    #!/bin/sh
    exec /usr/bin/python3 -m gpushare.epilog.mailprog --mail /usr/bin/mail "$@"

slurmctld runs it as SlurmUser on the controller with ``-s SUBJECT RECIPIENT`` (the subject reads
``Slurm Job_id=N Name=... Ended, ...``). For a job that ended or failed it waits until the node Epilog has
stored the run in the accounting database (slurmctld sends the mail as the job ends, before the Epilogs:
gpushare.epilog.stored_record), at most ``--wait-s``, then runs the real mail program with the same
arguments and the summary appended to the body. It reads only Slurm, like ``gpushare jobstats``. Fails open:
whatever goes wrong on our side, the mail Slurm meant to send is still sent, unchanged.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

_JOB = re.compile(r"\bJob_id=(\d{1,10})\b")
_ENDED = re.compile(r"\b(Ended|Failed|Preempted|Timeout|Out of memory)\b")  # Slurm's words for a job's end


def summary(job: str, wait_s: float, poll_s: float = 0.5) -> str:
    """``gpushare jobstats`` text for ``job`` once its run is stored (or after ``wait_s``: what there is)."""
    from gpushare.epilog.jobstats_cli import _client, from_sacct, render, summarise
    from gpushare.slurm import record as record_format

    client = _client(None)
    deadline = time.monotonic() + wait_s
    runs = None
    while True:
        runs = from_sacct(client, job)
        if not runs:
            return ""
        run = (record_format.stored(runs[-1].get("AdminComment"), runs[-1].get("SystemComment")) or {}).get("run")
        if (isinstance(run, dict) and "exit" in run) or time.monotonic() >= deadline:
            return render(summarise(runs))
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpushare.epilog.mailprog", description=__doc__.splitlines()[0])
    parser.add_argument("--mail", required=True, help="the real mail program (e.g. /usr/bin/mail)")
    parser.add_argument("--wait-s", type=float, default=30.0, help="longest wait for the Epilog's stored record")
    args, mail_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    body = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    try:
        subject = mail_args[mail_args.index("-s") + 1] if "-s" in mail_args[:-1] else ""
        job = _JOB.search(subject)
        if job and _ENDED.search(subject) and "Array" not in subject:
            text = summary(job.group(1), args.wait_s)
            if text:
                body = f"{body.rstrip()}\n\n{text}\n" if body.strip() else f"{text}\n"
    except Exception as exc:  # noqa: BLE001 - fail open: Slurm's own mail goes out regardless
        print(f"gpushare mailprog: summary left out: {str(exc)[-200:]}", file=sys.stderr)
    return subprocess.run([args.mail, *mail_args], input=body, text=True).returncode


if __name__ == "__main__":
    sys.exit(main())
