"""Prometheus metrics of the agent, produced at scrape time from its state (registry injectable, docs/style.md #11).

Why a custom collector rather than gauges set every tick: the sampling loop then pays nothing for
metrics, and finished jobs disappear from the output without bookkeeping. Tests build the agent with
their own ``CollectorRegistry`` and read ``registry.get_sample_value(...)``.

Per GPU (label ``gpu`` = NVML index): memory used/total bytes, risk score per metric (``metric`` =
smact|smocc|drama), risky, warming (TTFK), jobs, energy counter (J). Per job (label ``job``): TTFK seconds
(once seen) and attributed energy in joules (label ``gpu``). NaN for values the GPU cannot report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

if TYPE_CHECKING:
    from gpushare.agent.daemon import Agent


class AgentCollector(Collector):
    def __init__(self, agent: "Agent") -> None:
        self.agent = agent

    def collect(self) -> Iterator[Any]:
        snap = self.agent.snapshot()
        used = GaugeMetricFamily("gpushare_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"])
        total = GaugeMetricFamily("gpushare_gpu_memory_total_bytes", "GPU memory", labels=["gpu"])
        risk = GaugeMetricFamily("gpushare_gpu_risk_score", "CARMA risk score over the window",
                                 labels=["gpu", "metric"])
        risky = GaugeMetricFamily("gpushare_gpu_risky", "1 when the GPU is risky (CARMA §2.3)", labels=["gpu"])
        warming = GaugeMetricFamily("gpushare_gpu_warming", "1 while a new job's first kernel + window is pending",
                                    labels=["gpu"])
        jobs = GaugeMetricFamily("gpushare_gpu_jobs", "jobs registered on the GPU", labels=["gpu"])
        energy = GaugeMetricFamily("gpushare_gpu_energy_joules", "energy counter since driver load", labels=["gpu"])
        for gpu in snap["gpus"]:
            label = str(gpu["index"])
            used.add_metric([label], gpu["memory_used"])
            total.add_metric([label], gpu["memory_total"])
            for metric in ("smact", "smocc", "drama"):
                risk.add_metric([label, metric], gpu["risk"][metric])
            risky.add_metric([label], float(gpu["risky"]))
            warming.add_metric([label], float(gpu["warming"]))
            jobs.add_metric([label], len(gpu["jobs"]))
            energy.add_metric([label], gpu["energy_mj"] / 1000.0)
        ttfk = GaugeMetricFamily("gpushare_job_ttfk_seconds",
                                 "time from Prolog to first kernel: source=kernel when NVML per-process SM "
                                 "utilisation showed the job's process running kernels, source=first-process "
                                 "when the GPU cannot report it (or under MPS) and the first process of the job "
                                 "seen on its GPU (CUDA context creation) stands in", labels=["job", "source"])
        job_energy = GaugeMetricFamily("gpushare_job_energy_joules", "energy attributed to the job",
                                       labels=["job", "gpu"])
        for job in snap["jobs"]:
            if job["ttfk_s"] is not None:
                ttfk.add_metric([job["job"], str(job.get("ttfk_source") or "first-process")], job["ttfk_s"])
            for gpu, mj in job["share_mj"].items():
                job_energy.add_metric([job["job"], gpu], mj / 1000.0)
        guard = GaugeMetricFamily("gpushare_guard_actions", "memory-guard actions since the agent started: "
                                  "backstop_stops, backstop_records, forecast_warnings, oom_avoided (early requeues), "
                                  "adopted (jobs found running without a registration), unattributed_stops and "
                                  "unattributed_records (processes of no job on their GPU acted on)",
                                  labels=["action"])
        for name, count in snap.get("guard", {}).items():
            guard.add_metric([name], count)
        yield from (used, total, risk, risky, warming, jobs, energy, ttfk, job_energy, guard)


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
