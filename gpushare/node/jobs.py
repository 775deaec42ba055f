"""Job registration and closing, shared by the agent and by the Prolog/Epilog when the agent is down.

Why one code path for both: a job started while the agent restarts must get the same entry (start energy
counters, caps) as any other, and a job ending while it is down must still get its record. The agent adds
what only a running sampler can see (first kernel, attributed energy, peak memory); without it those
fields stay empty and the record says ``registered_by``/``closed_by`` so a reader knows why.
"""

from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING, Any, Protocol

from gpushare.cuda_context import context_bytes_for, sm_arch_of
from gpushare.gpus import GiB
from gpushare.gres import GpuError, is_na
from gpushare.gres.mps import mps_dirs
from gpushare.node.caps import Caps, decide_caps, need_mib, task_env
from gpushare.policy.observe import summary as observe_summary, would_share
from gpushare.node.store import check_job
from gpushare.slurm.gres_request import GresRequest

if TYPE_CHECKING:
    from gpushare.gres.device import GpuBackend, Number
    from gpushare.config import AgentSection
    from gpushare.slurm.jobs import Job

RECORD_VERSION = 1  # the per-run job record (docs/formats.md); gpushare.epilog.records reads it

log = logging.getLogger("gpushare.agent")
_USER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}$")
_MAX_SHARDS = 1 << 20  # clean_facts' bound on a registration's shard count


def shards_of(request: str | GresRequest | None) -> int | None:
    """Shard count of a job's per-node GRES request (None if it asks for no shards, or is not understood).

    Through the one GRES parser (gpushare.slurm.gres_request), which reads every form Slurm prints in
    ``tres_per_node``: ``gres:shard:12`` (22.05), ``gres/shard:12`` (23.02+), typed ``gres:shard:tesla:12`` /
    ``gres/shard:tesla:12``, and ``shard:12`` as typed to ``--gres``. Text it rejects counts as no shards,
    as does a count past what a registration accepts: the job registers unshared (uncapped), never refused."""
    if not isinstance(request, GresRequest):
        request = GresRequest.parse(request.strip() if isinstance(request, str) else None)
    counts = [item.count for item in request.named("shard")]
    return counts[0] if counts and 0 <= counts[0] < _MAX_SHARDS else None


def registration_facts(job: str, uid: int, user: str, gpus: list[int], slurm_job: "Job | None") -> dict[str, Any]:
    """What a registration says about a job: who and where from the caller (the Prolog's environment, or
    the agent's own observation of the job's processes), grant and estimate from Slurm's structured record
    of the job (may be None: registered uncapped). ``clean_facts`` validates the result."""
    from gpushare.slurm.jobs import number
    from gpushare.slurm.record import parse as parse_record

    shards = shards_of(slurm_job.gres_per_node if slurm_job else None)
    record = parse_record(slurm_job.admin_comment if slurm_job else None) or {}
    limit_min = number(slurm_job.raw.get("time_limit")) if slurm_job else None
    facts: dict[str, Any] = {
        "job": job, "uid": uid, "user": user, "gpus": gpus,
        "restarts": max(0, slurm_job.restarts) if slurm_job else 0,
        "shared": shards is not None, "shards": shards, "est_gib": None, "margin_gib": None,
        "time_limit_s": float(limit_min) * 60.0 if limit_min is not None and 0 < limit_min < 1 << 24 else None,
    }
    if record.get("decision") == "shared":
        for key in ("est_gib", "margin_gib"):
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1 << 20:
                facts[key] = float(value)
        facts.update(lane_facts_of(record.get("lanes")))
    would = would_share(record)
    if would is not None:  # observe mode: the cap it would have had, never applied (gpushare.policy.observe)
        facts["would_mib"], facts["would_shards"] = need_mib(would[1], would[2], would[0]), would[0]
    return facts


