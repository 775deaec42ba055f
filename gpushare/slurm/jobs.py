"""A job as the rest of the suite sees it, whatever Slurm release printed it.

Why one typed record: squeue/scontrol JSON changed shape between releases (22.05's data_parser v0.0.38
prints ``"job_state": "FAILED"`` and a raw wait status in ``exit_code``; 24.11's v0.0.42 and 26.05's
v0.0.45 print ``["FAILED", "COMPLETING"]``, ``{"return_code": {"set": true, "number": 3}, ...}`` and wrap
numbers as ``{"set", "infinite", "number"}``). Every caller reading raw dicts re-learnt that, and one
that did not broke OOM recovery on newer Slurm. :func:`job_from_json` is the only place that knows the
shapes; callers get :class:`Job`.

Trust: a :class:`Job` built from JSON is structured (a job name cannot imitate another field). The
``scontrol show job -o`` text parser (:func:`parse_scontrol_record`) stays for the few facts 22.05 has
only there (expanded log paths); 26.05 prints the user's ``SubmitLine=`` before ``WorkDir``,
``AdminComment``, ``StdErr``/``StdOut`` and ``TresPerNode``, so the text is never read on releases with
``scontrol --json``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from gpushare.slurm.gres_request import GresRequest

_JOB_ID_RE = re.compile(r"^[0-9]{1,10}(_[0-9]{1,10})?$", re.ASCII)  # never Unicode digits
# "Key=Value" pairs of `scontrol show job -o`.
_PAIR_RE = re.compile(r"(?:^|\s)([A-Z][A-Za-z0-9_:/]*)=")

# Base states (Slurm's job_state_string); newer releases add flags such as COMPLETING, REQUEUED beside them.
PENDING = "PENDING"
RUNNING_STATES = frozenset({"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "SIGNALING"})
ENDED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                          "BOOT_FAIL", "DEADLINE", "PREEMPTED"})
FLAG_STATES = frozenset({"COMPLETING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
                         "STAGE_OUT", "SIGNALING", "STOPPED", "UPDATE_DB", "REVOKED", "RECONFIG_FAIL",
                         "POWER_UP_NODE", "LAUNCH_FAILED", "EXPEDITING", "RESV_DEL_HOLD", "SPECIAL_EXIT"})


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
    *after* it: anything security-relevant comes from JSON (:func:`job_from_json`).
    """
    line = line.strip()
    matches = list(_PAIR_RE.finditer(line))
    fields: dict[str, str] = {}
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(line)
        fields.setdefault(match.group(1), line[match.end():end].strip())
    return fields


