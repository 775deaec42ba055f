"""The agent's sampling step: one pass over every GPU through the device interface, no process spawned.

Each ``tick(now)`` reads memory, running processes, utilisation and the energy counter of every GPU,
feeds CARMA's risk window (``gpushare.policy.risk.MetricWindow``), the TTFK table (``risk.TtfkTable``) and
the per-job accumulators. The clock value comes from the caller and the backend is injected (docs/style.md #11),
so tests drive it with a fake clock and the simulated backend.

Attribution of processes to jobs, by job and by uid (:meth:`Sampler.attribute`): ``pid_job(pid)`` names the
job a process claims (default :func:`process_job`: the ``job_<id>`` component of the process's cgroup, which
slurmstepd creates and the process cannot change; only where Slurm uses no cgroups, ``SLURM_JOB_ID`` in
``/proc/<pid>/environ``, which the process itself can set) and ``pid_uid(pid)`` its owner (the kernel's).
A process joins the job it claims only when that job runs on its GPU and belongs to the process's uid.
A process claiming a job the agent does not track (not registered yet, or its registration failed) belongs
to nobody: it is that job's, never billed to another job of its user (``gpushare.agent.failsafe``).
Otherwise (no job id: ``env -u SLURM_JOB_ID``; another user's job id; a job on another GPU) it belongs to
its own uid's job on that GPU, and failing that to nobody: an *unattributed* process, never billed to
another user, which the guard stops like any overrun (``Guard.check_unattributed``). Root's processes
(the MPS server, the admin's tools) are never unattributed overruns.

Energy attribution (documented in docs/agent.md): the counter delta of a GPU between two samples is
split equally among the jobs that had a process on it in that sample — the device interface has no
per-process SM activity, so "utilisation share" here is each job's share of the *active time* of the
GPU. Intervals with no job process are idle energy: in the whole-device delta, attributed to nobody.

Risk needs DCGM's SMACT/SMOCC/DRAMA. With NVML only (``source == "nvml"``) those are NA, the window
holds NaN, the score is NaN and no GPU is ever flagged risky; TTFK withholding still works.
"""

from __future__ import annotations

import glob
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from gpushare.gres import GpuError, is_na
from gpushare.agent.adopt import process_uid
from gpushare.policy.risk import MetricWindow, RiskAssessment, Thresholds, TtfkTable

if TYPE_CHECKING:
    from gpushare.gres.device import GpuBackend

log = logging.getLogger("gpushare.agent")
SERIES_POINTS = 600  # per job and GPU; halved (every other point dropped) when full


_CGROUP_JOB_RE = re.compile(rb"/job_(\d{1,10})(?:/|$)")


def cgroup_job(pid: int, proc: str = "/proc") -> str | None | bool:
    """The Slurm job of a process from its cgroup path (``…/job_123/step_0/…``, cgroup v1 and v2);
    None when the process is in no Slurm job cgroup, False when the process is gone or its cgroup file
    unreadable. Why: the kernel writes this file and a process cannot leave its job's cgroup, whereas its
    environment is its own to write (and reading another process's environment can block on its memory)."""
    try:
        data = Path(f"{proc}/{int(pid)}/cgroup").read_bytes()[:8192]
    except OSError:
        return False
    match = _CGROUP_JOB_RE.search(data)
    if match:
        return match.group(1).decode()
    return None if b"slurm" in data else False


def slurm_uses_cgroups(root: str = "/sys/fs/cgroup", node: str | None = None) -> bool:
    """Whether slurmstepd keeps jobs in cgroups on this node: a v2 scope, or a v1 hierarchy named ``slurm``,
    or ``slurm_<NodeName>`` where Slurm is built for several slurmd per host (Debian's packages are). Only
    this node's name counts, so another slurmd's hierarchy on the same host does not change this one's."""
    base = Path(root)
    if (base / "system.slice" / "slurmstepd.scope").is_dir() or any(base.glob("*/slurm")):
        return True
    return bool(node) and any(base.glob(f"*/slurm_{glob.escape(str(node))}"))


def process_job(pid: int, proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup",
                node: str | None = None) -> str | None:
    """:func:`cgroup_job`, falling back to :func:`environ_job` only on a node where Slurm puts jobs in no
    cgroup (proctrack/linuxproc): there a process's own environment is the only record the node has. On
    a node with Slurm cgroups, a process outside every job cgroup (an ssh session) belongs to no job,
    whatever its environment claims."""
    found = cgroup_job(pid, proc)
    if isinstance(found, str):
        return found
    if found is None or slurm_uses_cgroups(cgroup_root, node):
        return None
    return environ_job(pid, proc)


