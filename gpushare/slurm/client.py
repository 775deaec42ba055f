"""The one client for Slurm's command-line tools, on every supported release (22.05, 24.11, 26.05).

Why the CLIs: Debian's Slurm has no usable Python binding (pyslurm builds only against the one release it
is made for) and the CLIs are on every node. Every call passes an argument vector, never a shell string,
because job ids and names come from users and these calls run as root in epilogs.

Why version-aware: the tools' JSON changed between releases (gpushare.slurm.jobs normalises it) and
newer releases can filter and read single jobs structurally. :attr:`SlurmClient.version` is detected once
from ``sinfo --version``; :meth:`job` and :meth:`jobs` hand out typed :class:`~gpushare.slurm.jobs.Job`
records, so no caller looks at raw squeue/scontrol shapes. docs/compatibility.md has the table.

Hooks run by slurmctld get no PATH and no SLURM_CONF, so the binaries are looked up in a configured
directory first, then in the usual places.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from gpushare.errors import GpushareError
from gpushare.slurm.jobs import Job, check_job_id, job_from_json, parse_scontrol_record
from gpushare.slurm.version import SlurmVersion

if TYPE_CHECKING:
    from gpushare.config import Config

__all__ = ["JobGone", "SlurmClient", "SlurmError", "check_job_id", "parse_scontrol_record"]

_BIN_DIRS = ("/usr/bin", "/usr/local/bin", "/opt/slurm/bin", "/usr/sbin")
_VERSIONS: dict[tuple[str, str | None], SlurmVersion] = {}
_VERSIONS_LOCK = threading.Lock()


class SlurmError(GpushareError, RuntimeError):
    """A Slurm command failed; the message carries the command and its stderr.

    ``reason`` is the same without the command's arguments (``scontrol update: <Slurm's words>``), for a log
    line: the arguments may hold a whole AdminComment record, whose tail is no explanation."""

    def __init__(self, message: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class JobGone(SlurmError):
    """Slurm no longer knows the job (purged after MinJobAge, or never existed)."""


class SlurmClient:
    """Run scontrol/squeue/sbatch against one cluster (``conf_path`` → SLURM_CONF)."""

    def __init__(self, conf_path: str | os.PathLike[str] | None = None, bin_dir: str | None = None,
                 timeout_s: float = 30.0) -> None:
        self.conf_path = str(conf_path) if conf_path else os.environ.get("SLURM_CONF")
        self.bin_dir = bin_dir
        self.timeout_s = timeout_s

    @classmethod
    def from_config(cls, cfg: "Config", timeout_s: float = 30.0) -> "SlurmClient":
        """The client every gpushare component uses: the ``[slurm]`` section's paths."""
        return cls(cfg.slurm_conf_path(), cfg.slurm.bin_dir or None, timeout_s)

    @property
    def version(self) -> SlurmVersion:
        """The release of the tools this client runs (``sinfo --version``), detected once per process."""
        key = (self._binary("sinfo"), self.conf_path)
        with _VERSIONS_LOCK:
            found = _VERSIONS.get(key)
        if found is None:
            found = SlurmVersion.parse(self.run("sinfo", "--version"))
            with _VERSIONS_LOCK:
                _VERSIONS[key] = found
        return found

    def _binary(self, name: str) -> str:
        """The configured directory first, then PATH (the admin's or the caller's Slurm), then the usual
        places: hooks run by slurmctld get no PATH at all."""
        candidates = [self.bin_dir] if self.bin_dir else []
        for directory in candidates:
            path = Path(directory) / name
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
        found = shutil.which(name)
        if found:
            return found
        for directory in _BIN_DIRS:
            path = Path(directory) / name
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
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
            why = f"no answer in {self.timeout_s:.0f} s"
            raise SlurmError(f"{' '.join(argv)}: {why}", f"{' '.join([tool, *args[:1]])}: {why}") from exc
        if check and proc.returncode != 0:
            why = proc.stderr.strip() or f"exit {proc.returncode}"
            raise SlurmError(f"{' '.join(argv)}: {why}", f"{' '.join([tool, *args[:1]])}: {why}")
        return proc.stdout

    # --- jobs -------------------------------------------------------------------------------------
    def job(self, job_id: str | int) -> Job | None:
        """One job (``123`` or an array task ``100_4``), structured; None once it has left slurmctld.

        23.02+: ``scontrol --json show job N``, which reads one job. 22.05 has no such read and its
        ``squeue --json`` ignores filters: the whole queue is read and filtered here.
        """
        wanted = check_job_id(job_id)
        if self.version.scontrol_json:
            try:
                out = self.run("scontrol", "--json", "show", "job", wanted)
            except SlurmError as exc:
                if "Invalid job id" in str(exc):
                    return None
                raise
            candidates = self._parse_jobs(out)
        else:
            candidates = self.jobs()
        for job in candidates:
            if wanted in (job.job_id, job.array_name):
                return job
        return None

    def jobs(self) -> list[Job]:
        """Every job slurmctld still holds, finished ones included (23.02+ needs ``-t all`` for those)."""
        args = ["--json", "-t", "all"] if self.version.squeue_json_filters else ["--json"]
        return self._parse_jobs(self.run("squeue", *args))

    @staticmethod
    def _parse_jobs(out: str) -> list[Job]:
        try:
            data = json.loads(out)
        except json.JSONDecodeError as exc:
            raise SlurmError(f"Slurm printed JSON we cannot read: {exc}") from exc
        errors = data.get("errors") if isinstance(data, dict) else None
        if errors:
            first = errors[0] if isinstance(errors[0], dict) else {"description": str(errors[0])}
            raise SlurmError(f"Slurm reported: {str(first.get('description') or first.get('error') or first)[:200]}")
        items = data.get("jobs") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise SlurmError("Slurm's JSON has no 'jobs' list")
        return [job_from_json(item) for item in items if isinstance(item, dict)]

    def show_job_text(self, job_id: str | int) -> dict[str, str]:
        """``scontrol show job -o`` as a dict. Free text there can imitate later fields (26.05 prints the
        user's SubmitLine early): only for display and for facts no JSON gives, never for decisions."""
        out = self.run("scontrol", "show", "job", "-o", "--details", check_job_id(job_id))
        lines = [line for line in out.splitlines() if line.strip()]
        if not lines:
            raise SlurmError(f"scontrol show job {job_id}: no such job")
        return parse_scontrol_record(lines[0])

    def require_job(self, job_id: str | int) -> Job:
        """:meth:`job` for code that acts on the job: a job Slurm no longer knows raises :class:`JobGone`."""
        job = self.job(job_id)
        if job is None:
            raise JobGone(f"job {job_id}: Slurm no longer knows it (Invalid job id)")
        return job

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

    def nodes(self) -> list[dict[str, str]]:
        """Every node as ``scontrol -o show node`` prints it (NodeName, NodeAddr, NodeHostName, Gres, State…)."""
        out = self.run("scontrol", "-o", "show", "node")
        return [fields for fields in (parse_scontrol_record(line) for line in out.splitlines() if line.strip())
                if fields.get("NodeName")]

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T")
        states = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states