def lane_facts_of(lanes: Any) -> dict[str, Any]:
    """Registration facts of a lane job from the record's ``lanes`` field (docs/formats.md); {} if none.

    ``p_gib``/``e_gib``: its persistent and ephemeral memory at submit time; ``own``: no split was known,
    so it never shares a lane (``gpushare.agent.lanes``)."""
    if not isinstance(lanes, dict):
        return {}
    p, e = _num(lanes.get("p_gib")), _num(lanes.get("e_gib"))
    if p is None or e is None:
        return {}
    return {"lanes": True, "persistent_bytes": int(p * GiB), "ephemeral_bytes": int(e * GiB),
            "own_lane": bool(lanes.get("own"))}


def clean_facts(raw: dict[str, Any]) -> dict[str, Any]:
    """Validate what a Prolog sends: every field is typed and bounded, nothing is passed through."""
    gpus = raw.get("gpus")
    if not isinstance(gpus, list) or not gpus or len(gpus) > 64 or not all(
            isinstance(g, int) and not isinstance(g, bool) and 0 <= g < 1024 for g in gpus):
        raise ValueError("gpus: expected a non-empty list of GPU indices")
    user = str(raw.get("user") or "")
    facts = {
        "job": check_job(raw.get("job", "")),
        "restarts": _int(raw.get("restarts", 0), "restarts", 0, 1 << 20),
        "uid": _int(raw.get("uid", -1), "uid", -1, 1 << 31),
        "user": user if _USER_RE.match(user) else "",
        "gpus": sorted(set(gpus)),
        "shared": bool(raw.get("shared")),
        "est_gib": _num(raw.get("est_gib")),
        "margin_gib": _num(raw.get("margin_gib")),
        "shards": _int(raw["shards"], "shards", 0, 1 << 20) if raw.get("shards") is not None else None,
        "time_limit_s": _num(raw.get("time_limit_s")),
    }
    if raw.get("would_mib") is not None:
        facts["would_mib"] = _int(raw["would_mib"], "would_mib", 1, 1 << 24)
        facts["would_shards"] = _int(raw.get("would_shards"), "would_shards", 1, 1 << 20)
    if raw.get("lanes") is True:
        facts.update({"lanes": True, "own_lane": bool(raw.get("own_lane")),
                      "persistent_bytes": _int(raw.get("persistent_bytes"), "persistent_bytes", 0, 1 << 44),
                      "ephemeral_bytes": _int(raw.get("ephemeral_bytes"), "ephemeral_bytes", 0, 1 << 44)})
    return facts


def _int(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name}: expected an integer in {lo}..{hi}, got {str(value)[:20]!r}")
    return value


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1 << 20:
        return None
    return float(value)


class EnergyCounters(Protocol):
    """The one device call a job's record needs: an epilog whose backend cannot open still writes a record
    (with empty energy) through a stand-in that has only this."""

    def energy_mj(self, index: int) -> Number: ...


def read_energy(backend: EnergyCounters, gpus: list[int]) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for gpu in gpus:
        try:
            value = backend.energy_mj(gpu)
            out[str(gpu)] = None if is_na(value) else int(value)
        except GpuError as exc:
            log.warning("GPU %d energy counter unreadable: %s", gpu, exc)
            out[str(gpu)] = None
    return out


DEFAULT_REMAINING_S = 4 * 3600.0  # a job whose time limit Slurm did not give: a typical training run