def environ_job(pid: int, proc: str = "/proc") -> str | None:
    """The Slurm job of a process from its environment (root only); None when unknown."""
    try:
        data = Path(f"{proc}/{int(pid)}/environ").read_bytes()
    except OSError:
        return None
    for item in data.split(b"\0"):
        if item.startswith(b"SLURM_JOB_ID="):
            value = item[len(b"SLURM_JOB_ID="):].decode("ascii", "replace")
            return value if value.isdigit() else None
    return None


@dataclass
class JobAcc:
    """What the agent accumulates for one running job (mirrors its store entry)."""

    job: str
    uid: int
    gpus: list[int]
    start: float
    user: str = ""  # the Prolog's validated user name ("" when unknown)
    mode: str = "none"
    shared: bool = True
    kernel_at: float | None = None
    ttfk_source: str | None = None  # "kernel" (per-process SM activity) or "first-process"
    share_mj: dict[str, float] = field(default_factory=dict)
    active_s: dict[str, float] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    series: dict[str, list[list[float]]] = field(default_factory=dict)
    stride: dict[str, int] = field(default_factory=dict)
    seen: int = 0
    cap_bytes: int = 0  # estimate + margin (caps.mem_limit_mib); 0: no cap known
    # a lane job's cap while it does not hold its lane's turn: what it is charged (its shards: persistent +
    # its lane share + margin, docs/submit-path.md "Lanes"); 0: the same cap at all times
    lane_cap_bytes: int = 0
    # the latest sample only (not persisted): device bytes and pids of the job's processes (its own uid's, by
    # Sampler.attribute), per GPU: what the backstop and forecaster act on
    now_bytes: dict[str, float] = field(default_factory=dict)
    now_pids: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> "JobAcc":
        return cls(job=str(entry["job"]), uid=int(entry.get("uid", -1)), gpus=[int(g) for g in entry.get("gpus", [])],
                   start=float(entry["start"]), user=str(entry.get("user") or ""), mode=str((entry.get("caps") or {}).get("mode", "none")),
                   shared=bool(entry.get("shared", True)),
                   kernel_at=entry.get("kernel_at"), ttfk_source=entry.get("ttfk_source"),
                   share_mj=dict(entry.get("share_mj") or {}),
                   active_s=dict(entry.get("active_s") or {}), peak_bytes=dict(entry.get("peak_bytes") or {}),
                   series={k: list(v) for k, v in (entry.get("series") or {}).items()},
                   stride=dict(entry.get("series_stride") or {}),
                   cap_bytes=int((entry.get("caps") or {}).get("mem_limit_mib") or 0) << 20,
                   lane_cap_bytes=lane_charge(entry))

    def fields(self) -> dict[str, Any]:
        """The store fields this accumulator owns."""
        return {"kernel_at": self.kernel_at, "ttfk_source": self.ttfk_source, "share_mj": self.share_mj,
                "active_s": self.active_s,
                "peak_bytes": self.peak_bytes, "series": self.series, "series_stride": self.stride,
                "ttfk_s": None if self.kernel_at is None or self.ttfk_source == "adopted"
                else round(self.kernel_at - self.start, 3)}

    def add_point(self, gpu: str, point: list[float]) -> None:
        stride = self.stride.get(gpu, 1)
        if self.seen % stride:
            return
        series = self.series.setdefault(gpu, [])
        series.append(point)
        if len(series) >= SERIES_POINTS:
            self.series[gpu] = series[::2]
            self.stride[gpu] = stride * 2


def lane_charge(entry: dict[str, Any]) -> int:
    """A shared lane job's cap outside its turn: its shard grant (what Slurm charges it), when that is less
    than its full cap; 0 for any other job (a job with a lane of its own is charged in full)."""
    cap = int((entry.get("caps") or {}).get("mem_limit_mib") or 0) << 20
    shards = entry.get("shards")
    if not entry.get("lanes") or entry.get("own_lane") or not shards or cap <= 0:
        return 0
    charged = int(shards) << 30
    return charged if charged < cap else 0


@dataclass(frozen=True)
class Stranger:
    """A process on a GPU that belongs to no job there (latest sample): what it claims and who owns it."""

    pid: int
    uid: int
    used_bytes: float
    claim: str | None  # the job id it claims (cgroup or environment); None: none


@dataclass
class GpuView:
    """The latest state of one GPU as the agent sees it."""

    index: int
    total: int = 0
    used: float = math.nan
    energy_mj: float = math.nan
    power_w: float = math.nan
    source: str = "nvml"
    risk: RiskAssessment = RiskAssessment(math.nan, math.nan, math.nan, False)
    jobs: list[str] = field(default_factory=list)
    error: str | None = None
    samples: int = 0


