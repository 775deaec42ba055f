"""Controller-side Prometheus metrics of gpushare-submitd: what the submit path decided, and how often it
failed open.

Why: observe mode is a pilot, and a pilot is read in numbers (how many jobs would have shared, how many were
out of scope) before anyone switches to enforce; fail-opens count the jobs that went through unchanged
because of us. Off unless ``[submit] metrics_port`` is set: prometheus-client is then needed on the
controller (``pip install slurm-gpushare[node]``), and its absence is one line in the service log.
"""

from __future__ import annotations

import logging
from typing import Any

from gpushare.config import Config
from gpushare.slurm_plugins.decision import Decision

log = logging.getLogger("gpushare.submitd")


class SubmitMetrics:
    """``gpushare_submit_decisions_total{decision,mode}``, ``gpushare_submit_fail_open_total{reason}``,
    ``gpushare_submit_held_total`` (jobs held for asynchronous estimation) on one registry."""

    def __init__(self, oom_dir: str = "") -> None:
        from prometheus_client import CollectorRegistry, Counter

        self.registry = CollectorRegistry()
        self.decisions = Counter("gpushare_submit_decisions", "GPU jobs decided, by the record's decision "
                                 "(observe: by what enforce would have done) and [policy] mode",
                                 ["decision", "mode"], registry=self.registry)
        self.fail_open = Counter("gpushare_submit_fail_open", "jobs accepted unchanged because of a failure here",
                                 ["reason"], registry=self.registry)
        self.held = Counter("gpushare_submit_held", "jobs held until their asynchronous estimate lands",
                            registry=self.registry)
        if oom_dir:
            self.registry.register(_OomCounts(oom_dir))

    def decided(self, decision: Decision, mode: str) -> None:
        record = decision.record or {}
        if not record and decision.action == "accept":
            return  # not a GPU job (or mode off)
        kind = str(record.get("would") or record.get("decision") or decision.action)[:32]
        self.decisions.labels(decision=kind, mode=mode).inc()
        if decision.hold:
            self.held.inc()

    def failed_open(self, reason: str) -> None:
        self.fail_open.labels(reason=reason).inc()


class _OomCounts:
    """``gpushare_oom_recoveries_total{outcome}`` from the EpilogSlurmctld's counts file, read at each scrape
    (the hook is a short process of its own; gpushare/oom_counts.py)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        from gpushare.oom_counts import read_counts

        family = CounterMetricFamily("gpushare_oom_recoveries", "OOM recoveries by outcome (would_requeue: "
                                     "[policy] mode = observe recorded one and requeued nothing)",
                                     labels=["outcome"])
        for outcome, value in sorted(read_counts(self.directory).items()):
            family.add_metric([outcome], value)
        yield family


def start(cfg: Config) -> tuple[SubmitMetrics | None, Any]:
    """(metrics, http server) when ``[submit] metrics_port`` is set and the endpoint could start; else None."""
    if not cfg.submit.metrics_port:
        return None, None
    try:
        metrics = SubmitMetrics(cfg.oom.ledger_dir)
        from prometheus_client import start_http_server

        server = start_http_server(cfg.submit.metrics_port, addr=cfg.submit.metrics_address,
                                   registry=metrics.registry)
    except ImportError:
        log.error("[submit] metrics_port is set but prometheus-client is not installed "
                  "(pip install 'slurm-gpushare[node]'); no metrics")
        return None, None
    except OSError as exc:
        log.error("metrics on %s:%d unavailable: %s; the service continues", cfg.submit.metrics_address,
                  cfg.submit.metrics_port, exc)
        return None, None
    log.warning("metrics on http://%s:%d/metrics", cfg.submit.metrics_address, cfg.submit.metrics_port)
    return metrics, server[0] if isinstance(server, tuple) else server
