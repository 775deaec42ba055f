"""Prometheus metrics of the agent, produced at scrape time from its state (registry injectable, docs/style.md #11).

Why a custom collector rather than gauges set every tick: the sampling loop then pays nothing for
metrics, and finished jobs disappear from the output without bookkeeping. Tests build the agent with
their own ``CollectorRegistry`` and read ``registry.get_sample_value(...)``.

Names follow Prometheus's conventions: base units in the name (``_bytes``, ``_seconds``, ``_joules``,
``_watts``), counters are counter types and end in ``_total``, metadata is an ``_info`` metric with the value 1.
Labels are bounded: ``gpu`` (NVML index), ``metric`` (smact|smocc|drama), ``source``, ``action`` and ``mode``
take a handful of values, and ``jobid`` (the Slurm job id) and ``user`` appear only on per-job series, which
exist only while the job runs on this node (the collector reads the jobs the agent tracks now), so a node never
exports more job series than it runs jobs. ``user`` is on ``gpushare_job_info`` alone; join on ``jobid`` for
per-user sums. Why ``jobid`` and not ``job``: Prometheus gives every scraped series a ``job`` label (the scrape
job's name) and would rename ours to ``exported_job``.
The node is the scrape target's label (``instance``, or the ``node`` label the scrape config gives it,
docs/agent.md). NaN for values the GPU cannot report; a counter the GPU cannot report is left out.
The table of every metric is in docs/agent.md ("Metrics").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

if TYPE_CHECKING:
    from gpushare.agent.daemon import Agent


class AgentCollector(Collector):
    def __init__(self, agent: "Agent") -> None:
        self.agent = agent

    def collect(self) -> Iterator[Any]:
        snap = self.agent.snapshot()
        yield from gpu_families(snap)
        yield from job_families(snap)
        yield from agent_families(snap)


def gpu_families(snap: dict[str, Any]) -> list[Any]:
    """Per GPU, label ``gpu``."""
    used = GaugeMetricFamily("gpushare_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"])
    total = GaugeMetricFamily("gpushare_gpu_memory_total_bytes", "GPU memory", labels=["gpu"])
    power = GaugeMetricFamily("gpushare_gpu_power_watts", "GPU power draw at the latest sample", labels=["gpu"])
    energy = CounterMetricFamily("gpushare_gpu_energy_joules", "GPU energy counter since driver load",
                                 labels=["gpu"])
    risk = GaugeMetricFamily("gpushare_gpu_risk_score", "CARMA risk score over the window",
                             labels=["gpu", "metric"])
    risky = GaugeMetricFamily("gpushare_gpu_risky", "1 when the GPU is risky (CARMA §2.3)", labels=["gpu"])
    warming = GaugeMetricFamily("gpushare_gpu_warming", "1 while a new job's first kernel + window is pending",
                                labels=["gpu"])
    jobs = GaugeMetricFamily("gpushare_gpu_jobs", "jobs registered on the GPU", labels=["gpu"])
    for gpu in snap["gpus"]:
        label = str(gpu["index"])
        used.add_metric([label], gpu["memory_used"])
        total.add_metric([label], gpu["memory_total"])
        power.add_metric([label], gpu.get("power_w", math.nan))
        if not math.isnan(gpu["energy_mj"]):
            energy.add_metric([label], gpu["energy_mj"] / 1000.0)
        for metric in ("smact", "smocc", "drama"):
            risk.add_metric([label, metric], gpu["risk"][metric])
        risky.add_metric([label], float(gpu["risky"]))
        warming.add_metric([label], float(gpu["warming"]))
        jobs.add_metric([label], len(gpu["jobs"]))
    return [used, total, power, energy, risk, risky, warming, jobs]


def job_families(snap: dict[str, Any]) -> list[Any]:
    """Per running job, label ``jobid`` (and ``gpu`` where the value is per GPU)."""
    info = InfoMetricFamily("gpushare_job", "a job the agent tracks on this node: its user and caps mode "
                            "(mps, fraction, none, ...)", labels=["jobid"])
    ttfk = GaugeMetricFamily("gpushare_job_ttfk_seconds",
                             "time from Prolog to first kernel: source=kernel when NVML per-process SM "
                             "utilisation showed the job's process running kernels, source=first-process "
                             "when the GPU cannot report it (or under MPS) and the first process of the job "
                             "seen on its GPU (CUDA context creation) stands in", labels=["jobid", "source"])
    mem = GaugeMetricFamily("gpushare_job_memory_used_bytes", "device memory of the job's processes at the latest "
                            "sample", labels=["jobid", "gpu"])
    peak = GaugeMetricFamily("gpushare_job_memory_peak_bytes", "the job's peak device memory so far",
                             labels=["jobid", "gpu"])
    limit = GaugeMetricFamily("gpushare_job_memory_limit_bytes", "the job's memory cap (estimate + margin) per GPU; "
                              "absent when no cap is known", labels=["jobid"])
    energy = CounterMetricFamily("gpushare_job_energy_joules", "GPU energy attributed to the job",
                                 labels=["jobid", "gpu"])
    for job in snap["jobs"]:
        name = str(job["job"])
        info.add_metric([name], {"user": str(job.get("user") or job.get("uid", "")), "mode": str(job.get("mode"))})
        if job["ttfk_s"] is not None:
            ttfk.add_metric([name, str(job.get("ttfk_source") or "first-process")], job["ttfk_s"])
        for gpu in job.get("gpus", []):
            key = str(gpu)
            mem.add_metric([name, key], float(job.get("now_bytes", {}).get(key, 0.0)))
            if key in job.get("peak_bytes", {}):
                peak.add_metric([name, key], float(job["peak_bytes"][key]))
        if job.get("cap_bytes"):
            limit.add_metric([name], float(job["cap_bytes"]))
        for gpu, mj in job["share_mj"].items():
            energy.add_metric([name, gpu], mj / 1000.0)
    return [info, ttfk, mem, peak, limit, energy]


def agent_families(snap: dict[str, Any]) -> list[Any]:
    """The agent's own counters and the node's withholding state."""
    guard = CounterMetricFamily("gpushare_guard_actions", "memory-guard actions since the agent started: "
                                "backstop_stops, backstop_records, forecast_warnings, oom_avoided (early requeues), "
                                "adopted (jobs found running without a registration), unattributed_stops and "
                                "unattributed_records (processes of no job on their GPU acted on), unattributed_held "
                                "(such processes recorded, not stopped: the fail-safe held), observe_would_stop "
                                "(observe mode: stops the backstop would have made)",
                                labels=["action"])
    for name, count in snap.get("guard", {}).items():
        guard.add_metric([name], count)
    families: list[Any] = [guard]
    failsafe = GaugeMetricFamily("gpushare_agent_failsafe", "1 for each reason the backstop holds now (slurm: a "
                                 "Slurm lookup failed; tick: a sampling tick failed; threads: a thread could not be "
                                 "started): it stops no process it cannot attribute to a job", labels=["reason"])
    holding = (snap.get("failsafe") or {}).get("reasons") or {}
    for reason in ("slurm", "tick", "threads"):
        failsafe.add_metric([reason], float(reason in holding))
    families.append(failsafe)
    if snap.get("node_open") is not None:  # known once withholding has applied it (withhold = "feature")
        families.append(GaugeMetricFamily("gpushare_node_open", "1 while the node offers its withholding feature "
                                          "to new shared jobs", value=float(bool(snap["node_open"]))))
    return families


def register(agent: "Agent", registry: CollectorRegistry) -> AgentCollector:
    collector = AgentCollector(agent)
    registry.register(collector)
    return collector


def serve(registry: CollectorRegistry, port: int, address: str = "127.0.0.1") -> Any:
    """Expose ``registry`` on ``address`` (``[agent] metrics_address``); returns the server (``shutdown()`` stops it)."""
    from prometheus_client import start_http_server

    result = start_http_server(port, addr=address, registry=registry)
    return result[0] if isinstance(result, tuple) else result


class ConfigInfoCollector(Collector):
    """``gpushare_config_info{sha256, path, version} 1``: which gpushare.toml (and gpushare release) this node runs.

    Why a metric: ``gpushare doctor`` and a central Prometheus compare it across nodes without a shared disk
    or a login on each node; ``sha256="none"`` is an agent started with ``--defaults`` (no file)."""

    def __init__(self, sha256: str, path: str, version: str) -> None:
        self.labels = {"sha256": sha256, "path": path, "version": version}

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import InfoMetricFamily

        yield InfoMetricFamily("gpushare_config", "the configuration file this agent read (sha256 of its bytes; "
                               "none: built-in defaults) and the gpushare release", value=self.labels)


def register_config_info(registry: CollectorRegistry, sha256: str, path: str) -> ConfigInfoCollector:
    from gpushare.config import installed_version

    collector = ConfigInfoCollector(sha256, path, installed_version())
    registry.register(collector)
    return collector