@dataclass(frozen=True)
class Job:
    """The job facts the suite uses. Absent numbers are None (never a guessed 0)."""

    job_id: str  # Slurm's own numeric id ("123"); an array task has one of its own beside 100_4
    states: tuple[str, ...]  # ("FAILED", "COMPLETING"): base state first, then flags
    name: str = ""
    user_id: int | None = None
    user_name: str = ""
    group_id: int | None = None
    reason: str = ""  # state_reason: JobHeldUser, Dependency, Resources, Priority, ...
    exit_status: int | None = None  # the batch script's return code
    exit_signal: int | None = None  # the signal that ended it (0: none)
    priority: int | None = None
    nice: int | None = None
    submit_time: float | None = None  # epoch seconds
    restarts: int = 0
    requeue: bool | None = None  # False for --no-requeue jobs
    admin_comment: str = ""
    comment: str = ""  # the owner's to write (an estimation job's result travels here)
    partition: str = ""
    features: str = ""  # the job's --constraint expression
    nodes: str = ""  # hostlist expression
    batch_host: str = ""
    required_nodes: str = ""  # -w/--nodelist: a hostlist the job must run on ("" none)
    work_dir: str = ""
    std_out: str = ""  # as Slurm stores it: may hold %j patterns and be relative to work_dir
    std_err: str = ""
    tres_per_node: str = ""  # "gres:gpu:1" (22.05) / "gres/gpu:1" (23.02+); "" when none
    tres_per_job: str = ""  # --gpus
    tres_per_task: str = ""  # --gpus-per-task
    tres_per_socket: str = ""  # --gpus-per-socket
    array_job_id: int | None = None  # None when not an array
    array_task_id: int | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def array_name(self) -> str:
        """``100_4`` for an array task, else the job id: the name users and Slurm's tools accept."""
        if self.array_job_id and self.array_task_id is not None:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    @property
    def state(self) -> str:
        """The base state (FAILED for ``["FAILED", "COMPLETING"]``); COMPLETING alone on 22.05."""
        for state in self.states:
            if state not in FLAG_STATES:
                return state
        return self.states[0] if self.states else ""

    def has_state(self, name: str) -> bool:
        return name in self.states

    @property
    def pending(self) -> bool:
        return self.state == PENDING

    @property
    def held(self) -> bool:
        """Held by its user or an admin (priority 0 or a hold reason): not waiting for resources."""
        return self.pending and (self.priority == 0 or self.reason in ("JobHeldUser", "JobHeldAdmin"))

    @property
    def completing(self) -> bool:
        return "COMPLETING" in self.states

    @property
    def active(self) -> bool:
        """Holds (or is about to hold) its node's resources."""
        return any(state in RUNNING_STATES for state in self.states)

    @property
    def gres_per_node(self) -> GresRequest:
        """``tres_per_node`` parsed (gpushare.slurm.gres_request.GresRequest): take it once and pass it on."""
        return GresRequest.parse(self.tres_per_node)

    @property
    def gpu_requests(self) -> tuple[str, ...]:
        """Every field a GPU request can hide in (--gres, --gpus, --gpus-per-task, --gpus-per-socket)."""
        return tuple(text for text in (self.tres_per_node, self.tres_per_job, self.tres_per_task,
                                       self.tres_per_socket) if text)


def number(value: Any) -> int | float | None:
    """A JSON number as any release prints it: plain, or ``{"set": true, "infinite": false, "number": N}``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite"):
            return None
        return number(value.get("number"))
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip(), re.ASCII):
        return int(value)
    return None


def _int(value: Any) -> int | None:
    result = number(value)
    return int(result) if result is not None else None


def _signed32(value: int | None) -> int | None:
    """22.05 prints a negative nice as its unsigned 32-bit pattern (-10000 → 4294957296)."""
    return value - (1 << 32) if value is not None and value >= 1 << 31 else value


def _text(value: Any) -> str:
    if value is None or isinstance(value, (Mapping, list)):
        return ""
    text = str(value)
    return "" if text == "(null)" else text


def states_of(value: Any) -> tuple[str, ...]:
    """``"FAILED"`` (22.05) or ``["FAILED", "COMPLETING"]`` (23.02+) → ("FAILED", "COMPLETING")."""
    if isinstance(value, str):
        return tuple(part for part in value.upper().replace(",", "+").split("+") if part)
    if isinstance(value, list):
        return tuple(str(part).upper() for part in value if isinstance(part, str) and part)
    return ()


def exit_of(value: Any) -> tuple[int | None, int | None]:
    """(return code, signal) from 22.05's raw wait status or the newer ``{return_code, signal}`` object."""
    if isinstance(value, Mapping):
        code = _int(value.get("return_code"))
        signal = value.get("signal")
        sig = _int(signal.get("id")) if isinstance(signal, Mapping) else _int(signal)
        return code, sig if sig is not None else (0 if code is not None else None)
    raw = _int(value)
    if raw is None:
        return None, None
    return (raw >> 8) & 0xFF, raw & 0x7F