class Sampler:
    """Windows, TTFK and accumulators of every GPU of one node."""

    def __init__(self, backend: GpuBackend, window_samples: int = 30, period_s: float = 1.0,
                 thresholds: Thresholds = Thresholds(), pid_job: Callable[[int], str | None] = process_job,
                 pid_uid: Callable[[int], int | None] = process_uid) -> None:
        self.backend = backend
        self.window_samples = window_samples
        self.thresholds = thresholds
        self.pid_job = pid_job
        self.pid_uid = pid_uid
        self.ttfk = TtfkTable(window_s=window_samples * period_s)
        self.jobs: dict[str, JobAcc] = {}
        self.views: dict[int, GpuView] = {}
        self.windows: dict[int, MetricWindow] = {}
        self._last: dict[int, tuple[float, float]] = {}  # gpu -> (time, energy mJ)
        self._pid_cache: dict[int, tuple[str | None, int | None]] = {}  # pid -> (claimed job, uid)
        self._util_since: dict[int, int] = {}  # per GPU: newest per-process utilisation sample seen (µs)
        # processes of Slurm jobs nobody registered, per job and GPU (latest sample only): gpushare.agent.adopt
        self.strays: dict[str, dict[int, list[int]]] = {}
        # processes that belong to no job on their GPU, per GPU (latest sample only): Guard.check_unattributed
        self.unattributed: dict[int, list[Stranger]] = {}
        for info in backend.gpus():
            self.views[info.index] = GpuView(info.index, total=info.total_bytes)
            self.windows[info.index] = MetricWindow(size=window_samples)

    # -- jobs --------------------------------------------------------------------------------------
    def track(self, entry: dict[str, Any]) -> JobAcc:
        acc = JobAcc.from_entry(entry)
        self.jobs[acc.job] = acc
        if not acc.shared:  # a whole-GPU job: Slurm offers that GPU to nobody else, nothing to withhold
            return acc
        for gpu in acc.gpus:
            self.ttfk.dispatched(gpu, acc.job, acc.start)
            if acc.kernel_at is not None:
                self.ttfk.kernel_seen(gpu, acc.job, acc.kernel_at)
        return acc

    def untrack(self, job: str) -> JobAcc | None:
        self.ttfk.job_ended(job)
        return self.jobs.pop(job, None)

    def jobs_on(self, gpu: int) -> list[JobAcc]:
        return [acc for acc in self.jobs.values() if gpu in acc.gpus]

    # -- sampling ----------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        live_pids: set[int] = set()
        self.strays = {}
        self.unattributed = {}
        for acc in self.jobs.values():  # a GPU that fails to answer leaves no stale reading behind
            acc.now_bytes.clear()
            acc.now_pids.clear()
        for index, view in self.views.items():
            try:
                self._sample(index, view, now, live_pids)
                view.error = None
            except GpuError as exc:  # a lost or failing GPU: keep the others going, say so once per change
                if view.error != str(exc):
                    log.warning("GPU %d: %s", index, exc)
                view.error = str(exc)
        for pid in set(self._pid_cache) - live_pids:
            del self._pid_cache[pid]
        for acc in self.jobs.values():
            acc.seen += 1

    def _owner_of(self, pid: int) -> tuple[str | None, int | None]:
        if pid not in self._pid_cache:
            self._pid_cache[pid] = (self.pid_job(pid), self.pid_uid(pid))
        return self._pid_cache[pid]

    def attribute(self, index: int, claim: str | None, uid: int | None) -> str | None:
        """The tracked job on GPU ``index`` a process claiming ``claim``, owned by ``uid``, belongs to; None:
        none (module docstring). Never another user's job, whatever the process claims."""
        if uid is None:  # gone before it could be placed
            return None
        acc = self.jobs.get(claim) if claim is not None else None
        if acc is not None and index in acc.gpus and acc.uid == uid:
            return acc.job
        if claim is not None and acc is None:
            return None  # a job not registered here (yet, or its registration failed): its own memory, no other's
        own = sorted((a.start, a.job) for a in self.jobs_on(index) if a.uid == uid)
        return own[0][1] if own else None

    def owner_now(self, pid: int, index: int) -> str | None:
        """:meth:`attribute` from a fresh look at the process (no cache): checked again just before a signal."""
        return self.attribute(index, self.pid_job(pid), self.pid_uid(pid))

    def _sample(self, index: int, view: GpuView, now: float, live_pids: set[int]) -> None:
        memory = self.backend.memory(index)
        procs = self.backend.processes(index)
        util = self.backend.utilization(index)
        energy = self.backend.energy_mj(index)
        view.used, view.source = float(memory.used), util.source
        view.power_w = float(self.backend.power_watts(index))
        self.windows[index].add(float(util.smact), float(util.smocc), float(util.drama))
        view.risk = self.windows[index].assess(self.thresholds)
        view.samples += 1
        tracked = self.jobs_on(index)
        view.jobs = [acc.job for acc in tracked]
        job_bytes: dict[str, float] = {}
        job_pids: dict[str, list[int]] = {}
        own_bytes: dict[str, float] = {}
        strangers = 0
        for proc in procs:
            live_pids.add(proc.pid)
            claim, uid = self._owner_of(proc.pid)
            if claim is not None and claim not in self.jobs:
                self.strays.setdefault(claim, {}).setdefault(index, []).append(proc.pid)
            used = 0.0 if is_na(proc.used_bytes) else float(proc.used_bytes)
            owner = self.attribute(index, claim, uid)
            if owner is not None:
                job_bytes[owner] = job_bytes.get(owner, 0.0) + used
                own_bytes[owner] = own_bytes.get(owner, 0.0) + used
                job_pids.setdefault(owner, []).append(proc.pid)
            elif uid is not None and uid != 0:
                strangers += 1
                self.unattributed.setdefault(index, []).append(Stranger(proc.pid, uid, used, claim))
        key = str(index)
        for acc in tracked:
            acc.now_bytes[key] = own_bytes.get(acc.job, 0.0)
            acc.now_pids[key] = job_pids.get(acc.job, [])
        busy = self._kernel_pids(index, [p.pid for p in procs])
        for job in job_bytes:
            acc = self.jobs[job]
            if acc.kernel_at is None:
                source = self._first_kernel(acc, busy, job_pids.get(job, []))
                if source is not None:
                    acc.kernel_at, acc.ttfk_source = now, source
                    self.ttfk.kernel_seen(index, job, now)
            acc.peak_bytes[key] = max(int(job_bytes[job]), int(acc.peak_bytes.get(key, 0)))
        self._attribute_energy(index, now, energy, job_bytes, strangers)
        smact = float(util.smact) if not is_na(util.smact) else float(util.gpu)
        for acc in tracked:
            acc.add_point(key, [round(now, 3), view.used, job_bytes.get(acc.job, 0.0), smact])

    def _kernel_pids(self, index: int, pids: list[int]) -> set[int] | None:
        """Pids that ran kernels since the last sample (per-process SM utilisation > 0); None where the
        GPU cannot report per-process utilisation (then TTFK falls back to the first process seen)."""
        if not pids:
            return set()
        try:
            samples = self.backend.process_utilization(index, self._util_since.get(index, 0))
        except GpuError as exc:
            log.debug("GPU %d per-process utilisation: %s", index, exc)
            return None
        if is_na(samples) or not isinstance(samples, list):
            return None
        busy = {s.pid for s in samples if s.sm > 0}
        if samples:
            self._util_since[index] = max(s.timestamp_us for s in samples)
        return busy

    @staticmethod
    def _first_kernel(acc: JobAcc, busy: set[int] | None, own_pids: list[int]) -> str | None:
        """How this sample shows the job's first kernel (its TTFK source), or None: not yet.

        ``kernel``: one of the job's own processes ran kernels (NVML per-process utilisation). MPS
        clients' activity is reported under the MPS server's pid, so MPS jobs and GPUs without per-process
        samples fall back to ``first-process``.
        """
        if busy is None or acc.mode == "mps" or not own_pids:
            return "first-process"
        return "kernel" if busy & set(own_pids) else None

    def _attribute_energy(self, index: int, now: float, energy: Any, active: dict[str, float],
                          strangers: int = 0) -> None:
        """Split the GPU's energy since the last sample among its active jobs; an unattributed process
        takes a share that nobody is billed for."""
        view = self.views[index]
        if is_na(energy):
            return
        view.energy_mj = float(energy)
        last = self._last.get(index)
        self._last[index] = (now, float(energy))
        if last is None or not active:
            return
        delta_mj, delta_s = float(energy) - last[1], now - last[0]
        if delta_mj < 0 or delta_s <= 0:  # counter reset (driver reload) or clock step: skip the interval
            return
        share = delta_mj / (len(active) + strangers)
        key = str(index)
        for job in active:
            acc = self.jobs[job]
            acc.share_mj[key] = acc.share_mj.get(key, 0.0) + share
            acc.active_s[key] = acc.active_s.get(key, 0.0) + delta_s

    # -- decisions ---------------------------------------------------------------------------------
    def withheld(self, index: int, now: float) -> tuple[bool, bool]:
        """(risky, warming) of one GPU now."""
        return self.views[index].risk.risky, self.ttfk.warming(index, now)
