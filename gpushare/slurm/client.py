"""A small client for Slurm's command-line tools.

Why the CLIs: Debian's Slurm 22.05 has no usable Python binding (pyslurm 25.11 refuses 22.05, see
SLURM-FACTS.md) and ``scontrol`` has no ``--json`` there, so we parse ``scontrol show job -o`` and use
``squeue --json`` (filtered client-side: 22.05 ignores ``-j`` with ``--json``). Every call passes an
argument vector, never a shell string, because job ids and names come from users and these calls run as
root in epilogs.

Hooks run by slurmctld get no PATH and no SLURM_CONF, so the binaries are looked up in a configured
directory first, then in the usual places.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

_BIN_DIRS = ("/usr/bin", "/usr/local/bin", "/opt/slurm/bin", "/usr/sbin")
_JOB_ID_RE = re.compile(r"^\d{1,10}(_\d{1,10})?$")
# "Key=Value" pairs of `scontrol show job -o`; values may contain spaces only in a few keys that come
# last on the line or hold no '=' (Command, WorkDir with spaces are rare; we split on ' Key=').
_PAIR_RE = re.compile(r"(?:^|\s)([A-Z][A-Za-z0-9_:/]*)=")


class SlurmError(RuntimeError):
    """A Slurm command failed; the message carries the command and its stderr."""


def check_job_id(job_id: str | int) -> str:
    """Refuse anything that is not a plain (array) job id, since ids reach argv of root-run tools."""
    text = str(job_id).strip()
    if not _JOB_ID_RE.match(text):
        raise ValueError(f"not a Slurm job id: {text[:40]!r}")
    return text


def parse_scontrol_record(line: str) -> dict[str, str]:
    """Parse one ``scontrol show ... -o`` line into a dict (keys as Slurm prints them).

    The first occurrence of a key wins, so user text in a later field (``Comment=x AdminComment=y``)
    cannot override a real one printed earlier. Free text can still imitate a key that Slurm prints
    *after* it (StdErr, StdOut, TresPerNode follow Comment): anything security-relevant must come from
    :meth:`SlurmClient.job_json`, which is structured.
    """
    line = line.strip()
    matches = list(_PAIR_RE.finditer(line))
    fields: dict[str, str] = {}
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(line)
        fields.setdefault(match.group(1), line[match.end():end].strip())
    return fields


class SlurmClient:
    """Run scontrol/squeue/sbatch against one cluster (``conf_path`` → SLURM_CONF)."""

    def __init__(self, conf_path: str | os.PathLike[str] | None = None, bin_dir: str | None = None,
                 timeout_s: float = 30.0) -> None:
        self.conf_path = str(conf_path) if conf_path else os.environ.get("SLURM_CONF")
        self.bin_dir = bin_dir
        self.timeout_s = timeout_s

    def _binary(self, name: str) -> str:
        candidates = [self.bin_dir] if self.bin_dir else []
        for directory in [*candidates, *_BIN_DIRS]:
            path = Path(directory) / name
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
        found = shutil.which(name)
        if found:
            return found
        raise SlurmError(f"{name}: not found (install slurm-client or set the Slurm bin directory)")

    def run(self, tool: str, *args: str, input_text: str | None = None, check: bool = True) -> str:
        env = dict(os.environ)
        if self.conf_path:
            env["SLURM_CONF"] = self.conf_path
        argv = [self._binary(tool), *args]
        try:
            proc = subprocess.run(argv, input=input_text, capture_output=True, text=True, env=env,
                                  timeout=self.timeout_s, errors="replace")
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(f"{' '.join(argv)}: no answer in {self.timeout_s:.0f} s") from exc
        if check and proc.returncode != 0:
            raise SlurmError(f"{' '.join(argv)}: {proc.stderr.strip() or f'exit {proc.returncode}'}")
        return proc.stdout

    # --- jobs -------------------------------------------------------------------------------------
    def show_job(self, job_id: str | int) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", "--details", check_job_id(job_id))
        lines = [line for line in out.splitlines() if line.strip()]
        if not lines:
            raise SlurmError(f"scontrol show job {job_id}: no such job")
        return parse_scontrol_record(lines[0])

    def job_json(self, job_id: str | int) -> dict[str, Any] | None:
        """One job as squeue's JSON object (structured: safe against hostile comments and names).

        None once the job has left slurmctld's memory (MinJobAge after it ended).
        """
        wanted = check_job_id(job_id)
        base, _, task = wanted.partition("_")
        for job in self.squeue_json():
            if str(job.get("job_id")) == wanted:
                return job
            if task and str(job.get("array_job_id")) == base and str(job.get("array_task_id")) == task:
                return job
        return None

    def update_job(self, job_id: str | int, **fields: str | int) -> None:
        """``scontrol update jobid=N key=value...``; keys are scontrol's (e.g. admincomment, gres)."""
        args = [f"jobid={check_job_id(job_id)}"]
        for key, value in fields.items():
            if not re.match(r"^[A-Za-z]+$", key):
                raise ValueError(f"not an scontrol field: {key!r}")
            text = str(value)
            if "\n" in text or "\0" in text:
                raise ValueError(f"{key}: value has a newline or NUL")
            args.append(f"{key}={text}")
        self.run("scontrol", "update", *args)

    def requeue_hold(self, job_id: str | int) -> None:
        self.run("scontrol", "requeuehold", check_job_id(job_id))

    def release(self, job_id: str | int) -> None:
        self.run("scontrol", "release", check_job_id(job_id))

    def hold(self, job_id: str | int) -> None:
        self.run("scontrol", "hold", check_job_id(job_id))

    def squeue_json(self) -> list[dict[str, Any]]:
        """All jobs as squeue's JSON objects (22.05 ignores filters with --json: filter yourself)."""
        out = self.run("squeue", "--json")
        return list(json.loads(out).get("jobs", []))

    def sbatch(self, *args: str, script: str | None = None) -> tuple[int, str]:
        """Submit; returns (job id, sbatch's stderr lines such as our hook's one-line message)."""
        env = dict(os.environ)
        if self.conf_path:
            env["SLURM_CONF"] = self.conf_path
        proc = subprocess.run([self._binary("sbatch"), "--parsable", *args], input=script,
                              capture_output=True, text=True, env=env, timeout=self.timeout_s)
        if proc.returncode != 0:
            raise SlurmError(f"sbatch {' '.join(args)}: {proc.stderr.strip()}")
        job_id = int(proc.stdout.strip().split(";")[0])
        return job_id, proc.stderr

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T")
        states = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states
