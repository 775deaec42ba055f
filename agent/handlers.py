"""What the agent's three sockets ask (``gpushare.agent.sockets`` serves them): the root-only API
(register, close, status), the lanes socket's job checks, and the live socket's run summary so far."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from gpushare.agent.lane_service import LaneFacts, LaneRefused
from gpushare.gres import GpuError
from gpushare.node.api import node_name
from gpushare.node.jobs import final_record, time_left
from gpushare.node.store import check_job

if TYPE_CHECKING:
    from gpushare.agent.daemon import Agent

log = logging.getLogger("gpushare.agent")


class Handlers:
    """The answers to the agent's socket requests, each taken under the agent's lock for a moment."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.cfg, self.backend, self.clock, self.lock = agent.cfg, agent.backend, agent.clock, agent.lock
        self.store, self.sampler, self.lanes, self.pid_job = agent.store, agent.sampler, agent.lanes, agent.pid_job
        self.failsafe, self.counters, self.unattributed = agent.failsafe, agent.counters, agent.unattributed

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        try:
            if op == "ping":
                return {"ok": True}
            if op == "register":
                entry = self.agent.register(request.get("job") or {})
                return {"ok": True, "caps": entry["caps"], "env": entry["env"]}
            if op == "close":
                closed = self.agent.close(str(request.get("job", "")))  # None: the agent did not know the job
                return {"ok": True, "entry": closed}
            if op == "status":
                return {"ok": True, **self.snapshot()}
        except ValueError as exc:
            return {"ok": False, "error": str(exc)}
        return {"ok": False, "error": f"unknown op {str(op)[:30]!r} (known: ping, register, close, status)"}

    def lane_facts(self, job: str) -> LaneFacts:
        """A registered, open lane job's lane facts, with its GPU's memory left to lane jobs (the GPU's
        memory less the caps of the non-lane jobs on it) and its time limit left; LaneRefused otherwise."""
        with self.lock:
            entry = self.agent.jobs.known(job)  # kept in memory on a full disk
            if entry is None or entry.get("closed"):
                raise LaneRefused(f"job {job} is not running here")
            if not entry.get("lanes") or len(entry.get("gpus") or []) != 1:
                raise LaneRefused(f"job {job} is not a single-GPU lane job (#GPUSHARE lanes)")
            gpu = int(entry["gpus"][0])
            try:
                total = int(self.backend.gpu(gpu).total_bytes)
            except GpuError as exc:
                raise LaneRefused(f"GPU {gpu} unreadable: {exc}") from None
            others = [e for e in self.store.all() if not e.get("closed") and not e.get("lanes")
                      and gpu in (e.get("gpus") or [])]
            held = 0
            for other in others:
                need = (other.get("caps") or {}).get("mem_limit_mib")
                held += int(need) << 20 if need else (total if not other.get("shared") else 0)
            return LaneFacts(job, int(entry.get("uid", -1)), gpu, int(entry.get("persistent_bytes") or 0),
                             int(entry.get("ephemeral_bytes") or 0), bool(entry.get("own_lane")),
                             max(0, total - held), time_left(entry, self.clock()))

    def lane_owner(self, job: str, uid: int, pid: int) -> str | None:
        """None when the peer (uid, pid from SO_PEERCRED) may act for lane job ``job``; else the refusal."""
        try:
            facts = self.lane_facts(job)
        except LaneRefused as exc:
            return str(exc)
        if uid != facts.uid:
            return f"job {job} belongs to another user"
        if self.pid_job(pid) != job:
            return f"the connecting process is not one of job {job}'s processes"
        return None

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            now = self.clock()
            gpus = []
            for index, view in self.sampler.views.items():
                risky, warming = self.sampler.withheld(index, now)
                gpus.append({"index": index, "memory_used": view.used, "memory_total": view.total,
                             "energy_mj": view.energy_mj, "power_w": view.power_w, "source": view.source,
                             "risk": {"smact": view.risk.smact, "smocc": view.risk.smocc, "drama": view.risk.drama},
                             "risky": risky, "warming": warming, "ready_at": self.sampler.ttfk.ready_at(index),
                             "jobs": list(view.jobs) or [a.job for a in self.sampler.jobs_on(index)],
                             "samples": view.samples, "error": view.error})
            jobs = [{"job": a.job, "uid": a.uid, "user": a.user, "gpus": a.gpus, "mode": a.mode, "start": a.start,
                     "now_bytes": dict(a.now_bytes), "cap_bytes": a.cap_bytes,
                     **{k: v for k, v in a.fields().items() if k not in ("series", "series_stride")}}
                    for a in self.sampler.jobs.values()]
            state = {"now": now, "node_open": self.agent.watch.open, "gpus": gpus, "jobs": jobs, "guard": dict(self.counters),
                     "unattributed": list(self.unattributed), "failsafe": self.failsafe.snapshot()}
        return {**state, "lanes": self.lanes.snapshot()}

    def live(self, job: str, uid: int) -> dict[str, Any]:
        """A running job's run summary so far, for root or the job's own user (gpushare.agent.live_api): what
        ``gpushare jobstats`` shows before the node Epilog stores the final one."""
        from gpushare.node.comment import run_summary

        unknown = {"ok": False, "error": f"job {str(job)[:20]}: not running on this node as yours"}
        try:
            job = check_job(job)
        except ValueError:
            return unknown
        with self.lock:
            acc = self.sampler.jobs.get(job)
            entry = self.agent.jobs.known(job) if acc is not None else None
            if acc is None or entry is None or entry.get("closed") or uid not in (0, int(entry.get("uid", -1))):
                return unknown
            now = self.clock()
            record = final_record({**entry, **acc.fields()}, self.backend, end=now, node=node_name(self.cfg))
        return {"ok": True, "job": job, "node": node_name(self.cfg), "at": round(now, 3),
                "run": run_summary(record)}