def job_from_json(obj: Mapping[str, Any]) -> Job:
    """One element of ``squeue --json``'s / ``scontrol --json show job``'s ``jobs`` list, any release."""
    job_id = _int(obj.get("job_id"))
    array_job = _int(obj.get("array_job_id")) or None  # 22.05 prints 0 for "not an array"
    array_task = _int(obj.get("array_task_id")) if array_job else None
    exit_status, exit_signal = exit_of(obj.get("exit_code"))
    requeue = obj.get("requeue")
    return Job(
        job_id=str(job_id) if job_id is not None else "",
        states=states_of(obj.get("job_state")),
        name=_text(obj.get("name")),
        user_id=_int(obj.get("user_id")),
        user_name=_text(obj.get("user_name")),
        group_id=_int(obj.get("group_id")),
        reason=_text(obj.get("state_reason")),
        exit_status=exit_status,
        exit_signal=exit_signal,
        priority=_int(obj.get("priority")),
        nice=_signed32(_int(obj.get("nice"))),
        submit_time=number(obj.get("submit_time")),
        restarts=_int(obj.get("restart_cnt")) or 0,
        requeue=requeue if isinstance(requeue, bool) else None,
        admin_comment=_text(obj.get("admin_comment")),
        comment=_text(obj.get("comment")),
        partition=_text(obj.get("partition")),
        features=_text(obj.get("features")),
        nodes=_text(obj.get("nodes")),
        batch_host=_text(obj.get("batch_host")),
        required_nodes=_text(obj.get("required_nodes")),
        work_dir=_text(obj.get("current_working_directory")),
        std_out=_text(obj.get("standard_output")),
        std_err=_text(obj.get("standard_error")),
        tres_per_node=_text(obj.get("tres_per_node")),
        tres_per_job=_text(obj.get("tres_per_job")),
        tres_per_task=_text(obj.get("tres_per_task")),
        tres_per_socket=_text(obj.get("tres_per_socket")),
        array_job_id=array_job,
        array_task_id=array_task,
        raw=obj,
    )



_PATTERN_RE = re.compile(r"%(\d{0,2})([AajJNnstux%])")


def expand_log_pattern(pattern: str, job: Job, node: str = "") -> str | None:
    """A ``--output``/``--error`` pattern expanded as Slurm expands it for the batch step.

    Why here: JSON gives the pattern as the user wrote it (``out-%j.txt``), and the expanded text in
    ``scontrol show job`` can be forged through the job's own fields. None for a specifier whose value
    only slurmstepd knows (%n, %s, %t): the caller then skips that file rather than guess.
    """
    values = {"j": job.job_id, "J": f"{job.job_id}.batch", "u": job.user_name, "x": job.name,
              "N": node.split(".")[0], "A": str(job.array_job_id or job.job_id),
              "a": str(job.array_task_id) if job.array_task_id is not None else "4294967294"}
    unknown = False

    def repl(match: re.Match[str]) -> str:
        nonlocal unknown
        width, spec = match.groups()
        if spec == "%":
            return "%"
        if spec not in values:
            unknown = True
            return ""
        value = values[spec]
        return value.zfill(int(width)) if width and value.isdigit() else value

    expanded = _PATTERN_RE.sub(repl, pattern)
    return None if unknown else expanded


def log_paths(job: Job, node: str = "") -> tuple[str, ...]:
    """Absolute stderr then stdout paths of the batch step (Slurm's default ``slurm-%j.out``, or
    ``slurm-%A_%a.out`` for an array task, when none was given), deduplicated; /dev/null dropped."""
    default = "slurm-%A_%a.out" if job.array_job_id else "slurm-%j.out"
    out_pattern = job.std_out or default
    paths: list[str] = []
    for pattern in (job.std_err or out_pattern, out_pattern):
        path = expand_log_pattern(pattern, job, node)
        if not path:
            continue
        if not path.startswith("/") and job.work_dir.startswith("/"):
            path = f"{job.work_dir.rstrip('/')}/{path}"
        if path.startswith("/") and path not in paths and path != "/dev/null":
            paths.append(path)
    return tuple(paths)