def thread_percentage_for(facts: dict[str, Any], corunners: list[dict[str, Any]], cfg: AgentSection, now: float) -> int:
    """The MPS thread share of a job starting beside ``corunners`` (MPS store entries on its GPU).

    ``fixed``: ``mps_thread_percentage``. ``gimbal-*``: Gimbal's coordination with the co-runners' shares
    fixed (``gpushare.policy.gimbal.starting_share``, the function the simulator's ``gimbal-jct`` /
    ``gimbal-makespan`` call): MPS fixes a process's share when it starts, so a running job keeps its own
    until its next start (Gimbal's runtime recalibration needs a rewritten CUDA context pool inside
    PyTorch). Features: ``gimbal_features``."""
    policy = getattr(cfg, "thread_policy", "fixed")
    if policy == "fixed" or not corunners:
        return int(cfg.mps_thread_percentage)
    from gpushare.policy.gimbal import starting_share

    running = [(gimbal_features(e, now), running_share(e)) for e in corunners]
    return starting_share(gimbal_features({**facts, "start": now}, now), running, policy.removeprefix("gimbal-"))


def gimbal_features(entry: dict[str, Any], now: float) -> Any:
    """What the node knows of a job for Gimbal (a ``GimbalJob``): remaining work is the Slurm time limit
    left (at least a minute); solo SM demand is not known before a job runs and is taken as a busy GPU
    (1.0), which squeezes the side the objective values less."""
    from gpushare.policy.gimbal import GimbalJob

    return GimbalJob(str(entry["job"]), max(60.0, time_left(entry, now)), 1.0)


def share_bytes(entry: dict[str, Any]) -> int | None:
    """A shared job's GPU share in bytes, as OOM recovery sizes it (gpushare.policy.oom_recovery ``failed_size_bytes``): its
    shards (1 GiB each), else its memory cap; None for a job that does not share its GPU."""
    if not entry.get("shared"):
        return None
    shards = entry.get("shards")
    if isinstance(shards, int) and not isinstance(shards, bool) and shards > 0:
        return shards << 30
    limit = (entry.get("caps") or {}).get("mem_limit_mib")
    return int(limit) << 20 if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def running_share(entry: dict[str, Any]) -> int:
    """The thread share a running MPS job started with (100 when its entry has none)."""
    share = (entry.get("caps") or {}).get("thread_percentage")
    return int(share) if isinstance(share, int) and not isinstance(share, bool) and 1 <= share <= 100 else 100


def time_left(entry: dict[str, Any], now: float) -> float:
    """Seconds of a job's Slurm time limit left at ``now`` (its store entry's ``time_limit_s`` and
    ``start``); a job whose limit Slurm did not give counts as ``DEFAULT_REMAINING_S`` from its start.
    Remaining work as the lanes' SRTF sees it: nothing on the node knows how much work a job has left."""
    limit = entry.get("time_limit_s")
    return max(0.0, (float(limit) if limit else DEFAULT_REMAINING_S) - max(0.0, now - float(entry.get("start", now))))


