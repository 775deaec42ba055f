"""A faithful stand-in for SlurmClient in the OOM tests: one job's state, changed the way 22.05 does.

Behaviour copied from measurements on the local cluster (see epilog/slurmctld_epilog.py): during
EpilogSlurmctld the job is COMPLETING; requeuehold bumps Restarts at once; ``release`` resets nice; GRES
changes are refused across names (shard -> gpu). Calls are recorded, optionally also in a file shared by
processes, so tests can count requeues across concurrent epilog runs.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

from gpushare.slurm.client import SlurmError
from gpushare.slurm.jobs import Job, job_from_json

SHOW_JOB = {  # `scontrol show job -o --details` of a shard job inside EpilogSlurmctld, captured here
    "JobId": "1", "JobName": "sbatch", "UserId": "root(0)", "GroupId": "root(0)", "Priority": "4294901759",
    "Nice": "0", "JobState": "COMPLETING", "Reason": "NonZeroExitCode", "Requeue": "1", "Restarts": "0",
    "ExitCode": "1:0", "NodeList": "n1", "BatchHost": "n1", "NumNodes": "1", "JOB_GRES": "shard:4",
    "WorkDir": "/work/main", "StdErr": "/tmp/err-1.txt", "StdIn": "/dev/null", "StdOut": "/tmp/out-1.txt",
    "TresPerNode": "gres:shard:4",
}


class FakeSlurm:
    def __init__(self, fields: dict[str, str] | None = None, calls_file: str | None = None,
                 fail: dict[str, int] | None = None) -> None:
        self.fields = dict(SHOW_JOB, **(fields or {}))
        self.calls: list[tuple[Any, ...]] = []
        self.calls_file = calls_file
        self.fail = dict(fail or {})  # method name -> how many times it raises before working
        self.sinfo = "gpu:a100:1(S:0),gpu:1g.10gb:2,gpu:2g.20gb:1,gpu:3g.40gb:1"
        self.script = "#!/bin/bash\npython train.py --batch-size 64\n"

    def _record(self, *call: Any) -> None:
        self.calls.append(call)
        if self.calls_file:
            fd = os.open(self.calls_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.write(fd, (" ".join(map(str, call)) + "\n").encode())
            finally:
                os.close(fd)
        if self.fail.get(call[0], 0) > 0:
            self.fail[call[0]] -= 1
            raise SlurmError(f"scontrol {call[0]}: simulated failure")

    def show_job_text(self, job_id: str) -> dict[str, str]:
        return dict(self.fields)

    def job_json(self) -> dict[str, Any]:
        """The job as 22.05's ``squeue --json`` prints it (data_parser v0.0.38)."""
        f = self.fields
        status, signal = (int(x) for x in f.get("ExitCode", "0:0").split(":"))

        def owner(text: str) -> int:
            return int(text.rpartition("(")[2].rstrip(")"))
        return {"job_id": int(f["JobId"]), "name": f["JobName"], "user_id": owner(f["UserId"]),
                "group_id": owner(f["GroupId"]), "priority": int(f["Priority"]), "nice": int(f["Nice"]),
                "job_state": f["JobState"], "state_reason": f["Reason"], "requeue": f["Requeue"] == "1",
                "restart_cnt": int(f["Restarts"]), "exit_code": status << 8 | signal, "nodes": f["NodeList"],
                "batch_host": f["BatchHost"], "current_working_directory": f["WorkDir"],
                "standard_error": f["StdErr"], "standard_output": f["StdOut"], "standard_input": f["StdIn"],
                "tres_per_node": f["TresPerNode"], "admin_comment": f.get("AdminComment", ""),
                "array_job_id": 0, "array_task_id": None}

    def job(self, job_id: str) -> Job | None:
        if self.fail.get("job", 0) > 0:
            self.fail["job"] -= 1
            raise SlurmError("squeue: simulated failure")
        return job_from_json(self.job_json())

    def require_job(self, job_id: str) -> Job:
        found = self.job(job_id)
        assert found is not None
        return found

    def requeue_hold(self, job_id: str) -> None:
        self._record("requeuehold", job_id)
        if self.fields["JobState"] not in ("COMPLETING", "FAILED", "COMPLETED"):
            raise SlurmError("Job is pending execution")
        self.fields["Restarts"] = str(int(self.fields["Restarts"]) + 1)
        self.fields["Reason"] = "job_requeued_in_held_state"
        self.fields["Priority"] = "0"

    def update_job(self, job_id: str, **fields: Any) -> None:
        self._record("update", job_id, *sorted(f"{k}={v}" for k, v in fields.items()))
        if "gres" in fields:
            old, new = self.fields["TresPerNode"], str(fields["gres"])
            if old.split(":")[1] != new.removeprefix("gres:").split(":")[0]:
                raise SlurmError("Invalid generic resource (gres) specification")
            self.fields["TresPerNode"] = new if new.startswith("gres:") else f"gres:{new}"
        if "nice" in fields:
            self.fields["Nice"] = str(fields["nice"])
        if "admincomment" in fields:
            self.fields["AdminComment"] = str(fields["admincomment"])
        if "starttime" in fields:
            self.fields["Reason"] = "None"

    def release(self, job_id: str) -> None:
        self._record("release", job_id)
        self.fields["Nice"] = "0"
        self.fields["Priority"] = "4294901758"

    def run(self, tool: str, *args: str, **_: Any) -> str:
        self._record(tool, *args)
        if args[:2] == ("write", "batch_script"):
            return self.script
        return self.sinfo

    def complete(self) -> None:
        """What slurmctld does when the epilog ends: the requeued job becomes PENDING."""
        if self.fields["Reason"] == "job_requeued_in_held_state" or int(self.fields["Restarts"]) > 0:
            self.fields["JobState"] = "PENDING"