def build_entry(facts: dict[str, Any], cfg: AgentSection, backend: GpuBackend, tenants: list[tuple[int, str]], now: float,
                by: str, mps_ok: bool = True, corunners: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A new store entry for a registered job (``cfg`` is the ``[agent]`` section; ``corunners``: the store
    entries of the MPS jobs already on its GPU, for the thread share)."""
    gpu0 = facts["gpus"][0]
    try:
        info = backend.gpu(gpu0)
        total, outside = int(info.total_bytes), context_bytes_for(sm_arch_of(info.model, info.name))
    except GpuError:
        total, outside = 0, 0
    policy = cfg.collocation if mps_ok else ("fraction" if cfg.collocation != "none" else "none")
    caps = decide_caps(policy, shared=facts["shared"], gpus=len(facts["gpus"]), uid=facts["uid"],
                       need=need_mib(facts["est_gib"], facts["margin_gib"], facts["shards"]),
                       gpu_total_bytes=total, tenants=tenants,
                       thread_percentage=thread_percentage_for(facts, corunners or [], cfg, now),
                       outside_allocator_bytes=outside)
    if not mps_ok and cfg.collocation.startswith("mps") and caps.mode == "fraction":
        caps = Caps(**{**caps.as_dict(), "reason": "no MPS daemon for this GPU (the agent log says why): memory fraction only"})
    pipe = mps_dirs(cfg.run_dir, gpu0)[0] if caps.mode == "mps" else None
    env = task_env(caps, pipe, framework=getattr(cfg, "framework_caps", "yes") == "yes")
    if facts.get("lanes") and facts["shared"] and len(facts["gpus"]) == 1:
        from gpushare.node.api import lanes_socket_path

        env.update({"GPUSHARE_LANES": "1", "GPUSHARE_LANE_SOCKET": str(lanes_socket_path(cfg.run_dir))})
    return {**facts, "caps": caps.as_dict(), "pipe_dir": pipe, "env": env, "start": now,
            "start_energy_mj": read_energy(backend, facts["gpus"]), "kernel_at": None, "share_mj": {},
            "active_s": {}, "peak_bytes": {}, "series": {}, "registered_by": by}


def mps_corunners(entries: list[dict[str, Any]], gpus: list[int], job: str) -> list[dict[str, Any]]:
    """The running MPS jobs sharing any of ``gpus`` (whose thread shares a new job's share must respect)."""
    return [e for e in entries if str(e.get("job")) != job and not e.get("closed")
            and (e.get("caps") or {}).get("mode") == "mps" and set(e.get("gpus", [])) & set(gpus)]


def tenants_of(entries: list[dict[str, Any]], gpus: list[int], job: str) -> list[tuple[int, str]]:
    """(uid, caps mode) of the other registered jobs sharing any of ``gpus``."""
    return [(int(e.get("uid", -1)), str((e.get("caps") or {}).get("mode", "none"))) for e in entries
            if str(e.get("job")) != job and not e.get("closed") and set(e.get("gpus", [])) & set(gpus)]


def final_record(entry: dict[str, Any], backend: EnergyCounters, end: float | None = None, closed_by: str = "agent",
                 node: str = "") -> dict[str, Any]:
    """The job's record from its store entry and the energy counters now (for the records ledger)."""
    end = time.time() if end is None else end
    now_mj = read_energy(backend, [int(g) for g in entry.get("gpus", [])])
    gpus = {}
    for gpu in (str(g) for g in entry.get("gpus", [])):
        start_mj = (entry.get("start_energy_mj") or {}).get(gpu)
        end_mj = now_mj.get(gpu)
        whole = None if start_mj is None or end_mj is None or end_mj < start_mj else end_mj - start_mj
        share = (entry.get("share_mj") or {}).get(gpu)
        gpus[gpu] = {"energy_j": None if whole is None else round(whole / 1000.0, 3),
                     "share_j": None if share is None else round((share if whole is None else min(share, whole))
                                                                 / 1000.0, 3),
                     "active_s": round((entry.get("active_s") or {}).get(gpu, 0.0), 3),
                     "peak_bytes": (entry.get("peak_bytes") or {}).get(gpu)}
    kernel = entry.get("kernel_at")
    return {"v": RECORD_VERSION, "job": entry["job"], "restarts": entry.get("restarts", 0), "node": node,
            "uid": entry.get("uid"), "user": entry.get("user"), "shared": entry.get("shared"),
            "est_gib": entry.get("est_gib"), "margin_gib": entry.get("margin_gib"), "shards": entry.get("shards"),
            "caps": entry.get("caps"), "start": entry.get("start"), "end": round(end, 3),
            "duration_s": round(end - float(entry.get("start", end)), 3),
            "ttfk_s": None if kernel is None or entry.get("ttfk_source") == "adopted"
            else round(float(kernel) - float(entry["start"]), 3),
            "gpus": gpus, "series": entry.get("series") or {},
            "oom": entry.get("oom"), "forecast": entry.get("forecast"), "collateral": entry.get("collateral"),
            "would": observe_summary(entry.get("would_mib"), entry.get("would_stop")),
            "ttfk_source": entry.get("ttfk_source"),
            "registered_by": entry.get("registered_by"), "closed_by": closed_by}
